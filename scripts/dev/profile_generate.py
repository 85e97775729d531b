#!/usr/bin/env python3
"""Where a whole ``generate()`` call's time goes, per attention implementation: its GPU kernels against its wall time
(torch.profiler), and its host hotspots (cProfile). ``bench_generate.py`` gives the tokens/s; this says why a cell
is what it is (for instance static-cache batch 1, where every step is a CUDA-graph replay plus the host's loop).

    python scripts/dev/profile_generate.py --model deepseek-v2-lite --static --batch 1 --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_generate import timed_generate  # noqa: E402
from profile_replay import category, kernel_times  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--attn", nargs="+", default=["flashinfer_mla", "sdpa"], choices=bc.ATTNS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--static", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="profile_generate.txt")
    args = p.parse_args()
    import hf_flashinfer_mla  # noqa: F401

    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    model = bc.build_model(bc.build_config(args.model), dtype, device)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(args.batch)).to(device)
    report = io.StringIO()

    def say(line=""):
        print(line, flush=True)
        report.write(line + "\n")

    for attn in args.attn:
        model.set_attn_implementation(attn)
        for _ in range(2):  # compile and record at the timed length (see bench_generate.py)
            timed_generate(model, ids, args.new, args.static, device)
        wall = [timed_generate(model, ids, args.new, args.static, device) for _ in range(3)]
        acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            timed_generate(model, ids, args.new, args.static, device)
        profiled = time.perf_counter() - t0
        kern = kernel_times(prof, device, 1)
        total = sum(us for _, us in kern.values()) / 1e3
        cats = {}
        for name, (calls, us) in kern.items():
            c = cats.setdefault(category(name), [0.0, 0.0])
            c[0], c[1] = c[0] + calls, c[1] + us / 1e3
        say(f"== {attn} {args.model} B={args.batch} prompt {args.prompt} new {args.new}"
            f"{' static' if args.static else ''}: wall {1e3 * min(wall):.1f} ms (best of 3), under the profiler "
            f"{1e3 * profiled:.1f} ms; kernels {total:.1f} ms in all")
        for name, (calls, ms) in sorted(cats.items(), key=lambda kv: -kv[1][1]):
            say(f"   {name:12s} {calls:8.0f} launches {ms:8.2f} ms")
        prof_c = cProfile.Profile()
        prof_c.enable()
        timed_generate(model, ids, args.new, args.static, device)
        prof_c.disable()
        s = io.StringIO()
        pstats.Stats(prof_c, stream=s).strip_dirs().sort_stats("tottime").print_stats(args.top)
        say(s.getvalue())
        torch._dynamo.reset()
        bc.free_memory(device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name), "w") as f:
            f.write(report.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
