"""A DSA indexer's scores over each query token's own paged rows (``kernels/index_scores.py``) and the inputs it scores
with (``paged_indexer.scoring_inputs``), on the CPU: the PyTorch path selects what the model's own indexer selects,
for each family it serves; the Triton kernel (in Triton's interpreter, where Triton is installed) gives the PyTorch
path's scores. Under continuous batching, both ways of scoring give eager's tokens, and a token scored over one row
past its own fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from helpers import count_calls, make_model
from hf_flashinfer_mla import paged_indexer
from hf_flashinfer_mla.kernels import index_scores
from test_continuous_batching import greedy
from test_continuous_batching_sparse import _on_fa3, eager_tokens, requests, serving_cb

OWN_ROWS_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.mark.parametrize("model_type", OWN_ROWS_FAMILIES)
def test_scores_over_own_rows_select_what_the_models_indexer_selects(model_type):
    """The model's indexer and this package's scoring of its inputs, on the same 40 tokens (causal, so token i sees
    i + 1 rows, laid out shuffled in a larger key buffer): the same rows, token by token."""
    model = make_model(model_type, dtype=torch.float32)
    attention = model.model.layers[0].self_attn
    indexer = attention.indexer
    assert paged_indexer.scores_own_rows(indexer)
    t = 40
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, t, model.config.hidden_size, generator=g)
    q_resid = torch.randn(1, t, indexer.q_lora_rank, generator=g)
    positions = torch.arange(t)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)  # (the attention's, which its indexer is handed)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
    theirs = indexer(hidden, q_resid, cos_sin, causal, positions).long()[0]  # [t, topk]

    q, k, w = paged_indexer.scoring_inputs(indexer, {"hidden_states": hidden, "q_resid": q_resid,
                                                     "position_embeddings": cos_sin})
    rows = torch.randperm(3 * t, generator=g)[:t]  # position j's key lies at row rows[j]
    keys = torch.zeros(3 * t, k.shape[-1])
    keys[rows] = k
    lens = torch.arange(1, t + 1)
    scores = index_scores.scores(q, w, keys, rows, torch.zeros(t, dtype=torch.long), lens, t, indexer.softmax_scale,
                                 kernel=False)
    ours = scores.topk(min(indexer.index_topk, t), dim=-1).indices
    for i in range(t):
        assert set(theirs[i][theirs[i] <= i].tolist()) == set(ours[i][ours[i] <= i].tolist()), i
    assert indexer.index_topk < t  # (rows were dropped)


@pytest.mark.skipif(index_scores.triton is None, reason="Triton is not installed")
def test_the_triton_kernel_gives_the_pytorch_paths_scores_in_the_interpreter():
    """The Triton kernel, in Triton's interpreter (a fresh process: it is chosen at import), over ragged rows with
    tokens of no rows, strided keys and lengths that end mid-block, and over a chunk's tokens whose first row comes
    as one expanded value: the PyTorch path's scores and -inf past each token's rows."""
    script = textwrap.dedent("""
        import torch
        from hf_flashinfer_mla.kernels import index_scores as ix
        g = torch.Generator().manual_seed(0)
        t, h, d, n = 7, 64, 128, 3000
        keys = torch.randn(n, 3 * d, generator=g).to(torch.bfloat16)[:, d : 2 * d]
        q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
        w = torch.randn(t, h, generator=g)
        rows = torch.randperm(n, generator=g)
        assert ix.kernel_serves(q, keys)
        # ragged decode tokens; a chunk's tokens, their first row one expanded value (stride 0), as a call passes it
        for lens, first in ((torch.tensor([1, 100, 700, 257, 64, 0, 129]), torch.tensor([0, 10, 500, 1300, 2000, 0, 2500])),
                            (torch.arange(300, 307), torch.tensor([1500]).expand(7))):
            a = ix.scores(q, w, keys, rows, first, lens, 1024, 128 ** -0.5)
            b = ix.scores(q, w, keys, rows, first, lens, 1024, 128 ** -0.5, kernel=False)
            seen = torch.arange(1024) < lens[:, None]
            assert torch.equal(a.isfinite(), seen) and torch.equal(b.isfinite(), seen)
            err = (a[seen] - b[seen]).abs().max().item()
            assert err <= 1e-5 * b[seen].abs().max().item(), err
        print("ok", err)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(index_scores.triton is None, reason="Triton is not installed")
def test_continuous_batching_on_the_triton_kernel_in_the_interpreter_gives_the_pytorch_paths_tokens():
    """A bf16 DeepSeek-V3.2 model (16 index heads of 32: the kernel's tiles) under continuous batching, its scores
    from the Triton kernel in Triton's interpreter for every call: the tokens of the same run on the PyTorch path."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests")
        from hf_flashinfer_mla.kernels import index_scores
        from test_continuous_batching import greedy
        from test_continuous_batching_sparse import requests, serving_cb, sparse_model
        model = sparse_model("deepseek_v32", dtype=torch.bfloat16, index_n_heads=16, index_head_dim=32)
        served, batch, runs, kernels = index_scores.kernel_serves, requests(), [], []
        for kernel in (True, False):
            def serves(q, keys, kernel=kernel):
                kernels.append(kernel and served(q, keys))
                return kernels[-1]
            index_scores.kernel_serves = serves
            out = model.generate_batch(batch, generation_config=greedy(4), continuous_batching_config=serving_cb())
            runs.append([(o.error, o.generated_tokens) for o in out.values()])
        assert kernels.count(True) == kernels.count(False) > 0  # (the first run's calls all on the kernel)
        assert runs[0] == runs[1] and all(error is None for error, _ in runs[0])
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("own_rows", [True, False], ids=["own-rows", "indexer-forward"])
def test_continuous_batching_scores_over_own_rows_or_by_the_indexers_forward_match_eager(fake_hopper, monkeypatch,
                                                                                          own_rows):
    """DeepSeek-V3.2 on the fa3 stand-in under continuous batching (queueing, chunks over a cached past, decodes
    beside chunks): eager's tokens whether the scores are computed over each token's own rows or by the indexer's
    own forward per request group (``SCORES_OVER_OWN_ROWS``); the switch picks the path that ran."""
    monkeypatch.setattr(paged_indexer, "SCORES_OVER_OWN_ROWS", own_rows)
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    scored = count_calls(monkeypatch, index_scores, "scores")
    batch = requests()
    expected = [(None, tokens) for tokens in eager_tokens(model, batch)]
    out = model.generate_batch(batch, generation_config=greedy(4), continuous_batching_config=serving_cb())
    assert [(o.error, o.generated_tokens) for o in out.values()] == expected
    assert bool(scored) == own_rows


def test_control_a_token_scored_over_one_row_past_its_own_fails(fake_hopper, monkeypatch):
    """Control: each query token scored over one more row than it sees (a prefill token its chunk's next token's
    key) gives other tokens than eager's. The fault is shown to have reached tokens with rows left to read."""
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests()
    expected = eager_tokens(model, batch)
    real, widened = paged_indexer._pick, []

    def one_row_more(indexer, q, w, keys, source, first, lens, width):
        widened.append(bool((lens < width).any()))
        return real(indexer, q, w, keys, source, first, torch.clamp(lens + 1, max=width), width)

    monkeypatch.setattr(paged_indexer, "_pick", one_row_more)
    out = model.generate_batch(batch, generation_config=greedy(4), continuous_batching_config=serving_cb())
    assert any(widened)
    assert [o.generated_tokens for o in out.values()] != expected
