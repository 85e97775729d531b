"""The harness: FlashInfer 0.7.4's real trtllm_batch_decode_with_kv_cache_mla on CPU, only device queries and
the final native launches replaced (trtllm-gen op / cute-dsl compiled kernel), by emulators that re-implement the
launcher checks and read operands the way the kernels do (raw pointers + the strides the launcher passes)."""
from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests")]

import pytest
import torch

import flashinfer.mla
import flashinfer.mla._core as core
import flashinfer.mla._batch_mla._backends.trtllm_gen_backend as tgb
import flashinfer.cute_dsl.attention.monolithic.mla_decode as cmd
import flashinfer.cute_dsl.utils as cute_utils
from fake_flashinfer import blackwell, SM_COUNT  # noqa: F401
from fake_flashinfer import fresh_caches

REAL = flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla


def counter_bytes(batch, heads, sm):  # C++ getTrtllmGenMultiCtasKvCounterBytes
    n = max(batch * heads, sm)
    return (-(-n // 8) * 8) * 4


def raw(t, shape, dtype=None):
    """What a kernel reading t.data_ptr() as a dense row-major `shape` sees."""
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),))
    n = 1
    for s in shape:
        n *= s
    assert flat.numel() >= n, ("kernel would read past the tensor", tuple(shape), flat.numel())
    return flat[:n].view(shape)


def attend(q, kv_rows, n, sq, s, scale):
    """token s of a request of sq tokens over its first n rows: sees n - sq + s + 1 rows (bottom-right causal)."""
    vis = n - sq + s + 1
    assert vis >= 1, (n, sq, s)
    rows = kv_rows[:vis].double()
    p = (q.double() @ rows.T * scale).softmax(-1)  # [H, vis]
    return p @ rows[:, :512]


