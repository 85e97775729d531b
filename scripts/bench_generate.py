#!/usr/bin/env python3
"""Whole-model ``generate()`` throughput: tokens/s of flashinfer_mla against sdpa (and eager), as a user runs it.

For each ``--attn`` and ``--batch``: random prompts of ``--prompt`` tokens, greedy ``generate()`` of ``--new``
tokens (``min_new_tokens`` pins the length), default cache (``--static``: ``cache_implementation="static"``, which
compiles the decode step with CUDA graphs; each cell then starts from ``torch.compiler.reset()``, so that neither
implementation runs beside the other's compiled code). Each configuration runs once as warm-up, then ``--repeats``
times for ``--new`` tokens and for 1 token; reported (medians):

* ``tok/s``: batch x new tokens / the whole call (prefill included);
* ``decode tok/s``: batch x (new - 1) / (time for new tokens - time for 1 token), i.e. the decode steps alone;
* ``GPU step ms`` (CUDA): the median time between two decode steps' starts on the GPU's timeline (`step_starts`);
* ``x floor`` (CUDA): that step time over the bandwidth floor, (weights read per step + the latent at the
  middle of the decode) / the device's measured copy bandwidth, as ``bench_decode.py`` reports it per step.

``--stop-check every late`` runs flashinfer_mla once per mode (other implementations once, as Transformers runs
them): ``every`` with ``HF_FLASHINFER_MLA_DEFER_STOP=0``, the host reading generate()'s stop condition after each
step; ``late`` as the package runs it (with a Transformers that has ``DeferredStopCheck``: 5.24, 5.25), a step late
(``generation.py``), so the host queues the next step while the GPU runs this one. Both modes of one
implementation share its compiled step.

``--cache new kept`` (with ``--static``) runs each cell once per static-cache mode, sharing the compiled step too:
``new``, ``cache_implementation="static"``, for which Transformers builds a new cache every call (and CUDA graphs
record again where it lands at other addresses); ``kept``, one ``StaticCache`` passed to every call, reset, as the
README advises (Limitations).

    python scripts/bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out out
    python scripts/bench_generate.py --model deepseek-v3-attn --static --prompt 4096 --new 64 --batch 32 \
        --attn flashinfer_mla --stop-check every late --out out
    python scripts/bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 8 \
        --attn sdpa flashinfer_mla --cache new kept --out out
    python scripts/bench_generate.py --model tiny --device cpu --dtype float32 --prompt 16 --new 4 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from transformers import StaticCache

import bench_common as bc


def timed_generate(model, ids, new, static, device, steps: list | None = None, cache=None) -> float:
    """Seconds for one generate() call; the GPU's decode step times (ms, `step_starts`) appended to `steps`.
    `cache`: a `StaticCache` kept across calls, reset here (in inference mode, in which it was filled)."""
    kwargs = dict(cache=cache) if cache is not None else dict(cache_implementation="static") if static else {}
    bc.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), step_starts(model, device) as starts:
        if cache is not None:
            cache.reset()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    bc.synchronize(device)
    assert out.shape[1] == ids.shape[1] + new
    if steps is not None:  # (the first interval holds the prefill)
        steps.extend(starts[i].elapsed_time(starts[i + 1]) for i in range(1, len(starts) - 1))
    return time.perf_counter() - t0


@contextlib.contextmanager
def step_starts(model, device):
    """CUDA events recorded where generate() starts building each step (``prepare_inputs_for_generation``, on the
    host, before the forward). On the GPU's timeline two successive ones are one decode step apart, the GPU's idle
    gaps included: neither the prefill, nor the host's lead over the GPU, nor a late stop check enters it."""
    events = []
    if device.type != "cuda":
        yield events
        return
    real = model.prepare_inputs_for_generation

    def prepare(*args, **kwargs):
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        return real(*args, **kwargs)

    model.prepare_inputs_for_generation = prepare  # (an instance attribute over the method, removed below)
    try:
        yield events
    finally:
        del model.prepare_inputs_for_generation


