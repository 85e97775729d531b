"""Blackwell decode that runs without a GPU: the head-count rule, the counter buffer, the packed-page view, the block
tables (`hf_flashinfer_mla.trtllm`, `hf_flashinfer_mla.buffers`), and the call into FlashInfer, checked by a
stand-in for ``trtllm_batch_decode_with_kv_cache_mla`` that applies FlashInfer's own argument checks."""

from __future__ import annotations

import flashinfer.mla
import flashinfer.utils
import pytest
import torch
from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import _trtllm_gen_mla_incompatibility_reason
from flashinfer.utils import _resolve_trtllm_gen_multi_ctas_kv_counter_buffer, get_trtllm_gen_multi_ctas_kv_counter_bytes

import hf_flashinfer_mla
from hf_flashinfer_mla import MLALatentLayer, buffers, trtllm
from hf_flashinfer_mla.metadata import StepPlan
from hf_flashinfer_mla.reference import mla_attention_reference
from hf_flashinfer_mla.trtllm import _block_tables, multi_ctas_kv_counter_buffer, packed_pages, trtllm_gen_supports_num_heads

RANK, ROPE, ROW, PAGE = 512, 64, 576, 64
CPU = torch.device("cpu")
META = torch.device("meta")


# ---------------------------------------------------------------------------------------------------- head counts


# Written out by hand (not computed from the rule): from vLLM's FlashInfer MLA backend and the shared notes.
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
    assert hf_flashinfer_mla.trtllm_gen_supports_num_heads is trtllm_gen_supports_num_heads
    assert hf_flashinfer_mla.multi_ctas_kv_counter_buffer is buffers.multi_ctas_kv_counter_buffer


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


@pytest.fixture
def sm_count(monkeypatch):
    """FlashInfer's SM-count query, answered without a GPU."""
    asked = []

    def fake(device):
        asked.append(device)
        return 148

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


def _fake_trtllm_decode(calls):
    """Stands in for ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla``: FlashInfer's own checks of the counter
    buffer and of trtllm-gen eligibility (the functions FlashInfer calls), then the attention it would compute over
    the paged cache (causal over the step's query tokens), so that the indices are checked too."""

    def fake(*, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables,
             seq_lens, max_seq_len, bmm1_scale, bmm2_scale, backend, multi_ctas_kv_counter_buffer=None):
        calls.append({"backend": backend, "counter": multi_ctas_kv_counter_buffer, "heads": query.shape[2]})
        b, sq, h, width = query.shape
        assert width == kv_lora_rank + qk_rope_head_dim and kv_cache.shape[1:] == (PAGE, width)
        assert block_tables.dtype == seq_lens.dtype == torch.int32 and max_seq_len == int(seq_lens.max())
        assert workspace_buffer.dtype == torch.uint8 and bmm2_scale == 1.0
        eligible = _trtllm_gen_mla_incompatibility_reason(num_heads_q=h, block_size=kv_cache.shape[1]) is None
        if multi_ctas_kv_counter_buffer is not None:
            if backend == "cute-dsl" or (backend == "auto" and not eligible):
                raise ValueError("multi_ctas_kv_counter_buffer is only supported when a trtllm-gen runner is selected")
            _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(multi_ctas_kv_counter_buffer, b, h, 148, query.device)
        out = query.new_empty(b, sq, h, kv_lora_rank)
        for i in range(b):
            n = int(seq_lens[i])
            kv = kv_cache[block_tables[i].long()].reshape(-1, width)[:n]  # [n, L + R]
            scores = torch.einsum("qhd,kd->hqk", query[i], kv) * bmm1_scale
            visible = torch.arange(n)[None, :] <= torch.arange(n - sq, n)[:, None]  # [Sq, n]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[i] = torch.einsum("hqk,kd->qhd", probs, kv[:, :kv_lora_rank])
        return out

    return fake


@pytest.mark.parametrize("backend, heads", [("trtllm-gen", 16), ("cute-dsl", 96), ("cute-dsl", 16),
                                            ("trtllm-gen", 128), ("cute-dsl", 24)])
@pytest.mark.parametrize("q_len", [1, 3])
def test_trtllm_decode_call_contract(monkeypatch, clean_counters, sm_count, backend, heads, q_len):
    calls = []
    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", _fake_trtllm_decode(calls))
    monkeypatch.setattr(trtllm, "workspace_buffer", lambda device: torch.zeros(1024, dtype=torch.uint8))
    g = torch.Generator().manual_seed(heads + q_len)
    starts, s = [0, 64, 0], 150  # left padding aligned to trtllm-gen's pages
    layer, _ = _filled_layer(len(starts), [s], seed=heads)
    kv_latent, k_rot = layer.keys, layer.values
    mask = torch.zeros(len(starts), 1, q_len, s, dtype=torch.bool)
    for i, start in enumerate(starts):
        for j in range(q_len):
            mask[i, 0, j, start : s - q_len + 1 + j] = True
    q_lat = torch.randn(len(starts), heads, q_len, RANK, generator=g) * 0.05
    q_pe = torch.randn(len(starts), heads, q_len, ROPE, generator=g) * 0.05
    out = trtllm.trtllm_decode(backend, StepPlan(mask), q_lat, q_pe, kv_latent, k_rot, 0.1)
    assert len(calls) == 1
    call = calls[0]
    assert call["heads"] == heads
    if backend == "cute-dsl":
        assert call["backend"] == "cute-dsl" and call["counter"] is None
    else:
        assert call["backend"] == "auto" and call["counter"] is buffers._counters[CPU]
    ref = mla_attention_reference(q_lat, q_pe, kv_latent, k_rot, mask, 0.1)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_fake_rejects_what_flashinfer_rejects(monkeypatch, clean_counters, sm_count):
    """Control: the stand-in raises for the calls the old code made (a counter with cute-dsl), and for a counter
    sized for too few query tokens, as FlashInfer does."""
    fake = _fake_trtllm_decode([])
    layer, _ = _filled_layer(1, [64])
    pages = packed_pages(layer.keys, layer.values)
    args = dict(query=torch.zeros(1, 1, 96, ROW), kv_cache=pages, workspace_buffer=torch.zeros(8, dtype=torch.uint8),
                qk_nope_head_dim=RANK, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                block_tables=torch.zeros(1, 1, dtype=torch.int32), seq_lens=torch.tensor([64], dtype=torch.int32),
                max_seq_len=64, bmm1_scale=0.1, bmm2_scale=1.0)
    counter = torch.zeros(get_trtllm_gen_multi_ctas_kv_counter_bytes(1, 96, 148), dtype=torch.uint8)
    with pytest.raises(ValueError, match="trtllm-gen runner"):
        fake(**args, backend="cute-dsl", multi_ctas_kv_counter_buffer=counter)
    with pytest.raises(ValueError, match="trtllm-gen runner"):
        fake(**args, backend="auto", multi_ctas_kv_counter_buffer=counter)  # 96 heads: no trtllm-gen runner
    args["query"] = torch.zeros(1, 1, 128, ROW)
    with pytest.raises(ValueError, match="too small"):
        fake(**args, backend="auto", multi_ctas_kv_counter_buffer=torch.zeros(16, dtype=torch.uint8))
    fake(**args, backend="auto", multi_ctas_kv_counter_buffer=trtllm.counter_buffer(1, 128, CPU))


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
