#!/usr/bin/env python3
"""Why a warmed-up static-cache ``generate()`` records CUDA graphs again: runs the same call several times per
attention implementation with torch's cudagraph-tree log at DEBUG (``TORCH_LOGS=+cudagraphs``), and prints, per
call, its wall time and what the tree did (warm-ups, graphs recorded, and why recorded graphs failed a step's
checks: the graph input whose address or liveness changed).

    python scripts/dev/probe_rerecord.py --model deepseek-v2-lite --batch 1 --calls 4 --out OUT
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_common as bc  # noqa: E402
from bench_generate import timed_generate  # noqa: E402


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--attn", nargs="+", default=["flashinfer_mla", "sdpa"], choices=bc.ATTNS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import hf_flashinfer_mla  # noqa: F401

    torch._logging.set_logs(cudagraphs=True)
    collect = Collect()
    torch._logging.getArtifactLogger("torch._inductor.cudagraph_trees", "cudagraphs").addHandler(collect)
    device = bc.resolve_device("cuda")
    config = bc.build_config(args.model)
    if args.layers:
        config.num_hidden_layers = args.layers
    model = bc.build_model(config, torch.bfloat16, device)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    report = []
    for attn in args.attn:
        model.set_attn_implementation(attn)
        for call in range(args.calls):
            start = len(collect.lines)
            seconds = timed_generate(model, ids, args.new, True, device)
            lines = collect.lines[start:]
            # (torch logs "Re-recording" for every recorded graph whose invariants a step fails, also when another
            # recorded graph then matches: "Recording" counts the graphs actually recorded)
            counts = {name: sum(key in line for line in lines) for name, key in (
                ("warm-ups", "Running warmup"), ("eager runs", "Running eager"), ("recorded", "Recording"),
                ("failed checks", "Re-recording"))}
            head = f"== {attn} call {call}: {seconds * 1e3:.1f} ms; {counts}"
            reasons = sorted({line.split("reason=")[-1].split(". input stack trace")[0][:300]
                              for line in lines if "Re-recording" in line})
            report += [head] + ["   re-recorded: " + r for r in reasons]
            print("\n".join([head] + ["   re-recorded: " + r for r in reasons]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_rerecord.txt"), "w") as f:
            f.write("\n".join(report) + "\n\n-- full log --\n" + "\n".join(collect.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
