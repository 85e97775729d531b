"""Continuous batching's prefill chunks on FlashInfer's ragged prefill (fa3, Hopper): one launch per layer for a
step's prefill requests, where SDPA takes one per request.

A prefill chunk attends causally to its request's cached past and to itself: query ``i`` of a chunk of ``q`` tokens
after ``k - q`` cached rows sees rows ``0 .. k - q + i``, which is FlashInfer's causal rule for ``kv_len > qo_len``
(bottom-right aligned). Prefill is compute-bound, so its keys and values are expanded from the latent through the
model's own ``expand_kv`` (absorption does not pay there), as vLLM's and SGLang's MLA backends do for their prefill.
``BatchPrefillWithRaggedKVCacheWrapper`` takes the requests packed ("ragged": offsets of their query tokens and of
their key rows) with any row and head strides (fa3 reads them from the tensors), so the expanded keys and values
and the packed queries are passed as the views the model produces, without copies.

fa3 takes query/key head dim 192 with value head dim 128 (DeepSeek) besides equal dims of 64, 128 or 256
(``flashinfer.utils.is_fa3_prefill_head_dim_supported``). Other dims, other GPUs and a plan FlashInfer declines run
on SDPA (``paged_attention.py``). Requests are grouped so that one group's expanded keys and values stay within
`EXPANDED_BYTES` (a single longer request is a group of its own): the transient memory is bounded per step.

As for the decode kernels, a builder plans once per step (`plan`) and the kernel call only runs (`run`). A planned
wrapper holds its step's schedule, so wrappers belong to the paged cache whose steps they plan (`Wrappers`), one
per group of the step being run: two caches (two managers) never share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffers import workspace_buffer
from . import Refused

EXPANDED_BYTES = 1 << 30  # expanded keys, values and kv_b_proj's output of one group of prefill requests


def supported_dims(qk_head_dim: int, v_head_dim: int) -> bool:
    from flashinfer.utils import is_fa3_prefill_head_dim_supported  # heavy import

    return is_fa3_prefill_head_dim_supported(qk_head_dim, v_head_dim)


def wrapper_class():
    from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper  # heavy import

    return BatchPrefillWithRaggedKVCacheWrapper


class Wrappers:
    """The ragged-prefill wrappers of one paged cache: group ``g`` of a step of parity ``p`` plans wrapper ``(p,
    g)``. Each has its own integer workspace, to which a plan copies its schedule asynchronously from the wrapper's
    pinned host buffer. Under asynchronous batching the host plans step N+1 while the GPU may not yet have run step
    N's copy, so consecutive steps take the two sets in turn: a set is planned again only once the host has read
    the tokens of its last step, which its copy preceded. All share the device's float workspace, as the decode
    kernels of a step do."""

    def __init__(self):
        self._wrappers: dict[tuple, list] = {}

    def get(self, device: torch.device, group: int, parity: int = 0):
        pool = self._wrappers.setdefault((device, parity), [])
        while len(pool) <= group:
            pool.append(wrapper_class()(workspace_buffer(device), kv_layout="NHD", backend="fa3"))
        return pool[group]


@dataclass(eq=False)
class RaggedGroup:
    """Prefill requests run in one launch: their packed query tokens and the positions of their rows in the step's
    read indices (both on the device), and the wrapper planned for them."""

    requests: list[int]
    q_index: torch.Tensor
    kv_index: torch.Tensor
    wrapper: object = None


def groups(q_lens: torch.Tensor, k_lens: torch.Tensor, cu_q: torch.Tensor, kv_offsets: torch.Tensor,
           requests: list[int], row_bytes: int, device: torch.device) -> list[RaggedGroup]:
    """`requests` (the step's prefill requests, in order) grouped so that one group's expanded rows stay within
    `EXPANDED_BYTES` (`row_bytes` per cached row), with their token and row positions, from host lengths."""
    budget = max(1, EXPANDED_BYTES // max(row_bytes, 1))
    out, current, rows = [], [], 0
    for r in requests:
        k = int(k_lens[r])
        if current and rows + k > budget:
            out.append(current)
            current, rows = [], 0
        current.append(r)
        rows += k
    if current:
        out.append(current)

    def index(starts, lens, members):
        return torch.cat([torch.arange(int(starts[r]), int(starts[r] + lens[r])) for r in members]).to(device)

    return [RaggedGroup(m, index(cu_q, q_lens, m), index(kv_offsets, k_lens, m)) for m in out]


def plan(wrapper, q_lens: torch.Tensor, k_lens: torch.Tensor, heads: int, qk_head_dim: int, v_head_dim: int,
         scale: float, dtype: torch.dtype) -> None:
    """Plan `wrapper` for one group (host lengths, no sync); `Refused` where FlashInfer declines it."""
    # (in pinned memory on a GPU: the wrapper copies them to the device, and a copy from pageable memory would wait
    # for the stream, i.e. for the step the GPU is still running under asynchronous batching)
    pinned = getattr(getattr(wrapper, "device", None), "type", None) == "cuda"
    qo_indptr = torch.zeros(q_lens.numel() + 1, dtype=torch.int32, pin_memory=pinned)
    kv_indptr = torch.zeros(k_lens.numel() + 1, dtype=torch.int32, pin_memory=pinned)
    qo_indptr[1:], kv_indptr[1:] = q_lens.cumsum(0), k_lens.cumsum(0)
    try:
        wrapper.plan(qo_indptr, kv_indptr, heads, heads, qk_head_dim, v_head_dim, causal=True, sm_scale=scale,
                     q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
    except Exception as exc:  # FlashInfer's checks, or a module it cannot load or build (errors of many types)
        raise Refused(f"FlashInfer's fa3 ragged prefill declined the step: {exc}") from None


def run(wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [N, H, qk]``, ``k [M, H, qk]``, ``v [M, H, vo]`` (last dimension contiguous) -> ``[N, H, vo]``."""
    return wrapper.run(q, k, v)
