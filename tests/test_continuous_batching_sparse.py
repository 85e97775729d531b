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
from helpers import DSA_FAMILIES, VOCAB, count_calls, make_model, set_attention
from hf_flashinfer_mla import UnsupportedModelError, paged_attention, paged_indexer
from hf_flashinfer_mla.kernels import fa
from hf_flashinfer_mla.paged_cache import SlidingLatentAllocator
from test_continuous_batching import greedy, small_cb, steps  # noqa: F401  (steps: a fixture)
from test_continuous_batching_graphs import emulated_graphs  # noqa: F401  (a fixture)

NEW_TOKENS = 4
# Sparse families whose other layer types have no paged latent cache: refused, naming those layers.
HYBRID = {"glm5_next": "linear_attention"}
SERVED = [t for t in DSA_FAMILIES if t not in HYBRID]
SLIDING = "dots3_note_text"  # DSA layers beside sliding-window MLA layers of their own latent width


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
        decode = (step.q_lens == 1).nonzero().flatten()  # the requests of one query token
        if len(decode):
            tokens = step.cu_q[decode]
            seen["selections"].append((step.k_lens[decode], (out[0, tokens] >= 0).sum(-1)))
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
    if model_type == SLIDING:  # (Transformers shares no prompt block where a layer keeps a ring of pages)
        assert not observed["matched"]
    else:
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
def _on_fa3(fake_hopper, monkeypatch, model_type="deepseek_v32", **overrides):
    model = sparse_model(model_type, **overrides)  # float64: the stand-in's dtype
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


# -------------------------------------------------------------------------------- prefill chunks, absorbed
@pytest.fixture
def absorbed_steps(monkeypatch):
    """Per step planned: whether every query token ran absorbed (``PagedStep.absorbed``), and its query lengths."""
    seen = []
    of_batch = paged_attention.PagedStep.of_batch

    def recorded(requests, allocator, *args, **kwargs):
        step = of_batch(requests, allocator, *args, **kwargs)
        seen.append((step.absorbed, step.q_lens.tolist()))
        return step

    monkeypatch.setattr(paged_attention.PagedStep, "of_batch", staticmethod(recorded))
    return seen


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_sparse_prefill_chunks_on_the_fa3_stand_in_match_eager(fake_hopper, monkeypatch, absorbed_steps, absorbed):
    """A sparse model's steps with prefill chunks run every query token absorbed over the rows its indexer picked,
    on FlashInfer's sparse kernel (one request per token), and give eager's tokens; so does the expanded path it
    replaces (``SPARSE_CHUNKS_ABSORBED`` off: chunks expanded and attended under the selection as a mask)."""
    monkeypatch.setattr(paged_attention, "SPARSE_CHUNKS_ABSORBED", absorbed)
    model, runs = _on_fa3(fake_hopper, monkeypatch)
    expanded = count_calls(monkeypatch, paged_attention, "sdpa_attention_forward")  # (chunks expanded: `_prefill`)
    batch = requests()
    expected = [(None, tokens) for tokens in eager_tokens(model, batch, NEW_TOKENS)]
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert [(o.error, o.generated_tokens) for o in out.values()] == expected
    chunked = [ran for ran, q_lens in absorbed_steps if max(q_lens) > 1]
    assert chunked and all(ran == absorbed for ran in chunked)
    assert bool(expanded) != absorbed  # (expanded: SDPA ran; absorbed: never)
    if absorbed:  # plans of a whole step's tokens, each over min(topk, visible) rows
        topk = model.config.get_text_config(decoder=True).index_topk
        plans = [p for p in fake_hopper.modules["fa3"].plans if (p["kv_len"] <= topk).all()]
        assert max(len(p["kv_len"]) for p in plans) > serving_cb().max_requests_per_batch


