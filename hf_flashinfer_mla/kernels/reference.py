"""The reference backend: absorbed MLA attention in plain PyTorch.

Runs on any device and dtype and for any latent width (``kv_lora_rank``) or rope width. It is the fallback where
no FlashInfer kernel serves, and the oracle the kernels are tested against. It follows Transformers' ``eager``
semantics exactly (masked scores filled with the dtype minimum, softmax in at least float32), so in float64 it
matches ``eager`` to rounding. Its metadata is the step's boolean mask on the layer's device.
"""

from __future__ import annotations

import torch


def build(backend: str, step, layer, into=None, staged=None) -> torch.Tensor:
    return step.mask_on(layer.device)


def run(mask, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None) -> torch.Tensor:
    return attend(mask, layer.scale, q_lat, q_pe, kv_latent, k_rot)


def attend(mask, scale: float, q_lat, q_pe, kv_latent, k_rot) -> torch.Tensor:
    """The kernel call on the operands as every kernel gets them (``kernels/__init__.py``)."""
    h, n, rank = q_lat.shape
    b, sq = mask.shape[0], mask.shape[2]
    out = mla_attention_reference(q_lat.view(h, b, sq, rank).transpose(0, 1), q_pe.view(b, sq, h, -1).transpose(1, 2),
                                  kv_latent, k_rot, mask, scale)
    return out.transpose(0, 1).reshape(h, n, rank)


def mla_attention_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rot: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over the latent cache.

    Args:
        q_lat: ``[B, H, Sq, L]`` query already absorbed into the latent space.
        q_pe: ``[B, H, Sq, R]`` rotary part of the query.
        kv_latent: ``[B, 1, Skv, L]`` cached latent (keys and values at once).
        k_rot: ``[B, 1, Skv, R]`` cached rotary key.
        mask: ``[B, 1, Sq, Skv]`` bool, True = attend.
        scale: softmax scale.

    Returns:
        ``[B, H, Sq, L]`` latent attention output.
    """
    b, h, s, rank = q_lat.shape
    ckv = kv_latent[:, 0]  # [B, Skv, L]
    kpe = k_rot[:, 0]  # [B, Skv, R]
    # Heads and query tokens folded into one axis: one bmm per batch row reads the latent once for all heads,
    # where a broadcasting matmul would materialise a copy of the cache per head.
    scores = torch.bmm(q_lat.reshape(b, h * s, rank), ckv.transpose(1, 2))
    scores = scores + torch.bmm(q_pe.reshape(b, h * s, -1), kpe.transpose(1, 2))
    scores = scores.view(b, h, s, -1) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q_lat.dtype)
    out = torch.bmm(probs.view(b, h * s, -1), ckv)
    return out.view(b, h, s, rank)
