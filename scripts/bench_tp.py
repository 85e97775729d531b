#!/usr/bin/env python3
"""Decode step time on two GPUs: one GPU vs tensor parallelism (TP=2) vs a ``device_map`` split, sdpa vs flashinfer_mla.

    python scripts/bench_tp.py --out bench_tp/        # 2 GPUs; saves the checkpoints first where they are missing

What it measures (random weights, bf16, saved once by ``scripts/tp_parity.py make`` under ``--ckpt-dir``, default
``$HF_FLASHINFER_MLA_TP_DIR`` or ``/tmp/hf_flashinfer_mla_tp``, shared with ``tests/gpu/test_tensor_parallel.py``):

1. DeepSeek-V2-Lite at full depth (27 layers, 16 heads, MoE), batch 1 and 32, context 4096, per attention
   implementation: one GPU (``from_pretrained(..., device_map="cuda:0")``); two GPUs by layers
   (``device_map={...}``: embeddings + layers 0-13 on GPU 0, layers 14-26 + head on GPU 1); two GPUs with
   Transformers' tensor parallelism (``torchrun --nproc-per-node 2``, ``tp_plan="auto"``: 8 heads per rank).
2. DeepSeek-V3's attention shape (128 heads, 4 dense layers), batch 1 and 32, context 4096: one GPU; TP=2 with the
   shipped plan (attention replicated: 128 heads on each rank); TP=2 with attention sharded by heads through
   ``DistributedConfig(tp_plan=...)`` (64 per rank; `tp_parity.mla_attention_tp_plan`).
3. The attention module of one V3-shaped layer alone (q/kv projections, cache update, attention, o_proj), batch 32,
   context 4096, at 128 / 64 / 32 / 16 heads: what one rank's attention costs at TP = 1 / 2 / 4 / 8 if heads are
   sharded, without the per-layer all-reduce.

Method per cell, as in ``bench_decode.py`` (its cache helpers are in ``bench_common.py``): the cache is filled with
random latents (no prefill; on each layer's own device), then single-token steps at a constant context (the
appended token is cropped after each step); ``--warmup`` untimed, ``--steps`` timed; time = wall clock between
synchronisations of every device the process uses (CUDA events on one device would miss the other device's work
in a device_map split). Under TP every rank times its own steps (they are lock-stepped by the all-reduces) and the
slowest rank's median is reported. sdpa gets ``DynamicCache``, flashinfer_mla ``MLALatentCache`` (what ``generate()`` gives each).
Prints a table and writes ``OUT/bench_tp.json`` (and the parts each process wrote).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)

DEFAULT_ROOT = os.environ.get("HF_FLASHINFER_MLA_TP_DIR", "/tmp/hf_flashinfer_mla_tp")
V2, V3 = "v2-lite", "v3-attn-4l"  # checkpoint directory names (the GPU test makes the same)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------------------ one cell
def fill_latent(model, cache, batch: int, tokens: int, seed: int) -> None:
    """Random latents for every layer, on that layer's device (a device_map split keeps each layer's cache there)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)  # the same values on every rank
    for i, layer in enumerate(model.model.layers):
        device = next(layer.parameters()).device
        kv = torch.randn(batch, 1, tokens, config.kv_lora_rank, generator=g).to(device, model.dtype)
        kr = torch.randn(batch, 1, tokens, config.qk_rope_head_dim, generator=g).to(device, model.dtype)
        cache.update(kv, kr, i)


def sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def time_cell(model, attn: str, batch: int, context: int, args, hooks=None) -> dict:
    """Median decode-step time of `model` with `attn` at (batch, context); never raises (errors are recorded)."""
    from bench_common import cache_kwarg, is_oom, make_cache

    rec = {"attn": attn, "batch": batch, "context": context, "status": "ok"}
    devices = sorted({p.device for p in model.parameters()}, key=str)
    cache = None
    try:
        model.set_attn_implementation(attn)
        cache = make_cache("dynamic", attn, model.config, context + 1)
        extra = 1 if attn == "flashinfer_mla" else 0  # MLALatentCache: allocate the step's row up front
        fill_latent(model, cache, batch, context + extra, args.seed)
        if extra:
            cache.crop(-extra)
        first = model.model.embed_tokens.weight.device
        ids = torch.randint(1, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
        kw = {"input_ids": ids.to(first), cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1,
              "attention_mask": torch.ones(batch, context + 1, dtype=torch.long, device=first)}
        times, module_ms = [], []
        with torch.inference_mode():
            for i in range(args.warmup + args.steps):
                if hooks is not None:
                    hooks.reset()
                sync(devices)
                t0 = time.perf_counter()
                out = model(**kw)
                sync(devices)
                ms = (time.perf_counter() - t0) * 1e3
                cache.crop(-1)
                if i >= args.warmup:
                    times.append(ms)
                    if hooks is not None:
                        module_ms.append(hooks.elapsed_ms())
        rec.update(ms_median=statistics.median(times), ms_min=min(times), ms_all=times,
                   finite=bool(torch.isfinite(out.logits).all()))
        if module_ms:
            rec["attention_module_ms_median"] = statistics.median(module_ms)
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result, the run goes on
        rec.update(status="oom" if is_oom(exc) else "error", message=f"{type(exc).__name__}: {exc}"[:500],
                   traceback=traceback.format_exc(limit=-4))
    finally:
        cache = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec


class ModuleTimer:
    """CUDA events around one module's forward (for the attention-only numbers)."""

    def __init__(self, module):
        self.start, self.end = [], []
        module.register_forward_pre_hook(lambda *a: self._record(self.start))
        module.register_forward_hook(lambda *a: self._record(self.end))

    def _record(self, events):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)

    def reset(self):
        self.start, self.end = [], []

    def elapsed_ms(self) -> float:
        return sum(s.elapsed_time(e) for s, e in zip(self.start, self.end))


