"""The reference backend: absorbed MLA attention in plain PyTorch.

Runs on any device and dtype and for any latent width (``kv_lora_rank``) or rope width. It is the fallback where
no FlashInfer kernel serves, and the oracle the kernels are tested against. It follows Transformers' ``eager``
semantics exactly (masked scores filled with the dtype minimum, softmax in at least float32), so in float64 it
matches ``eager`` to rounding. Its metadata is the step's mask on the layer's device, held weakly: the mask owns
the step's plan, which holds this metadata (``plan.py`` says why no cycle may form). That mask is the float mask
itself where the model passed one, since its values may add a bias to the scores, as ``eager`` adds them.

A sparse layer (``layer.topk``) gathers the selected rows of each query token and attends over those of them that
its mask shows (`attend_sparse`): exactly what ``eager`` computes with the indexer's selection folded into its mask,
without reading the rows it did not select.
"""

from __future__ import annotations

import weakref

import torch

from ..rows import as_bool_mask


def build(backend: str, step, layer, into=None, staged=None):
    if step.pages is not None and layer.topk:  # a paged sparse layer's indices are its rows: nothing to build
        return PAGED_SPARSE
    if step.pages is not None:  # a paged cache: each request's rows gathered, and the mask of its real ones
        return step.pages.gather(step.rows().lens, layer.device)
    return weakref.ref(step.mask_on(layer.device, additive=True))


PAGED_SPARSE = "paged sparse"
# The most bytes a paged sparse call gathers and scores at once: a continuous-batching step absorbs every query token
# of a DSA model (``paged_attention.PagedStep.absorbed``), and 4096 tokens over 2048 selected 576-wide rows would
# otherwise gather 9.7 GB, plus their scores; the tokens are independent, so slices of them give the same result.
PAGED_SPARSE_BYTES = 1 << 30


def run(meta, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None, indices=None, sinks=None) -> torch.Tensor:
    if meta is PAGED_SPARSE:  # indices [B, 1, topk]: rows of the paged cache's [1, 1, rows, D] views, -1 for none
        b, _, k = indices.shape
        per_token = k * ((kv_latent.shape[-1] + k_rot.shape[-1]) * kv_latent.element_size() + 8 * q_lat.shape[0])
        per = max(1, PAGED_SPARSE_BYTES // per_token)
        if b <= per:
            return _paged_sparse(layer, q_lat, q_pe, kv_latent, k_rot, indices, sinks)
        return torch.cat([_paged_sparse(layer, q_lat[:, i : i + per], q_pe[i : i + per], kv_latent, k_rot,
                                        indices[i : i + per], sinks) for i in range(0, b, per)], dim=1)
    if isinstance(meta, tuple):  # (rows [B, W] of a paged cache's [1, 1, rows, D] views, mask [B, 1, 1, W])
        index, mask = meta
        b, width = index.shape
        kv_latent, k_rot = (cache[0, 0].index_select(0, index.flatten()).view(b, 1, width, -1)
                            for cache in (kv_latent, k_rot))
        return attend(mask, layer.scale, q_lat, q_pe, kv_latent, k_rot, sinks)
    mask = meta() if isinstance(meta, weakref.ref) else meta
    if layer.topk:
        return attend_sparse(mask, indices, layer.scale, q_lat, q_pe, kv_latent, k_rot, sinks)
    return attend(mask, layer.scale, q_lat, q_pe, kv_latent, k_rot, sinks)


def _paged_sparse(layer, q_lat, q_pe, kv_latent, k_rot, indices, sinks) -> torch.Tensor:
    """Query tokens ``[H, B, L]`` over their selected rows ``indices [B, 1, topk]`` of the paged cache."""
    b, _, k = indices.shape
    kv_latent, k_rot = (cache[0, 0].index_select(0, indices.clamp_min(0).flatten().long()).view(b, 1, k, -1)
                        for cache in (kv_latent, k_rot))
    return attend((indices >= 0)[:, None], layer.scale, q_lat, q_pe, kv_latent, k_rot, sinks)


def attend(mask, scale: float, q_lat, q_pe, kv_latent, k_rot, sinks=None) -> torch.Tensor:
    """The kernel call on the operands as every kernel gets them (``kernels/__init__.py``)."""
    h, n, rank = q_lat.shape
    b, sq = mask.shape[0], mask.shape[2]
    out = mla_attention_reference(q_lat.view(h, b, sq, rank).transpose(0, 1), q_pe.view(b, sq, h, -1).transpose(1, 2),
                                  kv_latent, k_rot, mask, scale, sinks)
    return out.transpose(0, 1).reshape(h, n, rank)


def masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`scores` under `mask` as ``eager`` applies it: the dtype's minimum where it hides a position and, where an
    additive (float) mask shows one, its value added (0, or a bias)."""
    keep = as_bool_mask(mask)
    if keep is not mask:  # (at the wider dtype of the two, as eager's addition promotes them)
        scores = scores + torch.where(keep, mask, 0)
    return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, head_dim: int, dtype) -> torch.Tensor:
    """Softmax over the last dimension in at least float32; with `sinks` (one logit per head, at `head_dim` of
    `scores`: attention sinks, as HY-V4 passes them in ``s_aux``) each row's weights also share their mass with a
    sink that holds no value, as the model's eager attention computes it."""
    compute = torch.promote_types(scores.dtype, torch.float32)
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=compute).to(dtype)
    shape = [1] * scores.dim()
    shape[head_dim] = -1
    sink = sinks.to(compute).view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores.to(compute), sink], dim=-1), dim=-1)[..., :-1].to(dtype)