def test_control_absorbed_prefill_tokens_reading_their_chunks_last_selection_fails(fake_hopper, monkeypatch,
                                                                                    absorbed_steps):
    """Control: every prefill token of a chunk given its chunk's last token's selection (rows after its own among
    them) gives other tokens than eager's: the absorbed prefill tokens' attention reaches the answers. The fault is
    shown to have changed selections of absorbed steps."""
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests()
    expected = eager_tokens(model, batch, NEW_TOKENS)
    select, changed = paged_indexer.select, []

    def last_tokens_selection(indexer, forward, bound, allocator):
        out = select(indexer, forward, bound, allocator)
        step = allocator.step
        for r in (step.q_lens > 1).nonzero().flatten().tolist():
            first, last = int(step.cu_q[r]), int(step.cu_q[r + 1]) - 1
            changed.append(step.absorbed and not torch.equal(out[0, first:last], out[0, last].expand(last - first, -1)))
            out[0, first:last] = out[0, last]
        return out

    monkeypatch.setattr(paged_indexer, "select", last_tokens_selection)
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert any(changed)
    assert [o.generated_tokens for o in out.values()] != expected


def test_absorbed_tokens_on_the_reference_in_slices_match_eager(monkeypatch):
    """The reference attends a step's absorbed tokens in slices bounded by ``PAGED_SPARSE_BYTES`` (a step's tokens
    over their selected rows would otherwise be gathered at once): at one token per slice, eager's tokens; every
    prompt token went through a slice of its own."""
    from hf_flashinfer_mla.kernels import reference

    monkeypatch.setattr(reference, "PAGED_SPARSE_BYTES", 1)
    sliced, real = [], reference._paged_sparse

    def counted(layer, q_lat, *args):
        sliced.append(q_lat.shape[1])
        return real(layer, q_lat, *args)

    monkeypatch.setattr(reference, "_paged_sparse", counted)
    model = sparse_model("deepseek_v32", dtype=torch.float32)
    batch = requests(12, shared=0)
    expected = eager_tokens(model, batch)
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert [o.generated_tokens for o in out.values()] == expected
    assert set(sliced) == {1} and len(sliced) >= sum(len(p) for p in batch)


