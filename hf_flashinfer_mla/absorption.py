"""Weight absorption: the per-head key and value halves of ``kv_b_proj``.

``kv_b_proj.weight`` is ``[H * (qk_nope + v_head_dim), kv_lora_rank]``; per head the first ``qk_nope`` rows are
W_UK and the next ``v_head_dim`` rows W_UV. Absorbed decode computes ``q_lat = q_nope @ W_UK`` (a
``kv_lora_rank``-wide query), attends over the cached latent, and maps the latent output back with W_UV.

The halves are *views* of the live weight, so they can never go stale; what is cached per module is only the
bookkeeping (head count, dims), keyed by the weight's identity, version, device and dtype so that ``.to()``,
``load_state_dict`` or an in-place edit re-derive it. The head count comes from the weight's shape, so a
tensor-parallel shard of ``kv_b_proj`` (fewer heads per rank) works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AbsorbedWeights:
    w_uk: torch.Tensor  # [H, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]
    v_bias: torch.Tensor | None  # [H, v_head_dim]; a key bias cancels in the softmax
    num_heads: int
    key: tuple


def _weight_key(weight: torch.Tensor) -> tuple:
    # Inference-mode tensors carry no version counter (and cannot be edited in place outside inference mode).
    version = None if weight.is_inference() else weight._version
    return (weight.data_ptr(), version, weight.device, weight.dtype, tuple(weight.shape))


def absorbed_weights(module: nn.Module) -> AbsorbedWeights:
    """Return W_UK / W_UV of `module.kv_b_proj`, derived once and re-derived only when the weight changes."""
    if torch.compiler.is_compiling():
        # Inside a compiled graph the views are traced (and free); the bookkeeping cache is for eager mode.
        return _split(module, key=None)
    key = _weight_key(module.kv_b_proj.weight)
    cached = getattr(module, "_flashinfer_mla_absorbed", None)
    if cached is not None and cached.key == key:
        return cached
    absorbed = _split(module, key)
    module._flashinfer_mla_absorbed = absorbed
    return absorbed


def _split(module: nn.Module, key) -> AbsorbedWeights:
    proj = module.kv_b_proj
    weight = proj.weight
    nope, v_dim = module.qk_nope_head_dim, module.v_head_dim
    rows, rank = weight.shape
    if rows % (nope + v_dim):
        raise ValueError(
            f"kv_b_proj.weight has {rows} rows, not a multiple of qk_nope_head_dim + v_head_dim = {nope + v_dim}; "
            "cannot split it into per-head key and value projections."
        )
    num_heads = rows // (nope + v_dim)
    per_head = weight.view(num_heads, nope + v_dim, rank)
    v_bias = None
    if proj.bias is not None:
        v_bias = proj.bias.view(num_heads, nope + v_dim)[:, nope:]
    return AbsorbedWeights(per_head[:, :nope], per_head[:, nope:], v_bias, num_heads, key)


def absorb_query(q_nope: torch.Tensor, weights: AbsorbedWeights) -> torch.Tensor:
    """``[B, H, Sq, qk_nope]`` -> latent query ``[B, H, Sq, kv_lora_rank]`` (one batched GEMM over heads)."""
    b, h, s, d = q_nope.shape
    q = q_nope.permute(1, 0, 2, 3).reshape(h, b * s, d)
    q_lat = torch.bmm(q, weights.w_uk)  # [H, B*Sq, L]
    return q_lat.view(h, b, s, -1).permute(1, 0, 2, 3)


def project_output(o_lat: torch.Tensor, weights: AbsorbedWeights) -> torch.Tensor:
    """Latent attention output ``[B, H, Sq, kv_lora_rank]`` -> ``[B, Sq, H, v_head_dim]`` (the interface's layout)."""
    b, h, s, rank = o_lat.shape
    o = o_lat.permute(1, 0, 2, 3).reshape(h, b * s, rank)
    out = torch.bmm(o, weights.w_uv.transpose(1, 2))  # [H, B*Sq, dv]
    if weights.v_bias is not None:
        out = out + weights.v_bias[:, None, :]
    return out.view(h, b, s, -1).permute(1, 2, 0, 3)
