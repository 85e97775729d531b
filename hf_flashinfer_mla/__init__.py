"""MLA decode over the latent cache for Hugging Face Transformers, on FlashInfer's kernels.

    import hf_flashinfer_mla  # registers attn_implementation="flashinfer_mla"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashinfer_mla", dtype=torch.bfloat16)

Decode steps then attend straight over the cached 512 + 64 latent with the up-projection absorbed into the query,
instead of re-expanding the whole history into per-head keys and values on every step.
"""

import torch

from .errors import (
    BackendUnavailableError,
    CacheLayoutError,
    FlashInferMLAError,
    TransformersVersionError,
    UnsupportedModelError,
)
from .supported import refusal

try:
    from . import buffers
    from .cache import MLALatentCache, MLALatentLayer
    from .buffers import multi_ctas_kv_counter_buffer
    from .capabilities import BACKENDS, ENV_VAR, backend_and_reason, choose_backend, trtllm_gen_supports_num_heads
    from .kernels import fa, graphs
    from .kernels.graphs import CapturedShape, captured_shapes
    from .models import ATTN_NAME, DENSE_MLA_MODEL_TYPES, SPARSE_MLA_MODEL_TYPES
    from .registration import register
except ImportError as error:
    # A Transformers the package cannot run on at all lacks a module or a name it imports: one line naming the
    # installed release and the fix, instead of the missing name deep inside.
    if isinstance(error, TransformersVersionError) or not (error.name or "").startswith("transformers"):
        raise
    missing = f"it has no module {error.name}" if isinstance(error, ModuleNotFoundError) else str(error)
    raise TransformersVersionError(refusal("hf_flashinfer_mla", missing.split(" (")[0])) from None

__version__ = "0.1.0"

register()


def reset() -> None:
    """What a fresh process has: ``torch.compiler.reset()`` (compiled code and its CUDA graphs), then the package's
    process caches, which only CUDA graphs hold by address: every captured shape's slot and route, FlashInfer's
    generated modules, and each device's buffers. Their GPU memory is freed once no plan still refers to it. For a
    process done with compiled models, and for tests that count what a fresh process captures. Do not call it while
    a CUDA graph of your own (``torch.cuda.graph``) that ran a flashinfer_mla step may still replay."""
    torch.compiler.reset()
    graphs.reset()
    fa.reset()
    buffers.reset()


__all__ = [
    "ATTN_NAME",
    "BACKENDS",
    "DENSE_MLA_MODEL_TYPES",
    "ENV_VAR",
    "SPARSE_MLA_MODEL_TYPES",
    "BackendUnavailableError",
    "CacheLayoutError",
    "CapturedShape",
    "FlashInferMLAError",
    "MLALatentCache",
    "MLALatentLayer",
    "TransformersVersionError",
    "UnsupportedModelError",
    "backend_and_reason",
    "captured_shapes",
    "choose_backend",
    "multi_ctas_kv_counter_buffer",
    "register",
    "reset",
    "trtllm_gen_supports_num_heads",
]
