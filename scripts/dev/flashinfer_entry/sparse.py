"""The sparse (DSA) trtllm-gen call against FlashInfer 0.7.4's own Python path (native launch emulated), and the
per-token bookkeeping on the stand-in (tests/fake_flashinfer.py). See README.md here.

    python scripts/dev/flashinfer_entry/sparse.py [-k EXPR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests")]

import pytest
import torch

import flashinfer.mla
import flashinfer.mla._core as core
import flashinfer.mla._batch_mla._backends.trtllm_gen_backend as tgb
import hf_flashinfer_mla
from helpers import DSA_FAMILIES, VOCAB, decode_logits, eager_alone, left_padded_batch, make_model, rel_err
from fake_flashinfer import blackwell, fake_blackwell, SM_COUNT  # noqa: F401
from fake_flashinfer import fresh_caches
from harness import counter_bytes

REAL = flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla


class NativeEmu:
    """Emulates trtllm_paged_attention_decode's C++ checks (launcher + kernelParams) and computes the sparse result
    as the kernel reads it: row b attends to block_tables[b, t, :seq_lens[b]] (slots of the flat page pool)."""

    def __init__(self):
        self.calls = []

    def trtllm_paged_attention_decode(self, out, out_sf, query, k, v, ws, counter, block_tables, seq_lens, max_q_len,
                                      max_kv_len, bmm1, bmm2, o_sf_scale, o_sf_vec, o_sf_start, batch_size,
                                      window_left, topk, sm_count, pdl, ws_size, sinks, cu_q, kbs, vbs, skip,
                                      shared_idx, lse, lse_scale, lse_s0, lse_s1, block_sparse, topk_lens, mode,
                                      fp16sm):
        n, h, d = query.shape
        self.calls.append(dict(batch=batch_size, max_q_len=max_q_len, max_kv_len=max_kv_len, topk=topk,
                               tables=tuple(block_tables.shape), seq_lens=seq_lens.clone(), n=n, h=h))
        assert topk > 0 and topk % 4 == 0, f"C++ FLASHINFER_CHECK: SparseMlaTopK must be a multiple of 4 (got {topk})"
        assert counter.numel() * counter.element_size() >= counter_bytes(batch_size, h, sm_count)
        assert counter.data_ptr() % 16 == 0
        assert n == batch_size * max_q_len, (n, batch_size, max_q_len)
        assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.numel() == batch_size
        assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
        assert tuple(block_tables.shape) == (batch_size, max_q_len, topk)
        assert d == 576 and out.shape[-1] == 512 and k.data_ptr() == v.data_ptr()
        assert int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= max_kv_len
        kv = k.reshape(-1, d)
        out_v = out.view(n, h, 512)
        for t in range(n):
            b, s = divmod(t, max_q_len)
            sl = block_tables[b, s, : min(int(seq_lens[b]), topk)].long()
            assert bool((sl >= 0).all() and (sl < kv.shape[0]).all()), (b, s, sl)
            rows = kv[sl].double()
            p = (query[t].double() @ rows.T * bmm1).softmax(-1)
            out_v[t] = (p @ rows[:, :512]).to(out.dtype)


@pytest.fixture
def real_flashinfer(monkeypatch):
    """blackwell() with dims (512, 64) whose kernel is FlashInfer 0.7.4's real Python function, with only the
    device queries and the native op replaced."""
    blackwell(monkeypatch, dims=(512, 64))
    emu = NativeEmu()
    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", REAL)
    monkeypatch.setattr(core, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(core, "get_device_sm_count", lambda device: SM_COUNT)
    monkeypatch.setattr(core, "device_support_pdl", lambda device: False)
    monkeypatch.setattr(tgb, "get_trtllm_gen_fmha_module", lambda: emu)
    # FlashInfer allocates a bf16 output; the float64 test models need float64 (only the dtype is changed)
    monkeypatch.setattr(core, "_prepare_trtllm_gen_mla_output",
                        lambda out, shape, device: torch.empty(shape, dtype=torch.float64, device=device))
    yield emu
    fresh_caches()


BIG = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=80)


def _per_row(model, steps, lengths=(7, 4, 12), chunks=None):
    ids, mask, prompts = left_padded_batch(lengths=lengths)
    forced = torch.randint(1, VOCAB, (len(lengths), steps), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, forced=forced, as_generate=chunks is None, chunks=chunks,
                             cache=hf_flashinfer_mla.MLALatentCache(model.config))
        refs = eager_alone(model, prompts, forced, chunks=chunks)
    return max(rel_err(ours[i], r) for i, r in enumerate(refs))


@torch.no_grad()
def test_real_flashinfer_python_path_topk_multiple_of_4(real_flashinfer):
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=8, **BIG)
    err = _per_row(model, 3)
    print("err", err, [(c["batch"], c["max_q_len"], c["topk"], c["tables"], c["seq_lens"].tolist())
                       for c in real_flashinfer.calls[:2]])
    assert real_flashinfer.calls, "kernel never reached"
    assert err < 1e-6


@torch.no_grad()
def test_real_flashinfer_multi_token_chunks(real_flashinfer):
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=8, **BIG)
    err = _per_row(model, 5, chunks=[2, 3])
    qs = {(c["max_q_len"], c["batch"]) for c in real_flashinfer.calls}
    print("err", err, qs, [c["seq_lens"].tolist() for c in real_flashinfer.calls])
    assert real_flashinfer.calls and err < 1e-6


@torch.no_grad()
def test_real_flashinfer_kv_len_below_index_topk(real_flashinfer):
    """index_topk=16 > kv_len (13.. at the first steps): the indexer returns min(index_topk, kv_len) columns."""
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=16, **BIG)
    try:
        err = _per_row(model, 4)
    finally:
        print("topks passed:", [c["topk"] for c in real_flashinfer.calls])
    assert err < 1e-6


# ------------------------------------------------------------------------------------- bookkeeping on the stand-in
KERNEL_FAMILIES = [t for t in DSA_FAMILIES if t not in ("glm5_next", "hy_v4", "hy_v4_vl")]


def _sparse_calls(fake):
    return [c for c in fake.calls if c.get("sparse")]


@pytest.mark.parametrize("dsa_type", KERNEL_FAMILIES)
@torch.no_grad()
def test_families_per_row(dsa_type, fake_blackwell):
    model = make_model(dsa_type, dtype=torch.float64)
    err = _per_row(model, 4)
    sp = _sparse_calls(fake_blackwell)
    dense = [c for c in fake_blackwell.calls if not c.get("sparse")]
    print(dsa_type, "err", err, "sparse calls", len(sp), "dense calls", len(dense),
          sp[0]["seq_lens"].tolist() if sp else None)
    assert sp and err < 1e-6


@pytest.mark.parametrize("topk", [4, 11, 16])
@torch.no_grad()
def test_chunks_left_padded_per_row(topk, fake_blackwell):
    """Multi-token decode steps (chunks 2 then 3) of a left-padded batch, rows seeing fewer positions than topk."""
    if topk % 4:
        pass
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=topk)
    err = _per_row(model, 5, lengths=(7, 2, 12), chunks=[2, 3])
    sp = _sparse_calls(fake_blackwell)
    print(topk, "err", err, [(c["batch"], c["q_len"], c["sparse"], c["seq_lens"].tolist()) for c in sp][:2])
    assert sp and err < 1e-6
    # expected per-token counts of the first chunk: rows see (7, 2, 12) + s + 1 positions; order b * Sq + s
    first = sp[0]
    exp = [min(n + s + 1, topk) for n in (12, 12, 12) for s in range(2)]  # left padded: visible from the mask
    vis = [min(n + s + 1, topk) for n in (7, 2, 12) for s in range(2)]
    assert first["seq_lens"].tolist() == vis, (first["seq_lens"].tolist(), vis, exp)


@torch.no_grad()
def test_holes_with_chunks_match_batched_eager(fake_blackwell):
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=6)
    g = torch.Generator().manual_seed(5)
    ids, forced = torch.randint(1, VOCAB, (3, 10), generator=g), torch.randint(1, VOCAB, (3, 5), generator=g)
    holes = torch.ones_like(ids)
    holes[0, 3] = holes[0, 7] = 0
    holes[1, 1:6] = 0  # row 1 sees 5 of 10 + new ones: fewer than topk at first
    holes[2, 9] = 0
    ours = decode_logits(model, ids, holes, cache=hf_flashinfer_mla.MLALatentCache(model.config), forced=forced,
                         chunks=[2, 3])
    model.set_attn_implementation("eager")
    try:
        ref = decode_logits(model, ids, holes, forced=forced, chunks=[2, 3])
    finally:
        model.set_attn_implementation("flashinfer_mla")
    sp = _sparse_calls(fake_blackwell)
    print("holes err", rel_err(ours, ref), [c["seq_lens"].tolist() for c in sp])
    assert sp and rel_err(ours, ref) < 1e-6


@torch.no_grad()
def test_dense_trtllm_and_sparse_in_one_model(fake_blackwell):
    """dots3: DSA layers 0-1 and sliding-window MLA layers 2-3, given the same latent dims and a window that does
    not bind, so the dense layers run trtllm-gen too, in the same steps."""
    model = make_model("dots3_note_text", dtype=torch.float64, swa_kv_lora_rank=32, sliding_window=64)
    err = _per_row(model, 4, lengths=(9, 9, 9))
    sp = _sparse_calls(fake_blackwell)
    dense = [c for c in fake_blackwell.calls if not c.get("sparse")]
    print("mixed err", err, len(sp), len(dense), [d["seq_lens"].tolist() for d in dense][:2],
          {id(c["counter"]) for c in fake_blackwell.calls}.__len__())
    assert sp and err < 1e-6


@torch.no_grad()
def test_dense_and_sparse_layers_share_one_step_plan(fake_blackwell):
    from hf_flashinfer_mla.plan import attach_plan, decode_latent
    from hf_flashinfer_mla.kernels import reference
    B, H, Sq, S, L, R, K = 3, 4, 2, 20, 32, 8, 8
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(B, 1, 256, L + R, generator=g, dtype=torch.float64)
    kv, kr = buf[..., :L][:, :, :S], buf[..., L:][:, :, :S]
    mask = (torch.arange(S)[None, :] <= torch.arange(S - Sq, S)[:, None]).expand(B, 1, Sq, S).clone()
    q_lat = torch.randn(B, H, Sq, L, generator=g, dtype=torch.float64)
    q_pe = torch.randn(B, H, Sq, R, generator=g, dtype=torch.float64)
    # per token: a random order of its visible positions first (visible = S - Sq + s + 1), then hidden ones
    idx = torch.empty(B, Sq, K, dtype=torch.int32)
    for b in range(B):
        for s in range(Sq):
            vis = S - Sq + s + 1
            idx[b, s] = torch.randperm(vis, generator=g)[:K].to(torch.int32)
    plan = attach_plan(mask)
    dense = decode_latent(plan, "auto", q_lat, q_pe, kv, kr, 0.3)
    sparse = decode_latent(plan, "auto", q_lat, q_pe, kv, kr, 0.3, indices=idx)
    dense2 = decode_latent(plan, "auto", q_lat, q_pe, kv, kr, 0.3)
    h, n = H, B * Sq
    ql, qp = q_lat.transpose(0, 1).reshape(h, n, L), q_pe.transpose(1, 2).reshape(n, h, R)
    ref_d = reference.attend(mask, 0.3, ql, qp, kv, kr).view(h, B, Sq, L).transpose(0, 1)
    ref_s = reference.attend_sparse(mask, idx, 0.3, ql, qp, kv, kr).view(h, B, Sq, L).transpose(0, 1)
    calls = fake_blackwell.calls
    print([(c["batch"], c["q_len"], c.get("sparse"), c["seq_lens"].tolist()) for c in calls])
    assert [c.get("sparse") for c in calls] == [None, K, None]
    assert calls[0]["counter"] is calls[1]["counter"] is calls[2]["counter"]
    assert rel_err(dense, ref_d) < 1e-9 and rel_err(sparse, ref_s) < 1e-9 and rel_err(dense2, ref_d) < 1e-9


def main(argv=None) -> int:
    """These probes under pytest (``-k`` selects some by name)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="keyword", default=None, help="run only the probes whose names match (pytest -k)")
    args = parser.parse_args(argv)
    return int(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider",
                            *(["-k", args.keyword] if args.keyword else [])]))


if __name__ == "__main__":
    sys.exit(main())
