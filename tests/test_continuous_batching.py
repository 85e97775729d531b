"""Continuous batching (``generate_batch``, the manager) over the paged latent cache (``paged_cache.py``, ``paged_attention.py``), on the CPU.

Every dense family of the registry generates through Transformers' own continuous-batching loop, with a cache small
enough that requests queue and prefills are chunked (so steps mix decodes with prefill chunks that read a cached
past), and must give exactly the tokens of eager ``generate()`` run on each prompt alone.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from helpers import FAMILIES, HYBRIDS, VOCAB, make_config, make_model, package_warnings
from hf_flashinfer_mla import UnsupportedModelError, paged_attention, paged_cache
from hf_flashinfer_mla.paged_cache import SlidingLatentAllocator

NEW_TOKENS = 5
LENGTHS = (3, 9, 1, 14, 6, 11)
DENSE = [t for t in FAMILIES if t not in HYBRIDS]


def prompts(lengths=LENGTHS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def small_cb(**overrides) -> ContinuousBatchingConfig:
    """Pages of 4 tokens, 16 query tokens and 4 requests per step: 44 prompt tokens need several steps, the
    14-token prompt is prefilled in chunks, and later requests wait in the queue."""
    return ContinuousBatchingConfig(**{"page_size": 4, "num_blocks": 48, "max_batch_tokens": 16,
                                       "max_requests_per_batch": 4, **overrides})


def greedy(new_tokens=NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def eager_tokens(model, batch, new_tokens=NEW_TOKENS) -> list[list[int]]:
    """Each prompt generated alone with eager attention: the oracle."""
    model.set_attn_implementation("eager")
    try:
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in batch]
    finally:
        model.set_attn_implementation("flashinfer_mla")


class Steps(list):
    """Every `PagedStep` the loop prepared over full-attention rows: (query lengths, rows seen) per request; in
    `windows`, the same over sliding-window layers' rows (each request's window only)."""

    def __init__(self):
        super().__init__()
        self.windows = []


@pytest.fixture
def steps(monkeypatch):
    seen = Steps()
    original = paged_attention.PagedStep.of_batch

    def of_batch(requests, allocator, *args, **kwargs):
        step = original(requests, allocator, *args, **kwargs)
        into = seen.windows if isinstance(allocator, SlidingLatentAllocator) else seen
        into.append((step.q_lens.tolist(), step.k_lens.tolist()))
        return step

    monkeypatch.setattr(paged_attention.PagedStep, "of_batch", staticmethod(of_batch))
    return seen


@pytest.mark.parametrize("model_type", DENSE)
def test_generate_batch_matches_eager(model_type, steps):
    model = make_model(model_type, dtype=torch.float32)
    batch = prompts()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.error for o in out.values()] == [None] * len(batch)
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    # The schedule did what the test is for: queueing, a chunk reading its cached past, decodes beside prefills.
    assert max(len(q) for q, _ in steps) < len(batch)
    assert any(q > 1 and k > q for qs, ks in steps for q, k in zip(qs, ks))
    assert any(1 in qs and any(q > 1 for q in qs) for qs, _ in steps)
    assert model.config._attn_implementation == "flashinfer_mla"  # the manager switched nothing


def test_shared_prefixes_read_shared_blocks():
    """Prefix sharing: later requests reuse the cached latent rows of a common prompt prefix (their prefill starts
    after it), and still give eager's tokens."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    prefix = prompts((12,), seed=5)[0]
    batch = [prefix + tail for tail in prompts((3, 5, 2), seed=6)]
    cb = small_cb(max_requests_per_batch=1, max_batch_tokens=32)
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb)
    manager.start()
    try:
        got = []
        for p in batch:  # one after the other, so that the first one's complete blocks are in the cache
            rid = manager.add_request(p, max_new_tokens=NEW_TOKENS)
            got.append(next(o for o in manager.request_id_iter(rid) if o.is_finished()).generated_tokens)
        assert manager.batch_processor.cache.use_prefix_sharing
    finally:
        manager.stop(block=True, timeout=10)
    assert got == eager_tokens(model, batch)


