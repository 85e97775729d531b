"""Blackwell (SM100/SM103) decode: FlashInfer's trtllm-gen MLA kernel, with cute-dsl for head counts it cannot tile.

Follows vLLM's FlashInfer MLA backend (the "seed"): on the trtllm-gen branch a zero-once counter buffer is handed to
every launch as ``multi_ctas_kv_counter_buffer`` (``buffers.py``; one per device, unlike the seed). Head counts
trtllm-gen cannot tile (`trtllm_gen_supports_num_heads`) go to ``backend="cute-dsl"``, which takes no counter buffer:
FlashInfer raises when one is given with it.

trtllm-gen reads a *packed* paged cache ``[pages, page_size, kv_lora_rank + rope]``. `MLALatentCache`
(``cache.py``) stores the latent that way, and ``generate()`` uses it by default under ``flashinfer_mla``.
This path follows FlashInfer's documented contract but has not run on Blackwell hardware: no such GPU was
available to the project. Where the layout cannot be served (a cache that is not packed, or left padding that is
not page-aligned) the step runs on the reference backend after one warning, never on wrong indices.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .buffers import multi_ctas_kv_counter_buffer, workspace_buffer
from .metadata import StepPlan
from .reference import mla_attention_reference

logger = logging.get_logger("hf_flashinfer_mla")

PAGE_SIZE = 64  # trtllm-gen takes 32 or 64 tokens per page
# The counter buffer is sized for at least this many query tokens (batch x tokens per sequence), then in powers of
# two: at 128 heads that is 512 KiB, so ordinary batches never re-size it and a larger one re-sizes it once per
# doubling.
COUNTER_MIN_TOKENS = 1024


def trtllm_gen_supports_num_heads(num_heads: int) -> bool:
    """Whether trtllm-gen can tile `num_heads` query heads: tile 8 up to 8 heads, 16 up to 32, else 64;
    supported iff ``num_heads % min(num_heads, tile) == 0`` (so 16, 48, 64, 128 are; 24 and 96 are not)."""
    if num_heads < 1:
        return False
    tile = 8 if num_heads <= 8 else 16 if num_heads <= 32 else 64
    return num_heads % min(num_heads, tile) == 0


def packed_pages(kv_latent: torch.Tensor, k_rot: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor | None:
    """A ``[pages, page_size, L + R]`` view of the packed storage behind the two latent views, or None if the
    cache does not store them packed (adjacent in one row, every sequence starting on a page boundary)."""
    rank, rope = kv_latent.shape[-1], k_rot.shape[-1]
    row = rank + rope
    elem = kv_latent.element_size()
    packed = (
        kv_latent.stride(-1) == 1
        and kv_latent.stride(2) == row
        and k_rot.stride()[2:] == (row, 1)
        and k_rot.data_ptr() == kv_latent.data_ptr() + rank * elem
        and kv_latent.stride(0) % (row * page_size) == 0
        and kv_latent.storage_offset() % (row * page_size) == 0
    )
    if not packed:
        return None
    storage_rows = (kv_latent.untyped_storage().nbytes() // elem - kv_latent.storage_offset()) // row
    pages = storage_rows // page_size
    return kv_latent.as_strided((pages, page_size, row), (page_size * row, row, 1), kv_latent.storage_offset())


def _block_tables(plan: StepPlan, device: torch.device, pitch_pages: int, page_size: int):
    """Per step: ``(block_tables [B, max_pages] int32, seq_lens [B] int32, max_seq_len)`` or a reason string."""
    valid = plan.kv_valid(device)
    b, s = valid.shape
    lens = valid.sum(-1)
    first = torch.where(valid.any(-1), valid.int().argmax(-1), torch.zeros_like(lens))
    pos = torch.arange(s, device=device)
    contiguous = (valid == ((pos >= first[:, None]) & (pos < (first + lens)[:, None]))).all()
    aligned = (first % page_size == 0).all()
    if not bool(contiguous & aligned):  # one host sync per step, at planning time
        return "left padding is not aligned to trtllm-gen's page size"
    max_len = int(lens.max())
    max_pages = (max_len + page_size - 1) // page_size
    base = torch.arange(b, device=device)[:, None] * pitch_pages + (first // page_size)[:, None]
    tables = (base + torch.arange(max_pages, device=device)[None, :]).to(torch.int32)
    return tables, lens.to(torch.int32), max_len


def counter_buffer(query_tokens: int, num_heads: int, device: torch.device) -> torch.Tensor:
    """The trtllm-gen counter buffer of `device`, big enough for `query_tokens` x `num_heads`.

    Sized for a worst case, not for this call: the token count is rounded up to a power of two, at least
    `COUNTER_MIN_TOKENS`, and the per-device buffer only ever grows. So a decode loop whose batch shrinks or
    fluctuates reuses one buffer, and the kernel, which resets every counter it used, never needs it re-zeroed.
    """
    from flashinfer.utils import get_device_sm_count, get_trtllm_gen_multi_ctas_kv_counter_bytes  # heavy: see dispatch

    bucket = max(COUNTER_MIN_TOKENS, 1 << max(query_tokens - 1, 0).bit_length())
    need = get_trtllm_gen_multi_ctas_kv_counter_bytes(bucket, num_heads, get_device_sm_count(device))
    return multi_ctas_kv_counter_buffer(need, device)


def trtllm_decode(backend, plan, q_lat, q_pe, kv_latent, k_rot, scale):
    """``[B, H, Sq, L]`` latent query -> ``[B, H, Sq, L]`` latent output on trtllm-gen (or cute-dsl)."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla  # heavy: see dispatch._flashinfer_import_error

    device = q_lat.device
    pages = packed_pages(kv_latent, k_rot)
    meta = None
    if pages is not None:
        pitch_pages = kv_latent.stride(0) // (pages.stride(0))
        meta = plan.state(("trtllm", device, pitch_pages), lambda: _block_tables(plan, device, pitch_pages, PAGE_SIZE))
        reason = meta if isinstance(meta, str) else None
    else:
        reason = "the cache does not store the latent packed (pass cache=MLALatentCache(model.config))"
    if reason:
        logger.warning_once(f"flashinfer_mla: this decode step runs on the reference backend because {reason}.")
        return mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, plan.mask_on(device), scale)
    tables, seq_lens, max_len = meta
    b, h, sq, rank = q_lat.shape
    query = torch.cat([q_lat, q_pe], dim=-1).transpose(1, 2).contiguous()  # [B, Sq, H, L + R]
    if backend == "cute-dsl":
        kernel = {"backend": "cute-dsl"}  # takes no counter buffer (FlashInfer raises if given one)
    else:
        # "auto" lets FlashInfer tune between its runners; the counter is what the trtllm-gen runner counts in.
        kernel = {"backend": "auto", "multi_ctas_kv_counter_buffer": counter_buffer(b * sq, h, device)}
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=query,
        kv_cache=pages,
        workspace_buffer=workspace_buffer(device),
        qk_nope_head_dim=rank,  # unused by the dense path; the absorbed query is kv_lora_rank wide
        kv_lora_rank=rank,
        qk_rope_head_dim=q_pe.shape[-1],
        block_tables=tables,
        seq_lens=seq_lens,
        max_seq_len=max_len,
        bmm1_scale=scale,
        bmm2_scale=1.0,
        **kernel,
    )  # [B, Sq, H, L]
    return out.transpose(1, 2)