# ------------------------------------------------------------------------------- sliding-window layers beside DSA
# dots3's sliding-window layers keep each request's last `sliding_window` tokens (4 in the test model) in a ring of
# pages, with a latent of their own width; its DSA layers page as the other families' do.
# A sliding-window layer first: what it gets wrong for a prompt's earlier tokens reaches the last token's logits
# through three more layers (in the family's default order its two sliding layers come last, where it barely does).
WINDOW_FIRST = dict(layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"])
# dots3 built without DSA (its config's `use_dsa=False`): full-attention MLA layers beside the sliding-window ones.
WINDOW_FIRST_DENSE = dict(use_dsa=False,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


def _window_of(model) -> int:
    return model.config.get_text_config(decoder=True).sliding_window


@pytest.mark.parametrize("layers", [WINDOW_FIRST, WINDOW_FIRST_DENSE], ids=["dsa", "without-dsa"])
def test_sliding_window_layers_see_their_window_under_continuous_batching(steps, layers):
    """Beyond the family test above: the schedule put every case of the window before the sliding layers, a chunk
    longer than the window, a chunk whose cached past filled the window (its new rows overwrite, in the ring, rows
    its own earlier tokens see), and decodes over a whole window, and every answer is eager's; beside DSA layers
    and beside dense ones."""
    model = sparse_model(SLIDING, dtype=torch.float32, **layers)
    window, batch = _window_of(model), requests()
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert [(o.error, o.generated_tokens) for o in out.values()] == [(None, t) for t in eager_tokens(model, batch)]
    pairs = [(q, k) for qs, ks in steps.windows for q, k in zip(qs, ks)]
    assert all(k - q <= window - 1 for q, k in pairs)  # (a step reads at most the window's last rows back)
    assert any(q > window for q, _ in pairs)
    assert any(1 < q and k - q == window - 1 for q, k in pairs)
    assert any(q == 1 and k == window for q, k in pairs)


@pytest.mark.parametrize("swa_rank", [32, 48])
def test_sliding_window_decode_on_the_fa3_stand_in_matches_eager(fake_hopper, monkeypatch, swa_rank):
    """On the fa3 stand-in (kernels built for a latent of 32 + 8) the DSA layers decode on FlashInfer's sparse
    kernel; sliding-window layers of that width on its dense kernel, over each request's gathered window (pages of
    one row), and wider ones on the reference, as in generate() (dots3's own: 1024 + 64, which no FlashInfer MLA
    kernel takes)."""
    model, runs = _on_fa3(fake_hopper, monkeypatch, SLIDING, swa_kv_lora_rank=swa_rank, **WINDOW_FIRST)
    batch = requests()
    expected = [(None, tokens) for tokens in eager_tokens(model, batch, NEW_TOKENS)]
    first, second = _served_twice(model, batch)
    assert first == expected and second == expected
    topk = model.config.get_text_config(decoder=True).index_topk
    assert set(runs) == ({0, topk} if swa_rank == 32 else {topk})  # (0: a dense layer's)


def test_control_new_rows_written_before_the_window_is_gathered_fails(monkeypatch):
    """Control: the sliding layers' new rows written into the ring before the window is read back (as a full
    layer's are) give a chunk's earlier tokens rows of its later ones, and other tokens than eager's. The fault is
    shown to have changed the rows some chunks saw."""
    model = sparse_model(SLIDING, dtype=torch.float32, **WINDOW_FIRST)
    batch = requests()
    expected = eager_tokens(model, batch)
    changed = []
    update = SlidingLatentAllocator.update

    def written_first(self, key_states, value_states, layer_idx, read_index, write_index):
        rows, cached = self._layer_rows[layer_idx], read_index[read_index != self.sentinel_index]
        before = rows.index_select(0, cached)
        update(self, key_states, value_states, layer_idx, read_index, write_index)  # writes the new rows ...
        changed.append(not torch.equal(before, rows.index_select(0, cached)))
        return update(self, key_states, value_states, layer_idx, read_index, write_index)  # ... then gathers

    monkeypatch.setattr(SlidingLatentAllocator, "update", written_first)
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert any(changed)
    assert [o.generated_tokens for o in out.values()] != expected


def test_control_a_chunk_attending_past_its_window_fails(monkeypatch, steps):
    """Control: prefill chunks of the sliding layers attended causally without the window give other tokens than
    eager's. The fault is shown to have met chunks whose tokens would see more rows than the window."""
    model = sparse_model(SLIDING, dtype=torch.float32, **WINDOW_FIRST)
    window, batch = _window_of(model), requests()
    expected = eager_tokens(model, batch)
    prefill = paged_attention._prefill

    def windowless(allocator, *args, **kwargs):
        if not isinstance(allocator, SlidingLatentAllocator):
            return prefill(allocator, *args, **kwargs)
        monkeypatch.setattr(allocator, "sliding_window", None)  # (the ring's indices were laid out already)
        try:
            return prefill(allocator, *args, **kwargs)
        finally:
            monkeypatch.setattr(allocator, "sliding_window", window)

    monkeypatch.setattr(paged_attention, "_prefill", windowless)
    out = model.generate_batch(batch, generation_config=greedy(NEW_TOKENS), continuous_batching_config=serving_cb())
    assert any(q > 1 and k > window for qs, ks in steps.windows for q, k in zip(qs, ks))
    assert [o.generated_tokens for o in out.values()] != expected


def test_sliding_window_layers_keep_continuous_batching_out_of_cuda_graphs():
    """A model with sliding-window MLA layers runs continuous batching without CUDA graphs, naming why, with DSA
    layers beside them or without (its sliding layers attend over a window gathered into a new tensor every
    step)."""
    assert "sliding-window layers" in paged_attention.graph_refusal(sparse_model(SLIDING), 64)
    assert "sliding-window layers" in paged_attention.graph_refusal(sparse_model(SLIDING, **WINDOW_FIRST_DENSE), 64)


# ------------------------------------------------------------------------------------------------ in CUDA graphs
def _graphed_cb() -> ContinuousBatchingConfig:
    """`serving_cb` with Transformers' graph padding: query tokens to multiples of 3, past rows to 64s (so that
    decode steps of a few requests meet a graph again as their contexts grow)."""
    return small_cb(num_blocks=96, max_batch_tokens=24, max_requests_per_batch=6, q_padding_interval_size=3,
                    kv_padding_interval_size=64)


GRAPHED_NEW = 8


@pytest.fixture
def graphed_selections(monkeypatch):
    """Per graphed sparse step (the indexer's first layer, warm-up, capture or replay): each real request's rows
    and the rows its selection kept."""
    seen = []
    in_graph = paged_indexer._select_in_graph

    def spy(indexer, forward, bound, allocator, step, *args):
        out = in_graph(indexer, forward, bound, allocator, step, *args)
        if indexer.layer_idx == allocator.layer_indices[0]:
            seen.append((step.k_lens.clone(), (out[0, : step.requests] >= 0).sum(-1)))
        return out

    monkeypatch.setattr(paged_indexer, "_select_in_graph", spy)
    return seen


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])  # (GLM: layers reusing a selection)
def test_sparse_decode_steps_replay_cuda_graphs_with_the_tokens_of_eager(emulated_graphs, fake_hopper, monkeypatch,
                                                                        graphed_selections, model_type):
    """A DSA model's decode steps run in CUDA graphs on fa3: the indexer scores each padded query token over the
    graph's fixed width of rows, read from where the step's launch wrote them, and its top-k feeds FlashInfer's
    sparse kernel with no host round trip; replayed over batches that change as requests join and finish, every
    request gets eager's tokens. Prefill chunks run uncompiled, as before."""
    made, prepared = emulated_graphs
    model, runs = _on_fa3(fake_hopper, monkeypatch, model_type)
    batch = requests(16, shared=4)
    out = model.generate_batch(batch, generation_config=greedy(GRAPHED_NEW), continuous_batching_config=_graphed_cb())
    expected = eager_tokens(model, batch, GRAPHED_NEW)
    assert [(o.error, o.generated_tokens) for o in out.values()] == [(None, t) for t in expected]
    graphed = [(n, t) for g, n, t, _ in prepared if g]
    assert made and sum(g.replays for g in made) > 0  # captured, then replayed
    assert len({n for n, _ in graphed}) >= 2 and any(n < t for n, t in graphed)  # joins/finishes, padding rows
    assert all(all(q == 1 for q in qs) for g, _, _, qs in prepared if g)  # (only decode steps)
    assert any(not g for g, *_ in prepared)  # prefill chunks uncompiled
    topk = model.config.get_text_config(decoder=True).index_topk
    assert graphed_selections and set(runs) == {topk}
    for visible, kept in graphed_selections:  # min(topk, visible) rows, and fewer than visible somewhere
        assert torch.equal(kept, visible.clamp(max=topk))
    assert any((visible > topk).any() for visible, _ in graphed_selections)


