"""Decode step with CUDA graphs (torch.compile, static cache) against the bandwidth floor.

The step is driven the way ``generate(..., cache_implementation="static")`` drives it: the 4D mask is built
eagerly each step (``create_masks_for_generate``, which runs flashinfer_mla's mask function and its FlashInfer
planning), then the model's forward, compiled with ``mode="reduce-overhead"`` (CUDA graphs), runs. Compared side by
side in one run: flashinfer_mla without compilation, flashinfer_mla compiled, and sdpa compiled (Transformers' own
fast path). The floor is (weights + latent cache) bytes / measured device copy bandwidth.

    python scripts/bench_cudagraphs.py --model deepseek-v3-attn --layers 4 --batch 32 --context 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from transformers import StaticCache
from transformers.masking_utils import create_masks_for_generate

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_decode  # noqa: E402  (model configs, cache filling)

import hf_flashinfer_mla  # noqa: E402,F401


def copy_bandwidth(device, gib=4, reps=10):
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * gib * 2**30 / statistics.median(times[2:])  # bytes read + written per second


@torch.no_grad()
def run(model, attn, compiled, args, device):
    torch._dynamo.reset()
    model.set_attn_implementation(attn)
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=args.context + args.warmup + args.steps + 8)
    bench_decode.fill_cache(cache, cfg, args.batch, args.context, model.dtype, device)
    forward = torch.compile(model.forward, mode="reduce-overhead") if compiled else model.forward
    tok = torch.randint(1, cfg.vocab_size, (args.batch, 1), device=device)
    mask2d = torch.ones(args.batch, args.context, dtype=torch.long, device=device)
    times, host = [], []
    for i in range(args.warmup + args.steps):
        mask2d = torch.cat([mask2d, mask2d[:, :1]], -1)
        pos = torch.full((args.batch, 1), args.context + i, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mask4d = create_masks_for_generate(config=cfg, inputs_embeds=torch.empty(args.batch, 1, 0, dtype=model.dtype,
                                           device=device), attention_mask=mask2d, cache=cache, position_ids=pos)
        t1 = time.perf_counter()
        out = forward(input_ids=tok, attention_mask=mask4d, position_ids=pos, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= args.warmup:
            times.append(t2 - t0)
            host.append(t1 - t0)
    del cache, out
    torch.cuda.empty_cache()
    return statistics.median(times), statistics.median(host)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v3-attn", choices=bench_decode.REAL_MODELS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = bench_decode.build_config(args.model, args.layers)
    model = bench_decode.build_model(cfg, torch.bfloat16, device, None)
    bw = copy_bandwidth(device)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    if not cfg.tie_word_embeddings:  # a decode step reads B rows of the embedding, not the table
        weight_bytes -= model.get_input_embeddings().weight.numel() * 2
    kv_bytes = cfg.num_hidden_layers * args.batch * args.context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    floor = (weight_bytes + kv_bytes) / bw
    rows = []
    for attn, compiled in (("flashinfer_mla", False), ("flashinfer_mla", True), ("sdpa", True)):
        try:
            step, host = run(model, attn, compiled, args, device)
            rows.append(dict(attn=attn, compiled=compiled, step_ms=step * 1e3, mask_and_plan_ms=host * 1e3,
                             x_floor=step / floor))
        except torch.cuda.OutOfMemoryError as exc:
            rows.append(dict(attn=attn, compiled=compiled, status="oom", message=str(exc)[:200]))
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; weights read per step {weight_bytes / 1e9:.2f} GB, latent cache "
          f"{kv_bytes / 1e9:.2f} GB; floor {floor * 1e3:.3f} ms")
    print(f"{'attn':<16}{'compiled':>9}{'step ms':>10}{'mask+plan ms':>14}{'x floor':>9}")
    for r in rows:
        if "step_ms" in r:
            print(f"{r['attn']:<16}{str(r['compiled']):>9}{r['step_ms']:>10.3f}{r['mask_and_plan_ms']:>14.3f}"
                  f"{r['x_floor']:>9.2f}")
        else:
            print(f"{r['attn']:<16}{str(r['compiled']):>9}  {r['status']}")
    if args.json:
        meta = dict(vars(args), date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(device),
                    torch=torch.__version__, copy_bandwidth_Bps=bw, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                    floor_ms=floor * 1e3)
        pathlib.Path(args.json).write_text(json.dumps(dict(meta=meta, results=rows), indent=1))


if __name__ == "__main__":
    main()
