"""MLA decode over the latent cache for Hugging Face Transformers, on FlashInfer's kernels.

    import hf_flashinfer_mla  # registers attn_implementation="flashinfer_mla"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashinfer_mla", dtype=torch.bfloat16)

Decode steps then attend straight over the cached 512 + 64 latent with the up-projection absorbed into the query,
instead of re-expanding the whole history into per-head keys and values on every step.
"""

from .cache import MLALatentCache, MLALatentLayer
from .buffers import multi_ctas_kv_counter_buffer
from .capabilities import BACKENDS, ENV_VAR, backend_and_reason, choose_backend, trtllm_gen_supports_num_heads
from .errors import BackendUnavailableError, CacheLayoutError, FlashInferMLAError, UnsupportedModelError
from .models import ATTN_NAME, DENSE_MLA_MODEL_TYPES, SPARSE_MLA_MODEL_TYPES
from .registration import register

__version__ = "0.1.0"

register()

__all__ = [
    "ATTN_NAME",
    "BACKENDS",
    "DENSE_MLA_MODEL_TYPES",
    "ENV_VAR",
    "SPARSE_MLA_MODEL_TYPES",
    "BackendUnavailableError",
    "CacheLayoutError",
    "FlashInferMLAError",
    "MLALatentCache",
    "MLALatentLayer",
    "UnsupportedModelError",
    "backend_and_reason",
    "choose_backend",
    "multi_ctas_kv_counter_buffer",
    "register",
    "trtllm_gen_supports_num_heads",
]