@contextlib.contextmanager
def counted_captures():
    """The CUDA-graph captures (torch.cuda.CUDAGraph.capture_end calls) made inside the block, as a list."""
    captures = []
    if not torch.cuda.is_available():
        yield captures
        return
    graph = torch.cuda.graphs.CUDAGraph
    real = graph.capture_end

    def capture_end(self, *args, **kwargs):
        captures.append(1)
        return real(self, *args, **kwargs)

    graph.capture_end = capture_end
    try:
        yield captures
    finally:
        graph.capture_end = real


DEFER_STOP_ENV = "HF_FLASHINFER_MLA_DEFER_STOP"  # (hf_flashinfer_mla.generation's; read at every generate())


@contextlib.contextmanager
def stop_check_mode(mode: str):
    """generate()'s stop check for flashinfer_mla: ``late`` (the package's default on CUDA)
    or ``every`` (``$HF_FLASHINFER_MLA_DEFER_STOP=0``)."""
    before = os.environ.get(DEFER_STOP_ENV)
    os.environ[DEFER_STOP_ENV] = "0" if mode == "every" else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DEFER_STOP_ENV)
        else:
            os.environ[DEFER_STOP_ENV] = before


def run(model, attn, batch, args, device, stop_check="late", fresh=True, floor_bps=None, cache="new") -> dict:
    rec = {"attn": attn, "batch": batch, "prompt": args.prompt, "new": args.new, "static": args.static,
           "order": args.attn.index(attn), "stop_check": stop_check, "cache": cache, "status": "ok"}
    kept = StaticCache(config=model.config, max_cache_len=args.prompt + args.new) if cache == "kept" else None
    try:
        if args.static and fresh:
            # Each cell compiles from a clean slate: with the previous implementation's compiled step still cached,
            # dynamo keeps two entries for the one compiled call (their guards differ in the attention
            # implementation) and CUDA-graph trees keep the other's pools, so whichever runs second would pay for
            # the first.
            torch.compiler.reset()
        model.set_attn_implementation(attn)
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
        # Warm-up (kernels, compilation). A static cache is sized from prompt + new tokens, and torch compiles (and
        # CUDA graphs record) per cache length, so a static run warms up at the length it then times: three calls,
        # since the second may record again where the first call's cache was still alive (tests/gpu/test_gpu_graphs.py
        # counts it), and a third after a change of stop-check mode, whose objects live for other spans.
        for _ in range(3 if args.static else 1):
            timed_generate(model, ids, args.new if args.static else min(args.new, 8), args.static, device, cache=kept)
        steps = []
        with counted_captures() as captures:  # CUDA graphs recorded during the timed calls (0 in a steady state)
            full = [timed_generate(model, ids, args.new, args.static, device, steps, kept) for _ in range(args.repeats)]
        rec["graphs_recorded_timed"] = len(captures)
        if args.static:  # the one-token run has a cache length of its own: warm it up too
            timed_generate(model, ids, 1, args.static, device, cache=kept)
        one = [timed_generate(model, ids, 1, args.static, device, cache=kept) for _ in range(args.repeats)]
        t_full, t_one = statistics.median(full), statistics.median(one)
        rec.update(seconds_all=full, seconds_one_token=one, tokens_per_s=batch * args.new / t_full,
                   decode_tokens_per_s=batch * (args.new - 1) / max(t_full - t_one, 1e-9),
                   decode_ms_per_step=(t_full - t_one) / (args.new - 1) * 1e3)
        if steps:
            rec.update(step_ms_median=statistics.median(steps), step_ms_all=steps)
        if floor_bps and steps:
            middle = args.prompt + args.new // 2
            floor = (bc.weight_bytes_per_step(model) + bc.latent_bytes(model.config, batch, middle)) / floor_bps * 1e3
            rec.update(floor_ms=floor, x_floor=rec["step_ms_median"] / floor)
    except Exception as exc:  # noqa: BLE001
        rec.update(bc.failure(exc))
    bc.free_memory(device)
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--attn", nargs="+", default=["sdpa", "flashinfer_mla"], choices=bc.ATTNS)
    p.add_argument("--static", action="store_true", help='cache_implementation="static" (CUDA graphs)')
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts-impl", default=None)
    p.add_argument("--stop-check", nargs="+", default=["late"], choices=("late", "every"),
                   help="flashinfer_mla's stop check in generate(): a step late (the default on CUDA) or after "
                        "every step; each given mode is a row of its own")
    p.add_argument("--cache", nargs="+", default=["new"], choices=("new", "kept"),
                   help="with --static: a new static cache per call (cache_implementation='static'), or one "
                        "StaticCache kept across calls and reset; each given mode is a row of its own")
    p.add_argument("--no-floor", action="store_true", help="skip the copy-bandwidth measurement")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None, help="JSON file name (default: generate_<model>.json)")
    args = p.parse_args(argv)
    if args.new < 2 or args.repeats < 1:
        p.error("--new must be >= 2 and --repeats >= 1")
    if args.cache != ["new"] and not args.static:
        p.error("--cache kept needs --static (a kept cache is a StaticCache)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    name = args.name or f"generate_{args.model}{'_static' if args.static else ''}.json"
    payload = {"metadata": bc.environment(device, args), "results": []}
    model = bc.build_model(bc.build_config(args.model, args.layers), dtype, device, args.experts_impl)
    floor_bps = bc.copy_bandwidth(device) if device.type == "cuda" and not args.no_floor else None
    payload["copy_bandwidth_Bps"] = floor_bps
    for batch in args.batch:
        for attn in args.attn:
            # (the package's stop-check modes apply to flashinfer_mla; Transformers checks every step for the others)
            modes = args.stop_check if attn == "flashinfer_mla" else ["every"]
            cells = [(mode, cache) for cache in args.cache for mode in modes]
            for i, (mode, cache) in enumerate(cells):
                with stop_check_mode(mode):
                    rec = run(model, attn, batch, args, device, mode, fresh=i == 0, floor_bps=floor_bps,
                              cache=cache)
                payload["results"].append(rec)
                shown = f"{rec['tokens_per_s']:.1f} tok/s" if rec["status"] == "ok" else rec["status"]
                print(f"  {args.model} B={batch} {attn} (stop check: {mode}, cache: {cache}): {shown}", flush=True)
                bc.write_json(args.out, name, payload)
    rows, by = [], {(r["batch"], r["attn"], r["cache"]): r for r in payload["results"]}
    for r in payload["results"]:
        base = by.get((r["batch"], "sdpa", r["cache"]))  # (against sdpa with the same static cache)
        ratio = (r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                 if r["status"] == "ok" and base and base["status"] == "ok" else None)
        ok = r["status"] == "ok"
        rows.append([args.model, str(r["batch"]), r["attn"], r["stop_check"], r["cache"] if args.static else "-",
                     bc.fmt(r.get("tokens_per_s") if ok else None, ".1f"),
                     bc.fmt(r.get("decode_tokens_per_s") if ok else None, ".1f"),
                     bc.fmt(r.get("decode_ms_per_step") if ok else None),
                     bc.fmt(r.get("step_ms_median") if ok else None), bc.fmt(r.get("x_floor") if ok else None),
                     bc.fmt(ratio), str(r.get("graphs_recorded_timed", "")), "" if ok else r["status"].upper()])
    print()
    bc.print_table(["model", "B", "attn", "stop check", "static cache", "tok/s", "decode tok/s", "ms/step",
                    "GPU step ms", "x floor", "vs sdpa", "graphs rec.", ""], rows,
                   [f"prompt {args.prompt} tokens, {args.new} new tokens, greedy; vs sdpa = decode tok/s ratio; "
                    "ms/step = (full call - one-token call) / (new - 1); GPU step ms = median time between two "
                    "steps' starts on the GPU (its idle gaps included); "
                    "x floor = GPU step ms / ((weights + latent at prompt + new/2) / copy bandwidth); "
                    "graphs rec. = CUDA graphs recorded during the timed full-length calls (0: a steady state); "
                    "static cache = new per call (cache_implementation='static') or one kept across calls"])
    path = bc.write_json(args.out, name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
