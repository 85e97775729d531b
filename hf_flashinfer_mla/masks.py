"""The mask function registered for ``flashinfer_mla``: the once-per-step point where a decode step is planned.

Transformers calls it once per forward (or, with a static cache, once per step in
``prepare_inputs_for_generation``, outside any compiled region) and hands the mask it returns to every layer. For
decode steps (at most `MAX_DECODE_QUERY` query tokens) the mask is always materialised, as SDPA's boolean mask,
and a `plan.StepPlan` is attached to it. Where the rows are known on the host (the 2D mask carries a
``rows.GrowingMask``, or there is no 2D mask at all) the plan gets them without a device sync, and the mask is
built from them in a handful of ops (the same values as ``sdpa_mask``'s); anything else is planned exactly from
the mask itself.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .kernels.graphs import note_mask_built_in_graph, note_mask_planned
from .plan import attach_plan
from .rows import GrowingMask, Rows

# Query tokens per sequence up to which a forward is treated as decode (absorbed attention). One token is plain
# decoding; a few cover assisted/speculative decoding. Above it, expanding K/V once is cheaper.
MAX_DECODE_QUERY = 8


def host_rows(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask):
    """``(growing mask or None, the step's rows or None)``: the rows when they are known without reading the GPU."""
    if mask_function is not causal_mask_function or kv_offset != 0:
        return None, None  # overlays (sliding windows, packed sequences, block masks): derive from the mask
    end = q_offset + q_length if isinstance(q_offset, int) else None  # a StaticCache's offset is a device tensor
    if attention_mask is None:
        if end is None or end > kv_length:
            return None, None
        return None, Rows(torch.full((batch_size,), end, dtype=torch.int32), q_length,
                          torch.zeros(batch_size, dtype=torch.long), end=end)
    growing = GrowingMask.of(attention_mask)
    if (growing is None or attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, growing.width)
            or (end is not None and end != growing.width)):
        return None, None
    return growing, growing.rows(q_length, kv_length)


def flashinfer_mla_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """The step's mask, as SDPA's boolean mask; for decode steps it is always materialised and planned."""
    decode = q_length <= MAX_DECODE_QUERY
    compiling = torch.compiler.is_compiling()
    growing = rows = None
    device = torch.device(kwargs.get("device", "cpu"))
    if decode and not compiling:
        growing, rows = host_rows(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
        ready = None if growing is None else growing.take_next(
            (batch_size, q_length, kv_length, device, id(kwargs.get("config"))))
        if ready is not None:  # built while the GPU ran the previous step (`plan.StepPlan.plan_next`)
            mask, plan = ready
            plan.make_current()
            return _planned(mask, plan, growing)
    if rows is not None:
        last = torch.arange(rows.end - q_length, rows.end, device=device)  # the last position each query sees
        causal = torch.arange(kv_length, device=device) <= last[:, None]
        mask = (causal.expand(batch_size, 1, q_length, kv_length).contiguous() if growing is None
                else growing.mask(batch_size, q_length, kv_length, device))
    else:
        mask = sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=allow_is_causal_skip and not decode,
            **kwargs,
        )
        if not decode or mask is None:
            return mask
        mask = mask.contiguous()
    if compiling:
        note_mask_built_in_graph()
        return mask
    return _planned(mask, attach_plan(mask, rows, kwargs.get("config")), growing)


def _planned(mask: torch.Tensor, plan, growing) -> torch.Tensor:
    note_mask_planned(plan)
    if growing is not None:
        growing.last_plan = plan  # generate()'s next mask update plans the next step from it
    plan.load_graph_slots()  # CUDA-graph slots of this shape get this step's metadata before any replay
    return mask


def selection_mask(attention_mask: torch.Tensor | None, indices: torch.Tensor, kv_length: int) -> torch.Tensor:
    """A sparse (DSA) layer's mask for a prefill chunk: the step's mask (None: causal) restricted to the positions its
    indexer selected, ``indices [B, Sq, topk]``, as DSA models build it for eager and sdpa. A negative index selects
    nothing (indexers that pad their selection use -1). An additive mask stays additive, as DSA models keep it."""
    batch, q_len, _ = indices.shape
    idx = indices.long()
    picked = torch.zeros(batch, q_len, kv_length + 1, dtype=torch.bool, device=indices.device)
    picked = picked.scatter_(-1, torch.where(idx >= 0, idx, kv_length), True)[..., :kv_length].unsqueeze(1)
    if attention_mask is None:
        positions = torch.arange(kv_length, device=indices.device)
        return picked & (positions <= positions[kv_length - q_len:, None])
    if attention_mask.dtype == torch.bool:
        return attention_mask & picked
    return attention_mask.masked_fill(~picked, torch.finfo(attention_mask.dtype).min)  # (keeping its bias)
