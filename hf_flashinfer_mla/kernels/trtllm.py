"""Blackwell (SM100/SM103) decode: FlashInfer's trtllm-gen MLA kernel, with cute-dsl for head counts it cannot tile.

Follows vLLM's FlashInfer MLA backend (the "seed"): on the trtllm-gen branch a zero-once counter buffer is handed to
every launch as ``multi_ctas_kv_counter_buffer`` (``buffers.py``; one per device, unlike the seed). Head counts
trtllm-gen cannot tile (``capabilities.trtllm_gen_supports_num_heads``) go to ``backend="cute-dsl"``, which takes
no counter buffer: FlashInfer raises when one is given with it.

trtllm-gen reads a *packed* paged cache ``[pages, page_size, kv_lora_rank + rope]``. `MLALatentCache`
(``cache.py``) stores the latent that way on Blackwell, and ``generate()`` uses it by default under
``flashinfer_mla``. Its block tables and lengths come from the step's host rows (no sync); the builder refuses a
cache that is not packed, rows with holes, and left padding that does not start on a page, and the step then runs
on the reference backend (``plan.py``), never on wrong indices. Inside CUDA graphs (`fixed`) the tables, the
lengths and the counter buffer are allocated before capture for the shape's worst case, and the kernel is given the
cache's capacity as its maximum length, so a replay reads only buffers that never move.

Sparse (DSA) layers take trtllm-gen's sparse MLA (``sparse_mla_top_k``) as vLLM's FlashInfer sparse backend calls
it: one kernel row per query token, ``block_tables [B * Sq, 1, topk]`` its selected cache slots (``b * pitch +
indices``: token ``j`` of sequence ``b`` sits at that flat slot of the packed pages), ``-1`` past the
``min(topk, visible)`` positions it may attend to and up to a width that is a multiple of 4 (the kernel's rule), and
that count as its ``seq_lens``; the per-step part (offsets, validity, counts) is built once, each layer adds its
indices.

Continuous batching's paged latent cache is read the same way (`_paged`): its rows are packed, and Transformers'
pages of 32 or 64 rows (or a multiple) give the block tables, gathered on the device from the step's read indices
(`gather_tables`). In a CUDA graph the slot holds each request's start in the read indices and its length, reloaded
before each replay; the gather runs inside the graph (`replayed`), over the whole padded read indices.

This path follows FlashInfer's documented contract but has not run on Blackwell hardware: no such GPU was
available to the project; a CPU stand-in checks the calls (``tests/test_kernels_trtllm.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..buffers import multi_ctas_kv_counter_buffer, workspace_buffer
from ..rows import to_device
from . import Refused, refuse_inexpressible

PAGE_SIZE = 64  # trtllm-gen takes 32 or 64 tokens per page
# The counter buffer is sized for at least this many query tokens (batch x tokens per sequence), then in powers of
# two: at 128 heads that is 512 KiB, so ordinary batches never re-size it and a larger one re-sizes it once per
# doubling, always before a CUDA graph that uses it is captured.
COUNTER_MIN_TOKENS = 1024


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
        and (kv_latent.shape[0] == 1 or kv_latent.stride(0) % (row * page_size) == 0)
        and kv_latent.storage_offset() % (row * page_size) == 0
    )
    if not packed:
        return None
    storage_rows = (kv_latent.untyped_storage().nbytes() // elem - kv_latent.storage_offset()) // row
    pages = storage_rows // page_size
    return kv_latent.as_strided((pages, page_size, row), (page_size * row, row, 1), kv_latent.storage_offset())


def counter_buffer(query_tokens: int, num_heads: int, device: torch.device) -> torch.Tensor:
    """The trtllm-gen counter buffer of `device`, big enough for `query_tokens` x `num_heads`.

    Sized for a worst case, not for this call: the token count is rounded up to a power of two, at least
    `COUNTER_MIN_TOKENS`, and the per-device buffer only ever grows. So a decode loop whose batch shrinks or
    fluctuates reuses one buffer, and the kernel, which resets every counter it used, never needs it re-zeroed.
    """
    from flashinfer.utils import get_device_sm_count, get_trtllm_gen_multi_ctas_kv_counter_bytes  # heavy import

    bucket = max(COUNTER_MIN_TOKENS, 1 << max(query_tokens - 1, 0).bit_length())
    need = get_trtllm_gen_multi_ctas_kv_counter_bytes(bucket, num_heads, get_device_sm_count(device))
    return multi_ctas_kv_counter_buffer(need, device)


@dataclass(eq=False)
class TrtllmMetadata:
    backend: str  # "trtllm-gen" or "cute-dsl"
    block_tables: torch.Tensor  # [B, pages] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int
    counter: torch.Tensor | None  # trtllm-gen only
    fixed: bool = False
    # sparse layers: (slot offset [B, Sq, 1], selectable [B, Sq, width]) on the device; seq_lens [B * Sq], per token;
    # max_seq_len: the width of each token's list (its picks, padded to a multiple of 4)
    sparse: tuple | None = None
    page_size: int = PAGE_SIZE  # rows per page of the tables (continuous batching: 32 where its pages hold 32)
    starts: torch.Tensor | None = None  # [B] int64: continuous batching in a CUDA graph, where each request's rows
    # begin in the step's read indices


def table_width(pages: int, page_size: int = PAGE_SIZE) -> int:
    """The block tables' width for rows of up to `pages` pages: FlashInfer's MLA decode with ``backend="auto"`` or
    ``"cute-dsl"`` asks for a multiple of 128 rows' worth of pages (``_check_mla_dense_page_mapping``); the kernel
    reads only a row's own pages, the rest repeats its last one."""
    step = 128 // page_size
    return max(step, -(-pages // step) * step)


def _host_tables(rows, layer, pages_per_row: int):
    """``(block_tables [B, pages_per_row], seq_lens [B])`` on the host for single-run rows starting on a page; a
    column past a row's pages repeats its last page of the cache."""
    if not layer.packed:
        raise Refused("the cache does not store the latent packed (pass cache=MLALatentCache(model.config))")
    if rows.first is None:
        raise Refused("the step's mask has holes (rows that are not one run of positions)")
    if bool((rows.first % PAGE_SIZE != 0).any()):
        raise Refused(f"left padding does not start on trtllm-gen's {PAGE_SIZE}-token pages")
    pitch_pages = layer.pitch // PAGE_SIZE
    start = torch.arange(rows.batch)[:, None] * pitch_pages
    pages = start + (rows.first // PAGE_SIZE)[:, None] + torch.arange(pages_per_row)[None, :]
    return torch.minimum(pages, start + pitch_pages - 1).to(torch.int32), rows.lens.to(torch.int32)


def build(backend: str, step, layer, into: TrtllmMetadata | None = None, staged=None) -> TrtllmMetadata:
    """Block tables and lengths of this step (`Refused` where the layout cannot be served); with `into` (a
    CUDA-graph slot's fixed metadata) they are copied into its buffers, stream-ordered."""
    if layer.sinks:
        raise Refused("FlashInfer's MLA decode kernels take no attention sinks")
    rows = step.rows()
    refuse_inexpressible(rows)
    if layer.topk:
        return _sparse(backend, rows, layer, into)
    if step.pages is not None:
        return _paged(backend, layer, rows, step.pages, into)
    if into is not None:
        tables, lens = _host_tables(rows, layer, into.block_tables.shape[1])
        into.block_tables.copy_(to_device(tables, layer.device), non_blocking=True)
        into.seq_lens.copy_(to_device(lens, layer.device), non_blocking=True)
        return into
    max_len = int(rows.lens.max()) if rows.batch else 0
    tables, lens = _host_tables(rows, layer, table_width(-(-max_len // PAGE_SIZE)))
    counter = counter_buffer(rows.batch * rows.q_len, layer.heads, layer.device) if backend == "trtllm-gen" else None
    return TrtllmMetadata(backend, to_device(tables, layer.device), to_device(lens, layer.device), max_len, counter)


def _sparse(backend: str, rows, layer, into) -> TrtllmMetadata:
    """A sparse step, one kernel row per query token as vLLM's FlashInfer sparse backend runs it
    (``flashinfer_mla_sparse.py``): its slot offset, which of its `topk` picks it may attend to (the first
    ``min(topk, visible)``: Transformers' indexers rank hidden positions last) and that count as its ``seq_lens``, so
    the kernel never reads past a token's valid picks; on the host, copied once."""
    if into is not None or backend != "trtllm-gen":
        raise Refused(f"sparse decode runs on trtllm-gen only and uncompiled (this step: {backend}"
                      f"{', in a CUDA graph' if into is not None else ''})")
    if not layer.packed:
        raise Refused("the cache does not store the latent packed (pass cache=MLALatentCache(model.config))")
    counts = rows.token_rows(layer.topk).lens  # [B * Sq]
    # The kernel reads a token's picks 16 bytes at a time: its list is a multiple of 4 wide (FlashInfer checks
    # `SparseMlaTopK % 4 == 0` in its C++ launcher), and an indexer's list is only `min(index_topk, cached)` wide.
    width = -(-layer.topk // 4) * 4
    selectable = torch.arange(width, dtype=torch.int32) < counts.view(rows.batch, rows.q_len, 1)
    offsets = (torch.arange(rows.batch, dtype=torch.int32) * layer.pitch).view(-1, 1, 1).expand(-1, rows.q_len, 1)
    counter = counter_buffer(rows.batch * rows.q_len, layer.heads, layer.device)
    return TrtllmMetadata(backend, None, to_device(counts, layer.device), width, counter,
                          sparse=(to_device(offsets.contiguous(), layer.device), to_device(selectable, layer.device)))


def _paged(backend: str, layer, rows, pages, into: TrtllmMetadata | None) -> TrtllmMetadata:
    """Continuous batching's decode requests over Transformers' paged latent cache: request ``r``'s rows (`pages`,
    a ``rows.PageTable``) run on within each of Transformers' pages of ``pages.page_rows`` rows. With pages of 64
    (or 32) rows dividing those, the ``c``-th page of the request is the one holding the row of its token ``c * 64``
    (`gather_tables`); with `into` (a CUDA-graph slot) only the starts and lengths are written, stream-ordered."""
    if not layer.packed:
        raise Refused("the paged cache does not store the latent packed (its rows are wider than rank + rope)")
    size = _paged_page_size(pages.page_rows)
    starts = to_device(pages.offsets, layer.device)
    lens = to_device(rows.lens.to(torch.int32), layer.device)
    if into is not None:
        into.starts.copy_(starts, non_blocking=True)
        into.seq_lens.copy_(lens, non_blocking=True)
        return into
    max_len = int(rows.lens.max())
    tables = gather_tables(pages, starts, lens, table_width(-(-max_len // size), size), size)
    counter = counter_buffer(rows.batch, layer.heads, layer.device) if backend == "trtllm-gen" else None
    return TrtllmMetadata(backend, tables, lens, max_len, counter, page_size=size)


def _paged_page_size(page_rows: int) -> int:
    size = next((p for p in (PAGE_SIZE, 32) if page_rows and page_rows % p == 0), None)
    if size is None:
        raise Refused(f"continuous batching's pages of {page_rows} tokens are not a multiple of trtllm-gen's "
                      "32 or 64 (ContinuousBatchingConfig(page_size=...))")
    return size


def gather_tables(pages, starts: torch.Tensor, lens: torch.Tensor, width: int, size: int) -> torch.Tensor:
    """``[B, width]`` int32 block tables of pages of `size` rows, on the device: column ``c`` of request ``r`` is
    the page of its row ``c * size`` (past its rows: its last row's page, never read)."""
    token = starts[:, None] + torch.arange(width, device=starts.device)[None, :] * size
    token = torch.minimum(token, (starts + lens - 1)[:, None])
    return (pages.typed(torch.long)[token] // size).to(torch.int32)


def replayed(meta: TrtllmMetadata, pages) -> TrtllmMetadata:
    """A continuous-batching CUDA-graph slot's metadata for this forward, computed on the device from the slot's
    starts and lengths: captured once, it gathers each replayed step's tables. The forward's padded read indices
    (fixed per graph) bound every request's length."""
    size, rows = _paged_page_size(pages.page_rows), pages.typed(torch.long).numel()
    tables = gather_tables(pages, meta.starts, meta.seq_lens, table_width(-(-rows // size), size), size)
    return dataclasses.replace(meta, block_tables=tables, max_seq_len=rows, page_size=size)


def fixed(backend: str, layer, batch: int, q_len: int) -> TrtllmMetadata:
    """Fixed-address metadata for a CUDA-graph slot: tables over the cache's whole capacity, the capacity as the
    maximum length (continuous batching: each request's start instead, see `replayed`), and the device's counter
    buffer grown now, before capture, for this shape."""
    if not layer.packed:  # (packed_pages already proved every sequence starts on a page)
        raise Refused("the cache does not store the latent packed (pass cache=MLALatentCache(model.config))")
    i32 = dict(dtype=torch.int32, device=layer.device)
    counter = counter_buffer(batch * q_len, layer.heads, layer.device) if backend == "trtllm-gen" else None
    return TrtllmMetadata(backend, torch.zeros(batch, table_width(-(-layer.pitch // PAGE_SIZE)), **i32),
                          torch.zeros(batch, **i32), layer.pitch, counter, fixed=True,
                          starts=torch.zeros(batch, dtype=torch.long, device=layer.device))


def refusal_for_every_step(layer, batch: int, q_len: int) -> str | None:
    return None  # trtllm-gen's refusals are layout refusals, raised by `fixed` and `build`


def run(meta: TrtllmMetadata, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None, indices=None) -> torch.Tensor:
    """The kernel call on trtllm-gen (or cute-dsl); ``kernels/__init__.py`` gives the operands' layouts."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla  # heavy import

    h, n, _ = q_lat.shape
    b = meta.seq_lens.shape[0]  # (sparse: one row per query token)
    query = torch.cat([q_lat.transpose(0, 1), q_pe], dim=-1).view(b, n // b, h, -1)  # [B, Sq, H, L + R]
    if meta.backend == "cute-dsl":
        kernel = {"backend": "cute-dsl"}  # takes no counter buffer (FlashInfer raises if given one)
    else:
        # "auto" lets FlashInfer tune between its runners; the counter is what the trtllm-gen runner counts in.
        kernel = {"backend": "auto", "multi_ctas_kv_counter_buffer": meta.counter}
    tables = meta.block_tables
    if layer.topk:
        offsets, selectable = meta.sparse  # [B, Sq, 1], [B, Sq, width]
        if meta.max_seq_len > layer.topk:  # (padded to the kernel's width: the extra picks are never selectable)
            indices = torch.nn.functional.pad(indices, (0, meta.max_seq_len - layer.topk))
        tables = torch.where(selectable, indices + offsets, -1).to(torch.int32).view(n, 1, -1)  # [B*Sq, 1, width]
        kernel["sparse_mla_top_k"] = meta.max_seq_len
    out = trtllm_batch_decode_with_kv_cache_mla(
        query=query,
        kv_cache=packed_pages(kv_latent, k_rot, meta.page_size),
        workspace_buffer=workspace_buffer(layer.device),
        qk_nope_head_dim=layer.rank,  # unused by the dense path; the absorbed query is kv_lora_rank wide
        kv_lora_rank=layer.rank,
        qk_rope_head_dim=layer.rope,
        block_tables=tables,
        seq_lens=meta.seq_lens,
        max_seq_len=meta.max_seq_len,
        bmm1_scale=layer.scale,  # a Python float: a captured graph holds it as a constant
        bmm2_scale=1.0,
        **kernel,
    )  # [B, Sq, H, L]
    return out.view(n, h, -1).transpose(0, 1)
