"""The decode kernels, one module per family, each split as vLLM's MLA backends and FlashMLA split theirs: a
*builder* that turns a step's rows into that kernel's metadata once per step and device (``build``), and a *kernel
call* that only runs (``run(metadata, layer, q_lat, q_pe, kv_latent, k_rot) -> o_lat``), once per layer.

* ``reference``: plain PyTorch, any device, dtype and latent width; the oracle of the others.
* ``fa``: FlashInfer's fa3 (Hopper) and fa2 (Ampere and newer) MLA kernels.
* ``trtllm``: FlashInfer's trtllm-gen and cute-dsl kernels (Blackwell).
* ``graphs``: the one CUDA-graph mechanism every family uses: fixed-address metadata, rebuilt in place.

Sparse layers (DeepSeek Sparse Attention: an indexer picks ``topk`` cached positions per query token) are the same
layers with ``Layer.topk > 0``: their kernel call also takes the layer's ``indices [B, Sq, topk]`` (int32 positions
in the sequence's cache, as Transformers' indexer returns them) and attends each query token over those rows only.

Every kernel call takes the latent query head-major, ``q_lat [H, N, L]`` (row ``n = b * Sq + s``), the rotary query
``q_pe [N, H, R]`` (any strides, last dimension contiguous), the cache views ``[B, 1, S, L]`` / ``[B, 1, S, R]``,
and returns ``o_lat [H, N, L]``: the layouts absorption produces and the projection reads, so nothing is copied
between them (FlashInfer's kernels take their query's and output's strides).

A builder that cannot serve a step raises `Refused`, with the reason; the step's plan (``plan.py``) then tries the
next backend of its chain (``capabilities.fallbacks``). Builders read the step through four attributes only
(``rows()``, ``mask_on(device, additive)``, ``q_len``, and ``pages``: where a paged cache keeps each request's rows,
None outside continuous batching), so no kernel module imports the plan. One builder per family serves every
caller: ``generate()``'s steps, continuous batching's (``paged_attention.py``) and CUDA-graph slots (``into=``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Refused(Exception):
    """A kernel declines this step (FlashInfer's validators, a cache layout it cannot read); the message says why."""


def refuse_inexpressible(rows) -> None:
    """`Refused` for a step whose mask no kernel's rows express (`Rows.refusal` says why: right padding in a chunk of
    a few tokens, a mask per head, an additive mask with a bias), or with a sequence that shows fewer positions
    than the step has query tokens: a prefill chunk inside a row's left padding (``prefill_chunk_size``), or a row
    the mask hides entirely. FlashInfer's contract has every sequence at least as long as the step (trtllm-gen
    faults otherwise, fa3 returns zeros for an empty row); the reference computes such rows as sdpa does."""
    if rows.refusal is not None:
        raise Refused(rows.refusal)
    if bool((rows.lens < rows.q_len).any()):
        raise Refused("a sequence shows fewer cached positions than the step has query tokens (a chunk within its "
                      "left padding, or a row the mask hides entirely)")


@dataclass(frozen=True)
class Layer:
    """What a kernel needs to know of one layer's call beyond the step's rows: operands' device, dtypes and dims,
    the cache's row pitch (rows between two sequences) and whether it stores the latent packed, the scale, and for a
    sparse (DSA) layer the width of its selection (0: dense, every visible row)."""

    device: torch.device
    dtype: torch.dtype  # the queries'
    kv_dtype: torch.dtype  # the cache's, as the kernel reads it (float8_e4m3fn: the FP8 latent, read in place)
    heads: int
    rank: int
    rope: int
    pitch: int
    packed: bool
    scale: float
    topk: int = 0
    sinks: bool = False  # attention sinks (HY-V4's ``s_aux``): FlashInfer's MLA kernels take none, the reference does


def cache_pitch(latent: torch.Tensor) -> int:
    """Rows between two sequences of a ``[B, 1, S, D]`` cache view: its capacity per sequence (for one sequence
    too, where the view's batch stride still spans its buffer; any other single sequence has its length)."""
    pitch, rem = divmod(latent.stride(0), latent.stride(2))
    return pitch if not rem and pitch >= latent.shape[2] else latent.shape[2]
