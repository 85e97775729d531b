#!/usr/bin/env python3
"""One attention layer's absorbed decode, per backend and cache layout, against the device's copy bandwidth; and
the per-step planning cost of each way to plan FlashInfer.

For each head count H (``--heads``), with DeepSeek's latent (kv_lora_rank 512, rope 64, qk_nope 128, v_head 128),
batch ``--batch`` and context ``--context``, and each cache layout:

* ``split``: two separate contiguous tensors, what Transformers' DynamicCache/StaticCache hold;
* ``latent``: `MLALatentLayer` as generate() allocates it on this GPU (split buffers on Hopper/Ampere);
* ``packed``: `MLALatentLayer(packed=True)`, one row per token (what trtllm-gen reads on Blackwell);

it checks every backend against a float32 reference, then times with CUDA events:
``kernel`` = ``decode_latent`` on an already planned step (layout copies + kernel), ``full`` = with the W_UK/W_UV
absorption GEMMs, and GB/s = (latent read + query + output bytes) / kernel time, also as a fraction of the copy
bandwidth measured in the same run. Caches are rotated over enough copies to defeat L2.

Planning (fa2/fa3), host milliseconds per step, each a fresh `StepPlan`:
``host rows`` = what generate() does (rows known on the host, FlashInfer's generated module planned directly: no
device sync), ``mask rows`` = rows read off the mask (one sync), ``wrapper`` = FlashInfer's public
``BatchMLAPagedAttentionWrapper.plan`` (what other FlashInfer releases use).

    python scripts/bench_kernel.py --heads 16 128 --batch 128 --context 4096 --out out
    python scripts/bench_kernel.py --device cpu --dtype float32 --heads 4 --batch 2 --context 256 --iters 3
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

import bench_common as bc

RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
BACKENDS = ("reference", "fa2", "fa3")
LAYOUTS = ("split", "latent", "packed")
L2_BYTES = 60 * 1000 * 1000  # H200, if the device does not report it
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


class LatentProjection(nn.Module):
    """Stands in for an MLA attention module: what ``absorbed_weights`` reads (``kv_b_proj`` and the head dims)."""

    def __init__(self, heads: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank, self.qk_rope_head_dim = NOPE, V_DIM, RANK, ROPE
        self.kv_b_proj = nn.Linear(RANK, heads * (NOPE + V_DIM), bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.kv_b_proj.weight.normal_(0.0, RANK**-0.5)


def make_caches(layout, batch, context, copies, dtype, device):
    from hf_flashinfer_mla import MLALatentLayer

    caches = []
    for _ in range(copies):
        kv = torch.randn(batch, 1, context, RANK, dtype=dtype, device=device)
        kr = torch.randn(batch, 1, context, ROPE, dtype=dtype, device=device)
        if layout == "split":
            caches.append((kv, kr, None))
        else:
            layer = MLALatentLayer(packed=True if layout == "packed" else None)
            caches.append((*layer.update(kv, kr), layer))
    return caches


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def kernel_bytes(batch, heads, context, elem) -> int:
    return batch * context * (RANK + ROPE) * elem + batch * heads * (RANK + ROPE) * elem + batch * heads * RANK * elem


def step_plan(mask, host_rows: bool):
    """A step over every cached position, its rows known on the host (as in generate()) or read off the mask."""
    from hf_flashinfer_mla.plan import StepPlan
    from hf_flashinfer_mla.rows import Rows

    rows = None
    if host_rows:
        b, context = mask.shape[0], mask.shape[-1]
        rows = Rows(torch.full((b,), context, dtype=torch.int32), 1, torch.zeros(b, dtype=torch.long), end=context)
    return StepPlan(mask, rows)


def planning_ms(backend, layer, mask, device, reps, how) -> float:
    """Host ms to plan one step: build its rows and plan FlashInfer, page indices included (median of `reps`)."""
    from hf_flashinfer_mla.kernels import fa as flashinfer_fa
    from hf_flashinfer_mla.plan import layer_of

    previous = os.environ.get(flashinfer_fa.PLANNER_ENV)
    os.environ[flashinfer_fa.PLANNER_ENV] = "wrapper" if how == "wrapper" else "direct"
    try:
        if how != "wrapper" and not flashinfer_fa.uses_generated_module():
            return None  # an untested FlashInfer release: only the wrapper
        times = []
        for _ in range(reps):
            plan = step_plan(mask, host_rows=how == "host rows")
            bc.synchronize(device)
            t0 = time.perf_counter()
            flashinfer_fa.build(backend, plan, layer)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    finally:
        if previous is None:
            os.environ.pop(flashinfer_fa.PLANNER_ENV, None)
        else:
            os.environ[flashinfer_fa.PLANNER_ENV] = previous


def bench_case(heads, layout, args, device, dtype, copy_bps) -> list[dict]:
    from hf_flashinfer_mla.absorption import absorb_query, absorbed_weights, project_output
    from hf_flashinfer_mla.capabilities import unavailable_reason
    from hf_flashinfer_mla.kernels import reference
    from hf_flashinfer_mla.plan import layer_of

    batch, context = args.batch, args.context
    elem = torch.empty((), dtype=dtype).element_size()
    one_cache = batch * context * (RANK + ROPE) * elem
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    copies = args.copies or min(32, max(1, math.ceil(4 * (l2 or L2_BYTES) / one_cache)))
    scale = (NOPE + ROPE) ** -0.5
    torch.manual_seed(args.seed + heads)
    module = LatentProjection(heads, dtype, device)
    weights = absorbed_weights(module, dtype)
    query = torch.randn(batch, heads, 1, NOPE + ROPE, device=device, dtype=dtype)
    caches = make_caches(layout, batch, context, copies, dtype, device)
    kv0, kr0 = caches[0][0], caches[0][1]
    pitch = kv0.stride(0) // kv0.stride(2)
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device)
    # The operands as the attention function hands them to a kernel: head-major, no copies (kernels/__init__.py).
    q_lat, q_rows = absorb_query(query, NOPE, weights)
    f32 = reference.attend(mask, scale, q_lat.float(), q_rows.float(), kv0.float(), kr0.float())
    common = dict(heads=heads, batch=batch, context=context, layout=layout, dtype=str(dtype).replace("torch.", ""),
                  cache_copies=copies, pitch=pitch)
    records = []
    for backend in args.backends:
        rec = {**common, "backend": backend}
        reason = unavailable_reason(backend, device, dtype, RANK, ROPE, heads)
        if reason:
            rec.update(status="skipped", message=reason)
            records.append(rec)
            continue
        try:
            layer = layer_of(q_lat, kv0, kr0, scale)
            route = step_plan(mask, True).route(backend, layer, backend, False)  # the step's metadata, built once
            if route.backend != backend:
                raise RuntimeError(f"{backend} declined the step; it would run on {route.backend}")
            lat = route.run(q_lat, q_rows, kv0, kr0)  # also loads the kernel
            rec["rel_err_vs_fp32"] = rel_err(lat, f32)
            rec["correct"] = rec["rel_err_vs_fp32"] <= REL_TOL.get(dtype, 1e-4)

            def kernel(i, route=route):
                kv, kr, _ = caches[i % copies]
                return route.run(q_lat, q_rows, kv, kr)

            def full(i, route=route):  # absorb, kernel, project: a decode layer's attention work
                kv, kr, _ = caches[i % copies]
                return project_output(route.run(*absorb_query(query, NOPE, weights), kv, kr), weights, batch)

            k_ms = statistics.median(bc.time_ms(kernel, device, args.warmup, args.iters))
            f_ms = statistics.median(bc.time_ms(full, device, args.warmup, args.iters))
            gbps = kernel_bytes(batch, heads, context, elem) / (k_ms / 1e3) / 1e9
            rec.update(status="ok", kernel_ms=k_ms, full_ms=f_ms, kernel_GBps=gbps,
                       of_copy=gbps * 1e9 / copy_bps if copy_bps else None)
            if backend in ("fa2", "fa3"):
                for how in ("host rows", "mask rows", "wrapper"):
                    rec[f"plan_ms_{how.replace(' ', '_')}"] = planning_ms(
                        backend, layer, mask, device, args.plan_reps, how)
        except Exception as exc:  # noqa: BLE001 - recorded; the other backends still run
            rec.update(bc.failure(exc))
        shown = f"{rec['kernel_ms']:.4f} ms" if rec.get("status") == "ok" else rec.get("status")
        print(f"  H={heads} {layout:6s} {backend:9s}: {shown}", flush=True)
        records.append(rec)
    del caches
    bc.free_memory(device)
    return records


def print_results(records, copy_bps) -> None:
    header = ["H", "layout", "backend", "kernel ms", "full ms", "GB/s", "of copy", "plan host", "plan mask",
              "plan wrapper", "err fp32"]
    rows = []
    for r in records:
        if r.get("status") != "ok":
            rows.append([str(r["heads"]), r["layout"], r["backend"], r.get("status", "?").upper()] + [""] * 7)
            continue
        rows.append([str(r["heads"]), r["layout"], r["backend"], bc.fmt(r["kernel_ms"], ".4f"),
                     bc.fmt(r["full_ms"], ".4f"), bc.fmt(r["kernel_GBps"], ".0f"), bc.fmt(r.get("of_copy"), ".1%"),
                     bc.fmt(r.get("plan_ms_host_rows"), ".3f"), bc.fmt(r.get("plan_ms_mask_rows"), ".3f"),
                     bc.fmt(r.get("plan_ms_wrapper"), ".3f"), bc.fmt(r["rel_err_vs_fp32"], ".1e")])
    notes = ["GB/s counts latent read + query + output bytes over the kernel time; plan = host ms per step: "
             "host rows (generate(): no sync), mask rows (one sync), FlashInfer's public wrapper"]
    if copy_bps:
        notes.insert(0, f"copy bandwidth (read + write): {copy_bps / 1e9:.0f} GB/s")
    bc.print_table(header, rows, notes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--plan-reps", type=int, default=20)
    p.add_argument("--copies", type=int, default=0, help="cache copies to rotate over (0: enough to defeat L2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="kernel.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    import hf_flashinfer_mla  # noqa: F401

    payload = {"metadata": bc.environment(device, args), "results": []}
    copy_bps = bc.copy_bandwidth(device) if device.type == "cuda" else None
    payload["copy_bandwidth_Bps"] = copy_bps
    with torch.no_grad():
        for heads in args.heads:
            for layout in args.layout:
                try:
                    payload["results"] += bench_case(heads, layout, args, device, dtype, copy_bps)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs
                    payload["results"].append({"heads": heads, "layout": layout, "backend": "*", **bc.failure(exc)})
                bc.write_json(args.out, args.name, payload)
    print()
    print_results([r for r in payload["results"] if r.get("backend") != "*"], copy_bps)
    path = bc.write_json(args.out, args.name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