def test_manager_streams_and_cancels():
    model = make_model("deepseek_v2", dtype=torch.float32)
    short, long_ = prompts((7, 4), seed=8)
    expected = eager_tokens(model, [short])[0]  # before the manager's thread runs the model
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_cb())
    manager.start()
    try:
        rid = manager.add_request(short, max_new_tokens=NEW_TOKENS, streaming=True)
        streamed = [o.generated_tokens for o in manager.request_id_iter(rid)]
        # One output per new token, each extending the last: the stream of eager's tokens.
        assert [len(s) for s in streamed] == list(range(1, NEW_TOKENS + 1))
        assert all(a == b[: len(a)] for a, b in zip(streamed, streamed[1:]))
        assert streamed[-1] == expected

        cancelled = manager.add_request(long_, max_new_tokens=200, streaming=True)
        for out in manager.request_id_iter(cancelled):
            if len(out.generated_tokens) >= 2:
                manager.cancel_request(cancelled)
                break
        time.sleep(0.5)
        late = []
        while (out := manager.get_result(timeout=0.2)) is not None:
            late.append(out)
        assert all(len(o.generated_tokens) < 200 for o in late)  # it stopped, and never finished
        assert not manager.batch_processor.scheduler.active_requests
        # The manager keeps serving after a cancellation.
        again = manager.add_request(short, max_new_tokens=NEW_TOKENS)
        assert next(o for o in manager.request_id_iter(again) if o.is_finished()).generated_tokens == streamed[-1]
    finally:
        manager.stop(block=True, timeout=10)


def test_an_empty_prompt_is_refused_in_the_callers_thread_and_the_model_keeps_serving(monkeypatch):
    """Transformers schedules an empty prompt as a request with nothing to attend from; beside others it is answered,
    without an error, from what its neighbours left (the control, with the seams' originals). generate_batch refuses
    it before the manager starts, naming the input, and a kept manager's add_request before queueing it; the requests
    after it give eager's tokens."""
    from transformers.generation.continuous_batching import continuous_api

    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((3, 9))
    expected = eager_tokens(model, batch)
    with pytest.raises(ValueError, match=r"empty prompt.*inputs \[1\] are empty"):
        model.generate_batch([batch[0], [], batch[1]], generation_config=greedy(),
                             continuous_batching_config=small_cb())
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == expected
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_cb())
    manager.start()
    try:
        with pytest.raises(ValueError, match="empty prompt"):
            manager.add_request([], max_new_tokens=NEW_TOKENS)
        rid = manager.add_request(batch[1], max_new_tokens=NEW_TOKENS)
        assert next(o for o in manager.request_id_iter(rid) if o.is_finished()).generated_tokens == expected[1]
    finally:
        manager.stop(block=True, timeout=10)
    # The control: without the two seams the empty prompt is answered, with no error and tokens made up.
    for cls, name in ((continuous_api.ContinuousMixin, "generate_batch"),
                      (continuous_api.ContinuousBatchingManager, "add_request")):
        monkeypatch.setattr(cls, name, getattr(cls, name).__wrapped__)
    out = list(model.generate_batch([batch[0], [], batch[1]], generation_config=greedy(),
                                    continuous_batching_config=small_cb()).values())
    assert out[1].error is None and len(out[1].generated_tokens) == NEW_TOKENS, out[1]


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrids_refused_at_generate_batch(model_type):
    model = make_model(model_type, dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="linear_attention.*no paged cache"):
        model.generate_batch(prompts((3, 4)), generation_config=greedy(), continuous_batching_config=small_cb())


def test_mla_on_other_implementations_refused_or_served_by_transformers(steps):
    """Up to Transformers 5.24 its paged cache cannot hold the latent: an MLA model on sdpa is refused in the caller's
    thread, naming the fix. From 5.25 Transformers pages the latent itself (`MLACacheAllocator`) and expands it for
    sdpa: served, with eager's tokens, and none of this package's paged steps ran."""
    model = make_model("deepseek_v3", attn="sdpa", dtype=torch.float32)
    batch = prompts((3, 4))
    if paged_cache.TRANSFORMERS_MLA_ALLOCATOR is None:
        with pytest.raises(UnsupportedModelError, match='attn_implementation="flashinfer_mla"'):
            model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
        return
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert not steps
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)


def test_non_mla_models_untouched():
    """A non-MLA model passes the check and gets Transformers' own per-head cache."""
    config = CONFIG_MAPPING["llama"](hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB)
    config._attn_implementation = "sdpa"
    paged_cache.refuse_unservable(SimpleNamespace(config=config))
    cache = _paged_cache(config)
    assert type(cache.cache_allocators["full_attention"]).__name__ == "FullAttentionCacheAllocator"


def _paged_cache(config, dtype=torch.bfloat16):
    cb = small_cb(num_blocks=8, max_memory_percent=0.5)
    cb.max_blocks_per_request = 0
    return PagedAttentionCache(config, cb, "cpu", DistributedHelper(None, None), dtype=dtype)


