"""trtllm-gen and cute-dsl inside torch.compile, on the CPU.

``generate(..., cache_implementation="static")`` compiles its decode step (here with ``aot_eager``) on a pretend
Blackwell GPU (`fake_flashinfer.fake_blackwell`) whose FlashInfer kernel is `fake_flashinfer.FakeTrtllm`, which asserts
FlashInfer's contract and computes the attention exactly, in float64, through the packed pages and block tables it
is handed. On that GPU generate() builds its static cache with `MLAStaticLayer` (packed), and the compiled steps run
the custom op ``hf_flashinfer_mla::decode_in_graph`` on a trtllm-gen (or cute-dsl) CUDA-graph slot: metadata at
fixed addresses that the mask function reloads before every step. On the CPU the op runs its warm-up branch on
every step (no capture), so these tests check the slot's metadata and routing, not a replay; and aot_eager hands
the op a functional copy of the packed cache (same layout, same values), so that the cache's own storage is read in
place is checked eagerly, in ``test_kernels_trtllm.py``.
"""

from __future__ import annotations

import logging

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import assert_batch_matches_eager_alone, left_padded_batch, make_model, package_warnings, rel_err
from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes
from fake_flashinfer import SM_COUNT, fake_blackwell  # noqa: F401  (fixture)
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_flashinfer_mla import buffers, captured_shapes
from hf_flashinfer_mla.cache import MLAStaticLayer
from hf_flashinfer_mla.kernels import graphs, trtllm

CPU = torch.device("cpu")
PAGE = trtllm.PAGE_SIZE
LAYERS = 2  # the helpers' models
# Every call's static cache holds 128 tokens (generate(max_cache_len=...)), so that a batch of one is served by a
# trtllm-gen slot: see test_batch_of_one_runs_trtllm_gen_in_graphs_at_the_default_cache_length.
MAX_CACHE = 128


@pytest.fixture(scope="module")
def model():
    """The 4-head model the tests share, with its compiled decode graphs (compiling costs more than all the rest):
    dense layers only, since a decode graph cannot hold the eager MoE's data-dependent shapes."""
    torch._dynamo.reset()
    return make_model("deepseek_v3", first_k_dense_replace=2)


def _slots(shapes) -> list[graphs.GraphSlot]:
    """The CUDA-graph slots of `shapes` (their fixed-address metadata)."""
    return [slot for s in shapes for _, slot in graphs.slots_for(s.batch, s.q_len, s.kv_len)]


def _generate(model, lengths, new_tokens: int, compiled: bool, max_cache_len: int | None = MAX_CACHE):
    """Greedy static-cache generate() of left-padded prompts of `lengths`: compiled as on a GPU (the decode step,
    with the mask built outside the compiled region), or not (``disable_compile=True``)."""
    ids, mask, prompts = left_padded_batch(lengths=lengths)
    if compiled:
        config = CompileConfig(backend="aot_eager", fullgraph=True)
        config._compile_all_devices = True  # Transformers compiles on CUDA only unless told otherwise
        kwargs = dict(compile_config=config)
    else:
        kwargs = dict(disable_compile=True)
    if max_cache_len is not None:
        kwargs["max_cache_len"] = max_cache_len
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         cache_implementation="static", output_logits=True, return_dict_in_generate=True, **kwargs)
    assert all(type(layer) is MLAStaticLayer for layer in out.cache.layers)  # the packed static layout
    return out, prompts


