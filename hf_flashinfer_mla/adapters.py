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
draws per element of the latent: `lora_terms` says why such a layer decodes through the module instead.
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
    # (dict lookups first: this runs for every layer of every step, and nn.Module's attribute misses raise)
    modules = proj._modules
    return "lora_A" in modules and "base_layer" in modules and hasattr(type(proj), "get_delta_weight")


def live_adapters(proj: nn.Module) -> list[tuple[str, float]]:
    """The adapters PEFT's forward would apply on top of the base weight as it is now, each with its sign."""
    if proj.disable_adapters:
        return [(name, -1.0) for name in proj.merged_adapters]
    if proj.merged:
        return []
    return [(name, 1.0) for name in proj.active_adapters if name in proj.lora_A]


def lora_terms(proj: nn.Module, num_heads: int, nope: int, dtype: torch.dtype) -> tuple[LoraTerm, ...] | str:
    """This step's `LoraTerm` of each adapter `live_adapters` names, or why they cannot be applied in the absorbed
    form (a LoRA variant, dropout in train mode, a hook on an adapter's module)."""
    terms = []
    # (read off the modules' dicts, not through nn.Module.__getattr__: this runs for every layer of every step)
    lora_a, lora_b, dropouts = (proj._modules[n]._modules for n in ("lora_A", "lora_B", "lora_dropout"))
    for name, sign in live_adapters(proj):
        if name in proj.lora_variant:
            return (f"its LoRA adapter {name!r} is a {type(proj.lora_variant[name]).__name__} (a LoRA variant such "
                    "as DoRA is no low-rank sum that absorbed decode can apply)")
        if dropouts[name].training and getattr(dropouts[name], "p", 0) > 0:
            return (f"its LoRA adapter {name!r} has dropout in train mode, which draws per element of each cached "
                    "latent; call model.eval() for absorbed decode")
        for m in (dropouts[name], lora_a[name], lora_b[name]):
            if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__:
                return (f"its LoRA adapter {name!r} has a forward hook or a replaced forward on "
                        f"{type(m).__name__}, which absorbed decode would skip")
        a, b = _local(lora_a[name]._parameters["weight"]), _local(lora_b[name]._parameters["weight"])
        if a.dtype != dtype:  # (PEFT keeps adapters in float32 for bf16/fp16 models by default)
            a, b = a.to(dtype), b.to(dtype)
        per_head = b.unflatten(0, (num_heads, -1))  # [H, nope + v, r]
        scale = proj.scaling[name]
        scale = sign * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)
        bias = lora_b[name]._parameters.get("bias") if getattr(proj, "lora_bias", {}).get(name) else None
        v_bias = None if bias is None else _local(bias).to(dtype).unflatten(0, (num_heads, -1))[:, nope:] * scale
        terms.append(LoraTerm(a, per_head[:, :nope], per_head[:, nope:].transpose(1, 2), scale, v_bias))
    return tuple(terms)


def adapt_query(q_lat: torch.Tensor, q_nope: torch.Tensor, terms: tuple[LoraTerm, ...]) -> torch.Tensor:
    """``q_lat [H, n, L]`` plus each adapter's ``s * (q_nope @ B_UK) @ A``."""
    for t in terms:
        low = torch.bmm(q_nope, t.b_uk)  # [H, n, r]
        if isinstance(t.scale, torch.Tensor):
            q_lat = q_lat + low.matmul(t.a) * t.scale
        else:
            q_lat = torch.baddbmm(q_lat, low, t.a.expand(low.shape[0], *t.a.shape), alpha=t.scale)
    return q_lat


def adapt_output(out: torch.Tensor, o_lat: torch.Tensor, terms: tuple[LoraTerm, ...]) -> torch.Tensor:
    """``out [H, n, v]`` plus each adapter's ``s * (o_lat @ A^T) @ B_UV^T`` and its value bias."""
    for t in terms:
        low = o_lat.matmul(t.a.t())  # [H, n, r]
        if isinstance(t.scale, torch.Tensor):
            out = out + torch.bmm(low, t.b_uv_t) * t.scale
        else:
            out = torch.baddbmm(out, low, t.b_uv_t, alpha=t.scale)
        if t.v_bias is not None:
            out = out + t.v_bias[:, None, :]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (tensor parallelism), any other tensor unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t