def cells(model, label: str, args, batches=None) -> list[dict]:
    out = []
    for attn in args.attn:
        for batch in batches or args.batch:
            rec = {"setup": label, **time_cell(model, attn, batch, args.context, args)}
            if os.environ.get("RANK", "0") == "0":
                shown = f"{rec['ms_median']:.2f} ms" if rec["status"] == "ok" else rec["status"]
                print(f"  {label} {attn} B={batch}: {shown}", flush=True)
            out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------ workers
def load(ckpt: str, **kwargs):
    import transformers

    import hf_flashinfer_mla  # noqa: F401

    return transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="sdpa", **kwargs).eval()


def free(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker_single(args) -> list[dict]:
    """One process: TP=1 on cuda:0, then the device_map split over cuda:0/1, then the attention-only sweep."""
    import transformers

    import hf_flashinfer_mla  # noqa: F401
    from bench_common import build_config

    results = []
    model = load(os.path.join(args.ckpt_dir, V2), device_map="cuda:0")
    results += [{"model": V2, **r} for r in cells(model, "tp1", args)]
    layers = model.config.num_hidden_layers
    free(model)
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
             **{f"model.layers.{i}": 0 if i < (layers + 1) // 2 else 1 for i in range(layers)}}
    model = load(os.path.join(args.ckpt_dir, V2), device_map=split)
    results += [{"model": V2, **r} for r in cells(model, "device_map", args)]
    free(model)
    model = load(os.path.join(args.ckpt_dir, V3), device_map="cuda:0")
    results += [{"model": V3, **r} for r in cells(model, "tp1", args)]
    free(model)
    # One V3-shaped layer at 128/64/32/16 heads: one rank's attention at TP=1/2/4/8 with head-sharded attention.
    for heads in args.heads:
        config = build_config("deepseek-v3-attn", 1)
        config.num_attention_heads = config.num_key_value_heads = heads
        config.vocab_size = 1024  # keep the head (lm_head) out of the picture; attention is timed by hooks anyway
        torch.manual_seed(0)
        with torch.device("cuda:0"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa").eval()
        timer = ModuleTimer(model.model.layers[0].self_attn)
        for attn in args.attn:
            rec = time_cell(model, attn, args.attn_batch, args.context, args, hooks=timer)
            rec.update(model="v3-attention-layer", setup=f"{heads} heads")
            shown = (f"{rec['attention_module_ms_median']:.3f} ms" if rec["status"] == "ok" else rec["status"])
            print(f"  V3 attention layer, {heads} heads, {attn} B={args.attn_batch}: {shown}", flush=True)
            results.append(rec)
        free(model)
    return results


def worker_tp(args) -> list[dict]:
    """Under torchrun: V2-Lite with its shipped plan; V3 shape with the shipped plan and with attention sharded."""
    from tp_parity import mla_attention_tp_plan, supports_plan_override, tp_load_kwargs

    import transformers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    runs = [(V2, "tp2", None), (V3, "tp2", None)]
    if supports_plan_override():
        config = transformers.AutoConfig.from_pretrained(os.path.join(args.ckpt_dir, V3))
        runs.append((V3, "tp2 heads sharded", mla_attention_tp_plan(config)))
    for name, label, plan in runs:
        model = load(os.path.join(args.ckpt_dir, name), **tp_load_kwargs(plan))
        for rec in cells(model, label, args):
            medians = [None] * world
            torch.distributed.all_gather_object(medians, rec.get("ms_median"))
            if rec["status"] == "ok":
                rec.update(ms_median=max(medians), ms_median_by_rank=medians)
            results.append({"model": name, **rec})
        free(model)
    torch.distributed.barrier()
    if rank:
        results = []
    torch.distributed.destroy_process_group()
    return results


# ------------------------------------------------------------------------------------------------ driver
def run(cmd, env=None) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **NO_MULTICAST, **(env or {})})


def table(results: list[dict]) -> list[str]:
    """Rows: model, attn, batch; columns: setups. Plus the attention-only sweep."""
    lines = []
    by = {}
    for r in results:
        if r["model"] == "v3-attention-layer":
            continue
        by.setdefault((r["model"], r["attn"], r["batch"]), {})[r["setup"]] = r
    setups = ["tp1", "device_map", "tp2", "tp2 heads sharded"]
    lines.append(f"{'model':<12} {'attn':<15} {'B':>3}  " + "  ".join(f"{s + ' ms':>20}" for s in setups)
                 + f"  {'tp2 / tp1':>9}")
    for (model, attn, batch), row in sorted(by.items()):
        cols = []
        for s in setups:
            r = row.get(s)
            cols.append("" if r is None else f"{r['ms_median']:.2f}" if r["status"] == "ok" else r["status"])
        tp1, tp2 = row.get("tp1"), row.get("tp2")
        ratio = (f"{tp2['ms_median'] / tp1['ms_median']:.2f}" if tp1 and tp2 and tp1["status"] == tp2["status"] == "ok"
                 else "")
        lines.append(f"{model:<12} {attn:<15} {batch:>3}  " + "  ".join(f"{c:>20}" for c in cols) + f"  {ratio:>9}")
    sweep = [r for r in results if r["model"] == "v3-attention-layer"]
    if sweep:
        lines.append("")
        lines.append("one V3-shaped attention module (projections + attention + o_proj), ms per step:")
        for r in sweep:
            shown = f"{r['attention_module_ms_median']:.3f}" if r["status"] == "ok" else r["status"]
            lines.append(f"  {r['setup']:>10} {r['attn']:<15} B={r['batch']:<3} {shown}")
    return lines


def targets(results: list[dict]) -> list[str]:
    """The issue's targets at batch 32 on V2-Lite, evaluated on this run."""
    cell = {(r["setup"], r["attn"]): r.get("ms_median") for r in results
            if r["model"] == V2 and r["batch"] == 32 and r["status"] == "ok"}
    need = [("tp1", "flashinfer_mla"), ("tp2", "flashinfer_mla"), ("tp1", "sdpa"), ("tp2", "sdpa")]
    if not all(k in cell for k in need):
        return ["targets: not all V2-Lite B=32 cells ran"]
    fi1, fi2, sd1, sd2 = (cell[k] for k in need)
    return [f"target: TP=2 flashinfer_mla ({fi2:.2f} ms) faster than TP=1 flashinfer_mla ({fi1:.2f} ms): "
            f"{'met' if fi2 < fi1 else 'missed'}",
            f"target: TP=2 sdpa/flashinfer_mla ratio {sd2 / fi2:.2f} >= one-GPU ratio {sd1 / fi1:.2f}: "
            f"{'met' if sd2 / fi2 >= sd1 / fi1 else 'missed'}"]


def driver(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    tp_parity = os.path.join(SCRIPTS, "tp_parity.py")
    run([sys.executable, tp_parity, "make", "--shape", "v2-lite", "--ckpt", os.path.join(args.ckpt_dir, V2)])
    run([sys.executable, tp_parity, "make", "--shape", "v3-attn", "--layers", "4", "--vocab", "32768",
         "--ckpt", os.path.join(args.ckpt_dir, V3)])
    common = ["--ckpt-dir", args.ckpt_dir, "--batch", *map(str, args.batch), "--context", str(args.context),
              "--attn", *args.attn, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    single, tp = os.path.join(args.out, "part_single.json"), os.path.join(args.out, "part_tp.json")
    run([sys.executable, __file__, "--worker", "single", "--part", single, "--heads", *map(str, args.heads),
         "--attn-batch", str(args.attn_batch), *common])
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
         "--worker", "tp", "--part", tp, *common])
    results = []
    for part in (single, tp):
        with open(part) as f:
            results += json.load(f)["results"]
    lines = table(results) + [""] + targets(results)
    print("\n" + "\n".join(lines))
    import transformers

    payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "args": vars(args), "torch": str(torch.__version__), "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "seconds": time.perf_counter() - t0, "table": lines, "results": results}
    path = os.path.join(args.out, "bench_tp.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"wrote {path} ({payload['seconds']:.0f} s)")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_tp", help="directory for bench_tp.json")
    p.add_argument("--ckpt-dir", default=DEFAULT_ROOT)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--attn", nargs="+", default=["sdpa", "flashinfer_mla"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--heads", type=int, nargs="+", default=[128, 64, 32, 16], help="attention-only sweep")
    p.add_argument("--attn-batch", type=int, default=32, help="batch of the attention-only sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=("single", "tp"), help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is None:
        if torch.cuda.device_count() < 2:
            print("bench_tp.py needs two CUDA GPUs", file=sys.stderr)
            return 2
        return driver(args)
    results = worker_single(args) if args.worker == "single" else worker_tp(args)
    if results:
        with open(args.part, "w") as f:
            json.dump({"results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
