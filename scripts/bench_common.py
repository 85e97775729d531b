"""Shared code of the benchmark scripts: models built from the real configurations (random weights, nothing is
downloaded), latent caches filled without a prefill, decode steps driven the way ``generate()`` drives them,
timing, out-of-memory detection, and output (a printed table plus JSON under ``--out``).

Every script imports this module from its own directory (``scripts/``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
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

REAL_MODELS = ("deepseek-v2-lite", "deepseek-v3-attn", "deepseek-v32-attn", "glm-4.7-flash")
MODEL_NAMES = (*REAL_MODELS, "tiny", "tiny-dsa")
ATTNS = ("eager", "sdpa", "flashinfer_mla")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIB = 1024 * 1024
# Messages of allocation failures that are not torch.OutOfMemoryError (cuBLAS, FlashInfer, the CPU allocator).
OOM_MARKERS = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation")
# Errors after which the process's CUDA context is unusable: stop measuring.
FATAL_CUDA_MARKERS = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address")

# DeepSeek-V2/V3's published YaRN rope scaling (mscale differs between the two).
V2_LITE_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
V3_ROPE = {**V2_LITE_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0}


# ----------------------------------------------------------------------------------------------------------------
# Models and caches
# ----------------------------------------------------------------------------------------------------------------
def build_config(name: str, layers: int | None = None):
    """The Transformers config of preset `name` (`layers` overrides the depth).

    deepseek-v2-lite  DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, kv_lora 512, no q_lora, MoE 64x6 (+2)
    deepseek-v3-attn  DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora 1536, kv_lora 512) in dense layers
                      (default 4): no MoE, so the weights fit next to a large cache
    deepseek-v32-attn DeepSeek-V3.2's attention with its indexer (the V3 attention above; 64 indexer heads of 128,
                      index_topk 2048) in dense layers (default 4)
    glm-4.7-flash     Glm4MoeLiteConfig's defaults (GLM-4.7-Flash: 47 layers, 20 heads, qk_nope 192, v_head 256)
    tiny              two small DeepSeek-V3-like layers, for CPU smoke tests
    tiny-dsa          two small DeepSeek-V3.2-like layers (index_topk 16), for CPU smoke tests
    """
    import transformers

    if name == "deepseek-v2-lite":
        return transformers.DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=layers or 27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
            num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1,
            topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
            rope_parameters=dict(V2_LITE_ROPE), eos_token_id=None,
        )
    if name == "deepseek-v3-attn":
        n = layers or 4
        return transformers.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=n,
            first_k_dense_replace=n, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_position_embeddings=163840, rope_parameters=dict(V3_ROPE), eos_token_id=None,
        )
    if name == "deepseek-v32-attn":
        n = layers or 4
        return transformers.DeepseekV32Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=n,
            first_k_dense_replace=n, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
            index_head_dim=128, index_topk=2048, max_position_embeddings=163840, rope_parameters=dict(V3_ROPE),
            eos_token_id=None,
        )
    if name == "glm-4.7-flash":
        return transformers.Glm4MoeLiteConfig(**({"num_hidden_layers": layers} if layers else {}), eos_token_id=None)
    if name == "tiny-dsa":
        return transformers.DeepseekV32Config(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers or 2,
            first_k_dense_replace=layers or 2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=8,
            index_head_dim=32, index_topk=16, max_position_embeddings=4096, eos_token_id=None,
        )
    if name == "tiny":
        return transformers.DeepseekV3Config(
            vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=layers or 2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096,
            eos_token_id=None,
        )
    raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")


def build_model(config, dtype: torch.dtype, device: torch.device, experts_impl: str | None = None):
    """A causal LM with random weights, created directly on `device` (no CPU copy of the weights)."""
    from transformers import AutoModelForCausalLM

    import hf_flashinfer_mla  # noqa: F401  (registers "flashinfer_mla")

    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    if experts_impl:
        kwargs["experts_implementation"] = experts_impl
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def cache_kwarg(model) -> str:
    """The forward keyword that takes the cache: ``cache`` from Transformers 5.24 on, ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(kind: str, attn: str, config, max_len: int, packed: bool | None = None):
    """The cache of a decode run: ``static`` gives every implementation a StaticCache; ``dynamic`` gives each what
    generate() gives it (flashinfer_mla: `MLALatentCache`, in the layout it picks for the GPU unless `packed`);
    ``transformers`` gives Transformers' own concatenating layers (``DynamicCache()``, built without the config,
    which is what flashinfer_mla models' caches built outside generate() held before the package adopted them)."""
    import transformers

    import hf_flashinfer_mla

    if kind == "static":
        return transformers.StaticCache(config=config, max_cache_len=max_len)
    if kind == "transformers":
        return transformers.DynamicCache()
    if attn == "flashinfer_mla":
        return hf_flashinfer_mla.MLALatentCache(config=config, packed=packed)
    return transformers.DynamicCache(config=config)