def mla_attention_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rot: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the latent cache.

    Args:
        q_lat: ``[B, H, Sq, L]`` query already absorbed into the latent space.
        q_pe: ``[B, H, Sq, R]`` rotary part of the query.
        kv_latent: ``[B, 1, Skv, L]`` cached latent (keys and values at once).
        k_rot: ``[B, 1, Skv, R]`` cached rotary key.
        mask: ``[B, 1, Sq, Skv]`` bool, True = attend, or additive (see `masked`).
        scale: softmax scale.
        sinks: ``[H]`` attention-sink logits, or None.

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
    scores = masked(scores.view(b, h, s, -1) * scale, mask)
    probs = softmax_with_sinks(scores, sinks, 1, q_lat.dtype)
    out = torch.bmm(probs.view(b, h * s, -1), ckv)
    return out.view(b, h, s, rank)


def attend_sparse(mask, indices, scale: float, q_lat, q_pe, kv_latent, k_rot, sinks=None) -> torch.Tensor:
    """Sparse decode on the kernel operands: query token ``(b, s)`` attends to the rows ``indices[b, s]`` of its
    sequence that ``mask[b, 0, s]`` shows. A position the mask hides (an indexer's pick past a short row's valid
    keys, or a negative placeholder) gets no weight, so the result does not depend on the indices' order."""
    h, n, rank = q_lat.shape
    b, sq, k = indices.shape
    idx = indices.long()
    # The mask at the selected positions, per head where it has a row per head: [B, Sq, H or 1, K]
    heads = mask.shape[1]
    picked = mask.transpose(1, 2).gather(3, idx.clamp_min(0)[:, :, None, :].expand(-1, -1, heads, -1))
    hidden = (idx < 0)[:, :, None, :]
    picked = (picked & ~hidden if picked.dtype == torch.bool
              else picked.masked_fill(hidden, torch.finfo(picked.dtype).min))
    flat = idx.clamp_min(0).view(b, sq * k, 1)

    def rows(cache):  # [B, 1, S, D] -> the selected rows [B, Sq, K, D]
        return cache[:, 0].gather(1, flat.expand(-1, -1, cache.shape[-1])).view(b, sq, k, -1)

    ckv, kpe = rows(kv_latent), rows(k_rot)
    scores = torch.einsum("hbsl,bskl->bshk", q_lat.view(h, b, sq, rank), ckv)
    scores = (scores + torch.einsum("bshr,bskr->bshk", q_pe.view(b, sq, h, -1), kpe)) * scale
    scores = masked(scores, picked)
    probs = softmax_with_sinks(scores, sinks, 2, q_lat.dtype)
    return torch.einsum("bshk,bskl->hbsl", probs, ckv).reshape(h, n, rank)
