#!/usr/bin/env python3
"""FP8 latent cache against the bf16 latent cache on one GPU: kernel bandwidth, step time and capacity, in one run.

1. ``kernel``: one layer, fa3, 16 heads, batch 128, context 16k: time per call (CUDA events, median) and the
   fraction of the device-to-device copy bandwidth (measured in the same run) counted in the bytes each cache
   holds (576 values per token: 1 byte in FP8, 2 in bf16).
2. ``step``: DeepSeek-V3 attention shape (hidden 7168, 128 heads, q_lora 1536), ``--layers`` dense layers, batch 32,
   context 65,536: one decode step (``model(...)`` with ``MLALatentCache``), bf16 vs FP8 latent.
3. ``maxctx``: the same model at batch 32: the largest context (doubling from 64k) at which one decode step runs,
   bf16 vs FP8 latent.

The caches are filled without a prefill: random latent rows are written through the layers' own ``update`` in
chunks, after ``reserve`` sized the buffers once (a prefill of 32 x 1M tokens would cost far more than the steps
measured, and decode time does not depend on the values). Random weights, bf16.

    python scripts/bench_fp8_cache.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_flashinfer_mla  # noqa: E402
from hf_flashinfer_mla.cache import FP8  # noqa: E402
from hf_flashinfer_mla.plan import StepPlan, decode_latent  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import is_oom  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
CHUNK = 8192


def events_ms(fn, warmup=3, reps=20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(4 * 2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * 4 * 2**30 / ms / 1e6  # GB/s, read + write


def filled_layer(batch: int, context: int, dtype) -> hf_flashinfer_mla.MLALatentLayer:
    """A latent layer holding `context` random rows per sequence (bf16 or FP8 storage)."""
    layer = hf_flashinfer_mla.MLALatentLayer(dtype=FP8 if dtype == FP8 else None)
    g = torch.Generator(device=DEV).manual_seed(0)
    done = 0
    while done < context:
        n = min(CHUNK, context - done)
        layer.update(torch.randn(batch, 1, n, 512, device=DEV, dtype=BF16, generator=g),
                     torch.randn(batch, 1, n, 64, device=DEV, dtype=BF16, generator=g))
        if done == 0:
            layer.reserve(context + 64)
        done += n
    return layer


def kernel(args, bandwidth: float) -> list[dict]:
    b, h, s = 128, 16, args.kernel_context
    rows = []
    for dtype in (BF16, FP8):
        layer = filled_layer(b, s, dtype)
        q_lat = torch.randn(b, h, 1, 512, device=DEV, dtype=BF16) * 0.05
        q_pe = torch.randn(b, h, 1, 64, device=DEV, dtype=BF16) * 0.05
        plan = StepPlan(torch.ones(b, 1, 1, s, dtype=torch.bool, device=DEV))
        ms = events_ms(lambda: decode_latent(plan, "fa3", q_lat, q_pe, layer.keys, layer.values, 192**-0.5))
        nbytes = b * s * 576 * (1 if dtype == FP8 else 2)
        gbs = nbytes / ms / 1e6
        rows.append({"case": "kernel", "cache": str(dtype).replace("torch.", ""), "batch": b, "heads": h,
                     "context": s, "ms": ms, "GB/s": gbs, "of_copy_bandwidth": gbs / bandwidth})
        del layer
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def v3_model(layers: int):
    cfg = transformers.DeepseekV3Config(
        vocab_size=32000, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=layers, n_group=1, topk_group=1, rope_interleave=True,
        max_position_embeddings=4 * 2**20, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flashinfer_mla", dtype=BF16)
    return model.eval()


@torch.no_grad()
def step_ms(model, batch: int, context: int, dtype, steps: int) -> float:
    cache = hf_flashinfer_mla.MLALatentCache(config=model.config, dtype=FP8 if dtype == FP8 else None)
    for i in range(model.config.num_hidden_layers):
        cache.layers[i] = filled_layer(batch, context, dtype)
    ids = torch.randint(1, 32000, (batch, 1), device=DEV)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=DEV)

    def one():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        cache.crop(-1)  # every timed step decodes at exactly `context` cached tokens

    try:
        return events_ms(one, warmup=2, reps=steps)
    finally:
        del cache
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="dense layers of the step and maxctx model")
    ap.add_argument("--batch", type=int, default=32, help="batch of the step and maxctx parts")
    ap.add_argument("--context", type=int, default=65536, help="context of the step part")
    ap.add_argument("--kernel-context", type=int, default=16384, help="context of the kernel part")
    ap.add_argument("--steps", type=int, default=10, help="timed calls per measurement (median)")
    ap.add_argument("--max-context", type=int, default=4 * 2**20, help="where maxctx stops doubling")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernel", "step", "maxctx"], help="parts not run")
    ap.add_argument("--json", default=None, help="file for the results")
    args = ap.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(DEV), "args": vars(args),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_GBs"] = bandwidth
    print(f"{result['device']}: device-to-device copy {bandwidth:.0f} GB/s")
    if "kernel" not in args.skip:
        result["kernel"] = kernel(args, bandwidth)
        for r in result["kernel"]:
            print(f"kernel {r['cache']:>14} H={r['heads']} B={r['batch']} ctx={r['context']}: {r['ms']:.3f} ms, "
                  f"{r['GB/s']:.0f} GB/s = {100 * r['of_copy_bandwidth']:.1f}% of copy")
    model = v3_model(args.layers)
    if "step" not in args.skip:
        times = {str(d): step_ms(model, args.batch, args.context, d, args.steps) for d in (BF16, FP8)}
        result["step"] = {"batch": args.batch, "context": args.context, "ms": times,
                          "speedup": times[str(BF16)] / times[str(FP8)]}
        print(f"V3 attention x{args.layers}, batch {args.batch}, context {args.context}: bf16 latent "
              f"{times[str(BF16)]:.2f} ms, FP8 latent {times[str(FP8)]:.2f} ms -> {result['step']['speedup']:.2f}x")
    if "maxctx" not in args.skip:
        result["maxctx"] = {}
        for dtype in (BF16, FP8):
            best, ctx = 0, 65536
            while ctx <= args.max_context:
                try:
                    step_ms(model, args.batch, ctx, dtype, steps=1)
                    best, ctx = ctx, ctx * 2
                except Exception as exc:  # noqa: BLE001
                    if not is_oom(exc):
                        raise
                    gc.collect()
                    torch.cuda.empty_cache()
                    break
            result["maxctx"][str(dtype)] = best
            print(f"largest context at batch {args.batch}, {dtype}: {best}")
        bf, f8 = result["maxctx"][str(BF16)], result["maxctx"][str(FP8)]
        print(f"FP8 / bf16 largest context: {f8 / max(bf, 1):.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
