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
from .cache import FP8, dequantize_latent, latent_scales
from .cuda_graphs import mask_planned_outside_graph, plan_always_accepted  # also registers the graph op
from .dispatch import backend_for_graph, choose_backend, load_backend, requested_backend
from .errors import CacheLayoutError, UnsupportedModelError
from .flashinfer_fa import cache_rows, fa_backend_for_step, fa_decode
from .metadata import MAX_DECODE_QUERY, StepPlan, as_bool_mask, step_plan
from .models import ATTN_NAME, is_mla_attention, original_expand_kv
from .reference import mla_attention_reference
from .trtllm import trtllm_decode

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
    if mla_backend is not None and not torch.compiler.is_compiling():
        requested_backend(mla_backend, module.config)  # an unknown name fails at the call, prefill included
    weights = None
    if query.shape[2] <= MAX_DECODE_QUERY and not (module.training and dropout > 0):
        weights = absorbed_weights(module, query.dtype)
    if weights is None:  # prefill, training with dropout, or a kv_b_proj that cannot be absorbed
        kv_latent, k_rot = dequantize_latent(kv_latent, k_rot, query.dtype)
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
    if torch.compiler.is_compiling():
        if kv_latent.dtype == FP8:
            raise CacheLayoutError(
                "the FP8 latent cache (MLALatentCache(dtype=torch.float8_e4m3fn)) does not run inside torch.compile "
                "or CUDA graphs yet; generate without compiling, or use the bf16 cache (cache_implementation="
                '"static") for CUDA graphs.'
            )
        dims = (kv_latent.shape[-1], k_rot.shape[-1], weights.num_heads)
        backend = "reference" if _needs_grad(q_lat, q_pe, kv_latent, k_rot) else backend_for_graph(
            str(query.device), query.dtype, *dims, mla_backend, load_backend(module.config))
        o_lat = decode_latent_graph(backend, attention_mask, q_lat, q_pe, kv_latent, k_rot, scale)
    else:
        plan = step_plan(attention_mask, module)
        backend, kv_dtype = step_backend(plan, module, q_lat, kv_latent, k_rot, mla_backend, scale)
        if kv_latent.dtype != kv_dtype:  # an FP8 latent that this backend cannot read in place
            kv_latent, k_rot = dequantize_latent(kv_latent, k_rot, kv_dtype)
        o_lat = decode_latent(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale)
    return project_output(o_lat, weights), None


# ----------------------------------------------------------------------------------------------- decode section
def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def step_backend(plan: StepPlan, module: nn.Module, q_lat, kv_latent, k_rot, mla_backend, scale):
    """``(backend, dtype it reads the latent in)`` for this step's layers of this shape: chosen (and for fa3/fa2
    planned) by the first layer, shared by the others. A plan FlashInfer declines moves the step to fa2 or the
    reference backend. An FP8 latent is read in place by fa3 (bf16 queries, 512 + 64); anything else reads it
    dequantized, after one warning.

    A step that autograd must differentiate (a training forward of <= 8 tokens) runs on the reference backend:
    FlashInfer's kernels have no backward, and gradients must not silently stop at the attention."""
    device, dtype, heads, rank, rope = q_lat.device, q_lat.dtype, q_lat.shape[1], kv_latent.shape[-1], k_rot.shape[-1]
    config_value = load_backend(module.config)
    stored = kv_latent.dtype
    grad = _needs_grad(q_lat, kv_latent, k_rot)

    def choose():
        backend = choose_backend(device, dtype, rank, rope, heads, requested_backend(mla_backend, module.config))
        if grad and backend != "reference":
            logger.warning_once(
                f"flashinfer_mla: a decode step ran with autograd recording, so it used the PyTorch reference backend "
                f"instead of {backend} (FlashInfer's kernels have no backward). For inference, run under "
                "torch.no_grad() or torch.inference_mode(), as generate() does."
            )
            backend = "reference"
        fp8_in_place = stored == FP8 and backend == "fa3" and dtype == torch.bfloat16
        read = stored if fp8_in_place else dtype
        if backend in ("fa3", "fa2"):
            pitch = cache_rows(kv_latent)[1]
            backend = fa_backend_for_step(plan, backend, device, heads, dtype, rank, rope, pitch, scale, read)
        if stored == FP8 and (backend != "fa3" or not fp8_in_place):
            read = dtype
            logger.warning_once(
                f"flashinfer_mla: the {backend} backend cannot read the FP8 latent in place (FlashInfer's fa3 on "
                f"Hopper with bfloat16 queries can); it dequantizes the whole cached latent on every decode step."
            )
        return backend, read

    return plan.state(("backend", device, dtype, stored, rank, rope, heads, mla_backend, config_value, grad), choose)


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
    if backend in ("fa3", "fa2"):
        scales = latent_scales(kv_latent) if kv_latent.dtype == FP8 else None
        return fa_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale,
                         None if scales is None else (scales.latent, scales.rope))
    if backend == "reference":
        return mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, plan.mask_on(q_lat.device), scale)
    return trtllm_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale)


def decode_latent_graph(
    backend: str,
    mask: torch.Tensor,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rot: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`decode_latent` inside a compiled graph: the mask tensor stands for the plan (dynamo cannot carry it)."""
    b, h, sq, _ = q_lat.shape
    if (
        backend in ("fa3", "fa2")
        and mask_planned_outside_graph()
        and plan_always_accepted(str(q_lat.device), b, sq, h)
    ):
        return torch.ops.hf_flashinfer_mla.fa_decode_graph(backend, mask, q_lat, q_pe, kv_latent, k_rot, scale)
    return mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, as_bool_mask(mask), scale)


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