def test_cache_sized_from_latent_bytes():
    """DeepSeek-V3's attention shape: 576 values per token and layer, where Transformers' per-head sizing (its
    head_dim is the rope width, 64, for 128 key-value heads) takes 2 x 128 x 64 = 16384: 28x more tokens."""
    config = make_config("deepseek_v3", num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64)
    config._attn_implementation = "flashinfer_mla"
    cache = _paged_cache(config)
    allocator = cache.cache_allocators["full_attention"]
    assert isinstance(allocator, paged_cache.LatentAllocator)
    assert allocator.bytes_per_page == 4 * 576 * 2  # page_size x latent row x bf16
    config._attn_implementation = "sdpa"
    # Up to Transformers 5.24 its own cache sizes per-head K/V; from 5.25 it pages the latent too (its MLA allocator).
    per_token = 576 if paged_cache.TRANSFORMERS_MLA_ALLOCATOR is not None else 2 * 128 * 64
    own = _paged_cache(config)
    assert not isinstance(own.cache_allocators["full_attention"], paged_cache.LatentAllocator)
    assert own.cache_allocators["full_attention"].bytes_per_page / allocator.bytes_per_page == pytest.approx(
        per_token / 576)
    # The sizing counts bytes: the same number of blocks takes that much less memory.
    assert own.cache_tensor.numel() / cache.cache_tensor.numel() == pytest.approx(per_token / 576)


def test_odd_latent_width_rounds_up():
    config = make_config("minicpm3", kv_lora_rank=23, qk_rope_head_dim=4)
    config._attn_implementation = "flashinfer_mla"
    allocator = _paged_cache(config, torch.float32).cache_allocators["full_attention"]
    assert allocator.row_width == 28 and allocator.bytes_per_page == 4 * 28 * 4


def test_graphs_turned_off_once_with_their_reason_and_async_batching_with_them_unless_asked(caplog):
    """`resolve_graphs` turns CUDA graphs off only with a reason, said once. Asynchronous batching stays as resolved
    while graphs stay; where they go, it goes too (Transformers' own rule: async with graphs), unless it was
    asked for."""
    cb = ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=True)
    paged_cache.resolve_graphs(cb, None)
    assert cb.cuda_graph_booleans == (True, True) and cb.use_async_batching is True
    paged_cache.resolve_graphs(cb, "its decode runs on reference")
    assert cb.cuda_graph_booleans == (False, False) and cb.use_async_batching is False
    asked = ContinuousBatchingConfig(use_cuda_graph=(True, False), use_async_batching=True)
    paged_cache.resolve_graphs(asked, "its decode runs on reference", async_asked=True)
    assert asked.cuda_graph_booleans == (False, False) and asked.use_async_batching is True
    said = package_warnings(caplog)
    assert len([m for m in said if "without CUDA graphs" in m and "runs on reference" in m]) == 1


@pytest.mark.parametrize("asked", [None, True])
def test_a_manager_whose_decode_runs_on_the_reference_runs_no_graphs_and_async_batching_only_if_asked(
        asked, monkeypatch, caplog):
    """Where a graph backend exists (emulated here: this host has none), Transformers turns CUDA graphs on for a
    "flash" implementation and asynchronous batching with them. A model whose decode runs on the PyTorch reference
    (as here: no FlashInfer kernel on this host) is planned on the host every step, so the manager turns graphs off,
    saying why, and asynchronous batching with them unless the caller asked for it. Transformers' own resolution
    decides both on (the fault this guards against)."""
    from transformers.generation.continuous_batching import initialization

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    monkeypatch.setattr(initialization, "resolve_max_memory_percent", lambda **kwargs: None)  # (reads the device)
    model = make_model("deepseek_v3", dtype=torch.float32)
    theirs = initialization.resolve_continuous_batching_config(
        model.config, small_cb(use_async_batching=asked), None, False, device=torch.device("cuda"))
    assert any(theirs.cuda_graph_booleans) and theirs.use_async_batching is True
    manager = model.init_continuous_batching(generation_config=greedy(),
                                             continuous_batching_config=small_cb(use_async_batching=asked))
    ours = manager.continuous_batching_config
    assert ours.cuda_graph_booleans == (False, False) and ours.use_async_batching is bool(asked)
    said = package_warnings(caplog)
    assert len([m for m in said if "without CUDA graphs" in m and "runs on reference" in m]) == 1


