"""What runs where: the decode backends, the rule that picks one from the device, dtype, latent dims and head count,
and the order in which a step falls back when a kernel declines it.

Backends:
  ``fa3``        FlashInfer's Hopper MLA kernel (SM90: H100, H200).
  ``fa2``        FlashInfer's portable MLA kernel (SM80+: A100, L40, H100 where fa3 refuses, RTX 50xx).
  ``trtllm-gen`` FlashInfer's Blackwell decode kernel (SM100/SM103: B200, GB200, B300), via
                 ``trtllm_batch_decode_with_kv_cache_mla``; head counts it cannot tile go to ``cute-dsl``.
  ``cute-dsl``   FlashInfer's CuTe-DSL Blackwell kernel (SM100/SM103).
  ``reference``  plain PyTorch (``reference.py``): any device, dtype and latent width.

``auto`` (the default) takes the kernel for the GPU at hand and falls back to ``reference`` with one warning where
that kernel cannot serve (CPU, float32/float64, a latent that is not 512 + 64). A forced backend is a runtime setting,
never a property of a checkpoint. It comes from, first to last:

1. ``mla_backend=...`` passed to ``generate()`` or to the model's forward (this call only);
2. ``mla_backend=...`` passed to ``from_pretrained``/``from_config`` (kept on the loaded model's config as
   `LOAD_ATTR`, a private attribute that ``save_pretrained`` never writes);
3. the environment variable ``HF_FLASHINFER_MLA_BACKEND``.

An unknown name fails at the call that passes it. Forcing a backend that cannot run here (no GPU, another
architecture, a dtype or head count its kernels do not take, FlashInfer missing) raises `BackendUnavailableError`
saying why. Layers whose latent its kernels are not built for (dots3's sliding-window layers, 1024 + 64 beside its
512 + 64 DSA layers; a whole MiniCPM3) are no reason to fail every request: they decode on the reference, after one
warning naming their dims, and the other layers run the forced kernel.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers.utils import logging

from .errors import BackendUnavailableError

logger = logging.get_logger("hf_flashinfer_mla")

ENV_VAR = "HF_FLASHINFER_MLA_BACKEND"
BACKENDS = ("auto", "reference", "fa3", "fa2", "trtllm-gen", "cute-dsl")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_DIMS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) the FlashInfer MLA kernels are built for
BLACKWELL = ((10, 0), (10, 3))
ATTN_NAME = "flashinfer_mla"  # the attention implementation's name in Transformers' registries
# Where the load option lives on a loaded model's config: a private attribute that `save_pretrained` drops
# (`load_option_not_saved`), so that a checkpoint never carries it.
LOAD_ATTR = "_flashinfer_mla_backend"


def trtllm_gen_supports_num_heads(num_heads: int) -> bool:
    """Whether trtllm-gen can tile `num_heads` query heads: tile 8 up to 8 heads, 16 up to 32, else 64;
    supported iff ``num_heads % min(num_heads, tile) == 0`` (so 16, 48, 64, 128 are; 24 and 96 are not)."""
    if num_heads < 1:
        return False
    tile = 8 if num_heads <= 8 else 16 if num_heads <= 32 else 64
    return num_heads % min(num_heads, tile) == 0


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None elsewhere. (Tests substitute this function.)"""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _flashinfer_import_error() -> str | None:
    # Imported here, not at the top: `flashinfer.mla` takes seconds to import and may raise on a broken CUDA install;
    # neither should happen to a CPU user, and the error becomes the reason a kernel cannot run.
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
    if backend in ("trtllm-gen", "cute-dsl") and dtype == torch.float16:
        return f"{backend}'s MLA decode takes bfloat16 only (FlashInfer writes its output in bfloat16)"
    if backend == "trtllm-gen" and not trtllm_gen_supports_num_heads(num_heads):
        return f"trtllm-gen cannot tile {num_heads} heads (use cute-dsl)"
    return _flashinfer_import_error()


def validate_backend(value: str, source: str) -> str:
    """`value` if it names a backend; otherwise raise, naming where the value came from."""
    if value not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown flashinfer_mla backend {value!r} (from {source}); choose one of {', '.join(BACKENDS)}"
        )
    return value


def load_backend(config) -> str | None:
    """The ``mla_backend=`` given to ``from_pretrained``/``from_config`` of the model that owns `config`, if any."""
    return getattr(config, LOAD_ATTR, None)


def requested_backend(call_value: str | None = None, config=None) -> str:
    """The one precedence rule: `call_value` (this call's keyword), then the load option kept on `config`, then
    ``$HF_FLASHINFER_MLA_BACKEND``, then ``auto``."""
    for value, source in (
        (call_value, "mla_backend= of this call"),
        (load_backend(config), "mla_backend= given when the model was loaded"),
        (os.environ.get(ENV_VAR), f"${ENV_VAR}"),
    ):
        if value:
            return validate_backend(value, source)
    return "auto"


