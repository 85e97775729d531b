#!/usr/bin/env python3
"""The absorbed MLA decode of ONE attention layer, per backend (reference, fa2, fa3), against the copy bandwidth.

For each head count H (``--heads``, default 16 and 128), batch B (``--batch``, 128), context S (``--context``, 4096)
and cache layout (``--layout``), with DeepSeek's latent shape (kv_lora_rank 512, rope 64, qk_nope 128, v_head 128):

* inputs: random ``q_nope [B, H, 1, 128]``, ``q_pe [B, H, 1, 64]``, a ``kv_b_proj``-like module holding the weight
  ``[H * (128 + 128), 512]``, and the latent cache ``[B, 1, S, 512]`` + ``[B, 1, S, 64]`` either as two separate
  contiguous tensors (``split``: what ``DynamicCache``/``StaticCache`` hold) or as views of one packed
  ``[B, 1, capacity, 576]`` buffer (``packed``: what ``hf_flashinfer_mla.MLALatentCache`` holds, built through
  ``MLALatentLayer.update``);
* correctness first: every backend's latent output (and the full layer output) on the same inputs against the
  ``reference`` backend, as ``||out - ref|| / ||ref||``, plus against a float32 reference;
* timings (CUDA events, warm-up, median of ``--iters``):
  (a) ``full``: the whole absorbed decode of the layer as ``flashinfer_mla`` runs it: ``absorb_query`` (W_UK) ->
      ``hf_flashinfer_mla.attention.decode_latent(backend, plan, ...)`` -> ``project_output`` (W_UV);
  (b) ``kernel``: ``decode_latent`` alone, on an already planned ``StepPlan`` (built from an all-True bool mask
      ``[B, 1, 1, S]``);
  (c) planning: the first ``decode_latent`` call on a fresh ``StepPlan`` (plan + kernel, wall clock, synchronised),
      and ``flashinfer_fa.plan_wrapper`` alone (CSR metadata + ``wrapper.plan``), i.e. the per-step host cost;
* bandwidth: bytes the kernel must move (latent read ``B*S*(512+64)*elem`` + query ``B*H*(512+64)*elem`` + output
  ``B*H*512*elem``) over its time, and that as a fraction of the device-to-device copy bandwidth measured in the same
  run (``--copy-mib`` MiB copied, read + written bytes counted, median of several copies).

If one cache copy fits in L2 (H200: 60 MB; read from the device), the timed loops rotate over enough copies to
exceed several times L2, so every call reads the cache from HBM.

Usage:

    python scripts/bench_kernel.py --heads 16 --batch 128 --context 4096 --json kernel.json
    python scripts/bench_kernel.py --device cpu --dtype float32 --heads 4 --batch 2 --context 256 --iters 3   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import torch
from torch import nn

RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128
BACKENDS = ("reference", "fa2", "fa3")
LAYOUTS = ("split", "packed")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_L2_BYTES = 60 * 1000 * 1000  # H200
L2_MULTIPLE = 4  # rotate over copies totalling at least this many times L2
MAX_COPIES = 32
GB = 1e9
# ||out - ref|| / ||ref|| above which a backend is flagged (bf16 rounding alone gives a few 1e-3).
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


class LatentProjection(nn.Module):
    """Stands in for an MLA attention module: what ``absorbed_weights`` reads (``kv_b_proj`` and the head dims)."""

    def __init__(self, heads: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.qk_nope_head_dim, self.v_head_dim = NOPE, V_DIM
        self.kv_lora_rank, self.qk_rope_head_dim = RANK, ROPE
        self.kv_b_proj = nn.Linear(RANK, heads * (NOPE + V_DIM), bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.kv_b_proj.weight.normal_(0.0, RANK**-0.5)


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    message = str(exc).lower()
    return isinstance(exc, oom_type) or any(m in message for m in ("out of memory", "can't allocate memory"))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-call times of ``fn(i)`` in ms (CUDA events on GPU, perf_counter elsewhere), after warm-up."""
    for i in range(warmup):
        fn(i)
    synchronize(device)
    times = []
    for i in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(warmup + i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def wall_ms(fn, device: torch.device) -> float:
    """Wall-clock ms of one call, synchronised on both sides (host-side work included)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(device: torch.device, mib: int, iters: int) -> dict:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time, median over `iters` copies."""
    n = mib * 1024 * 1024
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times = time_ms(lambda i: dst.copy_(src), device, warmup=2, iters=iters)
    med = statistics.median(times)
    return {"bytes_copied": n, "ms_median": med, "GBps": 2 * n / (med / 1e3) / GB, "ms_all": times}


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def make_caches(layout: str, batch: int, context: int, copies: int, dtype, device) -> list[tuple]:
    """`copies` latent caches as (kv_latent [B,1,S,512], k_rot [B,1,S,64], owner), in `layout`."""
    from hf_flashinfer_mla import MLALatentLayer

    caches = []
    for _ in range(copies):
        kv = torch.randn(batch, 1, context, RANK, dtype=dtype, device=device)
        kr = torch.randn(batch, 1, context, ROPE, dtype=dtype, device=device)
        if layout == "split":
            caches.append((kv, kr, None))
        else:
            layer = MLALatentLayer()
            kv_view, kr_view = layer.update(kv, kr)
            del kv, kr
            caches.append((kv_view, kr_view, layer))
    return caches


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def kernel_bytes(batch: int, heads: int, context: int, elem: int) -> int:
    """Bytes one decode call must move: the latent cache once, the query in and the latent output out."""
    return batch * context * (RANK + ROPE) * elem + batch * heads * (RANK + ROPE) * elem + batch * heads * RANK * elem


def full_bytes(batch: int, heads: int, context: int, elem: int) -> int:
    """Kernel bytes plus W_UK/W_UV, q_nope in and the projected output out."""
    weights = heads * (NOPE + V_DIM) * RANK * elem
    return kernel_bytes(batch, heads, context, elem) + weights + batch * heads * (NOPE + V_DIM) * elem


def bench_case(heads: int, layout: str, args, device, dtype, copy_gbps: float | None) -> list[dict]:
    """All backends for one (heads, layout): correctness, then timings. Returns one record per backend."""
    from hf_flashinfer_mla import flashinfer_fa
    from hf_flashinfer_mla.absorption import absorb_query, absorbed_weights, project_output
    from hf_flashinfer_mla.attention import decode_latent
    from hf_flashinfer_mla.dispatch import unavailable_reason
    from hf_flashinfer_mla.metadata import StepPlan

    batch, context = args.batch, args.context
    elem = torch.empty((), dtype=dtype).element_size()
    one_cache = batch * context * (RANK + ROPE) * elem
    l2 = l2_bytes(device)
    copies = 1 if one_cache >= L2_MULTIPLE * l2 / 2 else min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2 / one_cache))
    if args.copies:
        copies = args.copies
    scale = (NOPE + ROPE) ** -0.5
    gen = torch.Generator(device="cpu").manual_seed(args.seed + heads)
    torch.manual_seed(args.seed + heads)
    module = LatentProjection(heads, dtype, device)
    weights = absorbed_weights(module)
    q_nope = torch.randn(batch, heads, 1, NOPE, generator=gen).to(device, dtype)
    q_pe = torch.randn(batch, heads, 1, ROPE, generator=gen).to(device, dtype)
    caches = make_caches(layout, batch, context, copies, dtype, device)
    kv0, kr0 = caches[0][0], caches[0][1]
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device)
    q_lat = absorb_query(q_nope, weights)

    # Oracles: the reference backend in the run's dtype, and in float32.
    ref_plan = StepPlan(mask)
    ref_lat = decode_latent("reference", ref_plan, q_lat, q_pe, kv0, kr0, scale)
    ref_out = project_output(ref_lat, weights)
    f32_lat = decode_latent("reference", ref_plan, q_lat.float(), q_pe.float(), kv0.float(), kr0.float(), scale)
    del ref_plan

    common = {
        "heads": heads,
        "batch": batch,
        "context": context,
        "layout": layout,
        "dtype": str(dtype).replace("torch.", ""),
        "cache_copies": copies,
        "cache_bytes_per_copy": one_cache,
        "pitch_tokens": kv0.stride(0) // kv0.stride(2),
    }
    records = []
    for backend in args.backends:
        rec = {**common, "backend": backend}
        reason = unavailable_reason(backend, device, dtype, RANK, ROPE, heads)
        if reason:
            rec.update(status="skipped", message=reason)
            print(f"  H={heads} {layout:6s} {backend:9s}: skipped ({reason})", flush=True)
            records.append(rec)
            continue
        try:
            # Correctness on the same inputs (this first call also JIT-compiles/loads FlashInfer's kernel).
            plan = StepPlan(mask)
            lat = decode_latent(backend, plan, q_lat, q_pe, kv0, kr0, scale)
            out = project_output(lat, weights)
            rec.update(
                rel_err_vs_reference=rel_err(lat, ref_lat),
                rel_err_full_vs_reference=rel_err(out, ref_out),
                rel_err_vs_fp32=rel_err(lat, f32_lat),
            )
            rec["correct"] = rec["rel_err_vs_reference"] <= REL_TOL.get(dtype, 1e-4)
            if not rec["correct"]:
                print(
                    f"  WARNING H={heads} {layout} {backend}: relative error {rec['rel_err_vs_reference']:.2e} "
                    f"vs reference exceeds {REL_TOL.get(dtype, 1e-4):.0e}",
                    flush=True,
                )
            del lat, out

            def kernel(i, plan=plan, backend=backend):
                kv, kr, _ = caches[i % copies]
                return decode_latent(backend, plan, q_lat, q_pe, kv, kr, scale)

            def full(i, plan=plan, backend=backend):
                kv, kr, _ = caches[i % copies]
                q = absorb_query(q_nope, weights)
                return project_output(decode_latent(backend, plan, q, q_pe, kv, kr, scale), weights)

            k_times = time_ms(kernel, device, args.warmup, args.iters)
            f_times = time_ms(full, device, args.warmup, args.iters)
            k_ms, f_ms = statistics.median(k_times), statistics.median(f_times)
            k_bytes, f_bytes = kernel_bytes(batch, heads, context, elem), full_bytes(batch, heads, context, elem)
            rec.update(
                status="ok",
                kernel_ms=k_ms,
                kernel_ms_min=min(k_times),
                full_ms=f_ms,
                full_ms_min=min(f_times),
                kernel_bytes=k_bytes,
                kernel_GBps=k_bytes / (k_ms / 1e3) / GB,
                full_GBps=f_bytes / (f_ms / 1e3) / GB,
            )
            if copy_gbps:
                rec["kernel_frac_of_copy_bw"] = rec["kernel_GBps"] / copy_gbps
                rec["full_frac_of_copy_bw"] = rec["full_GBps"] / copy_gbps

            # Per-step planning: the first call on a fresh plan (plans, then runs), and the planning call alone.
            # Fresh plans are kept alive meanwhile, as a model step's mask is while the next one is built; a freed
            # plan's id() could otherwise be reused and change what the package's re-plan check sees.
            first, alive = [], []
            for _ in range(args.plan_reps):
                alive.append(StepPlan(mask))
                fresh = alive[-1]
                first.append(
                    wall_ms(lambda p=fresh, b=backend: decode_latent(b, p, q_lat, q_pe, kv0, kr0, scale), device)
                )
            del alive
            rec["first_call_ms"] = statistics.median(first)
            rec["first_call_minus_kernel_ms"] = rec["first_call_ms"] - k_ms
            if backend in ("fa2", "fa3"):
                pitch = common["pitch_tokens"]
                plan_only = [
                    wall_ms(
                        lambda b=backend, pitch=pitch: flashinfer_fa.plan_wrapper(
                            flashinfer_fa.fa_wrapper(device, b, heads, dtype), StepPlan(mask), device, pitch, heads,
                            dtype, RANK, ROPE, scale
                        ),
                        device,
                    )
                    for _ in range(args.plan_reps)
                ]
                rec["wrapper_plan_ms"] = statistics.median(plan_only)
                # How many plans a model's step pays at its first layer (1 expected; see print_table's note).
                rec["plans_per_first_call"] = rec["first_call_minus_kernel_ms"] / max(rec["wrapper_plan_ms"], 1e-9)
                # The wrapper now holds a plan no StepPlan knows about; forget which step it was for.
                flashinfer_fa.fa_wrapper(device, backend, heads, dtype)._hf_mla_step = None
            print(
                f"  H={heads} {layout:6s} {backend:9s}: kernel {k_ms:8.4f} ms ({rec['kernel_GBps']:7.1f} GB/s), "
                f"full {f_ms:8.4f} ms, rel err {rec['rel_err_vs_reference']:.2e}",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - recorded, the other backends still run
            rec.update(status="oom" if is_oom(exc) else "error", message=f"{type(exc).__name__}: {exc}"[:500])
            print(f"  H={heads} {layout:6s} {backend:9s}: {rec['status']} ({rec['message']})", flush=True)
        records.append(rec)
    return records


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(records: list[dict], copy_gbps: float | None) -> None:
    header = [
        "H",
        "B",
        "S",
        "layout",
        "backend",
        "kernel ms",
        "full ms",
        "GB/s",
        "of copy",
        "plan ms",
        "1st call ms",
        "rel err",
        "err fp32",
    ]
    rows = []
    for r in records:
        if r.get("status") != "ok":
            rows.append(
                [
                    str(r["heads"]),
                    str(r["batch"]),
                    str(r["context"]),
                    r["layout"],
                    r["backend"],
                    r.get("status", "?").upper(),
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
            continue
        rows.append(
            [
                str(r["heads"]),
                str(r["batch"]),
                str(r["context"]),
                r["layout"],
                r["backend"],
                fmt(r["kernel_ms"], ".4f"),
                fmt(r["full_ms"], ".4f"),
                fmt(r["kernel_GBps"], ".0f"),
                fmt(r.get("kernel_frac_of_copy_bw"), ".1%"),
                fmt(r.get("wrapper_plan_ms"), ".3f"),
                fmt(r["first_call_ms"], ".3f"),
                fmt(r["rel_err_vs_reference"], ".1e"),
                fmt(r["rel_err_vs_fp32"], ".1e"),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if copy_gbps:
        print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; GB/s counts latent read + query + output bytes")
    print(
        "plan ms = flashinfer_fa.plan_wrapper alone (CSR metadata + wrapper.plan); 1st call = fresh StepPlan: plan + kernel"
    )
    doubled = [r for r in records if r.get("plans_per_first_call", 0) > 1.6]
    if doubled:
        print(
            f"note: in {len(doubled)} case(s) the first call on a fresh plan cost about "
            f"{statistics.median(r['plans_per_first_call'] for r in doubled):.1f} plans: the wrapper was planned "
            "more than once for one step (see flashinfer_fa.fa_decode's re-plan check)"
        )


def metadata(args, device: torch.device) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "args": vars(args),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "l2_bytes": l2_bytes(device),
    }
    for pkg in ("transformers", "flashinfer", "hf_flashinfer_mla"):
        try:
            meta[pkg] = __import__(pkg).__version__
        except Exception as exc:  # noqa: BLE001
            meta[pkg] = f"unavailable ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return meta


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=50, help="timed calls (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--plan-reps", type=int, default=10, help="fresh plans timed for the planning cost")
    p.add_argument("--copies", type=int, default=0, help="cache copies to rotate over (0: enough to defeat L2)")
    p.add_argument("--copy-mib", type=int, default=4096, help="size of the bandwidth-reference copy")
    p.add_argument("--copy-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.plan_reps < 1:
        p.error("--iters and --plan-reps must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; pass --device cpu --dtype float32 for a smoke test.", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    import hf_flashinfer_mla  # noqa: F401

    payload = {"metadata": metadata(args, device), "copy_bandwidth": None, "results": []}
    # no_grad, not inference_mode: absorbed_weights keys its cache on weight._version, which inference tensors lack.
    with torch.no_grad():
        try:
            payload["copy_bandwidth"] = copy_bandwidth(device, args.copy_mib, args.copy_iters)
            copy_gbps = payload["copy_bandwidth"]["GBps"]
            print(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write, {args.copy_mib} MiB)", flush=True)
        except Exception as exc:  # noqa: BLE001
            copy_gbps = None
            payload["copy_bandwidth"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"copy bandwidth not measured: {exc}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for heads in args.heads:
            for layout in args.layout:
                try:
                    payload["results"] += bench_case(heads, layout, args, device, dtype, copy_gbps)
                except Exception as exc:  # noqa: BLE001 - e.g. OOM building the inputs
                    payload["results"].append(
                        {
                            "heads": heads,
                            "batch": args.batch,
                            "context": args.context,
                            "layout": layout,
                            "backend": "*",
                            "status": "oom" if is_oom(exc) else "error",
                            "message": f"{type(exc).__name__}: {exc}"[:500],
                        }
                    )
                    print(f"  H={heads} {layout}: error ({exc})", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print()
    print_table([r for r in payload["results"] if r.get("backend") != "*"], copy_gbps)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
