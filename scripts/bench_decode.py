#!/usr/bin/env python3
"""Per-step decode time of whole MLA models: eager vs sdpa vs flashinfer_mla, eager mode or CUDA graphs.

Each cell (model, batch, context) runs every ``--attn`` on the same model (random weights from the real
configuration, `bench_common.build_config`), with the cache filled to ``context`` tokens without a prefill, then
times single-token decode steps driven exactly as ``generate()`` drives them (`bench_common.decode_steps`: each
step adds a token, from ``context`` tokens on; the cache is cropped back after each cell). Caches are what
``generate()`` gives each implementation: ``DynamicCache`` for eager/sdpa, ``MLALatentCache`` for flashinfer_mla;
``--graphs`` gives all a ``StaticCache`` and compiles the step with CUDA graphs, as
``generate(..., cache_implementation="static")`` does. ``--stop-check deferred`` adds a row per cell whose host
waits for the step before instead of each step, as Transformers' ``DeferredStopCheck`` makes ``generate()`` wait
(for flashinfer_mla models on CUDA, ``generation.py``; for other implementations on MPS only): what each step
costs when the host builds it while the GPU runs the previous one.

Reported per cell: ms per step (median), tokens/s, the host's share (time until the step was enqueued), transient
memory above weights + cache, the speed-up over the faster of eager/sdpa, and the bandwidth floor: (weights read
per step + latent cache) / the device's measured copy bandwidth.

Cells run in the order given (``--batch`` x ``--context``), so put the important ones first when ``--time-limit``
may cut the run; a cell is skipped (recorded) when the same implementation ran out of memory at a smaller batch and
context, or after the time limit.

    python scripts/bench_decode.py --model deepseek-v3-attn --batch 32 --context 4096 --out out
    python scripts/bench_decode.py --graphs --batch 32 1 8 128 --context 4096 1024 --time-limit 200 --out out
    python scripts/bench_decode.py --model tiny --device cpu --dtype float32 --batch 2 --context 64 --steps 2
    python scripts/bench_decode.py --model deepseek-v32-attn --batch 1 8 32 --context 8192 32768 65536 131072

A sparse (DSA) model's cells are the same, with the indexer's keys filled too; its floor counts the `index_topk`
selected latent rows and the indexer's keys of the whole context (which Transformers' indexer scores every step).
The table ends with the longest context each implementation ran at each batch.

CUDA graphs are compiled as ``generate()`` compiles them: inductor, ``mode="reduce-overhead"`` (about a minute per
cell). Not torch's ``backend="cudagraphs"``: it treats only lifted parameters as static, and with nn modules inlined
(torch's default) a model's weights and its cache are graph inputs, which it copies into the graph's own buffers
before every replay, making a compiled step slower than an uncompiled one.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import bench_common as bc


def cell_mode(args, stop_check: str) -> str:
    return ("graphs" if args.graphs else "eager") + ("" if stop_check == "sync" else "-deferred")


def run_cell(model, attn, batch, context, args, device, dtype, floor_bps, stop_check="sync") -> dict:
    """Measure one (attn, batch, context, stop check); never raises."""
    config = model.config
    rec = {"attn": attn, "batch": batch, "context": context, "mode": cell_mode(args, stop_check), "status": "ok"}
    t0 = time.perf_counter()
    cache = forward = None
    try:
        model.set_attn_implementation(attn)
        if attn == "flashinfer_mla":
            from hf_flashinfer_mla.capabilities import choose_backend, requested_backend

            rec["mla_backend"] = choose_backend(device, dtype, config.kv_lora_rank, config.qk_rope_head_dim,
                                                config.num_attention_heads, requested_backend(args.mla_backend))
        kind = "static" if args.graphs else "transformers" if args.layout == "transformers" else "dynamic"
        packed = {"auto": None, "split": False, "packed": True, "transformers": None}[args.layout]
        warmup = max(args.warmup, 3) if args.graphs else args.warmup  # CUDA-graph trees warm up, then record
        cache = bc.make_cache(kind, attn, config, context + warmup + args.steps + 8, packed=packed)
        rec["cache_class"], rec["layout"] = type(cache).__name__, args.layout
        bc.fill_cache(cache, config, batch, context, dtype, device)
        if args.graphs:
            torch._dynamo.reset()
            forward = torch.compile(model.__call__, mode="reduce-overhead")  # what generate() compiles
        mla_backend = args.mla_backend if attn == "flashinfer_mla" else None
        rec.update(bc.decode_steps(model, cache, batch, context, warmup, args.steps, forward=forward,
                                   mla_backend=mla_backend, deferred=stop_check == "deferred"))
        if floor_bps:
            floor = (bc.weight_bytes_per_step(model) + bc.latent_bytes(config, batch, context)) / floor_bps * 1e3
            rec.update(floor_ms=floor, x_floor=rec["ms_median"] / floor)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded status
        rec.update(bc.failure(exc))
    finally:
        cache = forward = None
        if args.graphs:
            torch._dynamo.reset()
        bc.free_memory(device)
    rec["cell_seconds"] = time.perf_counter() - t0
    return rec


def summarize(results: list[dict], attns: list[str]) -> list[dict]:
    cells: dict[tuple, dict] = {}
    for rec in results:
        cells.setdefault((rec["model"], rec["mode"], rec["batch"], rec["context"]), {})[rec["attn"]] = rec
    rows = []
    for (model, mode, batch, context), by_attn in cells.items():
        ok = {a: r for a, r in by_attn.items() if r["status"] == "ok"}
        fi, base = ok.get("flashinfer_mla"), [ok[a]["ms_median"] for a in ("eager", "sdpa") if a in ok]
        speedup = None
        if fi is not None and base:
            speedup = min(base) / fi["ms_median"]
        elif fi is not None and any(a in by_attn for a in ("eager", "sdpa")):
            speedup = float("inf")  # the baselines ran out of memory where flashinfer_mla ran
        floor = next((r.get("floor_ms") for r in ok.values() if r.get("floor_ms")), None)
        rows.append(dict(model=model, mode=mode, batch=batch, context=context, by_attn=by_attn, speedup=speedup,
                         floor_ms=floor))
    return rows


def print_summary(rows: list[dict], attns: list[str]) -> None:
    header = ["model", "mode", "B", "ctx"] + [f"{a} ms" for a in attns]
    header += ["fi host ms", "fi peak MiB", "speedup", "floor ms", "fi x floor"]
    table = []
    for row in rows:
        line = [row["model"], row["mode"], str(row["batch"]), str(row["context"])]
        for a in attns:
            rec = row["by_attn"].get(a)
            line.append("" if rec is None else bc.fmt(rec["ms_median"]) if rec["status"] == "ok"
                        else rec["status"].upper())
        fi = row["by_attn"].get("flashinfer_mla", {})
        ok = fi.get("status") == "ok"
        peak = fi.get("transient_peak_bytes") if ok else None
        line += [bc.fmt(fi.get("host_ms_median") if ok else None), bc.fmt(peak / bc.MIB if peak else None, ".1f"),
                 bc.fmt(row["speedup"]), bc.fmt(row["floor_ms"], ".3f"), bc.fmt(fi.get("x_floor") if ok else None)]
        table.append(line)
    longest: dict[tuple, int] = {}
    for row in rows:
        for a, rec in row["by_attn"].items():
            if rec["status"] == "ok":
                key = (row["model"], row["batch"], a)
                longest[key] = max(longest.get(key, 0), row["context"])
    fits = "; ".join(f"{m} B={b} {a}: {c}" for (m, b, a), c in sorted(longest.items()))
    bc.print_table(header, table, [
        "speedup = min(eager, sdpa) / flashinfer_mla (inf: the baselines ran out of memory); fi host ms = time until "
        "the host had enqueued the step; floor = (weights + latent bytes) / copy bandwidth",
        f"longest context that ran: {fits}",
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["deepseek-v3-attn"], choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None, help="override the depth (deepseek-v3-attn: 4)")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--context", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    p.add_argument("--attn", nargs="+", default=list(bc.ATTNS), choices=bc.ATTNS)
    p.add_argument("--graphs", action="store_true", help="StaticCache + torch.compile with CUDA graphs")
    p.add_argument("--layout", default="auto", choices=("auto", "split", "packed", "transformers"),
                   help="flashinfer_mla's cache: auto, what generate() picks for the GPU; split/packed, that layout "
                        "forced; transformers, DynamicCache() built without the config (Transformers' own "
                        "concatenating layers, every implementation)")
    p.add_argument("--mla-backend", default=None, help="force flashinfer_mla's backend (fa3, fa2, reference, ...)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts-impl", default=None, help="transformers experts_implementation")
    p.add_argument("--stop-check", nargs="+", default=["sync"], choices=("sync", "deferred"),
                   help="how the host waits: for each step, or for the step before it (Transformers' "
                        "DeferredStopCheck, which generate() uses for flashinfer_mla on CUDA); each given mode "
                        "is a row of its own")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps per cell (>= 3 with --graphs)")
    p.add_argument("--no-floor", action="store_true", help="skip the copy-bandwidth measurement")
    p.add_argument("--time-limit", type=float, default=None, help="seconds after which no new cell starts")
    p.add_argument("--out", default=None, help="directory for the JSON")
    p.add_argument("--name", default=None, help="JSON file name (default: decode_<mode>.json)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    name = args.name or f"decode_{'graphs' if args.graphs else 'eager'}.json"
    payload = {"metadata": bc.environment(device, args), "models": {}, "results": []}
    deadline = bc.Deadline(args.time_limit)
    floor_bps = None
    if device.type == "cuda" and not args.no_floor:
        floor_bps = bc.copy_bandwidth(device)
        payload["copy_bandwidth_Bps"] = floor_bps
        print(f"copy bandwidth (read + write): {floor_bps / 1e9:.0f} GB/s", flush=True)
    fatal = None
    for model_name in args.model:
        config = bc.build_config(model_name, args.layers)
        try:
            model = bc.build_model(config, dtype, device, args.experts_impl)
            payload["models"][model_name] = {"layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                                             "weight_bytes_per_step": bc.weight_bytes_per_step(model)}
        except Exception as exc:  # noqa: BLE001
            payload["models"][model_name] = bc.failure(exc)
            continue
        failed: set = set()
        for batch in args.batch:
            for context in args.context:
                for attn, stop_check in ((a, s) for s in args.stop_check for a in args.attn):
                    base = {"model": model_name, "attn": attn, "batch": batch, "context": context,
                            "mode": cell_mode(args, stop_check)}
                    if fatal:
                        rec = {**base, "status": "error", "skipped": True, "message": f"CUDA lost earlier: {fatal}"}
                    elif deadline.passed():
                        rec = {**base, "status": "skipped", "skipped": True, "message": "--time-limit reached"}
                    elif any(a == attn and b <= batch and c <= context for a, b, c in failed):
                        rec = {**base, "status": "oom", "skipped": True,
                               "message": "ran out of memory at a smaller batch and context"}
                    else:
                        rec = {"model": model_name, **run_cell(model, attn, batch, context, args, device, dtype,
                                                               floor_bps, stop_check)}
                        if rec["status"] == "oom":
                            failed.add((attn, batch, context))
                        fatal = rec["message"] if rec.get("fatal") else fatal
                    payload["results"].append(rec)
                    shown = f"{rec['ms_median']:.2f} ms" if rec["status"] == "ok" else rec["status"]
                    print(f"  {model_name} {base['mode']} B={batch} ctx={context} {attn}: {shown}", flush=True)
                    bc.write_json(args.out, name, payload)
        model = None
        bc.free_memory(device)
    rows = summarize(payload["results"], args.attn)
    payload["summary"] = [{k: v for k, v in r.items() if k != "by_attn"} for r in rows]
    print()
    print_summary(rows, args.attn)
    for r in payload["results"]:
        if r["status"] == "error" and not r.get("skipped"):
            print(f"error: {r['model']} {r['attn']} B={r['batch']} ctx={r['context']}: {r['message']}")
    path = bc.write_json(args.out, name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