def fill_cache(cache, config, batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    """Write `tokens` random latent tokens into every layer through ``cache.update`` (no prefill: decode cost does
    not depend on the values, and a prefill of 32k tokens x batch 128 would cost far more than what is measured)."""
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    for layer_idx in range(config.num_hidden_layers):
        cache.update(torch.randn(batch, 1, tokens, rank, dtype=dtype, device=device),
                     torch.randn(batch, 1, tokens, rope, dtype=dtype, device=device), layer_idx)
        if hasattr(cache.layers[layer_idx], "update_indexer"):  # a sparse (DSA) layer: its indexer's keys too
            cache.update_indexer(torch.randn(batch, tokens, config.index_head_dim, dtype=dtype, device=device),
                                 layer_idx)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: all parameters but the input embedding table (a step reads B rows
    of it), unless it is tied to the output head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total


def latent_bytes(config, batch: int, context: int, elem: int = 2) -> int:
    """Bytes of cache all layers read in one decode step: the latent, and for a sparse (DSA) model only its
    `index_topk` selected rows of it, plus the indexer's keys of the whole context."""
    topk = getattr(config, "index_topk", None)
    if topk:
        per_token = min(context, topk) * (config.kv_lora_rank + config.qk_rope_head_dim) + context * config.index_head_dim
        return config.num_hidden_layers * batch * per_token * elem
    return config.num_hidden_layers * batch * context * (config.kv_lora_rank + config.qk_rope_head_dim) * elem


# ----------------------------------------------------------------------------------------------------------------
# Failures
# ----------------------------------------------------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MARKERS)


def is_fatal_cuda_error(exc: BaseException) -> bool:
    return any(m in str(exc).lower() for m in FATAL_CUDA_MARKERS)


def failure(exc: BaseException) -> dict:
    """A JSON-able record of a failed cell: status "oom" or "error" (with "fatal" when CUDA is lost)."""
    first = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ""
    rec = {"status": "oom" if is_oom(exc) else "error", "message": f"{type(exc).__name__}: {first}"}
    if rec["status"] == "error":
        rec["traceback"] = traceback.format_exc(limit=-6)
        rec["fatal"] = is_fatal_cuda_error(exc)
    return rec


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a lost CUDA context is reported by the cell, not raised here
            torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Deadline:
    """Stops starting new cells after `seconds` (None: never); skipped cells are recorded, not dropped."""

    def __init__(self, seconds: float | None):
        self.end = time.monotonic() + seconds if seconds else None

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
def time_ms(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-call times of ``fn(i)`` in ms: CUDA events on a GPU (the GPU's time, host time included when the GPU
    waits for the host), perf_counter elsewhere."""
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


def copy_bandwidth(device: torch.device, mib: int = 4096, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of `iters` copies)."""
    n = mib * MIB
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_ms(lambda i: dst.copy_(src), device, warmup=2, iters=iters)
    del src, dst
    free_memory(device)
    return 2 * n / (statistics.median(times) / 1e3)


def decode_steps(model, cache, batch: int, context: int, warmup: int, steps: int, forward=None,
                 mla_backend: str | None = None, deferred: bool = False) -> dict:
    """Time single-token decode steps from `context` cached tokens on, each driven exactly as generate() drives it:
    ``prepare_inputs_for_generation`` (with a static cache that builds the 4D mask, outside any compiled region),
    the forward, then ``_update_model_kwargs_for_generation``, which grows the 2D mask (and where flashinfer_mla
    plans the next step while the GPU runs this one), then a wait for the step, as generate() waits for its tokens.

    Returns medians and lists of: ``ms`` (the step from the host's start to the GPU's end, CUDA events: with a
    host-bound step this is the host's time), ``host_ms`` (time until the host had enqueued the step), the
    transient memory peak above weights + cache, and whether the logits were finite. The cache needs room for
    `warmup` + `steps` more tokens; it is cropped back to `context` tokens at the end.

    `deferred` (CUDA): the host waits for the *previous* step instead of this one, as Transformers' own
    ``DeferredStopCheck`` makes generate() wait (5.24+, MPS only there; the package enables it on CUDA for
    flashinfer_mla models), so the host builds each step while the GPU runs the one before; ``ms`` is then the time between two steps' ends on the GPU (no memory peak).
    """
    device = next(model.parameters()).device
    if deferred and device.type == "cuda":
        return _deferred_decode_steps(model, cache, batch, context, warmup, steps, forward or model, mla_backend)
    forward = forward or model
    gen = torch.Generator(device="cpu").manual_seed(batch + context)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).to(device)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
    extra = {"mla_backend": mla_backend} if mla_backend else {}
    ms, host, peaks, finite = [], [], [], True
    with torch.inference_mode():
        for i in range(warmup + steps):
            synchronize(device)
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            inputs = model.prepare_inputs_for_generation(tok, next_sequence_length=1, cache=cache,
                                                         attention_mask=mask, use_cache=True, logits_to_keep=1)
            out = forward(**inputs, **extra)
            t_host = (time.perf_counter() - t0) * 1e3
            mask = model._update_model_kwargs_for_generation(out, {"attention_mask": mask})["attention_mask"]
            if device.type == "cuda":
                end.record()
                end.synchronize()
                t_step = start.elapsed_time(end)
                peak = torch.cuda.max_memory_allocated(device) - base
            else:
                t_step, peak = (time.perf_counter() - t0) * 1e3, None
            finite = finite and bool(torch.isfinite(out.logits).all())
            del out
            if i >= warmup:
                ms.append(t_step)
                host.append(t_host)
                peaks.append(peak)
    cache.crop(-(warmup + steps))
    return {
        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_all": ms,
        "host_ms_median": statistics.median(host), "host_ms_all": host,
        "tokens_per_s": batch / (statistics.median(ms) / 1e3),
        "transient_peak_bytes": max(peaks) if peaks[0] is not None else None,
        "logits_finite": finite,
    }


def _deferred_decode_steps(model, cache, batch, context, warmup, steps, forward, mla_backend) -> dict:
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(batch + context)
    tok = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).to(device)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
    extra = {"mla_backend": mla_backend} if mla_backend else {}
    ends, host = [], []
    finite = torch.ones((), dtype=torch.bool, device=device)
    synchronize(device)
    with torch.inference_mode():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            inputs = model.prepare_inputs_for_generation(tok, next_sequence_length=1, cache=cache,
                                                         attention_mask=mask, use_cache=True, logits_to_keep=1)
            out = forward(**inputs, **extra)
            host.append((time.perf_counter() - t0) * 1e3)
            mask = model._update_model_kwargs_for_generation(out, {"attention_mask": mask})["attention_mask"]
            finite &= torch.isfinite(out.logits).all()  # (read at the end: reading it here would wait)
            del out
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
            if i:
                ends[-2].synchronize()  # the previous step, as DeferredStopCheck waits for it
    synchronize(device)
    ms = [ends[i - 1].elapsed_time(ends[i]) for i in range(max(warmup, 1), warmup + steps)]
    host = host[max(warmup, 1):]
    cache.crop(-(warmup + steps))
    return {
        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_all": ms,
        "host_ms_median": statistics.median(host), "host_ms_all": host,
        "tokens_per_s": batch / (statistics.median(ms) / 1e3),
        "transient_peak_bytes": None, "logits_finite": bool(finite), "deferred": True,
    }


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------
def environment(device: torch.device, args=None) -> dict:
    """Versions, GPU and the command line, for the JSON of every script."""
    import transformers

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HF_FLASHINFER_MLA")},
    }
    if args is not None:
        meta["args"] = {k: v for k, v in vars(args).items()}
    for pkg in ("flashinfer", "hf_flashinfer_mla"):
        try:
            meta[pkg] = __import__(pkg).__version__
        except Exception as exc:  # noqa: BLE001
            meta[pkg] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        from hf_flashinfer_mla.kernels import fa as flashinfer_fa

        meta["fa_planner"] = "generated module" if flashinfer_fa.uses_generated_module() else "public wrapper"
    except Exception as exc:  # noqa: BLE001
        meta["fa_planner"] = f"unavailable ({exc})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", gpu_memory_bytes=props.total_memory,
                    cuda=torch.version.cuda)
    return meta


def write_json(out_dir: str | None, name: str, payload: dict) -> str | None:
    """Write `payload` to ``out_dir/name`` atomically (scripts rewrite it after every cell)."""
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(f"{path}.tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(f"{path}.tmp", path)
    return path


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def print_table(header: list[str], rows: list[list[str]], notes: list[str] = ()) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for note in notes:
        print(note)


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("CUDA is not available; pass --device cpu (with --dtype float32) for a smoke test.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
