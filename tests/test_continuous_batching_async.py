"""Continuous batching with asynchronous batching, on the CPU: Transformers' two host/device IO pairs, with their
streams and events emulated (`emulated_async`: this host has neither, and Transformers refuses async batching
without them).

Under asynchronous batching the host prepares step N+1 (schedules it, lays out its inputs, and here plans its
kernels from the lengths it scheduled) before it has read step N's tokens: a request that finishes at step N is
still in step N+1, tokens predicted at step N are carried into step N+1's inputs on the device, requests join and
leave between the two. On a CPU the work runs in order, so what is checked is the host's side of it: every plan is
built from its own step's scheduled lengths, whatever the host learnt since, and every request gets the tokens of
synchronous batching and of eager ``generate()`` alone. A control plans each step from the previous one's lengths.
"""

from __future__ import annotations

import pytest
import torch

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from helpers import emulate_async_batching, make_model
from hf_flashinfer_mla import paged_attention
from test_continuous_batching import eager_tokens, greedy, prompts, small_cb
from test_continuous_batching_graphs import emulated_graphs  # noqa: F401  (fixture)


@pytest.fixture
def emulated_async(monkeypatch):
    """Transformers' asynchronous batching on this host: the IO pairs accept the CPU, their streams and events do
    nothing (the work runs in order). Returns the steps planned: (serial, the IO pair's batch, each request's
    rows)."""
    emulate_async_batching(monkeypatch)
    planned = []
    of_batch = paged_attention.PagedStep.of_batch

    def recorded(requests, allocator, *args, **kwargs):
        step = of_batch(requests, allocator, *args, **kwargs)
        planned.append(step.k_lens.tolist())
        return step

    monkeypatch.setattr(paged_attention.PagedStep, "of_batch", staticmethod(recorded))
    return planned


def _run(model, batch, new_tokens, asynchronous: bool, cb=None):
    """The prompts through a manager, each request with its own number of new tokens, the later half added while
    the first runs (they join mid-flight); returns each request's tokens, in order, and the manager's IO class."""
    cb = cb or small_cb()
    cb.use_async_batching = asynchronous
    manager = model.init_continuous_batching(generation_config=greedy(max(new_tokens)), continuous_batching_config=cb)
    manager.start()
    try:
        half = len(batch) // 2
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(batch[:half], new_tokens[:half])]
        done = {ids[0]: next(o for o in manager.request_id_iter(ids[0]) if o.is_finished())}
        # (the loop is running, the first request done: the others join it)
        ids += [manager.add_request(p, max_new_tokens=n) for p, n in zip(batch[half:], new_tokens[half:])]
        tokens = [done.get(rid) or next(o for o in manager.request_id_iter(rid) if o.is_finished()) for rid in ids]
        io = type(manager.batch_processor.inputs_and_outputs).__name__
    finally:
        manager.stop(block=True, timeout=30)
    assert [o.error for o in tokens] == [None] * len(batch)
    return [o.generated_tokens for o in tokens], io


NEW = (5, 2, 7, 1, 4, 6)  # (requests finish at different steps: one after its first token)


def test_async_batching_gives_synchronous_and_eager_tokens(emulated_async):
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts()
    sync, io = _run(model, batch, NEW, asynchronous=False)
    assert io == "ContinuousBatchingIOs"
    emulated_async.clear()
    got, io = _run(model, batch, NEW, asynchronous=True)
    assert io == "ContinuousBatchingAsyncIOs" and len(emulated_async) > len(batch)
    assert got == sync
    alone = eager_tokens(model, batch, max(NEW))
    assert got == [a[:n] for a, n in zip(alone, NEW)]


def test_async_batching_with_requests_offloaded(emulated_async, monkeypatch):
    """A cache too small for every request at once: requests are dropped for a new prefill and come back while
    the next step is already planned."""
    from test_paged_rows import _HostTorch
    from transformers.generation.continuous_batching import offloading_manager

    monkeypatch.setattr(offloading_manager, "torch", _HostTorch())
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((14, 13, 12, 11, 10, 9), seed=8)
    got, io = _run(model, batch, NEW, asynchronous=True, cb=small_cb(num_blocks=12))
    assert io == "ContinuousBatchingAsyncIOs"
    alone = eager_tokens(model, batch, max(NEW))
    assert got == [a[:n] for a, n in zip(alone, NEW)]


def test_async_batching_with_a_lora_on_kv_b_proj(emulated_async):
    """A PEFT adapter on kv_b_proj, applied live in the absorbed decode, under asynchronous batching."""
    peft = pytest.importorskip("peft")
    model = make_model("deepseek_v3", dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["kv_b_proj"], init_lora_weights=False))
    batch = prompts()
    sync, _ = _run(model, batch, NEW, asynchronous=False)
    got, io = _run(model, batch, NEW, asynchronous=True)
    assert io == "ContinuousBatchingAsyncIOs" and got == sync
    model.set_attn_implementation("eager")
    try:
        alone = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p, n in zip(batch, NEW)]
    finally:
        model.set_attn_implementation("flashinfer_mla")
    assert got == alone


def test_a_plan_from_the_previous_steps_lengths_gives_other_tokens(emulated_async, monkeypatch):
    """Control: every step planned from the lengths its requests had at the step before (a decode's rows one fewer:
    what a plan made before the previous step's token was placed would use) gives other tokens than synchronous
    batching."""
    stale = []

    def previous_lengths(requests, allocator, tokens, capture=False, read_end=0, max_rows=0, absorb=False):
        q = torch.tensor([fs.query_length for fs in requests], dtype=torch.long)
        k = torch.tensor([fs.state.position_offset for fs in requests], dtype=torch.long) - (q == 1).long()
        k = k.clamp_min(q)  # (a 1-token prompt's first step had no row before it)
        stale.append(int((q == 1).sum()))
        tables = allocator.block_rows([fs.state.request_id for fs in requests], k)
        return paged_attention.PagedStep(q, k, tokens, paged_attention.page_rows(allocator), False, tables, read_end)

    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts()
    sync, _ = _run(model, batch, NEW, asynchronous=False)
    monkeypatch.setattr(paged_attention.PagedStep, "of_batch", staticmethod(previous_lengths))
    got, _ = _run(model, batch, NEW, asynchronous=True)
    assert sum(stale) > 0  # (decodes were planned one row short)
    assert got != sync


@pytest.mark.parametrize("backend", ["fa3", "trtllm-gen"])
def test_async_batching_replays_cuda_graphs_with_the_tokens_of_eager(emulated_async, emulated_graphs, fake_hopper,
                                                                     monkeypatch, backend):
    """Both IO pairs capture their own graphs over the same slots, each reloaded right before its replay: with
    decodes and prefill chunks mixed in the graphs (every step the graphs take), the tokens are eager's."""
    from test_continuous_batching_graphs import _mixed

    made, prepared = emulated_graphs
    model, batch, cb = _mixed(monkeypatch, backend, pay=True)
    cb.use_async_batching = True
    manager = model.init_continuous_batching(generation_config=greedy(8), continuous_batching_config=cb)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=8) for p in batch]
        out = [next(o for o in manager.request_id_iter(rid) if o.is_finished()) for rid in ids]
        io = type(manager.batch_processor.inputs_and_outputs).__name__
    finally:
        manager.stop(block=True, timeout=30)
    assert io == "ContinuousBatchingAsyncIOs"
    assert [o.generated_tokens for o in out] == eager_tokens(model, batch, 8)
    assert len(made) >= 2 and sum(g.replays for g in made) > 0  # (graphs of both IO pairs, replayed)
