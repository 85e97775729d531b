"""The fa3/fa2 paged decode path of continuous batching, on the CPU, through the FlashInfer stand-in
(``fake_flashinfer.py``): FlashInfer's module planned from the step's host lengths with the read indices as the page
table (pages of one row), against the reference backend and against eager ``generate()``."""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from helpers import make_model
from hf_flashinfer_mla import paged_attention
from hf_flashinfer_mla.absorption import absorb_query, absorbed_weights
from test_continuous_batching import eager_tokens, greedy, prompts, small_cb


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_generate_batch_on_the_kernel_matches_eager(fake_hopper, monkeypatch, backend):
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    model = make_model("deepseek_v3")  # float64: the stand-in's dtype
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    module = fake_hopper.modules[backend]
    layers = len([m for m in model.modules() if hasattr(m, "kv_b_proj")])
    assert module.plans and module.runs == layers * len(module.plans)  # planned once per step, run per layer
    assert not any(p["causal"] for p in module.plans)  # one query token per request
    assert any(p["kv_len"].numel() > 1 for p in module.plans)
    prefill = [w for w in fake_hopper.ragged if w.plans]
    if backend == "fa3":  # prefill chunks on the ragged prefill: planned once per step, run by every layer
        assert prefill and all(w.runs == layers * len(w.plans) for w in prefill)
        assert any((p["kv_indptr"].diff() > p["qo_indptr"].diff()).any() for w in prefill for p in w.plans)
    else:  # fa2 steps prefill on SDPA
        assert not prefill


@pytest.mark.parametrize("grouped", [False, True])
def test_prefill_chunks_on_ragged_prefill_match_eager(fake_hopper, monkeypatch, grouped):
    """Prefill chunks after a cached past, on the ragged prefill in one launch per step, or (`grouped`: a budget of
    a few rows) in several groups, each planned on its own wrapper: the tokens of eager generate() per request."""
    from hf_flashinfer_mla.kernels import ragged

    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa3")
    if grouped:
        monkeypatch.setattr(ragged, "EXPANDED_BYTES", 1)  # every request a group of its own
    model = make_model("deepseek_v3")
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    plans = [p for w in fake_hopper.ragged for p in w.plans]
    assert any((p["kv_indptr"].diff() > p["qo_indptr"].diff()).any() for p in plans)  # a chunk after its past
    per_launch = [p["qo_indptr"].numel() - 1 for p in plans]
    if grouped:  # one request per launch, and a wrapper per group of a step, kept by the cache
        assert set(per_launch) == {1} and len(fake_hopper.ragged) >= 2
    else:  # a step's prefill requests in one launch, on the one wrapper of its set (consecutive steps: two sets)
        assert max(per_launch) >= 2 and len(fake_hopper.ragged) == 2


def test_ragged_prefill_control_misaligned_causal_fails(fake_hopper, monkeypatch):
    """Control: a ragged prefill that aligns its causal mask top-left (a chunk after a past would not see its own
    rows) changes the tokens; the fault is shown to have been reached on a chunk that has a past."""
    from fake_flashinfer import FakeRaggedPrefill

    reached = []

    def misaligned(self, q, k, v):
        plan = self.plans[-1]
        qo, kv = plan["qo_indptr"].tolist(), plan["kv_indptr"].tolist()
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for q0, q1, k0, k1 in zip(qo, qo[1:], kv, kv[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * plan["scale"]
            scores = scores.masked_fill(torch.arange(k1 - k0)[None, :] > torch.arange(q1 - q0)[:, None], -torch.inf)
            reached.append(k1 - k0 > q1 - q0)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v[k0:k1])
        return out

    monkeypatch.setattr(FakeRaggedPrefill, "run", misaligned)
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa3")
    model = make_model("deepseek_v3")
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert any(reached)
    assert [o.generated_tokens for o in out.values()] != eager_tokens(model, batch)


def test_mixed_step_kernel_against_reference(fake_hopper):
    """One step of 2 decodes around a prefill chunk, its rows scattered over the cache: the decode tokens' output
    on the kernel equals the reference backend's, on the same page table."""
    model = make_model("deepseek_v3")
    attn = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    g = torch.Generator().manual_seed(0)
    rows = 64
    latent = torch.randn(rows, 1, 40, generator=g, dtype=torch.float64)
    kv, rot = latent[:, :, :32].transpose(0, 1)[None], latent[:, :, 32:].transpose(0, 1)[None]
    q_lens, k_lens = torch.tensor([1, 5, 1]), torch.tensor([9, 7, 13])
    table = torch.randperm(rows, generator=g)[: int(k_lens.sum())]
    heads, tokens = attn.num_heads, int(q_lens.sum())
    query = torch.randn(1, heads, tokens, attn.qk_head_dim, generator=g, dtype=torch.float64)
    weights = absorbed_weights(attn, torch.float64)
    outs = {}
    for backend in ("fa3", "reference"):
        step = paged_attention.PagedStep(q_lens, k_lens, tokens)
        step.start(table)
        q_lat, q_pe = absorb_query(query[:, :, step.cu_q[step.decode]], attn.qk_nope_head_dim, weights)
        route = step.route(backend, step.layer_of(q_lat, kv, rot, 0.3), backend, False)
        assert route.backend == backend
        outs[backend] = route.run(q_lat, q_pe, kv, rot)
    torch.testing.assert_close(outs["fa3"], outs["reference"], rtol=1e-10, atol=1e-10)
    plan = fake_hopper.modules["fa3"].plans[-1]
    assert plan["kv_len"].tolist() == [9, 13] and plan["kv_indptr"][:2].tolist() == [0, 16]


def _long_prompts():
    """Prompts of 40 to 150 tokens: several of trtllm-gen's 32-row pages each, and chunked prefills at 64 tokens."""
    return prompts(lengths=(70, 41, 150, 96, 33), seed=5)


@pytest.mark.parametrize("page_size", [32, 64, 128])
def test_generate_batch_on_trtllm_gen_matches_eager(monkeypatch, page_size):
    """Blackwell (the trtllm-gen stand-in of ``fake_flashinfer.py``): decode tokens read Transformers' pages through
    block tables of 64 (or 32) rows gathered from the read indices, with the device's counter buffer; the tokens of
    eager generate() per request."""
    from fake_flashinfer import blackwell

    kernel = blackwell(monkeypatch)
    model = make_model("deepseek_v3")
    batch = _long_prompts()
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=2048 // page_size, max_batch_tokens=64,
                                  max_requests_per_batch=4)
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=cb)
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    calls = [c for c in kernel.calls if c["backend"] == "auto"]
    assert calls and all(c["counter"] is calls[0]["counter"] for c in calls)  # one zero-once buffer
    page = 32 if page_size == 32 else 64
    assert all(c["pages"] * page >= 2048 for c in calls)  # kv_cache: the layer's rows in pages of `page` rows
    assert any(c["batch"] > 1 for c in calls) and any(int(c["seq_lens"].max()) > page for c in calls)


