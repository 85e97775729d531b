"""Sparse-attention (DSA) models under continuous batching (``paged_indexer.py``, ``paged_attention.py``), on the CPU.

Every DSA family the package decodes, served by ``generate_batch`` and a kept manager: 40 requests of 1 to 60 tokens
(eight of them sharing a 24-token prefix) with a cache small enough that requests queue, prompts are prefilled in
chunks after their cached past, decodes run beside prefill chunks, and a prefix is reused. Every request's tokens
must be eager ``generate()``'s on that prompt alone. The test models' ``index_topk`` is 4, so every prompt longer
than 4 tokens attends to a real subset of its rows (checked: the selection drops rows). The same on the fa3
stand-in, where the decode runs FlashInfer's sparse kernel over the selected rows; controls show that a selection
made over another request's rows, or one keeping every row, fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from helpers import DSA_FAMILIES, VOCAB, make_model, set_attention
from hf_flashinfer_mla import UnsupportedModelError, paged_indexer
from hf_flashinfer_mla.kernels import fa
from test_continuous_batching import greedy, small_cb, steps  # noqa: F401  (steps: a fixture)

NEW_TOKENS = 4
# Sparse families whose other layer types have no paged latent cache: refused, naming those layers.
HYBRID = {"glm5_next": "linear_attention", "dots3_note_text": "sliding_attention"}
SERVED = [t for t in DSA_FAMILIES if t not in HYBRID]


def sparse_model(model_type: str, **kwargs):
    """A test model whose padding token's embedding is not zero. At its zero initial value a generated padding token
    gets a zero indexer query, so every index score of that step is exactly 0: a full tie, which top-k breaks by
    position differently at another width (a padded batch, as generate() does too), selecting other rows than eager
    alone, with nothing wrong."""
    model = make_model(model_type, **kwargs)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[0] = embeddings[1:].std() * torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(0),
                                                          dtype=embeddings.dtype)
    return model


def eager_tokens(model, batch, new_tokens=NEW_TOKENS) -> list[list[int]]:
    """Each prompt generated alone with eager attention (on a multimodal model, its text model's): the oracle."""
    set_attention(model, "eager")
    try:
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in batch]
    finally:
        set_attention(model, "flashinfer_mla")