def test_forward_without_prepared_step_fails_naming_the_loop(monkeypatch):
    """A paged forward whose step the loop did not lay out has no rows to read (its block tables are read where
    Transformers prepares the batch): it fails with an error naming the way to run it, not with another request's
    rows. Control: the same requests, prepared, give eager's tokens."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((5, 3, 8))
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    monkeypatch.setattr(paged_attention, "prepare_step", lambda *a, **k: None)  # (its seam calls it through the module)
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert len(out) == len(batch)
    for o in out.values():
        assert o.generated_tokens == [] and "was not prepared by its loop" in str(o.error)


def test_generate_batch_frees_its_cache():
    """The paged latent cache dies with its manager: each generate_batch() on a GPU holds most of its memory, so a
    cache kept alive (a reference cycle through the cache tensor, once) would leave the next call none."""
    import gc

    def caches():  # (an earlier test's kept manager may hold its own: only this call's are asserted on)
        return {id(o): o for o in gc.get_objects() if isinstance(o, (paged_cache.LatentAllocator, PagedAttentionCache))}

    gc.collect()
    earlier = caches()
    model = make_model("deepseek_v3", dtype=torch.float32)
    made = []
    original = PagedAttentionCache.__init__

    def init(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PagedAttentionCache, "__init__", init)
        model.generate_batch(inputs=prompts()[:2], generation_config=greedy(2), continuous_batching_config=small_cb())
    gc.collect()
    assert made and not [o for key, o in caches().items() if key not in earlier]


def test_forked_requests_of_a_one_token_prompt_get_every_sequence():
    """With several sequences per prompt (``num_return_sequences``), Transformers prefills a prompt without its last
    token before forking it: a 1-token prompt is scheduled with no query token at all. Every fork of every prompt
    comes back, and with ``top_k=1`` each equals the greedy tokens."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = [[5], [7, 8, 9, 10, 11]]
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                              num_return_sequences=3)
    out = model.generate_batch(batch, generation_config=config, continuous_batching_config=small_cb())
    expected = eager_tokens(model, batch, 4)
    assert len(out) == 6 and not [o.error for o in out.values() if o.error]
    assert all(o.generated_tokens == expected[batch.index(o.prompt_ids)] for o in out.values())


@pytest.mark.parametrize("other", ["eager", "sdpa"])
def test_a_persistent_manager_refuses_a_model_switched_to_another_attention(other):
    """A manager kept with ``persistent_manager=True`` is handed out again without being built, with its paged cache
    of latent rows, which eager or sdpa would read wrongly (seen with Transformers 5.25, which pages the latent for
    them: other tokens, silently). After the switch the next call raises instead, naming the fix."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((7, 9))
    model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb(),
                         persistent_manager=True)
    model.set_attn_implementation(other)
    with pytest.raises(UnsupportedModelError, match='attn_implementation="flashinfer_mla"'):
        model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb(),
                             persistent_manager=True)
    model.set_attn_implementation("flashinfer_mla")  # and back: the kept manager serves again
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)


def test_a_persistent_manager_built_on_sdpa_refuses_a_switch_to_flashinfer_mla():
    """From Transformers 5.25 an MLA model on sdpa is served with Transformers' own latent rows; a manager kept from
    such a run, handed to the model switched to flashinfer_mla, raises instead of failing every request."""
    if paged_cache.TRANSFORMERS_MLA_ALLOCATOR is None:
        pytest.skip("Transformers 5.24 and older do not page an MLA model on sdpa (refused above)")
    model = make_model("deepseek_v3", attn="sdpa", dtype=torch.float32)
    batch = prompts((7, 9))
    model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb(),
                         persistent_manager=True)
    model.set_attn_implementation("flashinfer_mla")
    with pytest.raises(UnsupportedModelError, match="another attention implementation"):
        model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb(),
                             persistent_manager=True)
    model.destroy_cached_continuous_batching_manager()  # the fix the error names: a new manager serves
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)


def test_a_persistent_manager_refuses_a_model_cast_to_another_dtype():
    """A kept manager's paged cache holds rows of the model's dtype when it was built; after ``model.to(dtype)`` its
    next run would fail every request (empty outputs). It raises instead, naming the fix, which then serves."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((7, 9))
    kept = dict(generation_config=greedy(), continuous_batching_config=small_cb(), persistent_manager=True)
    model.generate_batch(batch, **kept)
    model.to(torch.float64)
    with pytest.raises(UnsupportedModelError, match="destroy_cached_continuous_batching_manager"):
        model.generate_batch(batch, **kept)
    model.destroy_cached_continuous_batching_manager()
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=small_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)


def _lora(model, target="kv_a_proj_with_mqa"):
    peft = pytest.importorskip("peft")
    peft.inject_adapter_in_model(peft.LoraConfig(target_modules=[target], r=4, lora_alpha=8,
                                                 init_lora_weights=False), model)


def _lora_layers(model):
    return [m for m in model.modules() if "base_layer" in m._modules]


