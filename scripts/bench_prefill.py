#!/usr/bin/env python3
"""One attention layer's prefill, as generate() runs it (Transformers' SDPA over the expanded latent) against
FlashInfer's fa3 ragged prefill (``kernels/ragged.py``, what continuous batching's prefill chunks run on), at DeepSeek's
head dims (query/key 192, value 128).

For each head count H (``--heads``; 16: DeepSeek-V2-Lite, 128: DeepSeek-V3) and prompt length (``--lengths``), a
batch of ``--batch`` prompts, the first of full length and each further one ``--pad`` tokens shorter (left padding,
as generate() pads a batch):

* ``sdpa``: ``sdpa_attention_forward`` as Transformers calls it, with no mask (``is_causal``) for an unpadded batch,
  else the boolean mask ``masking_utils.sdpa_mask`` builds;
* ``ragged``: the valid tokens of each prompt packed (their gather included in the time), one ``plan`` (host) and
  one ``run``; the plan is timed apart, since a step plans once for all its layers.

Each is checked against a float32 SDPA of the valid rows; times are CUDA-event medians. The first-token time of a
model is this per layer, times its layers, plus what both share (projections, MLP, the expansion through
``kv_b_proj``).

    python scripts/bench_prefill.py --heads 16 128 --lengths 4096 16384 32768 --out out
    python scripts/bench_prefill.py --batch 4 --pad 512 --lengths 4096 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import bench_common as bc

QK, V_DIM = 192, 128


def rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def sdpa_prefill(q, k, v, mask, scale):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale, is_causal=mask is None)[0]


def bool_mask(lens, length, device):
    """generate()'s left-padded causal mask, as SDPA receives it: ``[B, 1, S, S]`` bool, True = attend."""
    pos = torch.arange(length, device=device)
    first = (length - lens.to(device))[:, None, None, None]
    return (pos[None, None, None, :] >= first) & (pos[None, None, None, :] <= pos[None, None, :, None])


def case(heads, length, args, device, dtype) -> dict:
    from hf_flashinfer_mla.kernels import ragged

    g = torch.Generator(device=device).manual_seed(args.seed)
    b, scale = args.batch, QK**-0.5
    lens = torch.tensor([length - i * args.pad for i in range(b)])
    q, k = (torch.randn(b, heads, length, QK, generator=g, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(b, heads, length, V_DIM, generator=g, device=device, dtype=dtype)
    mask = None if args.pad == 0 or b == 1 else bool_mask(lens, length, device)
    # the valid (not padded) token positions of each prompt, packed: [N]
    index = torch.cat([r * length + torch.arange(length - n, length) for r, n in enumerate(lens.tolist())])
    index = index.to(device)
    record = dict(heads=heads, length=length, batch=b, pad=args.pad, status="ok")

    def packed(t):  # [B, H, S, D] -> [N, H, D]
        return t.transpose(1, 2).reshape(b * length, heads, -1).index_select(0, index)

    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[r:r + 1, :, length - n:].float(), k[r:r + 1, :, length - n:].float(), v[r:r + 1, :, length - n:].float(),
        is_causal=True, scale=scale)[0].transpose(0, 1) for r, n in enumerate(lens.tolist())])  # [N, H, V]

    out = sdpa_prefill(q, k, v, mask, scale)  # [B, S, H, V]
    record["sdpa_err"] = rel_err(out.reshape(b * length, heads, -1).index_select(0, index), ref)
    record["sdpa_ms"] = statistics.median(bc.time_ms(lambda i: sdpa_prefill(q, k, v, mask, scale), device,
                                                     args.warmup, args.iters))
    if device.type != "cuda" or not ragged.supported_dims(QK, V_DIM):
        return record
    wrapper = ragged.Wrappers().get(device, 0)
    plan_times = []
    for _ in range(5):  # (host time: a step plans once for all its layers)
        start = time.perf_counter()
        ragged.plan(wrapper, lens, lens, heads, QK, V_DIM, scale, dtype)
        plan_times.append((time.perf_counter() - start) * 1e3)
    out = ragged.run(wrapper, packed(q), packed(k), packed(v))
    record["ragged_err"] = rel_err(out, ref)
    record["ragged_ms"] = statistics.median(bc.time_ms(
        lambda i: ragged.run(wrapper, packed(q), packed(k), packed(v)), device, args.warmup, args.iters))
    record["plan_ms"] = statistics.median(plan_times)
    record["speedup"] = record["sdpa_ms"] / record["ragged_ms"]
    return record


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pad", type=int, default=0, help="each further prompt this many tokens shorter (left padding)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="prefill.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    records = []
    for heads in args.heads:
        for length in args.lengths:
            try:
                records.append(case(heads, length, args, device, dtype))
            except Exception as exc:  # (out of memory at the longest lengths: reported, the rest still runs)
                records.append(dict(heads=heads, length=length, batch=args.batch, pad=args.pad, **bc.failure(exc)))
            bc.free_memory(device)
    rows = [[str(r["heads"]), str(r["length"]), str(r["batch"]), bc.fmt(r.get("sdpa_ms")), bc.fmt(r.get("ragged_ms")),
             bc.fmt(r.get("speedup")), bc.fmt(r.get("plan_ms"), ".3f"), bc.fmt(r.get("sdpa_err"), ".1e"),
             bc.fmt(r.get("ragged_err"), ".1e"), r.get("message", "")[:60]] for r in records]
    bc.print_table(["heads", "tokens", "batch", "sdpa ms", "ragged ms", "ragged vs sdpa", "plan ms", "sdpa err",
                    "ragged err", "failure"], rows,
                   [f"one layer's prefill attention, qk {QK} / v {V_DIM}, {args.dtype}, prompts {args.pad} tokens "
                    "shorter each after the first (left padding)"])
    path = bc.write_json(args.out, args.name, dict(metadata=bc.environment(device, args), results=records))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
