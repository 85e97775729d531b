#!/usr/bin/env python3
"""Where the time of one CUDA-graph decode step goes: GPU kernels (torch.profiler) and the host's share of a step.

Per cell and implementation (same model, `set_attn_implementation` between them) the step is compiled as
``bench_decode.py --graphs`` compiles it (StaticCache + ``torch.compile(model.__call__, mode="reduce-overhead")``,
what ``generate(cache_implementation="static")`` does), then: the step and host ms (``bench_common.decode_steps``,
no profiler); the device kernels of N steps under torch.profiler, per step, top kernels and categories, and the
gap between the step and its kernels; the host time of ``prepare_inputs_for_generation``, the registered mask
function inside it, the compiled forward until it returns and ``_update_model_kwargs_for_generation``; the
bandwidth floor. ``--device cpu --no-compile`` runs eager steps, for smoke tests (CPU ops stand in for kernels).

    python scripts/dev/profile_replay.py --cells 32x4096 --attn flashinfer_mla sdpa --out OUT
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch._dynamo.utils

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_common as bc  # noqa: E402

# Kernel categories: the first whose substrings occur in the lower-cased kernel name wins (rope/norms first, then
# attention before GEMM, as attention kernels are often cutlass/sm90 templates); unmatched: "other" (elementwise).
CATEGORIES = {
    "other": ("rotary", "rope", "norm"),
    "attention": ("flashinfer", "mla", "fmha", "flash", "attention", "attn", "sdpa", "softmax"),
    "gemm": ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "sm90", "bmm", "matmul", "splitk", "::mm", "addmm",
             "triton_tem"),
    "copy/memset": ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy"),
}


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pats in CATEGORIES.items() if any(p in low for p in pats)), "other")


def kernel_times(prof, device, steps: int) -> dict[str, list[float]]:
    """name -> [calls per step, us per step]: device kernels on CUDA, CPU ops' self time elsewhere."""
    acc = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", "")):
            continue  # record_function ranges projected on the GPU's timeline, not kernels
        if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.end - e.time_range.start
        elif device.type != "cuda" and e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        acc[e.name][0] += 1 / steps
        acc[e.name][1] += us / steps
    return dict(acc)


def _timed_segments(specs: list[str], spent: defaultdict):
    """Wrap each ``module:attr.attr`` of `specs` so that its calls add their time to ``spent[spec]`` (ms); returns
    the undo list. Wrap a function where it is looked up (``pkg.masks:attach_plan``, not ``pkg.plan:attach_plan``)."""
    import importlib

    undo = []
    for spec in specs:
        module, _, path = spec.partition(":")
        *owners, attr = path.split(".")
        owner = importlib.import_module(module)
        for name in owners:
            owner = getattr(owner, name)
        original = getattr(owner, attr)

        def timed(*a, _original=original, _spec=spec, **k):
            t0 = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_spec] += (time.perf_counter() - t0) * 1e3

        setattr(owner, attr, timed)
        undo.append((owner, attr, original))
    return undo


def host_breakdown(model, cache, forward, batch: int, context: int, steps: int, device, segments=()) -> dict:
    """decode_steps' loop, with each part of the host's step timed (ms per step, medians; mask: all its calls;
    `segments`: functions timed inside the step, see `_timed_segments`)."""
    from transformers import masking_utils as mu

    name = model.config._attn_implementation
    original, mask_ms = mu.ALL_MASK_ATTENTION_FUNCTIONS[name], []

    @functools.wraps(original)
    def timed_mask(*a, **k):
        t0 = time.perf_counter()
        out = original(*a, **k)
        mask_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    tok = torch.randint(0, model.config.vocab_size, (batch, 1),
                        generator=torch.Generator().manual_seed(batch + context)).to(device)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
    parts, spent = defaultdict(list), defaultdict(float)
    mu.AttentionMaskInterface.register(name, timed_mask)
    undo = _timed_segments(list(segments), spent)
    try:
        with torch.inference_mode():
            bc.synchronize(device)
            for _ in range(steps):
                calls, t = len(mask_ms), [time.perf_counter()]
                spent.clear()
                inputs = model.prepare_inputs_for_generation(tok, next_sequence_length=1, cache=cache,
                                                             attention_mask=mask, use_cache=True, logits_to_keep=1)
                t.append(time.perf_counter())
                out = forward(**inputs)
                t.append(time.perf_counter())
                mask = model._update_model_kwargs_for_generation(out, {"attention_mask": mask})["attention_mask"]
                t.append(time.perf_counter())
                bc.synchronize(device)  # the step's end, as decode_steps waits for it
                t.append(time.perf_counter())
                del out
                for key, (a, b) in {"prepare": (0, 1), "forward": (1, 2), "update": (2, 3), "wait": (3, 4),
                                    "step": (0, 4)}.items():
                    parts[key].append((t[b] - t[a]) * 1e3)
                parts["mask"].append(sum(mask_ms[calls:]))
                for spec in segments:
                    parts[spec].append(spent[spec])
    finally:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)
        mu.AttentionMaskInterface.register(name, original)
        cache.crop(-steps)
    rec = {f"{k}_ms": statistics.median(v) for k, v in parts.items()}
    rec["mask_calls_per_step"] = len(mask_ms) / steps
    return rec


