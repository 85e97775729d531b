"""Blackwell decode that runs without a GPU: the head-count rule (`capabilities`), the counter buffer
(`kernels.trtllm`, `buffers`), the packed-page view, the block tables built from a step's host rows
(`trtllm.build` / `trtllm.fixed`), the step's route when trtllm-gen declines it (`plan.StepPlan.route`), and the call
into FlashInfer, checked by `fake_flashinfer.FakeTrtllm`: a stand-in for
``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` that applies FlashInfer's documented contract and its own
argument checks, then computes the attention exactly (float64) through the packed pages and block tables it is given.
"""

from __future__ import annotations

import logging

import flashinfer.utils
import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import (
    VOCAB, assert_batch_matches_eager_alone, assert_same_outputs, decode_logits, generation_mode, left_padded_batch,
    make_model, mla_layers, package_warnings, rel_err,
)
from fake_flashinfer import SM_COUNT, FakeTrtllm, blackwell, fake_blackwell, fake_hopper, fresh_caches  # noqa: F401
from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import _trtllm_gen_mla_incompatibility_reason
from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes

from transformers import DynamicCache

import hf_flashinfer_mla
from hf_flashinfer_mla import MLALatentLayer, buffers, capabilities
from hf_flashinfer_mla.buffers import multi_ctas_kv_counter_buffer
from hf_flashinfer_mla.capabilities import trtllm_gen_supports_num_heads
from hf_flashinfer_mla.kernels import Layer, Refused, trtllm
from hf_flashinfer_mla.kernels.reference import mla_attention_reference
from hf_flashinfer_mla.kernels.trtllm import packed_pages
from hf_flashinfer_mla.plan import StepPlan, decode_latent
from hf_flashinfer_mla.rows import Rows

RANK, ROPE, ROW, PAGE = 512, 64, 576, 64
CPU = torch.device("cpu")
META = torch.device("meta")


# ---------------------------------------------------------------------------------------------------- head counts


# Written out by hand (not computed from the rule), from vLLM's FlashInfer MLA backend.
TILEABLE = [1, 2, 4, 7, 8, 9, 12, 15, 16, 32, 33, 40, 48, 63, 64, 128, 192, 256]
NOT_TILEABLE = [0, 17, 20, 24, 31, 65, 80, 96, 100, 127, 129, 160, 255]


@pytest.mark.parametrize("h", TILEABLE)
def test_tileable_head_counts(h):
    assert trtllm_gen_supports_num_heads(h) is True


@pytest.mark.parametrize("h", NOT_TILEABLE)
def test_untileable_head_counts(h):
    assert trtllm_gen_supports_num_heads(h) is False


def test_rule_never_sends_flashinfer_a_head_count_it_refuses():
    """FlashInfer's own trtllm-gen eligibility (64 < heads < 128 refused) must imply ours: no count we call tileable
    may be one FlashInfer rejects for a 64-token page."""
    refused = [h for h in range(1, 257) if _trtllm_gen_mla_incompatibility_reason(num_heads_q=h, block_size=PAGE)]
    assert refused == list(range(65, 128))  # what FlashInfer 0.7.4 says, so the comparison below is not vacuous
    assert not [h for h in refused if trtllm_gen_supports_num_heads(h)]


def test_exported_from_package():
    assert hf_flashinfer_mla.trtllm_gen_supports_num_heads is capabilities.trtllm_gen_supports_num_heads
    assert hf_flashinfer_mla.multi_ctas_kv_counter_buffer is buffers.multi_ctas_kv_counter_buffer


# ---------------------------------------------------------------------------------------------------- counter buffer


@pytest.fixture
def clean_counters():
    fresh_caches()
    yield
    fresh_caches()


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
    assert buffers.held(CPU)["counter"] is big


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
    assert buffers.held(CPU)["counter"] is cpu_buf and buffers.held(META)["counter"] is meta_big


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


@pytest.fixture
def sm_count(monkeypatch):
    """FlashInfer's SM-count query, answered without a GPU."""
    asked = []

    def fake(device):
        asked.append(device)
        return SM_COUNT

    monkeypatch.setattr(flashinfer.utils, "get_device_sm_count", fake)
    return asked


