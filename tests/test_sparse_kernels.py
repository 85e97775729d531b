"""Sparse (DSA) decode on the fa3 stand-in (``fake_flashinfer.py``): FlashInfer's contract for a sparse step (every
query token its own non-causal request over ``min(topk, visible)`` of its selected rows), planned once per step on
the host and run per layer with that layer's indices, gives eager's tokens; compiled static-cache steps of sparse
layers run the reference inline."""

from __future__ import annotations

import pytest

pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
import hf_flashinfer_mla
from helpers import DSA_FAMILIES, VOCAB, decode_logits, eager_alone, left_padded_batch, make_model, rel_err
from fake_flashinfer import fake_blackwell, fake_hopper  # noqa: F401  (fixtures)
from transformers import CompileConfig

from hf_flashinfer_mla.kernels import fa

TOL64 = 1e-6


def _matches_eager_per_row(model, steps: int, cache=None) -> None:
    """Teacher-forced decode of the helpers' left-padded batch (7, 4, 12) equals each row alone with eager."""
    ids, mask, prompts = left_padded_batch(lengths=(7, 4, 12))
    forced = torch.randint(1, VOCAB, (3, steps), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # (with autograd recording, decode runs the reference: kernels have no backward)
        ours = decode_logits(model, ids, mask, forced=forced, as_generate=True, cache=cache)
    for i, ref in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], ref) < TOL64


# The families whose sparse layers the kernel serves: GLM-5-next has no rope (its latent is 512 + 0, no FlashInfer
# kernel) and passes no indices; HY-V4's sinks are not in FlashInfer's MLA kernels (`test_sinks_decline_the_kernel`).
KERNEL_FAMILIES = [t for t in DSA_FAMILIES if t not in ("glm5_next", "hy_v4", "hy_v4_vl")]


@pytest.mark.parametrize("dsa_type", KERNEL_FAMILIES)
def test_fa3_sparse_decode_matches_eager_per_row(dsa_type, fake_hopper, monkeypatch):
    model = make_model(dsa_type, dtype=torch.float64)
    steps = 6
    runs = []
    real_run = fa.run

    def spy(meta, layer, *args, **kwargs):
        runs.append(layer.topk)
        return real_run(meta, layer, *args, **kwargs)

    monkeypatch.setattr(fa, "run", spy)
    _matches_eager_per_row(model, steps)
    topk = model.config.get_text_config(decoder=True).index_topk
    assert runs and all(k == topk for k in runs)
    plans = [p for p in fake_hopper.modules["fa3"].plans if not p["causal"]]
    # One sparse plan per step (shared by the step's sparse layers), one request per query token, no causal rule.
    assert len(plans) == steps
    for plan in plans:
        assert not plan["causal"] and plan["qo_indptr"].tolist() == list(range(4))
        assert plan["kv_indptr"].tolist() == [n * topk for n in range(4)]
        assert (plan["kv_len"] <= topk).all()


@pytest.mark.parametrize("dsa_type,topk", [("deepseek_v32", 4), ("glm_moe_dsa", 4), ("deepseek_v32", 11)])
def test_trtllm_gen_sparse_decode_matches_eager_per_row(dsa_type, topk, fake_blackwell):
    """Blackwell: trtllm-gen's sparse MLA over the packed cache generate() gives it, checked by the stand-in
    against the sparse contract vLLM's FlashInfer backend relies on (one row per query token, its slots, its
    count of valid picks as seq_lens, -1 after them)."""
    model = make_model(dsa_type, dtype=torch.float64, index_topk=topk)
    _matches_eager_per_row(model, 4, cache=hf_flashinfer_mla.MLALatentCache(model.config))
    sparse = [c for c in fake_blackwell.calls if c.get("sparse")]
    width = -(-topk // 4) * 4  # (the kernel takes lists a multiple of 4 wide: -1 past a token's picks)
    assert sparse and all(c["sparse"] == width and c["q_len"] == 1 for c in sparse)
    first = sparse[0]  # the first step: rows seeing 8, 5 and 13 positions, capped at topk
    counts = [min(n, topk) for n in (8, 5, 13)]
    assert first["seq_lens"].tolist() == counts and (first["tables"][:, 0] >= 0).sum(-1).tolist() == counts


@torch.no_grad()
def test_trtllm_gen_sparse_steps_with_left_padding_and_holes_match_eager(fake_blackwell):
    """Sparse steps of rows whose visible positions do not end where the row ends (left padding) or are not one run
    (holes in the mask) run trtllm-gen with each token's count of visible picks as its length, and give eager's
    logits (without left padding, where batched float64 eager is exact; left padding per row elsewhere)."""
    model = make_model("deepseek_v32", dtype=torch.float64, index_topk=5)
    g = torch.Generator().manual_seed(5)
    ids, forced = torch.randint(1, VOCAB, (2, 12), generator=g), torch.randint(1, VOCAB, (2, 2), generator=g)
    holes = torch.ones_like(ids)
    holes[0, 3] = holes[0, 7] = 0
    fake_blackwell.calls.clear()
    ours = decode_logits(model, ids, holes, cache=hf_flashinfer_mla.MLALatentCache(model.config), forced=forced)
    model.set_attn_implementation("eager")
    try:
        ref = decode_logits(model, ids, holes, forced=forced)
    finally:
        model.set_attn_implementation("flashinfer_mla")
    assert rel_err(ours, ref) < 1e-6
    sparse = [c for c in fake_blackwell.calls if c.get("sparse")]
    assert sparse and sparse[0]["seq_lens"].tolist() == [5, 5]  # (11 and 13 visible, capped at topk)
    short = make_model("deepseek_v32", dtype=torch.float64, index_topk=11)
    fake_blackwell.calls.clear()
    _matches_eager_per_row(short, 3, cache=hf_flashinfer_mla.MLALatentCache(short.config))
    sparse = [c for c in fake_blackwell.calls if c.get("sparse")]
    assert sparse and sparse[0]["seq_lens"].tolist() == [8, 5, 11]  # left-padded rows: their visible counts


def test_sinks_decline_the_kernel_and_decode_on_the_reference(fake_hopper, monkeypatch, caplog):
    _matches_eager_per_row(make_model("hy_v4", dtype=torch.float64), 3)
    assert not fake_hopper.modules.get("fa3", None) or not fake_hopper.modules["fa3"].runs
    assert any("attention sinks" in r.getMessage() or "fa3 declines" in r.getMessage() for r in caplog.records)


def test_rows_shorter_than_topk_attend_to_what_they_see(fake_hopper):
    """With index_topk above a row's visible positions, the plan's lengths are the visible counts (the indexer's
    tail picks, hidden positions, are never read) and the result is eager's."""
    _matches_eager_per_row(make_model("deepseek_v32", dtype=torch.float64, index_topk=11), 3)
    first = fake_hopper.modules["fa3"].plans[0]
    assert first["kv_len"].tolist() == [8, 5, 11]  # 7, 4, 12 prompt tokens + the first forced token, capped at 11


def test_compiled_static_generate_of_a_sparse_model_matches_uncompiled(fake_hopper):
    torch._dynamo.reset()
    model = make_model("deepseek_v32", dtype=torch.float64, first_k_dense_replace=2)  # no MoE: graphs need no
    ids, mask, _ = left_padded_batch()                                                 # data-dependent shapes
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")
    compiled = model.generate(**kwargs, compile_config=config)
    plain = model.generate(**kwargs, disable_compile=True)
    assert torch.equal(compiled.sequences, plain.sequences)
    assert max(rel_err(a, b) for a, b in zip(compiled.logits, plain.logits)) < TOL64