def _hot_swap(model):  # as PEFT's hotswap_adapter writes new factors: through .data, no version moves
    g = torch.Generator().manual_seed(9)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)


WEIGHT_CHANGES = {  # (adapter before the first run, the change between runs)
    "weight written in place": (False, lambda m: m.model.layers[0].mlp.down_proj.weight.mul_(3.0)),
    "weights loaded": (False, lambda m: m.load_state_dict({"model.layers.0.mlp.down_proj.weight":
                                                            torch.randn_like(m.model.layers[0].mlp.down_proj.weight)},
                                                           strict=False)),
    "adapter injected": (False, _lora),
    "adapter hot-swapped": (True, _hot_swap),
    "adapters disabled": (True, lambda m: [layer.enable_adapters(False) for layer in _lora_layers(m)]),
}


def _kept_runs(model, batch, change, monkeypatch):
    """Three generate_batch calls on one kept manager (the same prompts, whose blocks it caches), the weights changed
    before the third: the tokens and the prefix-matched token counts of the second and third."""
    matched = []
    search = PagedAttentionCache.search_prefix_match

    def search_prefix_match(self, *args):
        matched.append(search(self, *args))
        return matched[-1]

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", search_prefix_match)
    kept = dict(generation_config=greedy(), continuous_batching_config=small_cb(), persistent_manager=True)
    try:
        model.generate_batch(batch, **kept)
        matched.clear()
        again = [o.generated_tokens for o in model.generate_batch(batch, **kept).values()]
        reused, matched[:] = list(matched), []
        with torch.no_grad():
            change(model)
        after = [o.generated_tokens for o in model.generate_batch(batch, **kept).values()]
    finally:
        model.destroy_cached_continuous_batching_manager()
    return again, reused, after, list(matched)


@pytest.mark.parametrize("change", list(WEIGHT_CHANGES))
def test_a_persistent_manager_drops_its_cached_prompt_blocks_once_the_weights_change(change, monkeypatch):
    """A kept manager caches its requests' full prompt blocks for reuse (prefix sharing). A block's latent rows at
    layer i > 0 come out of layers 0..i-1, so after the weights or adapters change (a write, load_state_dict, an
    adapter injected, PEFT's hot-swap through ``.data``, adapters switched off) reusing it gives other tokens. The
    blocks are dropped then, and reused while nothing changed."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    adapter_first, write = WEIGHT_CHANGES[change]
    if adapter_first:
        _lora(model)
    batch = prompts((9, 14))
    expected = eager_tokens(model, batch)
    again, reused, after, matched = _kept_runs(model, batch, write, monkeypatch)
    assert again == expected and sum(reused) >= 8  # (unchanged weights: both prompts' full blocks were shared)
    assert after == eager_tokens(model, batch) != expected and sum(matched) == 0


def test_a_kept_manager_reusing_stale_prompt_blocks_gives_other_tokens(monkeypatch):
    """Control of the test above: with the blocks kept after a weight change, they are reused and the tokens differ
    from eager's."""
    monkeypatch.setattr(paged_cache, "forget_stale_prefixes", lambda model, manager: None)
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((9, 14))
    _, _, after, matched = _kept_runs(model, batch, WEIGHT_CHANGES["weight written in place"][1], monkeypatch)
    assert sum(matched) >= 8 and after != eager_tokens(model, batch)


def test_the_allocator_table_is_never_swapped_while_an_mla_cache_is_built(monkeypatch):
    """Transformers reads its module-level allocator table from any thread (a manager being built for another model
    reads ``supports_block_table`` off it). While an MLA model's paged cache is being built, the table's entry stays
    the one class with the parent's attributes (a swapped-in function there crashed the other thread); the MLA cache
    gets latent rows and another model's cache Transformers' own."""
    from transformers.generation.continuous_batching import cache as cb_cache

    seen = []
    original = paged_cache.LatentAllocator.__init__

    def init(self, *args, **kwargs):  # runs in the middle of the MLA cache's construction
        seen.append(getattr(cb_cache.ATTN_TYPE_TO_ALLOCATOR["full_attention"], "supports_block_table", "missing"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(paged_cache.LatentAllocator, "__init__", init)
    mla = make_config("deepseek_v3")
    mla._attn_implementation = "flashinfer_mla"
    assert type(_paged_cache(mla).cache_allocators["full_attention"]) is paged_cache.LatentAllocator
    assert seen and "missing" not in seen
    llama = CONFIG_MAPPING["llama"](hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB)
    llama._attn_implementation = "sdpa"
    assert type(_paged_cache(llama).cache_allocators["full_attention"]).__name__ == "FullAttentionCacheAllocator"
