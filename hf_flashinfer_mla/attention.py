"""The ``flashinfer_mla`` attention function, in the shape of Transformers' ``integrations/*_attention.py``.

Because the model's ``expand_kv`` is hooked (``models.py``), ``key`` and ``value`` arrive here as the cached latent
(``kv_nope`` ``[B, 1, S, kv_lora_rank]`` and ``k_rot`` ``[B, 1, S, rope]``), not as per-head keys and values.

* Decode (at most `MAX_DECODE_QUERY` query tokens per sequence): absorbed attention straight over the latent.
  ``kv_b_proj`` is applied to the query (W_UK) and to the attention output (W_UV), never to cached tokens.
  The model's attention call -> the step's plan (``plan.py``: the route, built once per step) -> the kernel
  (``kernels/``) -> the output projection.
* Prefill, training, and longer chunks: the latent is expanded once through the model's own ``expand_kv`` and
  attended with Transformers' SDPA, exactly like ``attn_implementation="sdpa"``.

Sparse (DSA) layers get ``indices [B, Sq, topk]``, the positions their indexer selected, which DSA models pass to
every implementation but eager and sdpa instead of folding them into the mask. Decode attends over those rows of
the latent only; prefill folds them into its mask itself (`masks.selection_mask`), as the model does for sdpa.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

from .absorption import absorbed_weights
from .cache import dequantize_latent
from .capabilities import requested_backend
from .decode import decode_layer
from .errors import CacheLayoutError, UnsupportedModelError
from .masks import MAX_DECODE_QUERY, selection_mask
from .models import ATTN_NAME, attention_with_sinks, is_mla_attention, original_expand_kv
from .paged_attention import attend as paged_attend
from .paged_cache import allocator_of
from .plan import step_plan

logger = logging.get_logger("hf_flashinfer_mla")


def flashinfer_mla_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    mla_backend: str | None = None,
    indices: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """MLA attention over the latent cache. Returns ``(attn_output [B, Sq, H, v_head_dim], None)``. `indices`: a
    sparse (DSA) layer's selection ``[B, Sq, topk]`` (None: dense, every position the mask shows); `s_aux`: one
    attention-sink logit per head (HY-V4), which shares each query's softmax mass without holding a value."""
    if not is_mla_attention(module):
        raise UnsupportedModelError(
            f'attn_implementation="{ATTN_NAME}" was called from {type(module).__name__}, which is not an MLA '
            "attention module (no kv_b_proj/expand_kv). Use sdpa or eager for this module."
        )
    if kwargs.pop("output_attentions", False):
        logger.warning_once(
            f"`{ATTN_NAME}` attention does not return attention weights (`output_attentions=True`): set the "
            'attention to "eager" if you need them.'
        )
    paged = allocator_of(key)  # continuous batching: key/value are rows of the paged latent cache (paged_cache.py)
    if paged is not None:
        return paged_attend(paged, module, query, key, value, scaling, mla_backend, indices, s_aux, **kwargs)
    kv_latent, k_rot = _check_latent(module, key, value)
    if mla_backend is not None and not torch.compiler.is_compiling():
        requested_backend(mla_backend, module.config)  # an unknown name fails at the call, prefill included
    weights = None
    if query.shape[2] <= MAX_DECODE_QUERY and not (module.training and dropout > 0):
        weights = absorbed_weights(module, query.dtype, sinks=s_aux is not None)
    if weights is None:  # prefill, training with dropout, or a kv_b_proj that cannot be absorbed
        kv_latent, k_rot = dequantize_latent(kv_latent, k_rot, query.dtype)
        key_states, value_states = original_expand_kv(module)(kv_latent, k_rot)
        if indices is not None:
            attention_mask = selection_mask(attention_mask, indices, key_states.shape[2])
        if s_aux is not None:
            return attention_with_sinks(module, query, key_states, value_states, attention_mask, dropout, scaling)
        return sdpa_attention_forward(
            module, query, key_states, value_states, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is None:
        raise CacheLayoutError(
            f"{ATTN_NAME} decode needs the attention mask built by its mask function, and got none. This happens "
            "with caches that bypass Transformers' mask creation (continuous batching / PagedAttentionCache), which "
            "are not supported: use generate() with the default DynamicCache or cache_implementation='static'."
        )
    attention_mask = _fit_mask(attention_mask, query, kv_latent)
    scale = scaling if scaling is not None else module.qk_head_dim**-0.5
    if query.shape[1] != weights.num_heads:
        raise ValueError(
            f"query has {query.shape[1]} heads but kv_b_proj holds {weights.num_heads}: q_b_proj/q_proj and "
            "kv_b_proj must be sharded the same way (both column-wise by heads under tensor parallelism)."
        )
    # The step's plan rides on its mask (inside a compiled graph the mask stands for it: `decode.decode_layer`).
    step = None if torch.compiler.is_compiling() else step_plan(attention_mask, module)
    return decode_layer(module, step, query, kv_latent, k_rot, weights, scale, mla_backend, indices, s_aux,
                        attention_mask), None


_FITTED = "_flashinfer_mla_fitted"  # a broadcast mask's expansion, kept on the mask: one view (and plan) per step


def _fit_mask(mask: torch.Tensor, query: torch.Tensor, kv_latent: torch.Tensor) -> torch.Tensor:
    """A decode step's mask at its query's batch size and length: a user's 4D mask may broadcast over them, as eager
    and sdpa let it. The expanded view is made once per step, so the step's layers share it and its plan. A mask
    whose width is not the cache's is refused, as they refuse it (a kernel would read rows past the cache)."""
    if mask.shape[-1] != kv_latent.shape[2]:
        raise ValueError(f"the attention mask covers {mask.shape[-1]} positions but the cache holds "
                         f"{kv_latent.shape[2]}: a 4D mask's last dimension must be the cache's length")
    shape = (query.shape[0], mask.shape[1], query.shape[2], mask.shape[3])
    if mask.shape == shape:
        return mask
    if torch.compiler.is_compiling():
        return mask.expand(shape)
    fitted = getattr(mask, _FITTED, None)
    if fitted is None or fitted.shape != shape:
        fitted = mask.expand(shape)
        setattr(mask, _FITTED, fitted)
    return fitted


def _check_latent(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
    shape = key.shape
    if len(shape) != 4 or shape[1] != 1 or shape[3] != rank or value.shape != (shape[0], 1, shape[2], rope):
        raise CacheLayoutError(
            f"{ATTN_NAME} expects the cache to return the MLA latent ([batch, 1, seq, {rank}] and "
            f"[batch, 1, seq, {rope}]) but got {tuple(key.shape)} and {tuple(value.shape)}. Use Transformers' "
            "DynamicCache or StaticCache (or this package's MLALatentCache); caches that store expanded keys and "
            "values cannot be read."
        )
    return key, value
