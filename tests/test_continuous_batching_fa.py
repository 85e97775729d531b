"""The fa3/fa2 paged decode path of continuous batching, on the CPU, through the FlashInfer stand-in
(``fake_flashinfer.py``): FlashInfer's module planned from the step's host lengths with the read indices as the page
table (pages of one row), against the reference backend and against eager ``generate()``."""

from __future__ import annotations

import pytest
import torch

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from conftest import make_model
from hf_flashinfer_mla import paged
from hf_flashinfer_mla.absorption import absorb_query, absorbed_weights, rope_rows
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
        step = paged.PagedStep(q_lens, k_lens, tokens)
        idx = step.cu_q[step.decode]
        q_nope, q_pe = query[:, :, idx].split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        key = (query.device, query.dtype, heads, 32, 8, 0.3, backend)
        route = paged._route(step, key, table)
        assert route.backend == backend
        outs[backend] = route.run(absorb_query(q_nope, weights), rope_rows(q_pe), kv, rot)
    torch.testing.assert_close(outs["fa3"], outs["reference"], rtol=1e-10, atol=1e-10)
    plan = fake_hopper.modules["fa3"].plans[-1]
    assert plan["kv_len"].tolist() == [9, 13] and plan["kv_indptr"][:2].tolist() == [0, 16]
