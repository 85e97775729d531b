"""FlashInfer 0.7.4's real trtllm_batch_decode_with_kv_cache_mla on the CPU for the dense calls (trtllm-gen, cute-dsl,
CUDA-graph slots, continuous batching): only the device queries and the native launches are replaced, by emulators
of the launcher's checks that read the operands as the kernels do. See README.md here.

    python scripts/dev/flashinfer_entry/dense.py [-k cb]
"""

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests")]

import pytest
import torch

import hf_flashinfer_mla
from helpers import VOCAB, decode_logits, eager_alone, left_padded_batch, make_model, rel_err
from fake_flashinfer import fresh_caches
from harness import install

BIG = dict(kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.fixture
def real(monkeypatch):
    yield install(monkeypatch)
    fresh_caches()


def run_loop(heads, lengths, steps=3, chunks=None):
    model = make_model("deepseek_v3", dtype=torch.bfloat16, num_attention_heads=heads, num_key_value_heads=heads, **BIG)
    ids, mask, prompts = left_padded_batch(lengths=lengths)
    forced = torch.randint(1, VOCAB, (len(lengths), steps if chunks is None else sum(chunks)),
                           generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, forced=forced, as_generate=chunks is None, chunks=chunks,
                             cache=hf_flashinfer_mla.MLALatentCache(model.config))
        refs = eager_alone(model, prompts, forced, chunks=chunks)
    return max(rel_err(ours[i].float(), r.float()) for i, r in enumerate(refs))


CASES = [
    (1, (5,)), (1, (70,)),            # batch 1: one page / two pages
    (3, (7, 7, 7)),                   # batch 3, no padding
    (2, (70, 6)),                     # left padding of 64 (aligned)
    (3, (7, 4, 12)),                  # left padding 5 / 8 (not aligned: expected refused -> reference)
]


@pytest.mark.parametrize("heads", [16, 128, 20, 96])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-{'-'.join(map(str, c[1]))}")
@pytest.mark.parametrize("chunks", [None, [2, 3]], ids=["gen", "chunks23"])
def test_dense_loop(real, heads, case, chunks):
    emu, cute = real
    _, lengths = case
    err, exc = None, None
    try:
        err = run_loop(heads, lengths, chunks=chunks)
    except Exception as e:  # noqa: BLE001
        exc = e
    tr = [(c["batch"], c["q"], c["tables"], c["max_kv_len"], c["seq_lens"].tolist()) for c in emu.calls]
    cu = [(c["batch"], c["q"], c["tables"], c["seq_lens"].tolist()) for c in cute.calls]
    print(f"\nH={heads} {lengths} chunks={chunks} err={err} trtllm={len(tr)} cute={len(cu)} exc={exc!r:.300}")
    print("  trtllm calls:", tr[:3], " cute calls:", cu[:3])
    if exc:
        raise exc
    assert err < 3e-2


# ------------------------------------------------------------------------------------------- 2. CUDA-graph slots
from hf_flashinfer_mla import buffers
from hf_flashinfer_mla.kernels import Layer, trtllm
from hf_flashinfer_mla.plan import StepPlan


def _direct(real, backend, heads, starts, s, q_len, capacity, use_fixed):
    buffers.WORKSPACE_BYTES = 128 * 1024 * 1024
    fresh_caches()
    emu, cute = real
    B, L, R = len(starts), 512, 64
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(B, 1, capacity, L + R, generator=g).to(torch.bfloat16)
    kv, kr = packed[..., :L][:, :, :s], packed[..., L:][:, :, :s]
    layer = Layer(torch.device("cpu"), torch.bfloat16, torch.bfloat16, heads, L, R, capacity, True, 0.07)
    mask = torch.zeros(B, 1, q_len, s, dtype=torch.bool)
    for b, st in enumerate(starts):
        for j in range(q_len):
            mask[b, 0, j, st: s - q_len + 1 + j] = True
    q_lat = torch.randn(heads, B * q_len, L, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(B * q_len, heads, R, generator=g).to(torch.bfloat16)
    if use_fixed:
        meta = trtllm.fixed(backend, layer, B, q_len)
        trtllm.build(backend, StepPlan(mask), layer, into=meta)
    else:
        meta = trtllm.build(backend, StepPlan(mask), layer)
    out = trtllm.run(meta, layer, q_lat, q_pe, kv, kr)  # [H, N, L]
    ref = torch.empty(heads, B * q_len, L, dtype=torch.float64)
    for b in range(B):
        for j in range(q_len):
            vis = mask[b, 0, j]
            rows = packed[b, 0, :s][vis].double()
            q = torch.cat([q_lat[:, b * q_len + j], q_pe[b * q_len + j]], -1).double()
            p = (q @ rows.T * 0.07).softmax(-1)
            ref[:, b * q_len + j] = p @ rows[:, :L]
    calls = emu.calls + cute.calls
    return rel_err(out.double(), ref), meta, calls


@pytest.mark.parametrize("use_fixed", [True, False], ids=["fixed", "build"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,backend", [(16, "trtllm-gen"), (128, "trtllm-gen"), (20, "cute-dsl"), (96, "cute-dsl")])
@pytest.mark.parametrize("capacity", [256, 512, 4096])
def test_slot(real, heads, backend, q_len, use_fixed, capacity):
    err, meta, calls = _direct(real, backend, heads, [0, 64, 128], 200, q_len, capacity, use_fixed)
    c = calls[-1]
    print(f"\n{'fixed' if use_fixed else 'build'} H={heads} {backend} q={q_len} cap={capacity} err={err:.2e} "
          f"max_seq_len={meta.max_seq_len} tables={tuple(meta.block_tables.shape)} kw={c.get('kw', {}).get('reducer_max_splits')}")
    assert err < 1e-2


@pytest.mark.parametrize("heads,backend", [(16, "trtllm-gen"), (20, "cute-dsl")])
def test_slot_batch1_odd_capacity(real, heads, backend):
    """B=1 cache_pitch falls back to the view's length: pitch 200 -> ceil(200/64) = 4 pages; pitch 130 -> 3."""
    err, meta, calls = _direct(real, backend, heads, [0], 120, 1, 192, True)
    print("\n", meta.max_seq_len, tuple(meta.block_tables.shape), err)


# ------------------------------------------------------------------------------------------- 3. continuous batching
from transformers import ContinuousBatchingConfig
from test_continuous_batching import greedy, prompts


def _cb(real, monkeypatch, page_size, heads):
    buffers.WORKSPACE_BYTES = 128 * 1024 * 1024
    emu, cute = real
    model = make_model("deepseek_v3", dtype=torch.bfloat16, num_attention_heads=heads, num_key_value_heads=heads, **BIG)
    batch = prompts(lengths=(70, 41, 150, 96, 33), seed=5)
    cb = dict(page_size=page_size, num_blocks=2048 // page_size, max_batch_tokens=64, max_requests_per_batch=4)
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=ContinuousBatchingConfig(**cb))
    errs = [o.error for o in out.values()]
    toks = [o.generated_tokens for o in out.values()]
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "reference")
    ref = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=ContinuousBatchingConfig(**cb))
    rtoks = [o.generated_tokens for o in ref.values()]
    calls = emu.calls + cute.calls
    print(f"\npage={page_size} H={heads} errors={[str(e)[:120] if e else None for e in errs]} same_tokens={toks == rtoks} "
          f"calls={len(calls)} {[(c['batch'], c['tables'], c['page'], c['seq_lens'].tolist()) for c in calls[:2]]}")
    return errs, toks == rtoks, calls


@pytest.mark.parametrize("page_size", [32, 64, 128])
@pytest.mark.parametrize("heads", [16, 20])
def test_cb(real, monkeypatch, page_size, heads):
    errs, same, calls = _cb(real, monkeypatch, page_size, heads)
    assert errs == [None] * 5 and same and calls


def main(argv=None) -> int:
    """These probes under pytest (``-k`` selects some by name)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="keyword", default=None, help="run only the probes whose names match (pytest -k)")
    args = parser.parse_args(argv)
    return int(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider",
                            *(["-k", args.keyword] if args.keyword else [])]))


if __name__ == "__main__":
    sys.exit(main())
