"""Blackwell decode helpers that run without a GPU: the head-count rule, the counter buffer, the packed-page view
and the block tables (`hf_flashinfer_mla.trtllm`, `hf_flashinfer_mla.buffers`)."""

from __future__ import annotations

import logging

import pytest
import torch
from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

import hf_flashinfer_mla
from hf_flashinfer_mla import MLALatentLayer, buffers, trtllm
from hf_flashinfer_mla.metadata import StepPlan
from hf_flashinfer_mla.trtllm import (
    _block_tables,
    multi_ctas_kv_counter_buffer,
    packed_pages,
    select_decode_backend,
    trtllm_gen_supports_num_heads,
)

RANK, ROPE, ROW, PAGE = 512, 64, 576, 64
CPU = torch.device("cpu")
META = torch.device("meta")


def expected_supported(h: int) -> bool:
    """Independent statement of trtllm-gen's tiling rule."""
    if h <= 8:
        tile = 8
    elif h <= 32:
        tile = 16
    else:
        tile = 64
    return h % min(h, tile) == 0


# ---------------------------------------------------------------------------------------------------- head counts


@pytest.mark.parametrize("h", range(1, 257))
def test_supports_num_heads_every_count(h):
    assert trtllm_gen_supports_num_heads(h) is expected_supported(h)


def test_supports_num_heads_spot_checks():
    for h in (16, 48, 64, 128):
        assert trtllm_gen_supports_num_heads(h), h
    for h in (24, 96):
        assert not trtllm_gen_supports_num_heads(h), h
    # Up to 8 heads every count fits one tile; a few more cases of the rule.
    assert all(trtllm_gen_supports_num_heads(h) for h in range(1, 9))
    assert [h for h in range(9, 33) if trtllm_gen_supports_num_heads(h)] == [*range(9, 17), 32]
    assert all(trtllm_gen_supports_num_heads(h) for h in range(33, 65))
    assert [h for h in range(65, 257) if trtllm_gen_supports_num_heads(h)] == [128, 192, 256]
    assert trtllm_gen_supports_num_heads(0) is False


def test_exported_from_package():
    assert hf_flashinfer_mla.trtllm_gen_supports_num_heads is trtllm_gen_supports_num_heads
    assert hf_flashinfer_mla.select_decode_backend is select_decode_backend
    assert hf_flashinfer_mla.multi_ctas_kv_counter_buffer is buffers.multi_ctas_kv_counter_buffer


@pytest.fixture
def clean_cute_warning():
    trtllm._warn_cute_dsl.cache_clear()
    yield
    trtllm._warn_cute_dsl.cache_clear()


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "hf_flashinfer_mla" and r.levelno >= logging.WARNING]


def test_select_decode_backend_all_counts(caplog, clean_cute_warning):
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    for h in range(1, 257):
        assert select_decode_backend(h) == (None if expected_supported(h) else "cute-dsl"), h
    unsupported = [h for h in range(1, 257) if not expected_supported(h)]
    warns = _warnings(caplog)
    assert len(warns) == len(unsupported)
    for h, record in zip(unsupported, warns):
        assert f"{h} query heads" in record.getMessage()
        assert "cute-dsl" in record.getMessage()


def test_select_decode_backend_warns_once_per_count(caplog, clean_cute_warning):
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    assert select_decode_backend(96) == "cute-dsl"
    assert select_decode_backend(96) == "cute-dsl"
    assert len(_warnings(caplog)) == 1
    assert select_decode_backend(24) == "cute-dsl"
    assert select_decode_backend(24) == "cute-dsl"
    assert select_decode_backend(96) == "cute-dsl"
    msgs = [r.getMessage() for r in _warnings(caplog)]
    assert len(msgs) == 2 and "96 query heads" in msgs[0] and "24 query heads" in msgs[1]
    caplog.clear()
    for h in (16, 48, 64, 128):
        assert select_decode_backend(h) is None
    assert _warnings(caplog) == []


# ---------------------------------------------------------------------------------------------------- counter buffer


@pytest.fixture
def clean_counters():
    saved = dict(buffers._counters)
    buffers._counters.clear()
    yield
    buffers._counters.clear()
    buffers._counters.update(saved)


def test_counter_zero_initialised_uint8(clean_counters):
    buf = multi_ctas_kv_counter_buffer(4096, CPU)
    assert buf.dtype == torch.uint8
    assert buf.device.type == "cpu"
    assert buf.dim() == 1 and buf.numel() >= 4096
    assert torch.count_nonzero(buf) == 0


