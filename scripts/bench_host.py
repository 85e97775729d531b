#!/usr/bin/env python3
"""Host time of one decode step, per step and per layer: where the CPU spends a step (flashinfer_mla vs sdpa).

Decode steps are driven as ``generate()`` drives them (`bench_common.decode_steps`: rows known on the host, no
device sync in flashinfer_mla's step). Measured without a profiler, with ``time.perf_counter`` around each step and
(forward hooks) around each decoder layer and its attention module: as long as nothing in the step syncs, these
are the host's own times (the GPU runs behind). Then ``torch.profiler`` records a few steps and its CPU-time table
(top operators) is written next to the JSON, to show what the host time is made of.

    python scripts/bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 --out out
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_common as bc


class LayerClock:
    """perf_counter around every decoder layer and its attention module (forward hooks)."""

    def __init__(self, model):
        self.times: dict[str, list[float]] = {}
        self.hooks = []
        for i, layer in enumerate(model.model.layers):
            for name, module in ((f"layer {i}", layer), (f"layer {i} attention", layer.self_attn)):
                self.hooks.append(module.register_forward_pre_hook(self._start(name)))
                self.hooks.append(module.register_forward_hook(self._stop(name)))
        self.open: dict[str, float] = {}

    def _start(self, name):
        def hook(module, args):
            self.open[name] = time.perf_counter()
        return hook

    def _stop(self, name):
        def hook(module, args, output):
            self.times.setdefault(name, []).append((time.perf_counter() - self.open.pop(name)) * 1e3)
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


class FunctionClock:
    """perf_counter around the registered attention function itself: the attention implementation's own share of a
    layer's host time (for flashinfer_mla: absorption, the step's route, the kernel launch, the projection),
    listed per call in layer order, so the first layer of a step (which builds the step's metadata) shows apart."""

    def __init__(self, attn: str):
        from transformers import AttentionInterface

        self.name, self.calls = attn, []
        self.original = AttentionInterface._global_mapping[attn]

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = self.original(*a, **k)
            self.calls.append((time.perf_counter() - t0) * 1e3)
            return out

        AttentionInterface._global_mapping[attn] = timed

    def remove(self):
        from transformers import AttentionInterface

        AttentionInterface._global_mapping[self.name] = self.original

    def split(self, layers: int) -> dict:
        first = self.calls[::layers]
        rest = [t for i, t in enumerate(self.calls) if i % layers]
        return {"function_first_layer_ms": statistics.median(first) if first else None,
                "function_other_layers_ms": statistics.median(rest) if rest else None}


def measure(model, attn, args, device, dtype) -> tuple[dict, str]:
    config = model.config
    model.set_attn_implementation(attn)
    cache = bc.make_cache("dynamic", attn, config, args.context + 8)
    bc.fill_cache(cache, config, args.batch, args.context, dtype, device)
    step = bc.decode_steps(model, cache, args.batch, args.context, args.warmup, args.steps)
    clock, function = LayerClock(model), FunctionClock(attn)
    try:
        bc.decode_steps(model, cache, args.batch, args.context, 0, args.steps)
    finally:
        clock.remove()
        function.remove()
    layers = {name: statistics.median(ts) for name, ts in clock.times.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bc.decode_steps(model, cache, args.batch, args.context, 0, 3)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    attn_ms = [v for k, v in layers.items() if k.endswith("attention")]
    rec = {"attn": attn, "status": "ok", "batch": args.batch, "context": args.context, "step_ms": step["ms_median"],
           "step_host_ms": step["host_ms_median"], "per_layer_host_ms": layers,
           "attention_host_ms_mean": statistics.mean(attn_ms),
           "layer_host_ms_mean": statistics.mean(v for k, v in layers.items() if not k.endswith("attention")),
           **function.split(len(model.model.layers))}
    del cache
    bc.free_memory(device)
    return rec, table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v3-attn", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--attn", nargs="+", default=["flashinfer_mla", "sdpa"], choices=bc.ATTNS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="host.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    payload = {"metadata": bc.environment(device, args), "results": []}
    model = bc.build_model(bc.build_config(args.model, args.layers), dtype, device)
    for attn in args.attn:
        try:
            rec, table = measure(model, attn, args, device, dtype)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"host_profile_{attn}.txt"), "w") as f:
                    f.write(table)
        except Exception as exc:  # noqa: BLE001
            rec = {"attn": attn, **bc.failure(exc)}
        payload["results"].append(rec)
        bc.write_json(args.out, args.name, payload)
    rows = []
    for r in payload["results"]:
        if "step_ms" not in r:
            rows.append([r["attn"], r["status"].upper(), "", "", "", "", ""])
            continue
        rows.append([r["attn"], bc.fmt(r["step_ms"]), bc.fmt(r["step_host_ms"]), bc.fmt(r["layer_host_ms_mean"], ".3f"),
                     bc.fmt(r["attention_host_ms_mean"], ".3f"), bc.fmt(r["function_first_layer_ms"], ".3f"),
                     bc.fmt(r["function_other_layers_ms"], ".3f")])
    print()
    bc.print_table(["attn", "step ms", "step host ms", "layer host ms", "attention host ms", "function 1st layer ms",
                    "function other layers ms"], rows, [
        f"{args.model}, batch {args.batch}, context {args.context}; host ms = until the host had enqueued the work "
        "(per layer: mean over layers); function = the attention implementation's own call (first layer of a step, "
        "median of the others); profiler tables in host_profile_<attn>.txt"])
    path = bc.write_json(args.out, args.name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