class NativeEmu:
    """trtllm_paged_attention_decode (csrc/trtllm_fmha_kernel_launcher.cu:538) + launcher:192 + kernelParams.h."""

    def __init__(self):
        self.calls = []

    def trtllm_paged_attention_decode(self, out, out_sf, query, k, v, ws, counter, block_tables, seq_lens, max_q_len,
                                      max_kv_len, bmm1, bmm2, o_sf_scale, o_sf_vec, o_sf_start, batch_size,
                                      window_left, topk, sm_count, pdl, ws_size, sinks, cu_q, kbs, vbs, skip,
                                      shared_idx, lse, lse_scale, lse_s0, lse_s1, block_sparse, topk_lens, mode,
                                      fp16sm):
        assert topk == 0 and cu_q is None and sinks is None and lse is None
        n, h, d = query.shape  # launcher: sum_seq_q = query.size(0), num_qo_heads = query.size(1)
        assert d == 576 and out.shape[-1] == 512 and k.data_ptr() == v.data_ptr()  # launcher:570-577
        assert out.dtype == torch.bfloat16 and query.dtype == k.dtype == torch.bfloat16
        assert k.dim() == 4 and k.shape[1] == 1, k.shape  # HND [pages, 1, page, 576]
        pages, _, page, _ = k.shape
        assert page in (32, 64) and (page & (page - 1)) == 0  # kernelParams.h:909
        assert k.stride(-1) == 1 and k.stride(-2) == 576 and k.stride(0) % 8 == 0 and k.data_ptr() % 16 == 0  # TMA
        assert query.stride(-1) == 1 and query.data_ptr() % 16 == 0 and (query.stride(1) * 2) % 16 == 0
        # counter (launcher:220-229)
        assert counter.data_ptr() % 16 == 0
        assert counter.numel() * counter.element_size() >= counter_bytes(batch_size, h, sm_count), (
            counter.numel(), batch_size, h)
        assert n == batch_size * max_q_len, (n, batch_size, max_q_len)  # uniform Q: no cum_seq_lens_q
        assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        assert type(bmm1) is float and type(bmm2) is float, (type(bmm1), type(bmm2))
        width = block_tables.size(-1)  # launcher:578 max_num_blocks_per_seq; rows read at that pitch
        self.calls.append(dict(batch=batch_size, q=max_q_len, h=h, max_kv_len=max_kv_len, tables=tuple(block_tables.shape),
                               tables_contig=block_tables.is_contiguous(), page=page, pages=pages,
                               seq_lens=seq_lens.clone(), counter_bytes=counter.numel(), ws=ws_size))
        bt = raw(block_tables, (batch_size, width))
        sl = raw(seq_lens, (batch_size,))
        assert int(sl.min()) >= max_q_len and int(sl.max()) <= max_kv_len, (sl.tolist(), max_kv_len)
        assert width * page >= int(sl.max())
        flat_q = query  # strides q_stride_tokens/heads honoured by the kernel
        kv = k[:, 0]
        o = out.view(n, h, 512)
        for b in range(batch_size):
            L = int(sl[b])
            pg = bt[b, : -(-L // page)].long()
            assert bool(((pg >= 0) & (pg < pages)).all()), (b, pg)
            rows = kv[pg].reshape(-1, 576)[:L]
            for s in range(max_q_len):
                o[b * max_q_len + s] = attend(flat_q[b * max_q_len + s], rows, L, max_q_len, s, bmm1).to(o.dtype)


class CuteEmu:
    """The compiled monolithic CuTe MLA kernel (mla_decode.cute_dsl_mla_decode's launch)."""

    def __init__(self):
        self.calls = []

    def compile(self, **kw):
        self.kw = kw
        return self.launch

    def launch(self, q_lat, q_rope, c_lat, c_rope, page_table, o, lse, ws, split_kv, seqs, cu_q, causal_g, cp_rank,
               block_split_kvs, softmax_scale, output_scale, lse_scale):
        kw = self.kw
        B, Sq, H, L = q_lat.shape
        assert cu_q is None and L == 512 and q_rope.shape[-1] == 64
        assert o.shape == (B, Sq, H, 512) and o.is_contiguous()
        assert page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == B
        assert page_table.is_contiguous(), "cute-dsl: 'page table tensor with shape [batch_size, page_count] (contiguous)'"
        assert seqs.dtype == torch.int32 and seqs.shape == (B,)
        page = c_lat.shape[1]
        assert kw["page_size"] == page and 128 % page == 0
        self.calls.append(dict(batch=B, q=Sq, h=H, tables=tuple(page_table.shape), page=page, seq_lens=seqs.clone(),
                               kw=dict(kw)))
        scale = float(softmax_scale)
        kv = torch.cat([c_lat, c_rope], -1)
        q = torch.cat([q_lat, q_rope], -1)
        for b in range(B):
            n = int(seqs[b])
            pg = page_table[b, : -(-n // page)].long()
            assert bool(((pg >= 0) & (pg < kv.shape[0])).all())
            rows = kv[pg].reshape(-1, 576)[:n]
            for s in range(Sq):
                o[b, s] = (attend(q[b, s], rows, n, Sq, s, scale) * float(output_scale)).to(o.dtype)


class Float32:  # cutlass scalar stand-ins read by the emulated launch
    def __init__(self, v):
        self.v = v

    def __float__(self):
        return float(self.v)


def install(monkeypatch, dtype=torch.bfloat16):
    kernel = blackwell(monkeypatch, dtype=dtype, dims=(512, 64))
    emu, cute = NativeEmu(), CuteEmu()
    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", REAL)
    monkeypatch.setattr(core, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(core, "get_device_sm_count", lambda device: SM_COUNT)
    monkeypatch.setattr(core, "device_support_pdl", lambda device: False)
    monkeypatch.setattr(tgb, "get_trtllm_gen_fmha_module", lambda: emu)
    # cute-dsl: the device queries and the compiled kernel only
    monkeypatch.setattr(cmd, "get_num_sm", lambda device: SM_COUNT)
    monkeypatch.setattr(cute_utils, "get_num_sm", lambda device: SM_COUNT)
    monkeypatch.setattr(cmd, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(cmd, "device_support_pdl", lambda device: False)
    monkeypatch.setattr(cmd, "cute_dsl_compile_arch", lambda *cc: "sm_100a")
    monkeypatch.setattr(cmd, "_get_compiled_mla_kernel", cute.compile)
    monkeypatch.setattr(cmd, "Float32", Float32)
    monkeypatch.setattr(cmd, "Int32", int)
    return emu, cute