def _check_steps(calls, lengths, new_tokens: int, fixed: bool, backend: str = "auto", capacity: int = MAX_CACHE):
    """`calls` are one generate()'s kernel calls: one per decode step and layer (the prompt, over 8 tokens, is
    prefilled by SDPA; the last token needs no step), each with the tables and lengths of that step's rows, in the
    packed cache (sequence ``b`` on pages ``b * pages_per_sequence + first_b / 64 ...``). A CUDA-graph slot
    (`fixed`) hands every step the same buffers, tables over the whole `capacity` (the static cache's length), and
    the capacity as the maximum length; the eager builder sizes them for the step."""
    steps = new_tokens - 1
    assert len(calls) == LAYERS * steps, len(calls)
    width, batch = max(lengths), len(lengths)
    first = [width - n for n in lengths]
    for t in range(steps):
        lens = [width + t + 1 - f for f in first]  # the cache holds this step's token too
        for call in calls[t * LAYERS : (t + 1) * LAYERS]:
            assert (call["backend"], call["batch"], call["q_len"]) == (backend, batch, 1)
            assert call["seq_lens"].tolist() == lens
            per_sequence = call["pages"] // batch
            for b, f in enumerate(first):
                needed = -(-lens[b] // PAGE)
                assert call["tables"][b, :needed].tolist() == [b * per_sequence + f // PAGE + p for p in range(needed)]
            if fixed:
                assert call["tables"].shape[1] * PAGE >= call["max_seq_len"] >= capacity
            else:
                pages = -(-max(lens) // PAGE)
                assert call["max_seq_len"] == max(lens) and call["tables"].shape[1] == max(2, -(-pages // 2) * 2)
    if fixed:
        assert len({(c["tables_ptr"], c["seq_lens_ptr"], c["max_seq_len"]) for c in calls}) == 1


def _same(graph_mode, eager_mode) -> None:
    assert torch.equal(graph_mode.sequences, eager_mode.sequences)
    assert rel_err(torch.stack(graph_mode.logits), torch.stack(eager_mode.logits)) < 1e-12


def test_compiled_static_generate_runs_trtllm_gen_slots_for_any_sequence_of_batch_sizes(fake_blackwell, model):
    """Static-cache generate() compiled in one process at batch 1, 4 (page-aligned left padding), 2, then 1 again:
    every decode step of every layer runs FlashInfer's trtllm-gen (the fake) on the graph slot of its batch size,
    with that step's block tables and lengths, and the tokens and logits equal the uncompiled run's (and, for the
    padded batch, each prompt generated alone with eager attention). Every call, compiled or not, of every batch
    size, gets the one counter buffer, allocated once for the worst case."""
    counters.clear()
    kernel = fake_blackwell
    runs = (((61,), 4), ((125, 61, 61, 125), 4), ((70, 70), 5), ((100,), 4))  # left padding 0 or 64
    first_counter = None
    for lengths, new_tokens in runs:
        start = len(kernel.calls)
        graph_mode, prompts = _generate(model, lengths, new_tokens, compiled=True)
        # The first slot allocated the counter, before its first kernel call, for the worst case of every batch.
        first_counter = buffers.held(CPU)["counter"] if first_counter is None else first_counter
        middle = len(kernel.calls)
        eager_mode, _ = _generate(model, lengths, new_tokens, compiled=False)
        _check_steps(kernel.calls[start:middle], lengths, new_tokens, fixed=True)
        _check_steps(kernel.calls[middle:], lengths, new_tokens, fixed=False)
        _same(graph_mode, eager_mode)
        if len(lengths) == 4:
            assert_batch_matches_eager_alone(model, graph_mode, prompts, new_tokens, tol=1e-6)
    assert counters["graph_break"] == {}  # (Transformers turns fullgraph off for names containing "flash")
    # One slot per batch size, on trtllm-gen; the two calls at batch 1 share theirs.
    shapes = captured_shapes()  # the cache length: 128
    assert sorted((s.batch, s.q_len) for s in shapes) == [(1, 1), (2, 1), (4, 1)]
    assert all(s.runs == "trtllm-gen" for s in shapes)
    # The counter: one buffer for every call, held by every slot, sized once for COUNTER_MIN_TOKENS query tokens.
    counter = buffers.held(CPU)["counter"]
    assert counter is first_counter
    assert {call["counter"].data_ptr() for call in kernel.calls} == {counter.data_ptr()}  # (calls hold theirs)
    assert {slot.meta.counter.data_ptr() for slot in _slots(shapes)} == {counter.data_ptr()}
    assert counter.numel() == get_trtllm_gen_multi_ctas_kv_counter_bytes(trtllm.COUNTER_MIN_TOKENS, 4, SM_COUNT)
    assert counter.numel() >= get_trtllm_gen_multi_ctas_kv_counter_bytes(4, 4, SM_COUNT)


def test_unaligned_left_padding_in_a_new_compiled_shape_runs_the_reference(fake_blackwell, model, caplog):
    """Left padding that does not start on a 64-token page, in a shape compiled for the first time: the shape's
    graph is given the reference backend (trtllm-gen is never called on wrong tables), with one warning saying
    why, and the tokens and logits are those of the uncompiled run (which falls back per step) and of each prompt
    generated alone."""
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    kernel = fake_blackwell
    lengths = (10, 4, 9)  # left padding 0, 6, 1
    eager_mode, prompts = _generate(model, lengths, 4, compiled=False)
    graph_mode, _ = _generate(model, lengths, 4, compiled=True)
    assert kernel.calls == []
    _same(graph_mode, eager_mode)
    assert_batch_matches_eager_alone(model, graph_mode, prompts, 4, tol=1e-6)
    assert [(s.runs, s.batch) for s in captured_shapes()] == [("reference", 3)]
    warnings = package_warnings(caplog)
    assert sum("trtllm-gen declines some decode steps" in w and "left padding does not start on" in w
               for w in warnings) == 1  # the uncompiled run
    assert sum(w.startswith("flashinfer_mla: CUDA graphs of this decode shape (batch 3, 1 query token(s), 4 heads) "
                            "run on the reference backend, not trtllm-gen: left padding does not start on "
                            "trtllm-gen's 64-token pages") for w in warnings) == 1


def test_unaligned_left_padding_in_a_shape_captured_on_trtllm_gen_fails_clearly(fake_blackwell, model):
    """A shape whose graph slot is on trtllm-gen (its first batch was page-aligned) cannot switch backends for a
    later batch whose left padding is not: the compiled generate() raises, saying why and what to do, before any
    kernel runs on that batch, and leaves the slot intact for the next aligned batch."""
    kernel = fake_blackwell
    aligned, unaligned = (80, 16), (10, 4)
    _generate(model, aligned, 4, compiled=True)
    assert len(kernel.calls) == LAYERS * 3
    with pytest.raises(RuntimeError, match=r"trtllm-gen cannot run this step of a CUDA graph captured on it \(left "
                                           r"padding does not start on trtllm-gen's 64-token pages\).*disable_compile"):
        _generate(model, unaligned, 4, compiled=True)
    assert len(kernel.calls) == LAYERS * 3  # nothing ran on the refused batch
    graph_mode, _ = _generate(model, aligned, 4, compiled=True)
    _check_steps(kernel.calls[LAYERS * 3 :], aligned, 4, fixed=True)
    assert len(kernel.calls) == 2 * LAYERS * 3
    _same(graph_mode, _generate(model, aligned, 4, compiled=False)[0])


def test_disable_compile_serves_an_unaligned_batch_after_a_compiled_one(fake_blackwell, model):
    """The way out the error above names: generate(..., disable_compile=True) runs a batch whose left padding is not
    on a page, on the reference backend, although a compiled call of the same shape made a trtllm-gen slot."""
    aligned, unaligned = (80, 16), (10, 4)
    _generate(model, aligned, 4, compiled=True)
    eager_mode, prompts = _generate(model, unaligned, 4, compiled=False)
    assert_batch_matches_eager_alone(model, eager_mode, prompts, 4, tol=1e-6)


def test_compiled_untileable_head_count_runs_cute_dsl_without_a_counter(fake_blackwell):
    """24 heads (trtllm-gen cannot tile them): the graph op runs FlashInfer's cute-dsl on its slots, passing no
    counter buffer (none is ever allocated), and gives the uncompiled run's tokens and logits."""
    torch._dynamo.reset()
    kernel = fake_blackwell
    model = make_model("deepseek_v3", first_k_dense_replace=2, num_attention_heads=24, num_key_value_heads=24)
    for lengths, new_tokens in (((20,), 4), ((80, 16, 80), 4)):
        start = len(kernel.calls)
        eager_mode, _ = _generate(model, lengths, new_tokens, compiled=False)
        middle = len(kernel.calls)
        graph_mode, _ = _generate(model, lengths, new_tokens, compiled=True)
        _check_steps(kernel.calls[start:middle], lengths, new_tokens, fixed=False, backend="cute-dsl")
        _check_steps(kernel.calls[middle:], lengths, new_tokens, fixed=True, backend="cute-dsl")
        _same(graph_mode, eager_mode)
    assert all(call["counter"] is None and call["heads"] == 24 for call in kernel.calls)
    assert "counter" not in buffers.held(CPU)
    shapes = captured_shapes()
    assert {s.batch for s in shapes} == {1, 3} and all(s.runs == "cute-dsl" for s in shapes)
    assert all(slot.meta.counter is None for slot in _slots(shapes))


def test_batch_of_one_runs_trtllm_gen_in_graphs_at_the_default_cache_length(fake_blackwell):
    """generate()'s own static cache length for one prompt (prompt + new tokens - 1, any number) is packed in a
    256-row MLAStaticLayer, which trtllm-gen reads: the compiled steps should run on a trtllm-gen slot."""
    torch._dynamo.reset()
    kernel = fake_blackwell
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    graph_mode, _ = _generate(model, (10,), 4, compiled=True, max_cache_len=None)
    assert [(s.runs, s.batch) for s in captured_shapes()] == [("trtllm-gen", 1)]
    _check_steps(kernel.calls, (10,), 4, fixed=True, capacity=10 + 4 - 1)


def test_two_static_cache_lengths_of_one_capacity_keep_their_own_slots(fake_blackwell, model, monkeypatch):
    """Static caches of 100 and 200 tokens are both packed into 256 rows, so their layer specs are equal; their
    graphs are two graphs (the mask's length differs), and each must replay its own slot's metadata: alternating
    between them, every compiled call equals its uncompiled run (a slot shared by both would replay the other
    cache's lengths)."""
    torch._dynamo.reset()
    graphs.reset()
    lengths = (80, 16)
    for max_cache_len in (100, 200, 100, 200):
        graph_mode, _ = _generate(model, lengths, 4, compiled=True, max_cache_len=max_cache_len)
        _same(graph_mode, _generate(model, lengths, 4, compiled=False, max_cache_len=max_cache_len)[0])
    # Two slots, one per cache length (generate() may reuse a larger static cache it made before: the lengths are
    # at least the ones asked for).
    lengths_seen = sorted(s.kv_len for s in captured_shapes())
    assert len(lengths_seen) == 2 and lengths_seen[0] >= 100 and lengths_seen[1] >= 200
