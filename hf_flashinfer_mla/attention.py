"""The ``flashinfer_mla`` attention function, in the shape of Transformers' ``integrations/*_attention.py``.

Because the model's ``expand_kv`` is hooked (``models.py``), ``key`` and ``value`` arrive here as the cached latent
(``kv_nope`` ``[B, 1, S, kv_lora_rank]`` and ``k_rot`` ``[B, 1, S, rope]``), not as per-head keys and values.

* Decode (at most `MAX_DECODE_QUERY` query tokens per sequence): absorbed attention straight over the latent.
  ``kv_b_proj`` is applied to the query (W_UK) and to the attention output (W_UV), never to cached tokens.
  The model's attention call -> the step's plan (``metadata.py``, once per step) -> backend kernel
  (``dispatch.py``) -> output projection.
* Prefill, training, and longer chunks: the latent is expanded once through the model's own ``expand_kv`` and
  attended with Transformers' SDPA, exactly like ``attn_implementation="sdpa"``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

from .absorption import absorb_query, absorbed_weights, project_output
from .dispatch import backend_for_graph, choose_backend, requested_backend
from .errors import CacheLayoutError, UnsupportedModelError
from .flashinfer_fa import fa_decode, fa_decode_graph, mask_planned_outside_graph
from .metadata import StepPlan, step_plan
from .models import ATTN_NAME, is_mla_attention, original_expand_kv
from .reference import mla_attention_reference

logger = logging.get_logger("hf_flashinfer_mla")

# Query tokens per sequence up to which a forward is treated as decode (absorbed attention). One token is plain
# decoding; a few cover assisted/speculative decoding. Above it, expanding K/V once is cheaper.
MAX_DECODE_QUERY = 8


def flashinfer_mla_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    mla_backend: str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """MLA attention over the latent cache. Returns ``(attn_output [B, Sq, H, v_head_dim], None)``."""
    if not is_mla_attention(module):
        raise UnsupportedModelError(
            f'attn_implementation="{ATTN_NAME}" was called from {type(module).__name__}, which is not a dense MLA '
            "attention module (no kv_b_proj/expand_kv, or a sparse DSA indexer). Use sdpa or eager for this module."
        )
    if kwargs.pop("output_attentions", False):
        logger.warning_once(
            f"`{ATTN_NAME}` attention does not return attention weights (`output_attentions=True`): set the "
            'attention to "eager" if you need them.'
        )
    kv_latent, k_rot = _check_latent(module, key, value)
    weights = None
    if query.shape[2] <= MAX_DECODE_QUERY and not (module.training and dropout > 0):
        weights = absorbed_weights(module, query.dtype)
    if weights is None:  # prefill, training with dropout, or a kv_b_proj that cannot be absorbed
        key_states, value_states = original_expand_kv(module)(kv_latent, k_rot)
        return sdpa_attention_forward(
            module, query, key_states, value_states, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is None:
        raise CacheLayoutError(
            f"{ATTN_NAME} decode needs the attention mask built by its mask function, and got none. This happens "
            "with caches that bypass Transformers' mask creation (continuous batching / PagedAttentionCache), which "
            "are not supported: use generate() with the default DynamicCache or cache_implementation='static'."
        )
    scale = scaling if scaling is not None else module.qk_head_dim**-0.5
    if query.shape[1] != weights.num_heads:
        raise ValueError(
            f"query has {query.shape[1]} heads but kv_b_proj holds {weights.num_heads}: q_b_proj/q_proj and "
            "kv_b_proj must be sharded the same way (both column-wise by heads under tensor parallelism)."
        )
    q_nope, q_pe = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    q_lat = absorb_query(q_nope, weights)
    dims = (kv_latent.shape[-1], k_rot.shape[-1], weights.num_heads)
    if torch.compiler.is_compiling():
        backend = backend_for_graph(str(query.device), query.dtype, *dims, mla_backend,
                                    getattr(module.config, "mla_backend", None))
        o_lat = decode_latent_graph(backend, q_lat, q_pe, kv_latent, k_rot, attention_mask, scale)
    else:
        backend = choose_backend(query.device, query.dtype, *dims, requested_backend(mla_backend, module.config))
        o_lat = decode_latent(backend, step_plan(attention_mask), q_lat, q_pe, kv_latent, k_rot, scale)
    return project_output(o_lat, weights), None


def decode_latent(
    backend: str,
    plan: StepPlan,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rot: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Run one backend: ``[B, H, Sq, L]`` latent query -> ``[B, H, Sq, L]`` latent output."""
    if backend == "reference":
        return mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, plan.mask_on(q_lat.device), scale)
    if backend in ("fa3", "fa2"):
        return fa_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale)
    from .trtllm import trtllm_decode

    return trtllm_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale)


def decode_latent_graph(backend, q_lat, q_pe, kv_latent, k_rot, mask, scale) -> torch.Tensor:
    """`decode_latent` inside a compiled graph: the mask tensor replaces the plan object (dynamo cannot carry it)."""
    if backend in ("fa3", "fa2"):
        if mask_planned_outside_graph():
            return fa_decode_graph(q_lat, q_pe, kv_latent, k_rot, mask, backend, scale)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, mask, scale)


def _check_latent(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
    ok = (
        key.dim() == 4
        and value.dim() == 4
        and key.shape[1] == 1
        and value.shape[1] == 1
        and key.shape[-1] == rank
        and value.shape[-1] == rope
        and key.shape[:3] == value.shape[:3]
    )
    if not ok:
        raise CacheLayoutError(
            f"{ATTN_NAME} expects the cache to return the MLA latent ([batch, 1, seq, {rank}] and "
            f"[batch, 1, seq, {rope}]) but got {tuple(key.shape)} and {tuple(value.shape)}. Use Transformers' "
            "DynamicCache or StaticCache (or this package's MLALatentCache); caches that store expanded keys and "
            "values cannot be read."
        )
    return key, value