def backend_and_reason(
    device: torch.device,
    dtype: torch.dtype,
    kv_lora_rank: int,
    rope_dim: int,
    num_heads: int,
    requested: str = "auto",
) -> tuple[str, str | None]:
    """``(backend, reason)``: the backend this decode call runs on, and why it is not the GPU's own kernel (``auto``)
    or the forced one (None where it is). A forced backend that cannot run on this device, dtype and head count
    raises; layers whose latent dims its kernels do not take run the reference, with the reason."""
    validate_backend(requested, "choose_backend(requested=...)")
    if requested != "auto":
        reason = unavailable_reason(requested, device, dtype, kv_lora_rank, rope_dim, num_heads)
        if reason is None:
            return requested, None
        # Asked again for the dims its kernels are built for: any reason left is the device, the dtype or the head
        # count, a setting that cannot work here, and it fails where it is passed. Otherwise only this layer's
        # latent dims stand in the way (a model with layers of several latent widths): the layer falls back.
        here = unavailable_reason(requested, device, dtype, *KERNEL_DIMS, num_heads)
        if here:
            raise BackendUnavailableError(
                f"mla_backend={requested!r} was requested but cannot run: {here}. "
                f'Unset it (or pass mla_backend="auto") to let flashinfer_mla choose, or "reference" to force PyTorch.'
            )
        return "reference", (
            f"mla_backend={requested!r} cannot run layers of kv_lora_rank {kv_lora_rank} + rope {rope_dim} (its "
            f"kernels are built for {KERNEL_DIMS[0]} + {KERNEL_DIMS[1]}); layers it can run stay on it")
    cc = device_capability(device)
    if cc is None:
        return "reference", f"it needs an NVIDIA GPU and the tensors are on {device.type}"
    # The GPU's own kernel. fa3 and fa2 refuse for the same reasons (dtype, latent dims, FlashInfer missing), so on
    # Hopper there is no second choice to try.
    tile = trtllm_gen_supports_num_heads(num_heads)
    kernel = ("trtllm-gen" if tile else "cute-dsl") if cc in BLACKWELL else "fa3" if cc[0] == 9 else "fa2"
    if cc < (8, 0):
        return "reference", f"no FlashInfer MLA kernel supports compute capability {cc[0]}.{cc[1]}"
    reason = unavailable_reason(kernel, device, dtype, kv_lora_rank, rope_dim, num_heads)
    if (reason and cc in BLACKWELL and dtype == torch.float16  # (Blackwell's own kernels are bfloat16 only)
            and not unavailable_reason("fa2", device, dtype, kv_lora_rank, rope_dim, num_heads)):
        return "fa2", f"{reason}; load the model in bfloat16 to run it"
    if reason:
        return "reference", reason
    if kernel == "cute-dsl":
        return kernel, f"trtllm-gen cannot tile {num_heads} query heads per device"
    return kernel, None


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    kv_lora_rank: int,
    rope_dim: int,
    num_heads: int,
    requested: str = "auto",
) -> str:
    """The backend that will run this decode call (see the module docstring); warns once per distinct fallback."""
    backend, reason = backend_and_reason(device, dtype, kv_lora_rank, rope_dim, num_heads, requested)
    if reason:
        name = "the PyTorch reference backend" if backend == "reference" else f"FlashInfer's {backend} backend"
        logger.warning_once(f"flashinfer_mla: decode runs on {name} because {reason}.")
    logger.info_once(f"flashinfer_mla decode on {device} ({dtype}, {num_heads} heads): backend {backend}")
    return backend


def fallbacks(backend: str, device: torch.device, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int,
              num_heads: int, fp8_latent: bool, paged: bool = False) -> tuple[str, ...]:
    """The backends a step tries, in order, when `backend` declines its plan (FlashInfer's validators, a cache
    layout trtllm-gen cannot read): fa3 then fa2 where fa2 can run (not for the FP8 latent, whose fa2 module is
    not built ahead of time), and always the reference last. A `paged` step (continuous batching) also tries fa2
    after trtllm-gen or cute-dsl, which need Transformers' pages to be a multiple of 32 rows: fa2 reads any."""
    chain = [backend]
    blackwell = paged and backend in ("trtllm-gen", "cute-dsl")
    if (backend == "fa3" or blackwell) and not fp8_latent and not unavailable_reason(
            "fa2", device, dtype, kv_lora_rank, rope_dim, num_heads):
        chain.append("fa2")
    if backend != "reference":
        chain.append("reference")
    return tuple(chain)


# ------------------------------------------------------------------------------------------------------------------
# Seams (``registration.py``): where Transformers takes and validates the ``mla_backend`` options
# ------------------------------------------------------------------------------------------------------------------
def with_load_option(original):
    """`from_pretrained` / `_from_config` (which every ``from_config`` reaches) with an ``mla_backend=`` keyword,
    validated at the call and kept on the loaded model's text config (`LOAD_ATTR`)."""
    original = original.__func__  # (a bound classmethod)

    @functools.wraps(original)
    def load(cls, *args, mla_backend: str | None = None, **kwargs):
        if mla_backend is not None:
            validate_backend(mla_backend, f"{original.__name__.lstrip('_')}(mla_backend=...)")
        loaded = original(cls, *args, **kwargs)
        if mla_backend is not None:
            model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True gives a tuple
            setattr(model.config.get_text_config(decoder=True), LOAD_ATTR, mla_backend)
        return loaded

    return classmethod(load)


def load_option_not_saved(original):
    """`PreTrainedConfig.to_dict` without the load option: a runtime setting of one loaded model must not reach
    config.json (nor the generation config, nor a config's repr), all of which are built from it."""

    @functools.wraps(original)
    def to_dict(self):
        output = original(self)
        output.pop(LOAD_ATTR, None)
        return output

    return to_dict


def generate_option_validated(original):
    """`GenerationMixin._validate_model_kwargs` with ``mla_backend=``: generate() checks its model keywords there,
    before anything runs, the place to refuse an unknown backend even when no decode step follows. The keyword
    itself is forwarded to every attention call by the model's forward."""

    @functools.wraps(original)
    def _validate_model_kwargs(self, model_kwargs):
        value = model_kwargs.pop("mla_backend", None)  # generate() hands over a copy
        text_config = self.config.get_text_config(decoder=True)
        if value is not None or text_config._attn_implementation == ATTN_NAME:
            requested_backend(value, text_config)
        return original(self, model_kwargs)

    return _validate_model_kwargs