def requests(n=40, seed=11, shared=8, prefix=24) -> list[list[int]]:
    """`n` prompts of 1 to 60 tokens; the last `shared` of them start with one common `prefix`-token prefix."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 61, (n,), generator=g).tolist()
    lengths[:2] = [1, 60]
    common = torch.randint(1, VOCAB, (prefix,), generator=g).tolist()
    out = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]
    for i in range(max(0, n - shared), n):
        out[i] = common + out[i][: max(1, len(out[i]) - prefix)]
    return out


def serving_cb() -> ContinuousBatchingConfig:
    """Pages of 4 tokens, room for a few requests at a time, 24 query tokens per step: requests queue, long
    prompts are prefilled in chunks, decodes run beside chunks."""
    return small_cb(num_blocks=96, max_batch_tokens=24, max_requests_per_batch=6)


@pytest.fixture
def observed(monkeypatch):
    """Per indexer call of every step: (the step's decode rows seen, their selected rows), and the prompt tokens
    each request found cached (prefix sharing)."""
    seen = {"selections": [], "matched": []}
    select, search = paged_indexer.select, PagedAttentionCache.search_prefix_match

    def spy_select(indexer, forward, bound, allocator):
        out = select(indexer, forward, bound, allocator)
        step = allocator.step
        if len(step.decode):
            tokens = step.cu_q[step.decode]
            seen["selections"].append((step.k_lens[step.decode], (out[0, tokens] >= 0).sum(-1)))
        return out

    def spy_search(self, *args):
        seen["matched"].append(search(self, *args))
        return seen["matched"][-1]

    monkeypatch.setattr(paged_indexer, "select", spy_select)
    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", spy_search)
    return seen


def _served_twice(model, batch):
    """The batch through one kept manager, twice: both runs' tokens and errors, and the prompt tokens the second
    run found cached."""
    kept = dict(generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb(), persistent_manager=True)
    try:
        first = model.generate_batch(batch, **kept)
        second = model.generate_batch(batch, **kept)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return [[(o.error, o.generated_tokens) for o in out.values()] for out in (first, second)]


def _assert_real_selection(observed, topk):
    """The decode steps' selections kept min(topk, visible) rows, and dropped rows: top-k was smaller than the
    context."""
    assert observed["selections"]
    for visible, kept in observed["selections"]:
        assert torch.equal(kept, visible.clamp(max=topk))
    assert any((visible > topk).any() for visible, _ in observed["selections"])


@pytest.mark.parametrize("model_type", SERVED)
def test_every_sparse_family_under_continuous_batching_matches_eager(model_type, observed, steps):
    model = sparse_model(model_type, dtype=torch.float32)
    batch = requests()
    expected = [(None, tokens) for tokens in eager_tokens(model, batch, NEW_TOKENS)]
    first, second = _served_twice(model, batch)
    assert first == expected
    assert second == expected  # the kept manager, again
    # The schedule did what the test is for: queueing, a chunk reading its cached past, decodes beside prefills,
    # and the shared prefix read from the cache instead of prefilled again.
    assert max(len(q) for q, _ in steps) < len(batch)
    assert any(q > 1 and k > q for qs, ks in steps for q, k in zip(qs, ks))
    assert any(1 in qs and any(q > 1 for q in qs) for qs, _ in steps)
    assert sum(observed["matched"]) >= 24
    _assert_real_selection(observed, model.config.get_text_config(decoder=True).index_topk)


@pytest.mark.parametrize("model_type", HYBRID)
def test_hybrid_sparse_models_refused_naming_their_layers(model_type):
    model = make_model(model_type, dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match=f"{HYBRID[model_type]}.*no paged cache"):
        model.generate_batch(requests(2, shared=0), generation_config=greedy(), continuous_batching_config=serving_cb())


def test_sparse_models_on_other_attention_refused_naming_the_fix():
    """Transformers alone cannot page a DSA model's indexer keys: on sdpa, generate_batch raises in the caller's
    thread naming flashinfer_mla, instead of failing every request."""
    model = sparse_model("deepseek_v32", attn="sdpa", dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match='attn_implementation="flashinfer_mla"'):
        model.generate_batch(requests(2, shared=0), generation_config=greedy(), continuous_batching_config=serving_cb())


# ------------------------------------------------------------------------------------------- on the fa3 stand-in
def _on_fa3(fake_hopper, monkeypatch, model_type="deepseek_v32"):
    model = sparse_model(model_type)  # float64: the stand-in's dtype
    runs = []
    real_run = fa.run

    def spy(meta, layer, *args, **kwargs):
        runs.append(layer.topk)
        return real_run(meta, layer, *args, **kwargs)

    monkeypatch.setattr(fa, "run", spy)
    return model, runs


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])  # (GLM: layers reusing a selection)
def test_sparse_decode_on_the_fa3_stand_in_matches_eager(fake_hopper, monkeypatch, observed, model_type):
    model, runs = _on_fa3(fake_hopper, monkeypatch, model_type)
    batch = requests()
    expected = [(None, tokens) for tokens in eager_tokens(model, batch, NEW_TOKENS)]
    first, second = _served_twice(model, batch)
    assert first == expected and second == expected
    topk = model.config.get_text_config(decoder=True).index_topk
    # Every decode layer ran FlashInfer's kernel on the selection (pages of one row, one request per query token).
    assert runs and set(runs) == {topk}
    sparse = [p for p in fake_hopper.modules["fa3"].plans if (p["kv_len"] <= topk).all()]
    assert sparse and all((p["kv_indptr"].diff() == topk).all() for p in sparse)
    _assert_real_selection(observed, topk)


def test_control_a_selection_over_another_requests_rows_fails(fake_hopper, monkeypatch):
    """Control: each decode request's indexer handed the next request's rows (scored and picked there) gives other
    tokens than eager's. The fault is shown to have been injected on steps of several decode requests."""
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests()
    expected = eager_tokens(model, batch, NEW_TOKENS)
    injected = []
    real_call = paged_indexer._call

    def shifted(step, reqs, first, q):
        call = real_call(step, reqs, first, q)
        if len(reqs) > 1:
            injected.append(len(reqs))
            call.read, call.offsets = call.read.roll(1, 0), call.offsets.roll(1, 0)
            call.lens = call.lens.roll(1, 0)
            call.last = torch.minimum(call.last, call.lens[:, None] - 1)
        return call

    monkeypatch.setattr(paged_indexer, "_call", shifted)
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert injected
    assert [o.generated_tokens for o in out.values()] != expected


def test_control_a_selection_keeping_every_row_fails(fake_hopper, monkeypatch, observed):
    """Control: an indexer whose top-k spans every row (dense attention) gives other tokens than eager's sparse
    model: top-k really is smaller than the context, and the test above sees the difference."""
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests()
    expected = eager_tokens(model, batch, NEW_TOKENS)
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    for indexer in indexers:
        indexer.index_topk = 10**6
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert indexers and all(bool((kept == visible).all()) for visible, kept in observed["selections"])
    assert [o.generated_tokens for o in out.values()] != expected
