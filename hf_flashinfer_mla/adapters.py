"""PEFT LoRA on ``kv_b_proj``, applied live in the absorbed form.

A LoRA layer computes ``base(x) + sum_a s_a * (B_a (A_a x) + b_a)`` over its active adapters (``b_a``: ``lora_B``'s
bias with ``lora_bias=True``). Absorbed decode never forms that matrix. The base is absorbed as any ``kv_b_proj``
is (``absorption.py``), and each adapter's factors are applied at rank r, read from the adapter's own tensors at
every step, as serving engines apply LoRA:

    q_lat += s * (q_nope @ B_UK) @ A        B_UK = the key rows of B, per head     [H, qk_nope, r]
    out   += s * (o_lat @ A^T) @ B_UV^T     B_UV = the value rows of B, per head   [H, v_head_dim, r]

(a key bias shifts every score of a query equally and cancels in the softmax; the value bias adds ``s * b_V``).
Nothing derived from an adapter outlives the step, so no write can leave it stale: ``set_adapter``,
``disable_adapter``, merges, PEFT's hot-swap (which copies new factors in with ``.data.copy_``, moving no version
counter), a write through ``.data``, an optimizer step.

PEFT's forward decides which adapters count; `live_adapters` follows it: with adapters disabled, the merged ones
are taken back out of the base weight (PEFT's forward unmerges them), with any adapter merged the base alone
counts, otherwise each active adapter. LoRA variants (DoRA, ...) are not a low-rank sum, and dropout in train mode
draws per element of the latent: `not_live` says why such a layer decodes through the module instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's factors in the absorbed layout (views of its live tensors, in the activation dtype)."""

    a: torch.Tensor  # [r, kv_lora_rank]
    b_uk: torch.Tensor  # [H, qk_nope_head_dim, r]
    b_uv_t: torch.Tensor  # [H, r, v_head_dim]
    scale: float | torch.Tensor  # PEFT's scaling, negated for a merged adapter taken back out
    v_bias: torch.Tensor | None  # [H, v_head_dim], scaled


def is_lora(proj: nn.Module) -> bool:
    """Whether `proj` is a PEFT LoRA layer (any of its backends: a plain, bitsandbytes, GPTQ, ... base)."""
    return hasattr(proj, "get_delta_weight") and hasattr(proj, "base_layer") and hasattr(proj, "lora_A")


def live_adapters(proj: nn.Module) -> list[tuple[str, float]]:
    """The adapters PEFT's forward would apply on top of the base weight as it is now, each with its sign."""
    if proj.disable_adapters:
        return [(name, -1.0) for name in proj.merged_adapters]
    if proj.merged:
        return []
    return [(name, 1.0) for name in proj.active_adapters if name in proj.lora_A]


def not_live(proj: nn.Module) -> str | None:
    """Why `proj`'s adapters cannot be applied in the absorbed form (None: they can)."""
    for name, _ in live_adapters(proj):
        if name in proj.lora_variant:
            return (f"its LoRA adapter {name!r} is a {type(proj.lora_variant[name]).__name__} (a LoRA variant such "
                    "as DoRA is no low-rank sum that absorbed decode can apply)")
        dropout = proj.lora_dropout[name]
        if dropout.training and getattr(dropout, "p", 0) > 0:
            return (f"its LoRA adapter {name!r} has dropout in train mode, which draws per element of each cached "
                    "latent; call model.eval() for absorbed decode")
    return None


def lora_terms(proj: nn.Module, num_heads: int, nope: int, dtype: torch.dtype) -> tuple[LoraTerm, ...]:
    """This step's `LoraTerm` of each adapter `live_adapters` names (`not_live` must have said None)."""
    terms = []
    for name, sign in live_adapters(proj):
        a, b = _local(proj.lora_A[name].weight).to(dtype), _local(proj.lora_B[name].weight).to(dtype)
        per_head = b.unflatten(0, (num_heads, -1))  # [H, nope + v, r]
        scale = proj.scaling[name]
        scale = sign * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)
        bias = proj.lora_B[name].bias if getattr(proj, "lora_bias", {}).get(name) else None
        v_bias = None if bias is None else _local(bias).to(dtype).unflatten(0, (num_heads, -1))[:, nope:] * scale
        terms.append(LoraTerm(a, per_head[:, :nope], per_head[:, nope:].transpose(1, 2), scale, v_bias))
    return tuple(terms)


def adapt_query(q_lat: torch.Tensor, q_nope: torch.Tensor, terms: tuple[LoraTerm, ...]) -> torch.Tensor:
    """``q_lat [H, n, L]`` plus each adapter's ``s * (q_nope @ B_UK) @ A``."""
    for t in terms:
        q_lat = q_lat + torch.bmm(q_nope, t.b_uk).matmul(t.a) * t.scale
    return q_lat


def adapt_output(out: torch.Tensor, o_lat: torch.Tensor, terms: tuple[LoraTerm, ...]) -> torch.Tensor:
    """``out [H, n, v]`` plus each adapter's ``s * (o_lat @ A^T) @ B_UV^T`` and its value bias."""
    for t in terms:
        out = out + torch.bmm(o_lat.matmul(t.a.t()), t.b_uv_t) * t.scale
        if t.v_bias is not None:
            out = out + t.v_bias[:, None, :]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (tensor parallelism), any other tensor unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t