def run_one(model, attn, batch, context, args, device, dtype, floor_bps) -> dict:
    config, n = model.config, args.steps
    rec = {"attn": attn, "batch": batch, "context": context, "compiled": not args.no_compile, "status": "ok"}
    model.set_attn_implementation(attn)
    if attn == "flashinfer_mla":
        from hf_flashinfer_mla.capabilities import choose_backend, requested_backend

        rec["mla_backend"] = choose_backend(device, dtype, config.kv_lora_rank, config.qk_rope_head_dim,
                                            config.num_attention_heads, requested_backend(None))
    warmup = max(args.warmup, 3)  # CUDA-graph trees warm up, then record
    cache = bc.make_cache("static", attn, config, context + max(warmup, n) + 8)
    bc.fill_cache(cache, config, batch, context, dtype, device)
    forward = model
    if not args.no_compile:
        torch._dynamo.reset()
        forward = torch.compile(model.__call__, mode="reduce-overhead")  # what generate() compiles
    timed = bc.decode_steps(model, cache, batch, context, warmup, n, forward=forward)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rec.update(ms=timed["ms_median"], host_ms=timed["host_ms_median"], logits_finite=timed["logits_finite"])
    print(f"\n== {attn} B={batch} ctx={context}{'' if args.no_compile else ' graphs'}: step {rec['ms']:.3f} ms, "
          f"host {rec['host_ms']:.3f} ms (median of {n}, no profiler)", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
    with torch.profiler.profile(activities=acts) as prof:  # includes decode_steps' logits check (a few us)
        bc.decode_steps(model, cache, batch, context, 0, n, forward=forward)
    kern = kernel_times(prof, device, n)
    total = sum(us for _, us in kern.values())
    rec.update(kernel_us_per_step=total, kernels=len(kern), gaps_ms=rec["ms"] - total / 1e3)
    what = "CUDA kernels" if device.type == "cuda" else "CPU ops (aten::, self time)"
    if not kern:
        print(f"no {what} in the profiler's trace (count 0): kernels replayed in CUDA graphs were not recorded")
    else:
        top = sorted(kern.items(), key=lambda kv: -kv[1][1])[: args.top]
        rec["top"] = [{"name": k, "calls_per_step": c, "us_per_step": us, "category": category(k)}
                      for k, (c, us) in top]
        cats = defaultdict(lambda: [0.0, 0.0])
        for k, (c, us) in kern.items():
            cats[category(k)][0] += c
            cats[category(k)][1] += us
        rec["categories"] = {k: {"calls_per_step": c, "us_per_step": us} for k, (c, us) in cats.items()}
        for title, items in ((f"top {what}", top), ("categories", sorted(cats.items(), key=lambda kv: -kv[1][1]))):
            print(f"-- {title}, per step (over {n} profiled steps)")
            bc.print_table(["name", "calls/step", "us/step", "share"],
                           [[k.removeprefix("void ")[:70], f"{c:.1f}", f"{us:.1f}", f"{100 * us / total:.1f}%"]
                            for k, (c, us) in items])
        print(f"{what}: {total:.1f} us per step ({len(kern)} names); step {rec['ms']:.3f} ms; "
              f"gaps (step - kernels) {rec['gaps_ms']:.3f} ms")
    segments = args.segments if attn == "flashinfer_mla" else [s for s in args.segments if "hf_flashinfer" not in s]
    h = rec["host"] = host_breakdown(model, cache, forward, batch, context, n, device, segments)
    print("-- host per step (ms, medians, no profiler); mask = the registered mask function inside prepare")
    keys = ("prepare", "mask", "forward", "update", "wait", "step")
    bc.print_table([*keys, "mask calls"], [[f"{h[k + '_ms']:.3f}" for k in keys] + [f"{h['mask_calls_per_step']:.1f}"]])
    if segments:
        bc.print_table(["segment (ms per step, median)", "ms"], [[spec, f"{h[spec + '_ms']:.3f}"] for spec in segments])
    rec["recompiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    if rec["recompiled_graphs"]:
        print(f"warning: {rec['recompiled_graphs']} graphs compiled after warm-up (profiled steps include compiles)")
    if floor_bps:  # as bench_decode computes it
        floor = (bc.weight_bytes_per_step(model) + bc.latent_bytes(config, batch, context)) / floor_bps * 1e3
        rec.update(floor_ms=floor, x_floor=rec["ms"] / floor)
        print(f"floor (weights + latent) / copy bandwidth: {floor:.3f} ms; step = {rec['x_floor']:.2f}x floor")
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["32x4096"], help="BATCHxCONTEXT")
    p.add_argument("--attn", nargs="+", default=["flashinfer_mla", "sdpa"], choices=bc.ATTNS)
    p.add_argument("--model", default="deepseek-v3-attn", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None, help="override the depth (deepseek-v3-attn: 4)")
    p.add_argument("--steps", type=int, default=10, help="steps per measurement (timing, profiler, host)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps after compiling (at least 3)")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--no-compile", action="store_true", help="eager steps (CPU smoke tests)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--segments", nargs="*", default=[], help="module:attr functions to time inside the host step")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="profile_replay.json")
    args = p.parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    payload = {"metadata": bc.environment(device, args), "categories": CATEGORIES, "results": []}
    floor_bps = payload["copy_bandwidth_Bps"] = bc.copy_bandwidth(device) if device.type == "cuda" else None
    model = bc.build_model(bc.build_config(args.model, args.layers), dtype, device)
    for cell in args.cells:
        batch, context = map(int, cell.split("x"))
        for attn in args.attn:
            try:
                rec = run_one(model, attn, batch, context, args, device, dtype, floor_bps)
            except Exception as exc:  # noqa: BLE001 - record it, go on with the next implementation
                rec = {"attn": attn, "batch": batch, "context": context, **bc.failure(exc)}
                print(f"\n== {attn} B={batch} ctx={context}: {rec['status']}: {rec['message']}", flush=True)
            finally:
                torch._dynamo.reset()
                bc.free_memory(device)
            payload["results"].append({"model": args.model, **rec})
            bc.write_json(args.out, args.name, payload)
    if args.out:
        print(f"\nwrote {os.path.join(args.out, args.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