def test_counter_buffer_sized_for_a_worst_case_and_kept(clean_counters, sm_count):
    small = trtllm.counter_buffer(1, 128, CPU)  # one query token: sized for COUNTER_MIN_TOKENS all the same
    assert small.numel() == get_trtllm_gen_multi_ctas_kv_counter_bytes(trtllm.COUNTER_MIN_TOKENS, 128, 148)
    for tokens, heads in [(64, 128), (1024, 128), (7, 16), (1000, 96), (3, 128)]:
        assert trtllm.counter_buffer(tokens, heads, CPU) is small, (tokens, heads)
    big = trtllm.counter_buffer(1025, 128, CPU)  # past the bucket: the next power of two, once
    assert big.numel() == get_trtllm_gen_multi_ctas_kv_counter_bytes(2048, 128, 148)
    for tokens in (1025, 1500, 2048, 1, 512):
        assert trtllm.counter_buffer(tokens, 128, CPU) is big
    assert sm_count and all(d == CPU for d in sm_count)


# ---------------------------------------------------------------------------------------------------- the kernel call


def _left_padded_mask(starts, s, q_len=1) -> torch.Tensor:
    """``[B, 1, q_len, s]`` causal decode mask of rows ``[start_b, s)`` (query ``j`` sees up to ``s - q_len + j``)."""
    mask = torch.zeros(len(starts), 1, q_len, s, dtype=torch.bool)
    for i, start in enumerate(starts):
        for j in range(q_len):
            mask[i, 0, j, start : s - q_len + 1 + j] = True
    return mask