def test_trtllm_gen_declines_pages_it_cannot_read(monkeypatch):
    """Pages of 4 tokens hold no 32-row page: the decode runs on the reference (fa2 is not available on the
    stand-in), with tokens still equal to eager, and trtllm-gen never launched."""
    from fake_flashinfer import blackwell

    kernel = blackwell(monkeypatch)
    model = make_model("deepseek_v3")
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    assert not kernel.calls


def test_ragged_groups_stay_within_the_expansion_bound(monkeypatch):
    """Consecutive prefill requests share a launch while their expanded rows fit `EXPANDED_BYTES`; a request longer
    than the bound is a group of its own; each group's token and row positions are its requests' own, in order."""
    from hf_flashinfer_mla.kernels import ragged

    monkeypatch.setattr(ragged, "EXPANDED_BYTES", 15 * 100)  # 15 rows of 100 bytes
    q_lens, k_lens = torch.tensor([5, 1, 10, 3, 20, 2]), torch.tensor([5, 9, 10, 3, 20, 12])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    kv_offsets = torch.cat([torch.zeros(1, dtype=torch.long), k_lens.cumsum(0)])
    groups = ragged.groups(q_lens, k_lens, cu_q, kv_offsets, [0, 2, 3, 4, 5], 100, torch.device("cpu"))
    assert [g.requests for g in groups] == [[0, 2], [3], [4], [5]]
    assert groups[0].q_index.tolist() == list(range(0, 5)) + list(range(6, 16))
    assert groups[0].kv_index.tolist() == list(range(0, 5)) + list(range(14, 24))
    assert all(int(k_lens[g.requests].sum()) <= 15 for g in groups if len(g.requests) > 1)


def test_every_caller_decodes_through_one_routine(fake_hopper, monkeypatch):
    """generate() and continuous batching decode every layer through `decode.decode_layer` (the only caller of the
    output projection), each step routing once per layer shape: on the step's plan (`StepPlan`) for generate(), on
    the paged step (`PagedStep`) for continuous batching."""
    from hf_flashinfer_mla import decode, plan

    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa3")
    projected, routed = [], []
    project = decode.project_output
    monkeypatch.setattr(decode, "project_output", lambda *a: projected.append(1) or project(*a))
    route = plan.Routing.route
    monkeypatch.setattr(plan.Routing, "route", lambda step, *a: routed.append(type(step).__name__) or route(step, *a))
    model = make_model("deepseek_v3")
    layers = len([m for m in model.modules() if hasattr(m, "kv_b_proj")])
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    steps = len(fake_hopper.modules["fa3"].plans)
    assert routed == ["PagedStep"] * steps and len(projected) == layers * steps
    projected.clear(), routed.clear()
    model.generate(torch.tensor([batch[0]]), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert set(routed) == {"StepPlan"} and len(projected) == layers * len(routed)


def test_page_table_control_rolled_indices_fail(fake_hopper, monkeypatch):
    """Control: the page table the kernel reads rolled by one entry (each position of a request names the row of the
    one before it) changes the tokens; the fault is shown to have been applied."""
    from hf_flashinfer_mla.rows import PageTable

    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa3")
    rolled = []
    typed = PageTable.typed

    def rolled_typed(self, dtype):
        out = typed(self, dtype)
        rolled.append(out.numel() > 1 and bool((out.roll(1) != out).any()))
        return out.roll(1)

    monkeypatch.setattr(PageTable, "typed", rolled_typed)
    model = make_model("deepseek_v3")
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert any(rolled)
    assert [o.error for o in out.values()] == [None] * len(batch)
    assert [o.generated_tokens for o in out.values()] != eager_tokens(model, batch)
