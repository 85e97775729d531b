#!/usr/bin/env python3
"""Decode step of a DeepSeek-V3-shaped model whose attention linears are FP8 (block 128), flashinfer_mla vs sdpa.

DeepSeek-V3/R1 and Kimi-K2 ship FP8: Transformers loads their linears as ``FP8Linear``. This measures what the
absorbed decode gains over sdpa on the *same* quantized weights: V3 attention shape (hidden 7168, 128 heads,
q_lora 1536, kv_lora 512), ``--layers`` dense layers with a small MLP, random weights quantized to float8_e4m3fn with
per-[128, 128] scales, bf16 activations. Transformers' FP8 matmul is a Hub kernel that cannot be fetched offline, so
every FP8Linear runs dequantize + ``F.linear`` (what that kernel computes), for both implementations alike; that
costs both the same per-step weight dequantization, which a real FP8 kernel does not pay.

Each implementation gets the cache ``generate()`` gives it (flashinfer_mla: MLALatentCache; sdpa: DynamicCache),
filled by a real prefill of ``--context`` tokens; then ``--steps`` decode steps are timed with CUDA events (median).

    python scripts/bench_quantized.py --batch 32 --context 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache
from transformers.integrations import finegrained_fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_flashinfer_mla  # noqa: E402

FP8 = torch.float8_e4m3fn


def fp8_linear_reference(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                         allow_deepgemm=True):
    w = finegrained_fp8._dequantize_fp8_weight(weight, weight_scale_inv, block_size, input.dtype)
    return F.linear(input, w, bias)


def quantize(linear: torch.nn.Linear, block=(128, 128)) -> torch.nn.Module:
    w = linear.weight.detach().float()
    out_f, in_f = w.shape
    q = finegrained_fp8.FP8Linear(in_f, out_f, block_size=list(block)).to(w.device)
    bo, bi = block
    padded = F.pad(w, (0, -in_f % bi, 0, -out_f % bo))  # kv_a_proj_with_mqa has 576 rows: ceil-sized scale blocks
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(FP8).max
    q.weight.data = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out_f, :in_f].to(FP8)
    q.weight_scale_inv.data = scale
    return q.requires_grad_(False)


def build(layers: int, device) -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=32000, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=layers, n_group=1, topk_group=1, rope_interleave=True,
        max_position_embeddings=163840, eos_token_id=None, pad_token_id=0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    for attn in (m for m in model.modules() if hasattr(m, "kv_b_proj")):
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            setattr(attn, name, quantize(getattr(attn, name)))
    return model.eval()


@torch.no_grad()
def decode_ms(model, attn: str, batch: int, context: int, steps: int, warmup: int, device) -> dict:
    model.set_attn_implementation(attn)
    cache = (hf_flashinfer_mla.MLALatentCache if attn == "flashinfer_mla" else DynamicCache)(config=model.config)
    ids = torch.randint(1, 32000, (batch, context), device=device)
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    del ids
    times = []
    for i in range(warmup + steps):
        mask = torch.cat([mask, mask[:, :1]], dim=-1)
        nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(input_ids=nxt, attention_mask=mask, cache=out.cache, use_cache=True)
        end.record()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return {"attn": attn, "batch": batch, "context": context, "ms_per_step": statistics.median(times),
            "steps": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="dense layers")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens prefilled before the timed steps")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps")
    ap.add_argument("--json", default=None, help="file for the results")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    finegrained_fp8.fp8_linear = fp8_linear_reference
    model = build(args.layers, device)
    rows = [decode_ms(model, attn, args.batch, args.context, args.steps, args.warmup, device)
            for attn in ("sdpa", "flashinfer_mla")]
    ratio = rows[0]["ms_per_step"] / rows[1]["ms_per_step"]
    print(f"V3 attention shape, {args.layers} layers, FP8 weights (block 128), batch {args.batch}, "
          f"context {args.context}, {torch.cuda.get_device_name(device)}")
    print(f"{'attn':<16}{'ms/step':>10}")
    for r in rows:
        print(f"{r['attn']:<16}{r['ms_per_step']:>10.2f}")
    print(f"flashinfer_mla speed-up over sdpa: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "speedup": ratio, "args": vars(args),
                                               "device": torch.cuda.get_device_name(device),
                                               "versions": {"torch": torch.__version__,
                                                            "transformers": transformers.__version__}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
