#!/usr/bin/env python3
"""Per-decode-step benchmark of whole MLA models: eager vs sdpa vs flashinfer_mla.

Models are built from their real hyperparameters with random weights (nothing is downloaded):

    deepseek-v2-lite   DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, kv_lora 512, no q_lora, MoE 64x6 (+2 shared)
    deepseek-v3-attn   DeepSeek-V3's attention shape (hidden 7168, 128 heads, q_lora 1536, kv_lora 512) in
                       `--layers` (default 4) dense layers: no MoE, so the weights fit next to a large cache
    glm-4.7-flash      GLM-4.7-Flash (Glm4MoeLiteConfig's defaults, which mirror the released model: 47 layers,
                       20 heads, qk_nope 192, v_head 256, MoE 64x4 (+1 shared))
    tiny               a two-layer DeepSeek-V3-like model with small dims, for CPU smoke tests

Method, per (model, attn implementation, batch, context):

* The model is built once per model (random weights, directly on the device) and switched between attention
  implementations with ``model.set_attn_implementation``.
* The cache is filled to ``context`` tokens WITHOUT a prefill: random latent tensors of the shape the MLA models
  cache (``kv_nope [B, 1, S, kv_lora_rank]`` and ``k_rot [B, 1, S, qk_rope_head_dim]``) are written into every layer
  through ``cache.update(k, v, layer_idx)``, the same call the attention modules make. Decode cost does not depend
  on the values, and a real prefill of 32k tokens x batch 128 would cost far more than the decode steps measured.
* Cache classes (``--cache dynamic``, the default): eager and sdpa get ``transformers.DynamicCache(config=...)``,
  which is what ``generate()`` uses for them; flashinfer_mla gets ``hf_flashinfer_mla.MLALatentCache(config=...)``,
  which is what ``generate()`` uses for it (the package swaps it in) and which grows in place instead of
  concatenating the whole history on every step. ``MLALatentCache`` grows geometrically when full; the benchmark
  writes ``context + headroom`` tokens and crops the headroom off, so the timed steps measure the steady state and
  not the one-off doubling copy (which in real use costs up to 2x the latent memory right after prefill).
  ``--cache static`` gives every implementation ``transformers.StaticCache(config=..., max_cache_len=context +
  headroom)`` instead.
* Each step is ``model(input_ids=[B, 1], attention_mask=ones[B, context + 1], cache=cache, use_cache=True)``.
  After every step (warm-up and timed) the cache is cropped back by the one token the step appended
  (``cache.crop(-1)``), so every timed step decodes at exactly ``context`` cached tokens (pass ``--no-rewind`` to
  let it grow by warmup + steps tokens instead).
* Measured per step: time (CUDA events, synchronised; median over ``--steps``), tokens/s = batch / step time,
  transient peak memory = ``max_memory_allocated`` during the step (peak stats reset right before it) minus
  ``memory_allocated`` just before it, i.e. memory above weights + cache, KV-cache bytes per token = sum over layers
  of the bytes of one token of the cached latent (read from the cache tensors actually held; the same latent for
  all implementations), and the bytes the cache actually holds (capacity, static tail).
* ``torch.cuda.OutOfMemoryError`` in a cell is recorded as status "oom" (memory freed, run continues); any other
  exception as status "error" with its message. Cells at a larger batch and context than one that ran out of memory
  (same model and attn) are recorded as "oom" without running ("skipped": true). If the CUDA context is lost (an
  illegal memory access), the remaining cells are recorded as errors and the run stops.

Usage (the default grid is all three real models x batch 1 8 32 64 128 x context 1k 4k 16k 32k x eager, sdpa,
flashinfer_mla: about 10 minutes on an H200, so run one model per command where commands are time-limited):

    python scripts/bench_decode.py --model deepseek-v3-attn --batch 32 --context 4096 --json out.json
    python scripts/bench_decode.py --model tiny --device cpu --dtype float32 --batch 2 --context 64 --steps 2 --warmup 1
    python scripts/bench_decode.py --model deepseek-v3-attn --batch 32 --max-context-search --json search.json

``--max-context-search`` doubles the context from ``--search-start`` (1024) for each attn until a decode step
fails (out of memory), capped at ``--max-context`` (1,048,576), and reports the largest context that completed one
step (``--context`` is not used there; each probe runs ``--search-warmup`` + ``--search-steps`` steps, 1 + 1 by
default). FlashInfer compiles its kernels on first use unless a JIT cache is installed: that lands in the first
flashinfer_mla cell's warm-up, never in a timed step (keep ``--warmup`` >= 1). ``--json`` is rewritten after every
cell, so an interrupted run keeps what it measured; ``--time-limit`` stops starting new cells after that many seconds
(they are recorded as "skipped").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback

import torch

REAL_MODELS = ("deepseek-v2-lite", "deepseek-v3-attn", "glm-4.7-flash")
MODEL_NAMES = (*REAL_MODELS, "tiny")
ATTN_CHOICES = ("eager", "sdpa", "flashinfer_mla")
DEFAULT_BATCHES = (1, 8, 32, 64, 128)
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
DEFAULT_V3_ATTN_LAYERS = 4
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIB = 1024 * 1024
# Markers of a CUDA error after which the process's CUDA context is unusable.
FATAL_CUDA_MARKERS = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address")
# Messages of allocation failures that are not torch.OutOfMemoryError (cuBLAS, FlashInfer, the CPU allocator).
OOM_MARKERS = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation")

# DeepSeek-V2/V3's published YaRN rope scaling (mscale differs between the two).
V2_LITE_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
V3_ROPE = {**V2_LITE_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0}


# ----------------------------------------------------------------------------------------------------------------
# Models and caches
# ----------------------------------------------------------------------------------------------------------------


def build_config(name: str, layers: int | None):
    """The transformers config of preset `name`; `layers` overrides the depth."""
    import transformers

    if name == "deepseek-v2-lite":
        return transformers.DeepseekV2Config(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=layers or 27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            max_position_embeddings=163840,
            rope_parameters=dict(V2_LITE_ROPE),
        )
    if name == "deepseek-v3-attn":
        n = layers or DEFAULT_V3_ATTN_LAYERS
        return transformers.DeepseekV3Config(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            num_hidden_layers=n,
            first_k_dense_replace=n,  # every layer dense: no MoE weights are built
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            max_position_embeddings=163840,
            rope_parameters=dict(V3_ROPE),
        )
    if name == "glm-4.7-flash":
        kwargs = {"num_hidden_layers": layers} if layers else {}
        return transformers.Glm4MoeLiteConfig(**kwargs)  # class defaults mirror GLM-4.7-Flash
    if name == "tiny":
        return transformers.DeepseekV3Config(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=layers or 2,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            max_position_embeddings=4096,
        )
    raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")


def build_model(config, dtype: torch.dtype, device: torch.device, experts_impl: str | None):
    """A causal LM with random weights, created directly on `device` (no CPU copy of the weights)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if experts_impl:
        kwargs["experts_implementation"] = experts_impl
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def make_cache(kind: str, attn: str, config, max_len: int):
    """The cache a decode run of `attn` uses (see the module docstring)."""
    import transformers

    import hf_flashinfer_mla

    if kind == "static":
        return transformers.StaticCache(config=config, max_cache_len=max_len)
    if attn == "flashinfer_mla":
        return hf_flashinfer_mla.MLALatentCache(config=config)
    return transformers.DynamicCache(config=config)