def test_graphed_sparse_control_a_replay_reading_the_step_befores_rows_fails(emulated_graphs, fake_hopper,
                                                                               monkeypatch):
    """Control: the indexer's per-token rows not rewritten before a replay (each token scored over the rows of
    the step before, which had one fewer for a decode) gives other tokens than eager's; the skipped writes were
    graphed steps'."""
    made, _ = emulated_graphs
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests(16, shared=4)
    expected = eager_tokens(model, batch, GRAPHED_NEW)
    skipped, launch = [], paged_attention.PagedStep.launch

    def stale(step, allocator):
        if step.graphed and step.width and made:  # (once a graph exists: replays read the rows left before)
            kept = allocator.token_rows.clone()
            launch(step, allocator)
            skipped.append(step.batch)
            allocator.token_rows.copy_(kept)
            return
        launch(step, allocator)

    monkeypatch.setattr(paged_attention.PagedStep, "launch", stale)
    out = model.generate_batch(batch, generation_config=greedy(GRAPHED_NEW), continuous_batching_config=_graphed_cb())
    assert skipped
    assert [o.generated_tokens for o in out.values()] != expected


def test_graphed_sparse_control_a_selection_keeping_every_row_fails(emulated_graphs, fake_hopper, monkeypatch):
    """Control: in graphs too, an indexer whose top-k spans every row gives other tokens than eager's sparse
    model."""
    made, prepared = emulated_graphs
    model, _ = _on_fa3(fake_hopper, monkeypatch)
    batch = requests(16, shared=4)
    expected = eager_tokens(model, batch, GRAPHED_NEW)
    for indexer in [m for m in model.modules() if type(m).__name__.endswith("Indexer")]:
        indexer.index_topk = 10**6
    out = model.generate_batch(batch, generation_config=greedy(GRAPHED_NEW), continuous_batching_config=_graphed_cb())
    assert any(g for g, *_ in prepared) and sum(g.replays for g in made) > 0
    assert [o.generated_tokens for o in out.values()] != expected