def test_counter_reused_for_equal_or_smaller(clean_counters):
    buf = multi_ctas_kv_counter_buffer(1024, CPU)
    ptr = buf.data_ptr()
    for size in (1024, 1000, 512, 8, 1, 0):
        again = multi_ctas_kv_counter_buffer(size, CPU)
        assert again is buf
        assert again.data_ptr() == ptr
    # Accepts the device as a string as well.
    assert multi_ctas_kv_counter_buffer(16, "cpu") is buf


def test_counter_is_not_rezeroed_on_reuse(clean_counters):
    """It is zeroed once at allocation, never per call (the kernel resets what it used)."""
    buf = multi_ctas_kv_counter_buffer(64, CPU)
    buf[3] = 7
    again = multi_ctas_kv_counter_buffer(64, CPU)
    assert again is buf and int(again[3]) == 7


def test_counter_grows_when_more_is_asked(clean_counters):
    small = multi_ctas_kv_counter_buffer(256, CPU)
    small.fill_(5)  # dirty the old one: the grown buffer must still be zeroed
    big = multi_ctas_kv_counter_buffer(4096, CPU)
    assert big is not small
    assert big.numel() >= 4096
    assert big.dtype == torch.uint8
    assert torch.count_nonzero(big) == 0
    ptr = big.data_ptr()
    # After growth, smaller and equal requests return the grown buffer, never a new one.
    for size in (256, 1, 4096, 2048, 4096):
        again = multi_ctas_kv_counter_buffer(size, CPU)
        assert again is big and again.data_ptr() == ptr
    assert buffers._counters[CPU] is big


def test_counter_zero_request_gives_nonempty_buffer(clean_counters):
    buf = multi_ctas_kv_counter_buffer(0, CPU)
    assert buf.numel() >= 1 and buf.dtype == torch.uint8


def test_counter_per_device(clean_counters):
    cpu_buf = multi_ctas_kv_counter_buffer(128, CPU)
    meta_buf = multi_ctas_kv_counter_buffer(128, META)
    assert cpu_buf.device.type == "cpu" and meta_buf.device.type == "meta"
    assert meta_buf is not cpu_buf
    assert meta_buf.dtype == torch.uint8
    # Growing one device's buffer leaves the other's alone.
    meta_big = multi_ctas_kv_counter_buffer(8192, META)
    assert meta_big.numel() >= 8192
    assert multi_ctas_kv_counter_buffer(128, CPU) is cpu_buf
    assert cpu_buf.numel() < 8192
    assert multi_ctas_kv_counter_buffer(64, META) is meta_big
    assert set(buffers._counters) == {CPU, META}


def test_counter_cuda_devices_kept_apart_without_gpu(clean_counters, monkeypatch):
    """Per-device separation for two CUDA indices, with the allocation substituted (no GPU here)."""
    real_zeros = torch.zeros
    allocated = []

    def fake_zeros(*size, dtype=None, device=None):
        assert torch.device(device).type == "cuda"
        t = real_zeros(*size, dtype=dtype, device="cpu")
        allocated.append((torch.device(device), t))
        return t

    monkeypatch.setattr(buffers.torch, "zeros", fake_zeros)
    monkeypatch.setattr(buffers.torch.cuda, "current_device", lambda: 1)
    a = multi_ctas_kv_counter_buffer(100, torch.device("cuda", 0))
    b = multi_ctas_kv_counter_buffer(100, torch.device("cuda", 1))
    assert a is not b
    # "cuda" without an index means the current device (patched to 1).
    assert multi_ctas_kv_counter_buffer(50, "cuda") is b
    assert multi_ctas_kv_counter_buffer(50, "cuda:0") is a
    assert [d for d, _ in allocated] == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize(
    "batch, heads, sm_count", [(1, 16, 148), (8, 128, 148), (64, 128, 132), (256, 96, 148), (3, 24, 160)]
)
def test_counter_sized_by_flashinfer(clean_counters, batch, heads, sm_count):
    need = get_trtllm_gen_multi_ctas_kv_counter_bytes(batch, heads, sm_count)
    assert need > 0
    buf = multi_ctas_kv_counter_buffer(need, CPU)
    assert buf.numel() * buf.element_size() >= need
    assert torch.count_nonzero(buf) == 0