def fill_cache(cache, config, batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    """Write `tokens` random latent tokens into every layer through `cache.update` (no prefill)."""
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    for layer_idx in range(config.num_hidden_layers):
        kv_nope = torch.randn(batch, 1, tokens, rank, dtype=dtype, device=device)
        k_rot = torch.randn(batch, 1, tokens, rope, dtype=dtype, device=device)
        cache.update(kv_nope, k_rot, layer_idx)
        del kv_nope, k_rot


def cache_footprint(cache) -> tuple[int, int]:
    """(bytes of one cached token summed over layers, bytes of storage the cache holds)."""
    per_token, storages = 0, {}
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            continue
        per_token += keys.shape[1] * keys.shape[-1] * keys.element_size()
        per_token += values.shape[1] * values.shape[-1] * values.element_size()
        for t in (keys, values):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return per_token, sum(storages.values())


def cache_kwarg(model) -> str:
    """The forward keyword for the cache: ``cache`` (transformers >= 5.2x) or the older ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def flashinfer_backend(config, device: torch.device, dtype: torch.dtype) -> str:
    """The decode backend flashinfer_mla will pick for this model (may log its one fallback warning)."""
    from hf_flashinfer_mla.dispatch import choose_backend, requested_backend

    return choose_backend(
        device,
        dtype,
        config.kv_lora_rank,
        config.qk_rope_head_dim,
        config.num_attention_heads,
        requested_backend(None, config),
    )


# ----------------------------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------------------------


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if is_cuda(device):
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a lost CUDA context is reported by the cell, not raised here
            pass


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in message for marker in OOM_MARKERS)


def is_fatal_cuda_error(exc: BaseException) -> bool:
    message = str(exc).lower()
    return any(marker in message for marker in FATAL_CUDA_MARKERS)


def timed_step(model, inputs: dict, device: torch.device) -> tuple[float, int | None, int | None, bool]:
    """One decode step: (milliseconds, transient peak bytes, bytes allocated before it (both None off CUDA),
    logits finite)."""
    if is_cuda(device):
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(**inputs)
        end.record()
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(end)
        transient = torch.cuda.max_memory_allocated(device) - base
    else:
        t0 = time.perf_counter()
        out = model(**inputs)
        ms = (time.perf_counter() - t0) * 1e3
        base = transient = None
    finite = bool(torch.isfinite(out.logits).all())
    del out
    return ms, transient, base, finite


def run_cell(model, attn: str, batch: int, context: int, args, device, dtype, warmup: int, steps: int) -> dict:
    """Measure one (attn, batch, context) cell; never raises."""
    config = model.config
    rec = {"attn": attn, "batch": batch, "context": context, "cache": args.cache, "status": "ok"}
    headroom = 1 if not args.no_rewind else warmup + steps + 1
    t_cell = time.perf_counter()
    cache = inputs = None
    try:
        model.set_attn_implementation(attn)
        if attn == "flashinfer_mla":
            rec["mla_backend"] = flashinfer_backend(config, device, dtype)
        cache = make_cache(args.cache, attn, config, context + headroom)
        rec["cache_class"] = type(cache).__name__
        if args.cache == "static":
            fill_cache(cache, config, batch, context, dtype, device)
        else:
            # MLALatentCache is sized once for context + headroom, then cropped back (no growth copy while timed).
            extra = headroom if attn == "flashinfer_mla" else 0
            fill_cache(cache, config, batch, context + extra, dtype, device)
            if extra:
                cache.crop(-extra)
        if int(cache.get_seq_length()) != context:
            raise RuntimeError(f"cache holds {int(cache.get_seq_length())} tokens after filling, expected {context}")

        gen = torch.Generator(device="cpu").manual_seed(args.seed + batch + context)
        ids = torch.randint(0, config.vocab_size, (batch, 1), generator=gen).to(device)
        inputs = {"input_ids": ids, cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
        times, transients, bases, finite = [], [], [], True
        with torch.inference_mode():
            for i in range(warmup + steps):
                seen = int(cache.get_seq_length())
                inputs["attention_mask"] = torch.ones(batch, seen + 1, dtype=torch.long, device=device)
                ms, transient, base, ok = timed_step(model, inputs, device)
                if not args.no_rewind:
                    cache.crop(-1)
                if i >= warmup:
                    times.append(ms)
                    transients.append(transient)
                    bases.append(base)
                    finite = finite and ok
        per_token, held = cache_footprint(cache)
        median = statistics.median(times)
        rec.update(
            ms_median=median,
            ms_min=min(times),
            ms_all=times,
            tokens_per_s=batch / (median / 1e3),
            transient_peak_bytes=max(transients) if transients[0] is not None else None,
            kv_bytes_per_token=per_token,
            cache_held_bytes=held,
            mem_before_step_bytes=bases[0],  # weights + cache + step inputs
            logits_finite=finite,
        )
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded status
        rec["status"] = "oom" if is_oom(exc) else "error"
        rec["message"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}"
        if rec["status"] == "error":
            rec["traceback"] = traceback.format_exc(limit=-6)
            rec["fatal"] = is_fatal_cuda_error(exc)
    finally:
        cache = inputs = None
        free_memory(device)
    rec["cell_seconds"] = time.perf_counter() - t_cell
    return rec


# ----------------------------------------------------------------------------------------------------------------
# Grid, search, output
# ----------------------------------------------------------------------------------------------------------------


class Progress:
    """tqdm if installed, else one printed line per cell."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.done = total, 0

    def step(self, rec: dict) -> None:
        self.done += 1
        label = f"{rec.get('model')} {rec['attn']} B={rec['batch']} ctx={rec['context']}"
        result = f"{rec['ms_median']:.2f} ms" if rec["status"] == "ok" else rec["status"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label}: {result}")
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}: {result}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def metadata(args, device: torch.device) -> dict:
    import transformers

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "args": {k: v for k, v in vars(args).items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "env_HF_FLASHINFER_MLA_BACKEND": os.environ.get("HF_FLASHINFER_MLA_BACKEND"),
    }
    for pkg in ("flashinfer", "hf_flashinfer_mla"):
        try:
            meta[pkg] = __import__(pkg).__version__
        except Exception as exc:  # noqa: BLE001
            meta[pkg] = f"unavailable ({type(exc).__name__}: {exc})"
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        meta.update(
            gpu=props.name,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    return meta


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def dominated_by_oom(failed: set, key: tuple, batch: int, context: int) -> bool:
    """True if the same (model, attn) ran out of memory at a batch and context no larger than these."""
    return any(k == key and b <= batch and c <= context for (k, b, c) in failed)


def skipped(model: str, attn: str, batch: int, context: int, args, status: str, message: str) -> dict:
    return {
        "model": model,
        "attn": attn,
        "batch": batch,
        "context": context,
        "cache": args.cache,
        "status": status,
        "skipped": True,
        "message": message,
    }


def model_info(model, config) -> dict:
    params = sum(p.numel() for p in model.parameters())
    return {
        "config_class": type(config).__name__,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "hidden_size": config.hidden_size,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "q_lora_rank": getattr(config, "q_lora_rank", None),
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "parameters": params,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def run_grid(args, device, dtype, payload: dict, deadline: float | None) -> None:
    """The benchmark grid: model x attn x batch x context (contexts ascending, so OOMs prune larger cells)."""
    batches, contexts = sorted(args.batch), sorted(args.context)
    total = len(args.model) * len(args.attn) * len(batches) * len(contexts)
    progress = Progress(total, "decode grid")
    failed: set = set()
    fatal = None
    for name in args.model:
        model = None
        try:
            if fatal is None and not (deadline and time.time() > deadline):
                config = build_config(name, args.layers)
                t0 = time.perf_counter()
                model = build_model(config, dtype, device, args.experts_impl)
                payload["models"][name] = {**model_info(model, config), "build_seconds": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001
            payload["models"][name] = {
                "status": "oom" if is_oom(exc) else "error",
                "message": f"{type(exc).__name__}: {exc}",
            }
            fatal = fatal or (f"{type(exc).__name__}: {exc}" if is_fatal_cuda_error(exc) else None)
            free_memory(device)
        for attn in args.attn:
            for batch in batches:
                for context in contexts:
                    if fatal is not None:
                        rec = skipped(name, attn, batch, context, args, "error", f"CUDA context lost earlier: {fatal}")
                    elif model is None:
                        rec = skipped(name, attn, batch, context, args, "error", "model could not be built")
                    elif deadline and time.time() > deadline:
                        rec = skipped(name, attn, batch, context, args, "skipped", "--time-limit reached")
                    elif dominated_by_oom(failed, (name, attn), batch, context):
                        rec = skipped(name, attn, batch, context, args, "oom", "ran out of memory at a smaller cell")
                    else:
                        rec = {
                            "model": name,
                            **run_cell(model, attn, batch, context, args, device, dtype, args.warmup, args.steps),
                        }
                        if rec["status"] == "oom":
                            failed.add(((name, attn), batch, context))
                        if rec.get("fatal"):
                            fatal = rec["message"]
                    payload["results"].append(rec)
                    write_json(args.json, payload)
                    progress.step(rec)
        model = None
        free_memory(device)
    progress.close()


def run_search(args, device, dtype, payload: dict, deadline: float | None) -> None:
    """Largest context (doubling from --search-start, capped at --max-context) that completes a decode step."""
    searches = payload.setdefault("max_context_search", [])
    for name in args.model:
        try:
            config = build_config(name, args.layers)
            model = build_model(config, dtype, device, args.experts_impl)
            payload["models"][name] = model_info(model, config)
        except Exception as exc:  # noqa: BLE001
            payload["models"][name] = {
                "status": "oom" if is_oom(exc) else "error",
                "message": f"{type(exc).__name__}: {exc}",
            }
            free_memory(device)
            continue
        for batch in args.batch:
            for attn in args.attn:
                entry = {"model": name, "batch": batch, "attn": attn, "largest_ok": None, "first_failure": None}
                entry["probes"] = probes = []
                context = args.search_start
                while context <= args.max_context:
                    if deadline and time.time() > deadline:
                        entry["stopped"] = "--time-limit reached"
                        break
                    rec = run_cell(
                        model, attn, batch, context, args, device, dtype, args.search_warmup, args.search_steps
                    )
                    probes.append({k: v for k, v in rec.items() if k not in ("traceback",)})
                    result = f"{rec['ms_median']:.2f} ms" if rec["status"] == "ok" else rec["status"]
                    print(f"  {name} B={batch} {attn} ctx={context}: {result}", flush=True)
                    if rec["status"] != "ok":
                        entry["first_failure"] = {
                            "context": context,
                            "status": rec["status"],
                            "message": rec.get("message"),
                        }
                        break
                    entry["largest_ok"] = context
                    context *= 2
                entry["capped"] = entry["first_failure"] is None and entry["largest_ok"] == last_doubling(args)
                searches.append(entry)
                write_json(args.json, payload)
                if any(p.get("fatal") for p in probes):
                    print("CUDA context lost; stopping the search.", flush=True)
                    return
        model = None
        free_memory(device)


def last_doubling(args) -> int:
    c = args.search_start
    while c * 2 <= args.max_context:
        c *= 2
    return c


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def summary_rows(results: list[dict], attns: list[str]) -> list[dict]:
    """One row per (model, batch, context) with each attn's numbers, the speedup and the memory ratio."""
    cells: dict[tuple, dict] = {}
    for rec in results:
        cells.setdefault((rec["model"], rec["batch"], rec["context"]), {})[rec["attn"]] = rec
    rows = []
    for (model, batch, context), by_attn in cells.items():
        row = {"model": model, "batch": batch, "context": context, "by_attn": by_attn}
        ok = {a: r for a, r in by_attn.items() if r["status"] == "ok"}
        row["kv_bytes_per_token"] = next((r["kv_bytes_per_token"] for r in ok.values()), None)
        fi = ok.get("flashinfer_mla")
        baselines = [ok[a]["ms_median"] for a in ("eager", "sdpa") if a in ok]
        row["speedup"] = None
        if fi is not None and baselines:
            row["speedup"] = min(baselines) / fi["ms_median"]
        elif fi is not None and any(a in by_attn for a in ("eager", "sdpa")):
            row["speedup"] = float("inf")  # baselines failed (OOM) where flashinfer_mla ran
        row["mem_ratio"] = None
        eager = ok.get("eager")
        if fi is not None and eager is not None and fi.get("transient_peak_bytes") is not None:
            row["mem_ratio"] = fi["transient_peak_bytes"] / max(eager["transient_peak_bytes"], 1)
        rows.append(row)
    rows.sort(key=lambda r: (r["model"], r["batch"], r["context"]))
    return rows


def print_table(rows: list[dict], attns: list[str]) -> None:
    header = ["model", "B", "ctx"]
    for a in attns:
        header += [f"{a} ms", f"{a} tok/s", f"{a} peak MiB"]
    header += ["KV B/tok", "speedup", "mem_ratio"]
    lines = []
    for row in rows:
        line = [row["model"], str(row["batch"]), str(row["context"])]
        for a in attns:
            rec = row["by_attn"].get(a)
            if rec is None:
                line += ["", "", ""]
            elif rec["status"] != "ok":
                line += [rec["status"].upper(), "", ""]
            else:
                peak = rec.get("transient_peak_bytes")
                line += [
                    fmt(rec["ms_median"]),
                    fmt(rec["tokens_per_s"], ".0f"),
                    fmt(peak / MIB if peak is not None else None, ".1f"),
                ]
        line += [fmt(row["kv_bytes_per_token"], "d"), fmt(row["speedup"], ".2f"), fmt(row["mem_ratio"], ".3f")]
        lines.append(line)
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(
        "speedup = min(eager, sdpa) ms / flashinfer_mla ms (inf: baselines OOM); "
        "mem_ratio = flashinfer_mla transient peak / eager transient peak; peak = memory above weights + cache"
    )


def print_search(searches: list[dict]) -> None:
    print("\nLargest context that completes a decode step:")
    by_key: dict[tuple, dict] = {}
    for s in searches:
        by_key.setdefault((s["model"], s["batch"]), {})[s["attn"]] = s
        fail = s["first_failure"]
        tail = (
            f"first failure at {fail['context']} ({fail['status']})"
            if fail
            else ("capped at --max-context" if s.get("capped") else s.get("stopped", ""))
        )
        print(f"  {s['model']:>18} B={s['batch']:<4} {s['attn']:>15}: {fmt(s['largest_ok'], 'd', 'none'):>8}  {tail}")
    for (model, batch), by_attn in by_key.items():
        fi = by_attn.get("flashinfer_mla", {}).get("largest_ok")
        capped = by_attn.get("flashinfer_mla", {}).get("capped")
        for base in ("sdpa", "eager"):
            b = by_attn.get(base, {}).get("largest_ok")
            if fi and b:
                bound = ">= " if capped else ""
                print(f"  {model} B={batch}: flashinfer_mla reaches {bound}{fi / b:.0f}x the context of {base}")


def plot(path: str, results: list[dict], attns: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping --plot {path}")
        return
    panels = sorted({(r["model"], r["batch"]) for r in results})
    if not panels:
        print("no results to plot")
        return
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for (model, batch), (ax_tps, ax_mem) in zip(panels, axes):
        for attn in attns:
            pts = sorted(
                (r["context"], r["tokens_per_s"], r.get("transient_peak_bytes"))
                for r in results
                if r["model"] == model and r["batch"] == batch and r["attn"] == attn and r["status"] == "ok"
            )
            if not pts:
                continue
            ctx = [p[0] for p in pts]
            ax_tps.plot(ctx, [p[1] for p in pts], marker="o", label=attn)
            if pts[0][2] is not None:
                ax_mem.plot(ctx, [p[2] / MIB for p in pts], marker="o", label=attn)
        ax_tps.set_title(f"{model}, batch {batch}: decode throughput")
        ax_tps.set_ylabel("tokens/s")
        if not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "no CUDA memory statistics", ha="center", va="center", transform=ax_mem.transAxes)
        ax_mem.set_title(f"{model}, batch {batch}: transient peak memory")
        ax_mem.set_ylabel("MiB above weights + cache")
        for ax in (ax_tps, ax_mem):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", nargs="+", default=list(REAL_MODELS), choices=MODEL_NAMES, help="model presets (default: the 3 real)"
    )
    p.add_argument("--layers", type=int, default=None, help="override the depth of every model")
    p.add_argument("--batch", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    p.add_argument("--context", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    p.add_argument("--attn", nargs="+", default=list(ATTN_CHOICES), choices=ATTN_CHOICES)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps per cell")
    p.add_argument("--cache", default="dynamic", choices=("dynamic", "static"))
    p.add_argument("--no-rewind", action="store_true", help="let the context grow by one token per step")
    p.add_argument("--experts-impl", default=None, help="transformers experts_implementation (default: its choice)")
    p.add_argument(
        "--mla-backend", default=None, help="force flashinfer_mla's backend (sets HF_FLASHINFER_MLA_BACKEND)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write raw results + metadata here (rewritten after every cell)")
    p.add_argument("--plot", default=None, help="write a PNG: tokens/s and transient memory vs context")
    p.add_argument("--time-limit", type=float, default=None, help="seconds after which no new cell is started")
    p.add_argument("--max-context-search", action="store_true", help="find the largest context per attn instead")
    p.add_argument("--search-start", type=int, default=1024)
    p.add_argument("--max-context", type=int, default=1_048_576)
    p.add_argument("--search-steps", type=int, default=1, help="timed steps per search probe")
    p.add_argument("--search-warmup", type=int, default=1, help="untimed steps per search probe")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.search_steps < 1 or args.search_warmup < 0:
        p.error("--steps/--search-steps must be >= 1 and --warmup/--search-warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mla_backend:
        os.environ["HF_FLASHINFER_MLA_BACKEND"] = args.mla_backend
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if is_cuda(device) and not torch.cuda.is_available():
        print("CUDA is not available; pass --device cpu (with --dtype float32) for a smoke test.", file=sys.stderr)
        return 2
    if is_cuda(device) and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    import hf_flashinfer_mla  # noqa: F401  (registers attn_implementation="flashinfer_mla")

    torch.manual_seed(args.seed)
    deadline = time.time() + args.time_limit if args.time_limit else None
    payload = {"metadata": metadata(args, device), "models": {}, "results": []}
    t0 = time.perf_counter()
    if args.max_context_search:
        run_search(args, device, dtype, payload, deadline)
        print_search(payload.get("max_context_search", []))
    else:
        run_grid(args, device, dtype, payload, deadline)
        rows = summary_rows(payload["results"], args.attn)
        payload["summary"] = [{k: v for k, v in r.items() if k != "by_attn"} for r in rows]
        print()
        print_table(rows, args.attn)
        backends = sorted({r["mla_backend"] for r in payload["results"] if r.get("mla_backend")})
        if backends:
            print(f"flashinfer_mla decode backend: {', '.join(backends)}")
        errors = [r for r in payload["results"] if r["status"] == "error" and not r.get("skipped")]
        for r in errors:
            print(f"error: {r['model']} {r['attn']} B={r['batch']} ctx={r['context']}: {r['message']}")
        if args.plot:
            plot(args.plot, payload["results"], args.attn)
    payload["metadata"]["total_seconds"] = time.perf_counter() - t0
    write_json(args.json, payload)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