@pytest.mark.parametrize("requested, heads, backend", [
    ("trtllm-gen", 16, "trtllm-gen"), ("cute-dsl", 96, "cute-dsl"), ("cute-dsl", 16, "cute-dsl"),
    ("trtllm-gen", 128, "trtllm-gen"), ("cute-dsl", 24, "cute-dsl"), ("auto", 16, "trtllm-gen"),
    ("auto", 96, "cute-dsl"),
])
@pytest.mark.parametrize("q_len", [1, 3])
def test_trtllm_decode_call_contract(monkeypatch, caplog, requested, heads, backend, q_len):
    """A step routed to trtllm-gen or cute-dsl (`plan.decode_latent`, as the attention routes a layer) makes one
    FlashInfer call per layer with the contract `FakeTrtllm` checks: the packed pages of the cache itself, block
    tables and lengths of the step's rows, the counter buffer for trtllm-gen only; and computes the reference's
    attention."""
    kernel = blackwell(monkeypatch, torch.float32, (RANK, ROPE))
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    g = torch.Generator().manual_seed(heads + q_len)
    starts, s = [0, 64, 0], 150  # left padding aligned to trtllm-gen's pages
    layer, _ = _filled_layer(len(starts), [s], seed=heads)
    kv_latent, k_rot = layer.keys, layer.values
    mask = _left_padded_mask(starts, s, q_len)
    q_lat = torch.randn(len(starts), heads, q_len, RANK, generator=g) * 0.05
    q_pe = torch.randn(len(starts), heads, q_len, ROPE, generator=g) * 0.05
    step = StepPlan(mask)
    out = decode_latent(step, requested, q_lat, q_pe, kv_latent, k_rot, 0.1)
    (route,) = step.routes.values()
    assert route.backend == backend
    assert len(kernel.calls) == 1
    call = kernel.calls[0]
    assert call["heads"] == heads and call["batch"] == len(starts) and call["q_len"] == q_len
    if backend == "cute-dsl":
        assert call["backend"] == "cute-dsl" and call["counter"] is None
        assert "counter" not in buffers.held(CPU)  # cute-dsl never allocates one
    else:
        assert call["backend"] == "auto" and call["counter"] is buffers.held(CPU)["counter"]
    # The kernel read the cache's own storage (no copy), through tables of the step's rows.
    assert call["kv_storage"] == layer._buffer.untyped_storage().data_ptr()
    lens = [s - st for st in starts]
    pitch_pages = layer._buffer.shape[2] // PAGE
    assert call["seq_lens"].tolist() == lens and call["max_seq_len"] == max(lens)
    pages = -(-max(lens) // PAGE)
    assert call["tables"].shape[1] == max(2, -(-pages // 2) * 2)  # (128 rows' worth of pages: FlashInfer's rule)
    assert call["tables"][:, :pages].tolist() == [[b * pitch_pages + st // PAGE + i for i in range(pages)]
                                                  for b, st in enumerate(starts)]
    assert all(b * pitch_pages <= p < (b + 1) * pitch_pages  # (columns past the rows' pages: their own last page)
               for b, row in enumerate(call["tables"].tolist()) for p in row)
    assert call["scale"] == 0.1
    ref = mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, mask, 0.1)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    assert [m for m in package_warnings(caplog) if "declines" in m] == []


def test_fake_rejects_what_flashinfer_rejects(monkeypatch, clean_counters, sm_count):
    """Control: the stand-in raises, as FlashInfer does, for a counter given with cute-dsl and for a counter sized
    for too few query tokens, and for what the contract excludes: an unpacked cache, a scale
    given as a tensor, a length its table does not cover, int64 tables, and trtllm-gen without the package's
    counter."""
    fake = FakeTrtllm()
    layer, _ = _filled_layer(1, [64])
    pages = packed_pages(layer.keys, layer.values)
    args = dict(query=torch.zeros(1, 1, 96, ROW), kv_cache=pages, workspace_buffer=torch.zeros(8, dtype=torch.uint8),
                qk_nope_head_dim=RANK, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                block_tables=torch.zeros(1, 2, dtype=torch.int32), seq_lens=torch.tensor([64], dtype=torch.int32),
                max_seq_len=64, bmm1_scale=0.1, bmm2_scale=1.0)
    counter = torch.zeros(get_trtllm_gen_multi_ctas_kv_counter_bytes(1, 96, 148), dtype=torch.uint8)
    with pytest.raises(ValueError, match="trtllm-gen runner"):
        fake(**args, backend="cute-dsl", multi_ctas_kv_counter_buffer=counter)
    with pytest.raises(ValueError, match="trtllm-gen runner"):
        fake(**args, backend="auto", multi_ctas_kv_counter_buffer=counter)  # 96 heads: no trtllm-gen runner
    fake(**args, backend="cute-dsl")
    args["query"] = torch.zeros(1, 1, 128, ROW)
    with pytest.raises(ValueError, match="too small"):
        fake(**args, backend="auto", multi_ctas_kv_counter_buffer=torch.zeros(16, dtype=torch.uint8))
    good = trtllm.counter_buffer(1, 128, CPU)
    fake(**args, backend="auto", multi_ctas_kv_counter_buffer=good)
    with pytest.raises(AssertionError, match="counter"):
        fake(**args, backend="auto")
    split = torch.zeros(1, PAGE, ROW + 8)[..., :ROW]  # rows not adjacent
    bad = [dict(kv_cache=split), dict(bmm1_scale=torch.tensor(0.1)), dict(max_seq_len=torch.tensor(64)),
           dict(seq_lens=torch.tensor([65], dtype=torch.int32), max_seq_len=65),
           dict(block_tables=torch.zeros(1, 2, dtype=torch.int64)),
           dict(block_tables=torch.zeros(1, 1, dtype=torch.int32)),  # not 128 rows' worth of pages
           dict(block_tables=torch.full((1, 2), pages.shape[0], dtype=torch.int32))]  # a page past the cache
    for change in bad:
        with pytest.raises(AssertionError):
            fake(**{**args, **change}, backend="auto", multi_ctas_kv_counter_buffer=good)
    assert len(fake.calls) == 2  # only the accepted calls ran


# ---------------------------------------------------------------------------------------------------- packed pages


def _filled_layer(batch, steps, seed=0, packed=True):
    g = torch.Generator().manual_seed(seed)
    layer = MLALatentLayer(packed=packed)  # packed: the layout trtllm-gen reads (the default on Blackwell)
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
    # The split layout of MLALatentLayer (Hopper, Ampere, CPU).
    layer, _ = _filled_layer(2, [10], packed=False)
    assert packed_pages(layer.keys, layer.values) is None


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


def _layer(pitch: int, packed: bool = True, device=CPU, heads: int = 16) -> Layer:
    return Layer(device, torch.float32, torch.float32, heads, RANK, ROPE, pitch, packed, 0.1)


def _tables(mask: torch.Tensor, pitch_pages: int):
    """``(block_tables, seq_lens, max_seq_len)`` that `trtllm.build` makes for the step of `mask` (rows read off the
    mask) on a packed cache of `pitch_pages` pages per sequence."""
    meta = trtllm.build("trtllm-gen", StepPlan(mask), _layer(pitch_pages * PAGE))
    assert meta.backend == "trtllm-gen" and not meta.fixed
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.counter is buffers.held(CPU)["counter"]
    # FlashInfer's rule for backend "auto": 128 rows' worth of pages (two of 64); columns past the longest row's
    # pages repeat a page of the row's own (never read). The tables are returned without them.
    pages = -(-meta.max_seq_len // PAGE)
    tables = meta.block_tables
    assert tables.shape[1] == max(2, -(-pages // 2) * 2)
    assert all(b * pitch_pages <= p < (b + 1) * pitch_pages for b, row in enumerate(tables.tolist()) for p in row)
    return tables[:, :pages], meta.seq_lens, meta.max_seq_len


def _plan_mask(valid: torch.Tensor) -> torch.Tensor:
    return valid[:, None, None, :].clone()


@pytest.fixture
def builds(clean_counters, sm_count):
    """`trtllm.build` for trtllm-gen allocates the counter buffer: give it a device SM count and fresh buffers."""


def test_block_tables_unpadded(builds):
    pitch_pages = 4
    s = 150
    valid = torch.ones(3, s, dtype=torch.bool)
    tables, seq_lens, max_len = _tables(_plan_mask(valid), pitch_pages)
    assert max_len == s
    assert seq_lens.tolist() == [s, s, s]
    n = -(-s // PAGE)
    assert tables.shape == (3, n)
    assert tables.tolist() == [[b * pitch_pages + i for i in range(n)] for b in range(3)]


def test_block_tables_unequal_lengths_right_side(builds):
    """Sequences of different lengths that start at row 0 (a static cache's unfilled tail is masked)."""
    pitch_pages = 8
    lengths = [1, 64, 65, 300]
    s = 320
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    tables, seq_lens, max_len = _tables(_plan_mask(valid), pitch_pages)
    assert seq_lens.tolist() == lengths
    assert max_len == 300
    n = -(-300 // PAGE)
    assert tables.shape == (4, n)
    for b in range(4):
        assert tables[b].tolist() == [b * pitch_pages + i for i in range(n)]


def test_block_tables_left_padding_page_aligned(builds):
    pitch_pages = 6
    s = 320
    starts = [0, 64, 128, 256]
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    tables, seq_lens, max_len = _tables(_plan_mask(valid), pitch_pages)
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


def test_block_tables_left_padding_tokens_land_on_table_pages(builds):
    """Cross-check against packed_pages: the rows the table points at are the sequence's valid tokens."""
    batch, s = 2, 200
    layer, latent = _filled_layer(batch, [s])
    pages = packed_pages(layer.keys, layer.values)
    pitch = layer._buffer.shape[2]
    starts = [64, 0]
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    tables, seq_lens, _ = _tables(_plan_mask(valid), pitch // PAGE)
    for b in range(batch):
        n = int(seq_lens[b])
        gathered = pages[tables[b, : -(-n // PAGE)].long()].reshape(-1, ROW)[:n]
        assert torch.equal(gathered, latent[b, 0, starts[b] :])


@pytest.mark.parametrize("starts", [[0, 3], [1, 1], [63, 0], [65, 128]])
def test_block_tables_left_padding_not_aligned_is_refused(builds, starts):
    s = 200
    valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
    with pytest.raises(Refused, match="left padding does not start on trtllm-gen's 64-token pages"):
        trtllm.build("trtllm-gen", StepPlan(_plan_mask(valid)), _layer(4 * PAGE))


def test_block_tables_hole_in_mask_is_refused(builds):
    valid = torch.ones(2, 128, dtype=torch.bool)
    valid[1, 70] = False  # not one contiguous run: no table can describe it
    with pytest.raises(Refused, match="the step's mask has holes"):
        trtllm.build("trtllm-gen", StepPlan(_plan_mask(valid)), _layer(2 * PAGE))


def test_block_tables_of_a_split_cache_are_refused(builds):
    valid = torch.ones(2, 128, dtype=torch.bool)
    with pytest.raises(Refused, match="the cache does not store the latent packed"):
        trtllm.build("trtllm-gen", StepPlan(_plan_mask(valid)), _layer(2 * PAGE, packed=False))
    with pytest.raises(Refused, match="the cache does not store the latent packed"):
        trtllm.fixed("trtllm-gen", _layer(2 * PAGE, packed=False), 2, 1)


def test_block_tables_from_decode_mask_last_query_row(builds):
    """A causal multi-token mask: the tables follow what the last query token sees."""
    s, q = 130, 3
    mask = _left_padded_mask([0, 64], s, q)
    tables, seq_lens, max_len = _tables(mask, 3)
    assert seq_lens.tolist() == [s, s - 64]
    assert max_len == s
    assert tables[0, 0].item() == 0 and tables[1, 0].item() == 3 + 1


def test_block_tables_additive_mask(builds):
    s = 128
    valid = torch.arange(s)[None, :] >= torch.tensor([0, 64])[:, None]
    additive = torch.zeros(2, 1, 1, s)
    additive[~valid[:, None, None, :]] = torch.finfo(torch.float32).min
    tables, seq_lens, max_len = _tables(additive, 2)
    assert seq_lens.tolist() == [128, 64]
    assert tables[:, 0].tolist() == [0, 3]


def test_block_tables_come_from_the_host_rows_without_reading_the_mask(builds, monkeypatch):
    """With the rows known on the host (as generate() knows them), the tables are computed on the host and only
    uploaded: the mask here lives on the meta device, which holds no data, so any read of it would raise."""
    uploads = []
    real = trtllm.to_device

    def recording(host, device):
        uploads.append((host.clone(), device))
        return real(host, device)

    monkeypatch.setattr(trtllm, "to_device", recording)
    mask = torch.ones(3, 1, 1, 200, dtype=torch.bool, device=META)
    rows = Rows(torch.tensor([200, 136, 8], dtype=torch.int32), 1, torch.tensor([0, 64, 192]), end=200)
    meta = trtllm.build("trtllm-gen", StepPlan(mask, rows), _layer(4 * PAGE, device=META))
    assert meta.block_tables.device == meta.seq_lens.device == META and meta.max_seq_len == 200
    (tables, to1), (lens, to2) = uploads
    assert to1 == to2 == META and tables.device == lens.device == CPU
    # (columns past a row's own pages of the cache repeat its last one: never read, and never another row's)
    assert tables.tolist() == [[0, 1, 2, 3], [5, 6, 7, 7], [11, 11, 11, 11]]
    assert lens.tolist() == [200, 136, 8]


def test_graph_metadata_is_rebuilt_in_place_from_each_steps_rows(builds):
    """`trtllm.fixed` (a CUDA-graph slot's metadata): tables over the whole capacity, the capacity as the maximum
    length, the counter grown before capture; `build(into=...)` rewrites them in place for every step, at the same
    addresses, and a step it refuses leaves them untouched."""
    layer = _layer(4 * PAGE)
    meta = trtllm.fixed("trtllm-gen", layer, 3, 1)
    assert meta.fixed and meta.backend == "trtllm-gen"
    assert meta.block_tables.shape == (3, 4) and meta.block_tables.dtype == torch.int32
    assert meta.seq_lens.shape == (3,) and meta.seq_lens.dtype == torch.int32 and meta.max_seq_len == 4 * PAGE
    assert meta.counter is buffers.held(CPU)["counter"]
    assert meta.counter.numel() == get_trtllm_gen_multi_ctas_kv_counter_bytes(trtllm.COUNTER_MIN_TOKENS, 16, SM_COUNT)
    addresses = (meta.block_tables.data_ptr(), meta.seq_lens.data_ptr(), meta.counter.data_ptr())
    for starts, s in (([0, 64, 128], 200), ([0, 0, 0], 201), ([192, 64, 0], 256)):
        valid = torch.arange(s)[None, :] >= torch.tensor(starts)[:, None]
        assert trtllm.build("trtllm-gen", StepPlan(_plan_mask(valid)), layer, into=meta) is meta
        assert (meta.block_tables.data_ptr(), meta.seq_lens.data_ptr(), meta.counter.data_ptr()) == addresses
        assert meta.max_seq_len == 4 * PAGE  # a constant of the captured graph
        assert meta.seq_lens.tolist() == [s - st for st in starts]
        for b, st in enumerate(starts):
            needed = -(-(s - st) // PAGE)
            assert meta.block_tables[b, :needed].tolist() == [b * 4 + st // PAGE + i for i in range(needed)]
    before = meta.block_tables.clone(), meta.seq_lens.clone()
    valid = torch.arange(200)[None, :] >= torch.tensor([0, 3, 0])[:, None]
    with pytest.raises(Refused, match="left padding"):
        trtllm.build("trtllm-gen", StepPlan(_plan_mask(valid)), layer, into=meta)
    assert torch.equal(meta.block_tables, before[0]) and torch.equal(meta.seq_lens, before[1])
    # The same shape on cute-dsl: no counter, none allocated.
    fresh_caches()
    assert trtllm.fixed("cute-dsl", layer, 3, 1).counter is None and "counter" not in buffers.held(CPU)


# ------------------------------------------------------------------------------- steps trtllm-gen cannot serve


@pytest.mark.parametrize("case, reason", [
    ("hole", "the step's mask has holes"),
    ("unaligned", "left padding does not start on trtllm-gen's N-token pages"),
    ("split", "the cache does not store the latent packed"),
])
@pytest.mark.parametrize("requested, heads, backend", [
    ("auto", 16, "trtllm-gen"), ("auto", 24, "cute-dsl"), ("trtllm-gen", 16, "trtllm-gen"),
])
def test_step_trtllm_cannot_serve_runs_on_the_reference(monkeypatch, caplog, case, reason, requested, heads, backend):
    """A step whose mask has a hole, whose left padding does not start on a page, or whose cache stores the latent
    split: the step's route falls down `capabilities.fallbacks` to the reference backend (never a kernel call on
    wrong indices), with one warning naming the reason, and computes exactly the reference's output."""
    kernel = blackwell(monkeypatch, torch.float32, (RANK, ROPE))
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    s, starts = 200, {"unaligned": [0, 64, 3]}.get(case, [0, 64, 128])
    layer, _ = _filled_layer(len(starts), [s], seed=heads, packed=case != "split")
    mask = _left_padded_mask(starts, s)
    if case == "hole":
        mask[1, 0, 0, 100] = False
    g = torch.Generator().manual_seed(heads)
    q_lat = torch.randn(len(starts), heads, 1, RANK, generator=g) * 0.05
    q_pe = torch.randn(len(starts), heads, 1, ROPE, generator=g) * 0.05
    for _ in range(2):  # a second step of the same kind: the same route, no second warning
        step = StepPlan(mask.clone())
        out = decode_latent(step, requested, q_lat, q_pe, layer.keys, layer.values, 0.1)
        (route,) = step.routes.values()
        assert route.backend == "reference"
        assert kernel.calls == []
        assert torch.equal(out, mla_attention_reference(q_lat, q_pe, layer.keys, layer.values, mask, 0.1))
    declined = [m for m in package_warnings(caplog) if "declines" in m]
    assert len(declined) == 1, declined
    head = f"flashinfer_mla: {backend} declines some decode steps at {heads} heads ({reason}"
    assert declined[0].startswith(head) and declined[0].endswith("); those steps run on reference."), declined
    # Control: the same step with aligned rows on a packed cache runs the kernel.
    if case != "split":
        step = StepPlan(_left_padded_mask([0, 64, 128], s))
        decode_latent(step, requested, q_lat, q_pe, layer.keys, layer.values, 0.1)
        assert next(iter(step.routes.values())).backend == backend and len(kernel.calls) == 1


# (fake_blackwell: left padding 0 and 64, on trtllm-gen's pages; fake_hopper: 0 and 67, so that the last chunk ends
# 3 positions after row 1's padding, 3 of its 6 query tokens)
@pytest.mark.parametrize("fixture, lengths", [("fake_blackwell", (70, 6)), ("fake_hopper", (70, 3))])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_prefill_chunks_inside_left_padding_run_on_the_reference(request, caplog, fixture, lengths,
                                                                 cache_implementation):
    """``generate(prefill_chunk_size=8)`` on a left-padded batch: a chunk that lies inside a row's padding, or ends
    in it, shows that row fewer cached positions than it has query tokens (none, or 3 of 6), which FlashInfer's
    kernels do not take (trtllm-gen faults: its stand-in checks the contract and raised; fa3 returns zeros for an
    empty row). Those steps run on the reference, with one warning; the decode steps still run on the kernel, and
    every token and logit equals each prompt generated alone with eager."""
    kernel = request.getfixturevalue(fixture)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch(lengths=lengths)
    static = {} if cache_implementation is None else dict(cache_implementation="static", disable_compile=True)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, prefill_chunk_size=8,
                         output_logits=True, return_dict_in_generate=True, **static)
    assert_batch_matches_eager_alone(model, out, prompts, 4, tol=1e-6)
    warned = [w for w in package_warnings(caplog) if "fewer cached positions than the step has query tokens" in w]
    assert len(warned) == 1, package_warnings(caplog)
    runs = len(kernel.calls) if fixture == "fake_blackwell" else kernel.modules["fa3"].runs
    assert runs > 0  # the other steps ran on the kernel


@pytest.mark.parametrize("mode", ["assisted-other", "assisted-self", "beams", "sampling", "guidance", "second-model"])
def test_generation_modes_on_trtllm_gen_match_the_reference(fake_blackwell, monkeypatch, mode):
    """``helpers.generation_mode`` on the trtllm-gen stand-in against the same calls on the reference backend, with
    prompts of 70 and 6 tokens: left padding 0 and 64, on trtllm-gen's pages, so the padded batches' decode steps run
    the kernel too. The stand-in attends through the block tables and lengths it is given, where the reference reads
    the step's mask: cropped caches and 5-token verify steps (assisted), reordered caches (beams), repeated batches
    (sampling) and the main steps next to guidance's forward or a second model's loop must all reach it with the right
    rows. (Guidance's own forward and the second model's loop decode over a `DynamicCache` built from the model's
    config, which stores the latent packed on Blackwell: they run the kernel too, see the next test.)"""
    ours = generation_mode(mode, lengths=(70, 6))
    calls = len(fake_blackwell.calls)
    assert calls > 0 and {c["backend"] for c in fake_blackwell.calls} == {"auto"}  # (trtllm-gen, as FlashInfer picks)
    monkeypatch.setenv(hf_flashinfer_mla.ENV_VAR, "reference")
    ref = generation_mode(mode, lengths=(70, 6))
    assert len(fake_blackwell.calls) == calls  # the second pass ran the reference only
    assert_same_outputs(ours, ref, 1e-6)


@torch.no_grad()
def test_forwards_that_build_their_own_cache_run_trtllm_gen(fake_blackwell, monkeypatch, caplog):
    """Classifier-free guidance's own forward inside generate() and a loop of the user's own decode over the cache
    the model's forward builds when called without one. On Blackwell that cache stores the latent packed, as
    generate()'s does, so their decode steps run trtllm-gen, with no warning, and give the reference's tokens and
    logits. Control: a `DynamicCache()` built without the model's config keeps Transformers' split layers, which
    trtllm-gen cannot read (one warning, the reference runs)."""
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    model = make_model("deepseek_v3")
    layers = len(mla_layers(model))
    ours = generation_mode("guidance", lengths=(70, 6))
    # The guidance forward attends over its 8-token negative prompt and what it has decoded since, the main steps
    # over 70 positions and more. Per layer: the guidance's 6 forwards (its prompt, of <= 8 tokens, decodes too) and
    # the main call's 5 decode steps.
    guided = [c for c in fake_blackwell.calls if int(c["seq_lens"].max()) < 20]
    assert len(guided) == 6 * layers and len(fake_blackwell.calls) == 11 * layers
    ids, mask, _ = left_padded_batch(lengths=(70, 6))
    forced = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))
    calls = len(fake_blackwell.calls)
    loop = decode_logits(model, ids, mask, forced=forced)
    assert len(fake_blackwell.calls) == calls + 4 * len(mla_layers(model))
    assert not [w for w in package_warnings(caplog) if "packed" in w], package_warnings(caplog)
    calls = len(fake_blackwell.calls)
    assert rel_err(loop, decode_logits(model, ids, mask, cache=DynamicCache(), forced=forced)) < 1e-6
    assert len(fake_blackwell.calls) == calls  # (the control: split layers, on the reference)
    assert [w for w in package_warnings(caplog) if "does not store the latent packed" in w]
    assert rel_err(loop, decode_logits(model, ids, mask, forced=forced, mla_backend="reference")) < 1e-6
    monkeypatch.setenv(hf_flashinfer_mla.ENV_VAR, "reference")
    assert_same_outputs(ours, generation_mode("guidance", lengths=(70, 6)), 1e-6)
