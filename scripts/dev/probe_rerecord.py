#!/usr/bin/env python3
"""Why a warmed-up static-cache ``generate()`` records CUDA graphs again: runs the same call several times per
attention implementation with torch's cudagraph-tree log at DEBUG (``TORCH_LOGS=+cudagraphs``), and prints, per
call, its wall time and what the tree did (warm-ups, graphs recorded, and why recorded graphs failed a step's
checks: the graph input whose address or liveness changed).

It also counts, at each static cache ``generate()`` builds, the earlier ones still alive. ``--early-init``
allocates a new cache's latent layers where ``generate()`` builds it, before the prefill (Transformers allocates
them inside the prefill's first layer, where the prefill's activations may already hold the blocks the last call's
cache freed); ``--reuse-cache`` passes one `StaticCache` of the user's own, reset before every call, as the README
advises. A call that records no graph after the first is in a steady state; the log names every static input that
moved, with its addresses.

    python scripts/dev/probe_rerecord.py --model deepseek-v2-lite --batch 1 --calls 4 --out OUT
    python scripts/dev/probe_rerecord.py --model deepseek-v3-attn --layers 4 --batch 32 --prompt 4096 --new 64 \
        --calls 5 --attn flashinfer_mla sdpa [--early-init | --reuse-cache] --out OUT
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from transformers import StaticCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_common as bc  # noqa: E402
from bench_generate import timed_generate  # noqa: E402


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def watch_static_caches(early_init: bool) -> list[int]:
    """Counts, at each static cache generate() builds, the earlier ones still alive (their tensors keep their
    addresses, so the new cache lands elsewhere and CUDA graphs record again); with `early_init`, allocates the new
    cache's latent layers right there, before the prefill's activations can take the blocks an earlier cache
    freed."""
    import weakref

    from transformers.generation.utils import GenerationMixin

    made, alive = [], []
    original = GenerationMixin._prepare_static_cache

    def prepare(self, cache_implementation, batch_size, max_cache_len, *rest, **kwargs):
        alive.append(sum(ref() is not None for ref in made))
        cache = original(self, cache_implementation, batch_size, max_cache_len, *rest, **kwargs)
        made.append(weakref.ref(cache))
        if early_init:
            text = self.config.get_text_config(decoder=True)
            for layer in cache.layers:
                if not layer.is_initialized:
                    k = torch.empty(batch_size, 1, 0, text.kv_lora_rank, dtype=self.dtype, device=self.device)
                    layer.lazy_initialization(k, k.new_empty(batch_size, 1, 0, text.qk_rope_head_dim))
        return cache

    GenerationMixin._prepare_static_cache = prepare
    return alive


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--attn", nargs="+", default=["flashinfer_mla", "sdpa"], choices=bc.ATTNS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=16, help="new tokens per call")
    p.add_argument("--calls", type=int, default=4, help="generate() calls per implementation (the first compiles)")
    p.add_argument("--layers", type=int, default=None, help="override the depth")
    p.add_argument("--out", default=None, help="directory for probe_rerecord.txt (summary, then the whole log)")
    p.add_argument("--early-init", action="store_true",
                   help="allocate each static cache's latent layers when generate() builds the cache, before the "
                        "prefill (Transformers allocates them lazily, inside the prefill's first layer)")
    p.add_argument("--reuse-cache", action="store_true",
                   help="pass generate() one StaticCache of the user's own, reset before every call, instead of "
                        "cache_implementation='static' (a new cache per call)")
    args = p.parse_args(argv)
    import hf_flashinfer_mla  # noqa: F401

    alive = watch_static_caches(args.early_init)

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
        cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new) if args.reuse_cache else None
        for call in range(args.calls):
            start = len(collect.lines)
            seconds = timed_generate(model, ids, args.new, True, device, cache=cache)
            lines = collect.lines[start:]
            # (torch logs "Re-recording" for every recorded graph whose invariants a step fails, also when another
            # recorded graph then matches: "Recording" counts the graphs actually recorded)
            counts = {name: sum(key in line for line in lines) for name, key in (
                ("warm-ups", "Running warmup"), ("eager runs", "Running eager"), ("recorded", "Recording"),
                ("failed checks", "Re-recording"))}
            head = (f"== {attn} call {call}: {seconds * 1e3:.1f} ms; {counts}; static caches alive when this call "
                    f"built its own: {alive.pop(0) if alive else '?'}")
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
