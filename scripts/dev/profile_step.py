#!/usr/bin/env python3
"""Where a decode step's host time goes: cProfile of `bench_common.decode_steps` per attention implementation.

For each (batch, context) and implementation, on the V3 attention shape (4 layers): the step time and host time
(no profiler), then the same steps under cProfile, printing the functions with the largest cumulative and own
time. A development tool (the published host numbers come from ``scripts/bench_host.py``).

    python scripts/dev/profile_step.py --cells 1x1024 32x4096 --out out
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_common as bc  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["1x1024", "32x4096"], help="BATCHxCONTEXT")
    p.add_argument("--attn", nargs="+", default=["sdpa", "flashinfer_mla"], choices=bc.ATTNS)
    p.add_argument("--model", default="deepseek-v3-attn", choices=bc.MODEL_NAMES)
    p.add_argument("--steps", type=int, default=20, help="steps timed, then profiled")
    p.add_argument("--top", type=int, default=45, help="functions listed per sort order")
    p.add_argument("--graphs", action="store_true", help="StaticCache + torch.compile(mode='reduce-overhead')")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--out", default=None, help="directory for the report")
    p.add_argument("--name", default="profile_step.txt", help="the report's file name")
    args = p.parse_args(argv)
    import hf_flashinfer_mla  # noqa: F401

    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    config = bc.build_config(args.model)
    model = bc.build_model(config, dtype, device)
    report = io.StringIO()
    for cell in args.cells:
        batch, context = map(int, cell.split("x"))
        for attn in args.attn:
            model.set_attn_implementation(attn)
            kind = "static" if args.graphs else "dynamic"
            cache = bc.make_cache(kind, attn, config, context + 4 + 2 * args.steps + 8)
            bc.fill_cache(cache, config, batch, context, dtype, device)
            forward = None
            if args.graphs:
                torch._dynamo.reset()
                forward = torch.compile(model.__call__, mode="reduce-overhead")
            timed = bc.decode_steps(model, cache, batch, context, 4, args.steps, forward=forward)
            prof = cProfile.Profile()
            prof.enable()
            bc.decode_steps(model, cache, batch, context, 0, args.steps, forward=forward)
            prof.disable()
            head = (f"== {attn}{' graphs' if args.graphs else ''} B={batch} ctx={context}: step "
                    f"{timed['ms_median']:.2f} ms, host {timed['host_ms_median']:.2f} ms (median of {args.steps}, "
                    "no profiler)")
            print(head, flush=True)
            report.write(head + "\n")
            for key in ("cumulative", "tottime"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
                report.write(f"-- sorted by {key} (over {args.steps} steps)\n{s.getvalue()}\n")
            cache = None
            bc.free_memory(device)
    text = report.getvalue()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