def test_counter_sized_for_worst_case_then_reused(clean_counters):
    sizes = [get_trtllm_gen_multi_ctas_kv_counter_bytes(b, 128, 148) for b in (64, 1, 8, 32, 64)]
    first = multi_ctas_kv_counter_buffer(sizes[0], CPU)
    for size in sizes[1:]:
        assert multi_ctas_kv_counter_buffer(size, CPU) is first


# ---------------------------------------------------------------------------------------------------- packed pages


def _filled_layer(batch, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = MLALatentLayer(packed=True)  # the layout trtllm-gen reads (the default on Blackwell)
    kvs, rots = [], []
    for n in steps:
        kv = torch.randn(batch, 1, n, RANK, generator=g)
        rot = torch.randn(batch, 1, n, ROPE, generator=g)
        layer.update(kv, rot)
        kvs.append(kv)
        rots.append(rot)
    latent = torch.cat([torch.cat(kvs, 2), torch.cat(rots, 2)], -1)  # [B, 1, S, 576]
    return layer, latent


@pytest.mark.parametrize("batch, steps", [(1, [5]), (3, [7, 1, 1]), (2, [300, 1]), (4, [64]), (2, [256, 1, 1])])
def test_packed_pages_of_latent_layer(batch, steps):
    layer, latent = _filled_layer(batch, steps)
    pages = packed_pages(layer.keys, layer.values)
    assert pages is not None
    pitch = layer._buffer.shape[2]  # capacity
    assert pitch % PAGE == 0
    assert pages.dim() == 3 and pages.shape[1:] == (PAGE, ROW)
    assert pages.shape[0] == batch * pitch // PAGE
    # A view of the cache storage, not a copy.
    assert pages.data_ptr() == layer.keys.data_ptr()
    assert pages.untyped_storage().data_ptr() == layer._buffer.untyped_storage().data_ptr()
    rows = pages.reshape(-1, ROW)
    s = latent.shape[2]
    for b in range(batch):
        for j in range(s):
            assert torch.equal(rows[b * pitch + j], latent[b, 0, j]), (b, j)
    # Vectorised restatement over all tokens.
    idx = (torch.arange(batch)[:, None] * pitch + torch.arange(s)[None, :]).reshape(-1)
    assert torch.equal(rows[idx], latent[:, 0].reshape(-1, ROW))


def test_packed_pages_is_a_live_view():
    layer, _ = _filled_layer(2, [10])
    pages = packed_pages(layer.keys, layer.values)
    pitch = layer._buffer.shape[2]
    kv = torch.full((2, 1, 1, RANK), 3.0)
    rot = torch.full((2, 1, 1, ROPE), -2.0)
    layer.update(kv, rot)  # capacity suffices: written in place
    rows = pages.view(-1, ROW)
    assert torch.equal(rows[pitch + 10, :RANK], kv[1, 0, 0])
    assert torch.equal(rows[pitch + 10, RANK:], rot[1, 0, 0])


def test_packed_pages_none_for_separate_tensors():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 1, 128, RANK, generator=g)
    rot = torch.randn(2, 1, 128, ROPE, generator=g)
    assert packed_pages(kv, rot) is None
    # DynamicLayer-style concatenation over steps: still two separate tensors.
    kv2 = torch.cat([kv, torch.randn(2, 1, 1, RANK, generator=g)], 2)
    rot2 = torch.cat([rot, torch.randn(2, 1, 1, ROPE, generator=g)], 2)
    assert packed_pages(kv2, rot2) is None


def test_packed_pages_none_when_sequences_not_page_aligned():
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(2, 1, 100, ROW, generator=g)  # pitch 100 rows: not a multiple of 64
    assert packed_pages(buf[..., :RANK], buf[..., RANK:]) is None
    # Rope not right after the latent in the row.
    buf = torch.randn(2, 1, 128, ROW + 8, generator=g)
    assert packed_pages(buf[..., :RANK], buf[..., RANK + 8 :]) is None


def test_packed_pages_of_page_aligned_packed_tensor():
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 1, 128, ROW, generator=g)
    pages = packed_pages(buf[:, :, :70, :RANK], buf[:, :, :70, RANK:])
    assert pages is not None and pages.shape == (4, PAGE, ROW)
    assert torch.equal(pages.reshape(2, 128, ROW), buf[:, 0])


# ---------------------------------------------------------------------------------------------------- block tables


def _plan(valid: torch.Tensor) -> StepPlan:
    return StepPlan(valid[:, None, None, :].clone())


