"""The one place that picks the decode backend, from the device, dtype, latent dims and head count.

Backends:
  ``fa3``        FlashInfer's Hopper MLA kernel (SM90: H100, H200).
  ``fa2``        FlashInfer's portable MLA kernel (SM80+: A100, L40, H100 where fa3 refuses, RTX 50xx).
  ``trtllm-gen`` FlashInfer's Blackwell decode kernel (SM100/SM103: B200, GB200, B300), via
                 ``trtllm_batch_decode_with_kv_cache_mla``; head counts it cannot tile go to ``cute-dsl``.
  ``cute-dsl``   FlashInfer's CuTe-DSL Blackwell kernel (SM100/SM103).
  ``reference``  plain PyTorch (``reference.py``): any device, dtype and latent width.

``auto`` (the default) takes the kernel for the GPU at hand and falls back to ``reference`` with one warning where
that kernel cannot serve (CPU, float32/float64, a latent that is not 512 + 64). A backend can be forced with the
environment variable ``HF_FLASHINFER_MLA_BACKEND``, with ``mla_backend=...`` passed to ``from_pretrained`` (it lands
on the config), or with ``mla_backend=...`` passed to ``generate``/``forward`` (call time wins, then the config, then
the environment). Forcing a backend that cannot run raises `BackendUnavailableError` saying why.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .errors import BackendUnavailableError

logger = logging.getLogger("hf_flashinfer_mla")

ENV_VAR = "HF_FLASHINFER_MLA_BACKEND"
BACKENDS = ("auto", "reference", "fa3", "fa2", "trtllm-gen", "cute-dsl")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_DIMS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) the FlashInfer MLA kernels are built for
BLACKWELL = ((10, 0), (10, 3))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None elsewhere. (Tests substitute this function.)"""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _flashinfer_import_error() -> str | None:
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken CUDA install raising at import
        return f"flashinfer cannot be imported ({type(exc).__name__}: {exc}); install flashinfer-python"
    return None


def unavailable_reason(
    backend: str, device: torch.device, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, num_heads: int
) -> str | None:
    """Why `backend` cannot serve this call, or None if it can."""
    if backend == "reference":
        return None
    cc = device_capability(device)
    if cc is None:
        return f"it needs an NVIDIA GPU and the tensors are on {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"its kernels take bfloat16 or float16 and the model runs in {dtype}"
    if (kv_lora_rank, rope_dim) != KERNEL_DIMS:
        return (
            f"its kernels are built for kv_lora_rank {KERNEL_DIMS[0]} + rope {KERNEL_DIMS[1]}, "
            f"this model has {kv_lora_rank} + {rope_dim}"
        )
    arch = f"compute capability {cc[0]}.{cc[1]}"
    if backend == "fa3" and cc[0] != 9:
        return f"fa3 runs on Hopper (9.0) only, this GPU has {arch}"
    if backend == "fa2" and cc < (8, 0):
        return f"fa2 needs compute capability 8.0 or newer, this GPU has {arch}"
    if backend in ("trtllm-gen", "cute-dsl") and cc not in BLACKWELL:
        return f"{backend} runs on SM100/SM103 (B200, GB200, B300) only, this GPU has {arch}"
    if backend == "trtllm-gen":
        from .trtllm import trtllm_gen_supports_num_heads

        if not trtllm_gen_supports_num_heads(num_heads):
            return f"trtllm-gen cannot tile {num_heads} heads (use cute-dsl)"
    return _flashinfer_import_error()


def preferred_kernel(cc: tuple[int, int], num_heads: int) -> str | None:
    """The kernel `auto` picks for a compute capability, before checking dtype and dims."""
    if cc in BLACKWELL:
        from .trtllm import trtllm_gen_supports_num_heads

        return "trtllm-gen" if trtllm_gen_supports_num_heads(num_heads) else "cute-dsl"
    if cc[0] == 9:
        return "fa3"
    if cc >= (8, 0):
        return "fa2"
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


@functools.lru_cache(maxsize=None)
def _log_choice(backend: str, device: str, dtype: torch.dtype, num_heads: int) -> None:
    logger.info("flashinfer_mla decode on %s (%s, %d heads): backend %s", device, dtype, num_heads, backend)


def requested_backend(call_value: str | None = None, config=None) -> str:
    """Resolve a forced backend: call-time keyword, then ``config.mla_backend``, then the environment."""
    value = call_value or getattr(config, "mla_backend", None) or os.environ.get(ENV_VAR) or "auto"
    if value not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown flashinfer_mla backend {value!r} (from mla_backend= or ${ENV_VAR}); choose one of {BACKENDS}"
        )
    return value


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    kv_lora_rank: int,
    rope_dim: int,
    num_heads: int,
    requested: str = "auto",
) -> str:
    """The backend that will run this decode call (see the module docstring for the rules)."""
    if requested not in BACKENDS:
        raise BackendUnavailableError(f"unknown flashinfer_mla backend {requested!r}; choose one of {BACKENDS}")
    if requested != "auto":
        reason = unavailable_reason(requested, device, dtype, kv_lora_rank, rope_dim, num_heads)
        if reason:
            raise BackendUnavailableError(
                f"mla_backend={requested!r} was requested but cannot run: {reason}. "
                f'Unset it (or pass mla_backend="auto") to let flashinfer_mla choose, or "reference" to force PyTorch.'
            )
        chosen = requested
    else:
        cc = device_capability(device)
        candidates = []
        if cc is not None:
            first = preferred_kernel(cc, num_heads)
            candidates = [first] if first else []
            if first == "fa3":
                candidates.append("fa2")
        chosen, reason = "reference", f"the tensors are on {device.type}, not an NVIDIA GPU"
        for candidate in candidates:
            reason = unavailable_reason(candidate, device, dtype, kv_lora_rank, rope_dim, num_heads)
            if reason is None:
                chosen = candidate
                break
        if cc is not None and not candidates:
            reason = f"no FlashInfer MLA kernel supports compute capability {cc[0]}.{cc[1]}"
        if chosen == "reference":
            _warn_once(f"flashinfer_mla: decode runs on the PyTorch reference backend because {reason}.")
        elif chosen == "cute-dsl":
            from .trtllm import select_decode_backend

            select_decode_backend(num_heads)  # warns once that trtllm-gen cannot tile this head count
    _log_choice(chosen, str(device), dtype, num_heads)
    return chosen


@torch.compiler.assume_constant_result
def backend_for_graph(device: str, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, num_heads: int,
                      requested: str | None, config_value: str | None) -> str:
    """`choose_backend` evaluated once while a graph is traced (the choice is a constant of the graph)."""
    value = requested or config_value or os.environ.get(ENV_VAR) or "auto"
    chosen = choose_backend(torch.device(device), dtype, kv_lora_rank, rope_dim, num_heads, value)
    if chosen in ("trtllm-gen", "cute-dsl"):
        if value != "auto":
            raise BackendUnavailableError(
                f"mla_backend={value!r} is not supported inside torch.compile / CUDA graphs yet; run without "
                "compiling (generate(..., disable_compile=True)) or let flashinfer_mla choose."
            )
        _warn_once(f"flashinfer_mla: {chosen} does not run inside torch.compile / CUDA graphs yet; compiled decode "
                   "steps use the PyTorch reference backend (generate(..., disable_compile=True) keeps the kernel).")
        chosen = "reference"
    return chosen