def test_block_tables_unpadded():
    pitch_pages = 4
    s = 150
    valid = torch.ones(3, s, dtype=torch.bool)
    out = _block_tables(_plan(valid), CPU, pitch_pages, PAGE)
    assert not isinstance(out, str)
    tables, seq_lens, max_len = out
    assert tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert max_len == s
    assert seq_lens.tolist() == [s, s, s]
    n = -(-s // PAGE)
    assert tables.shape == (3, n)
    assert tables.tolist() == [[b * pitch_pages + i for i in range(n)] for b in range(3)]


def test_block_tables_unequal_lengths_right_side():
    """Sequences of different lengths that start at row 0 (a static cache's unfilled tail is masked)."""
    pitch_pages = 8
    lengths = [1, 64, 65, 300]
    s = 320
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    tables, seq_lens, max_len = _block_tables(_plan(valid), CPU, pitch_pages, PAGE)
    assert seq_lens.tolist() == lengths
    assert max_len == 300
    n = -(-300 // PAGE)
    assert tables.shape == (4, n)
    for b in range(4):
        assert tables[b].tolist() == [b * pitch_pages + i for i in range(n)]


def test_block_tables_left_padding_page_aligned():
    pitch_pages = 6
    s = 320
    starts = [0, 64, 128, 256]
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    out = _block_tables(_plan(valid), CPU, pitch_pages, PAGE)
    assert not isinstance(out, str)
    tables, seq_lens, max_len = out
    lens = [s - st for st in starts]
    assert seq_lens.tolist() == lens
    assert max_len == max(lens)
    n = -(-max(lens) // PAGE)
    assert tables.shape == (4, n)
    for b, st in enumerate(starts):
        first_page = b * pitch_pages + st // PAGE
        assert tables[b, 0].item() == first_page
        # The pages holding this sequence's tokens, in order.
        needed = -(-lens[b] // PAGE)
        assert tables[b, :needed].tolist() == [first_page + i for i in range(needed)]


def test_block_tables_left_padding_tokens_land_on_table_pages():
    """Cross-check against packed_pages: the rows the table points at are the sequence's valid tokens."""
    batch, s = 2, 200
    layer, latent = _filled_layer(batch, [s])
    pages = packed_pages(layer.keys, layer.values)
    pitch = layer._buffer.shape[2]
    starts = [64, 0]
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    tables, seq_lens, _ = _block_tables(_plan(valid), CPU, pitch // PAGE, PAGE)
    for b in range(batch):
        n = int(seq_lens[b])
        gathered = pages[tables[b].long()].reshape(-1, ROW)[:n]
        assert torch.equal(gathered, latent[b, 0, starts[b] :])


@pytest.mark.parametrize("starts", [[0, 3], [1, 1], [63, 0], [65, 128]])
def test_block_tables_left_padding_not_aligned_is_a_reason(starts):
    s = 200
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    out = _block_tables(_plan(valid), CPU, 4, PAGE)
    assert isinstance(out, str)
    assert "page" in out and "aligned" in out


def test_block_tables_hole_in_mask_is_a_reason():
    valid = torch.ones(2, 128, dtype=torch.bool)
    valid[1, 70] = False  # not one contiguous run: no table can describe it
    out = _block_tables(_plan(valid), CPU, 2, PAGE)
    assert isinstance(out, str)


def test_block_tables_from_decode_mask_last_query_row():
    """A causal multi-token mask: the tables follow what the last query token sees."""
    s, q = 130, 3
    mask = torch.zeros(2, 1, q, s, dtype=torch.bool)
    for i in range(q):
        mask[:, 0, i, : s - q + 1 + i] = True
    mask[1, 0, :, :64] = False  # aligned left padding on sequence 1
    tables, seq_lens, max_len = _block_tables(StepPlan(mask), CPU, 3, PAGE)
    assert seq_lens.tolist() == [s, s - 64]
    assert max_len == s
    assert tables[0, 0].item() == 0 and tables[1, 0].item() == 3 + 1


def test_block_tables_additive_mask():
    s = 128
    valid = torch.arange(s)[None, :] >= torch.tensor([0, 64])[:, None]
    additive = torch.zeros(2, 1, 1, s)
    additive[~valid[:, None, None, :]] = torch.finfo(torch.float32).min
    tables, seq_lens, max_len = _block_tables(StepPlan(additive), CPU, 2, PAGE)
    assert seq_lens.tolist() == [128, 64]
    assert tables[:, 0].tolist() == [0, 3]
