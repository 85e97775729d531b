"""Continuous batching in CUDA graphs, on the CPU: Transformers' graph capture emulated (`emulated_graphs`), the
fa3/fa2 and trtllm-gen/cute-dsl kernels through the FlashInfer stand-ins (``fake_flashinfer.py``).

Transformers pads every step to a graph's shape (query tokens to an interval, fake sequences of no tokens) and
captures each shape once; the package lets it capture the steps in which every request decodes, whose schedule it
reloads into the graph slots' fixed buffers before each replay (``paged_attention.prepare_step``). A replay runs no
Python: here a "replay" runs the captured forward again and checks that the package planned nothing meanwhile, so
the kernels read only what the reload wrote."""

from __future__ import annotations

import pytest
import torch

from fake_flashinfer import FakeMLAModule, FakeTrtllm, blackwell, fake_hopper  # noqa: F401  (fixture)
from helpers import emulate_async_batching, make_model, package_warnings
from hf_flashinfer_mla import paged_attention
from hf_flashinfer_mla.kernels import fa, graphs, trtllm
from test_continuous_batching import eager_tokens, greedy, prompts, small_cb

LENGTHS = (5, 3, 9, 2, 7, 4)


class FakeGraph:
    """A forward captured by Transformers' model runner, "replayed" by running it again on the inputs it was
    captured with (Transformers rewrites them in place before each replay) while the stand-in counts plans and
    records its launches: a replayed graph runs no Python, so the package may plan nothing during one, and it
    relaunches the captured kernels on operands of the captured shapes."""

    def __init__(self, forward, args, plans, launches):
        self.forward, self.args, self._plans, self.launches = forward, args, plans, launches
        self.replays = 0
        launches.clear()
        forward(*args)  # the captured forward
        self.captured = list(launches)

    def reset(self) -> None:  # (Transformers' graph buffer resets the graphs it drops)
        pass

    def replay(self) -> None:
        before = self._plans()
        self.launches.clear()
        self.replays += 1
        self.forward(*self.args)
        assert self._plans() == before, "the package planned a kernel or uploaded host data during a replay"
        assert self.launches == self.captured, "a replay launched other kernels or shapes than its capture"


@pytest.fixture
def emulated_graphs(fake_hopper, monkeypatch):
    """Transformers' continuous batching with CUDA graphs on this host (which has no graph backend): its own padding,
    graph keys and replays; its capture (a warm-up forward, then the captured one) keeps the forward as a `FakeGraph`.
    Returns the graphs made, and the steps the package prepared (graphed, real requests, query tokens, each
    request's query tokens)."""
    from transformers.generation.continuous_batching import initialization, model_runner

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "CUDAGraph")
    emulate_async_batching(monkeypatch)  # (which Transformers turns on with the graphs)
    monkeypatch.setattr(model_runner, "get_memory_pools", lambda: (None, None))
    made, prepared, launches, host_builds = [], [], [], []
    run, call, build = FakeMLAModule.run, FakeTrtllm.__call__, trtllm.build

    def launch(self, *args):
        launches.append((self.backend, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return run(self, *args)

    def trtllm_launch(self, **kwargs):
        shapes = [tuple(a.shape) for a in kwargs.values() if isinstance(a, torch.Tensor)]
        # (and the buffers a captured launch reads at fixed addresses: the slot's lengths, the counter buffer)
        fixed = [kwargs[k].data_ptr() for k in ("seq_lens", "multi_ctas_kv_counter_buffer")
                 if kwargs.get(k) is not None]
        launches.append((kwargs["backend"], shapes, kwargs["max_seq_len"], fixed))
        return call(self, **kwargs)

    def trtllm_build(*args, **kwargs):  # (trtllm-gen has no plan: its host metadata is built here)
        host_builds.append(args[0])
        return build(*args, **kwargs)

    def uploading(module):  # host data copied to the device: a replay would read what the capture copied
        to_device = module.to_device

        def counted(*args):
            host_builds.append("upload")
            return to_device(*args)

        monkeypatch.setattr(module, "to_device", counted)

    for module in (paged_attention, trtllm, fa):
        uploading(module)

    def plans() -> int:
        return sum(len(m.plans) for m in fake_hopper.modules.values()) + len(host_builds)

    def capture(self, forward_fn, compute_stream, *args):
        forward_fn(*args)  # warm-up, as Transformers' own capture
        graph = FakeGraph(forward_fn, args, plans, launches)
        self.inputs_and_outputs.set_graph(graph)
        made.append(graph)

    original = paged_attention.prepare_step

    def prepare_step(io):
        original(io)
        step = next(a.step for a in io.cache.cache_allocators.values() if hasattr(a, "step"))
        prepared.append((step.graphed, step.requests, step.tokens, tuple(step.q_lens.tolist())))

    monkeypatch.setattr(FakeMLAModule, "run", launch)
    monkeypatch.setattr(FakeTrtllm, "__call__", trtllm_launch)
    monkeypatch.setattr(trtllm, "build", trtllm_build)
    monkeypatch.setattr(model_runner.ModelRunner, "_capture_graph", capture)
    monkeypatch.setattr(paged_attention, "prepare_step", prepare_step)
    return made, prepared


def _padded_cb(**overrides):
    # Query tokens padded to multiples of 3 (decode graphs of 3 and 6 rows for up to 4 requests), past rows to 8s.
    return small_cb(q_padding_interval_size=3, kv_padding_interval_size=8, **overrides)


def _blackwell(monkeypatch, backend):
    """The trtllm-gen/cute-dsl stand-in, Transformers' pages of 32 rows (trtllm-gen's smallest), prompts that span
    several of them."""
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    return blackwell(monkeypatch), _padded_cb(page_size=32, num_blocks=24), prompts((37, 5, 70, 33, 9, 40), seed=6)


@pytest.mark.parametrize("backend", ["fa3", "fa2", "trtllm-gen", "cute-dsl"])
def test_decode_steps_replay_cuda_graphs_with_the_tokens_of_eager(emulated_graphs, fake_hopper, monkeypatch,
                                                                  backend):
    """Requests of several lengths join and finish between replays: the steps where every request decodes are
    captured once per shape and replayed with padded query rows and key lengths, the others run uncompiled on the
    same padded inputs, and every request's tokens equal eager generate()'s. On trtllm-gen/cute-dsl each replay
    gathers its block tables inside the graph, over requests of several 32-row pages."""
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    made, prepared = emulated_graphs
    model = make_model("deepseek_v3")
    cb, batch = _padded_cb(), prompts(LENGTHS)
    if backend in ("trtllm-gen", "cute-dsl"):
        kernel, cb, batch = _blackwell(monkeypatch, backend)
    # (8 new tokens: asynchronous batching's two IO pairs capture a graph each, then replay them)
    out = model.generate_batch(batch, generation_config=greedy(8), continuous_batching_config=cb)
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch, 8)
    graphed = [(n, t) for g, n, t, _ in prepared if g]
    assert made and sum(g.replays for g in made) > 0  # captured, then replayed
    assert len({t for _, t in graphed}) >= 2  # several graph shapes
    assert any(n < t for n, t in graphed)  # padding rows
    assert len({n for n, _ in graphed}) >= 2  # requests joined or finished between graphed steps
    assert any(not g for g, *_ in prepared)  # prefill steps ran uncompiled
    assert {key[0] for key in graphs._slots if key[4] is None} == {backend}
    if backend in ("trtllm-gen", "cute-dsl"):
        calls = [c for c in kernel.calls if c["batch"] == 6]  # the graph of 6 rows (4 requests and padding)
        assert calls and any(int(c["seq_lens"].max()) > 32 for c in calls)  # tables of several pages, replayed
        assert all(c["counter"] is calls[0]["counter"] for c in calls)  # one counter buffer, allocated before


# Long prompts that decode while short ones join: the short ones' prefill chunks share steps with the long ones'
# decodes, and read fewer rows than those (`paged_attention.graph_pays`), so those steps are graphed.
MIXED = (30, 2, 28, 3, 26, 2, 3, 4, 2, 3)


def _mixed(monkeypatch, backend, pay=None):
    """The model, its batch and the padded config for mixed steps; `pay` replaces the policy of which steps a graph
    serves (True: every step the graphs can take)."""
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    if pay is not None:
        monkeypatch.setattr(paged_attention, "graph_pays", lambda q, k: pay)
    cb, batch = _padded_cb(num_blocks=80), prompts(MIXED, seed=7)
    if backend in ("trtllm-gen", "cute-dsl"):  # (pages of 32 rows; requests over several of them)
        blackwell(monkeypatch)
        cb, batch = _padded_cb(page_size=32, num_blocks=24), prompts((70, *MIXED[1:]), seed=6)
    return make_model("deepseek_v3"), batch, cb


@pytest.mark.parametrize("backend", ["fa3", "fa2", "trtllm-gen", "cute-dsl"])
@pytest.mark.parametrize("pay", [None, True], ids=["policy", "every-step"])
def test_mixed_steps_replay_cuda_graphs_with_the_tokens_of_eager(emulated_graphs, fake_hopper, monkeypatch, backend,
                                                                 pay):
    """Steps that mix prefill chunks with decodes run in the same CUDA graphs as decode steps of their padded token
    count, every query token absorbed over its causal prefix of its request's rows: replayed at several mixes of
    chunks and decodes, every request's tokens equal eager generate()'s. Under the package's policy a step's chunks
    must read no more rows than its decodes; with every step admitted, prefill-only steps replay too."""
    made, prepared = emulated_graphs
    model, batch, cb = _mixed(monkeypatch, backend, pay)
    out = model.generate_batch(batch, generation_config=greedy(8), continuous_batching_config=cb)
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch, 8)
    mixed = [(t, q) for g, _, t, q in prepared if g and any(n > 1 for n in q)]
    by_shape = {}
    for t, q in mixed:
        by_shape.setdefault(t, set()).add(q)
    assert max(len(mixes) for mixes in by_shape.values()) >= 2  # one graph shape, replayed at several mixes
    assert made and sum(g.replays for g in made) > 0
    assert any(1 in q for _, q in mixed)  # chunks beside decodes
    if pay is None:
        assert any(not g and any(n > 1 for n in q) for g, _, _, q in prepared)  # prefill-heavy steps uncompiled
    else:
        assert all(g for g, *_ in prepared)


@pytest.mark.parametrize("backend", ["fa3", "trtllm-gen"])
def test_mixed_graph_control_skipped_reload_changes_tokens(emulated_graphs, fake_hopper, monkeypatch, backend):
    """Control: with the slots' reload skipped for mixed steps only (every step admitted, as above), their replays
    read the schedule or lengths of the step before, and the tokens change; the skipped reloads were mixed steps'."""
    skipped, load = [], graphs.GraphSlot.load

    def load_unless_mixed(self, step, staged=None):
        if bool((step.q_lens > 1).any()):
            skipped.append(step)
        else:
            load(self, step, staged)

    monkeypatch.setattr(graphs.GraphSlot, "load", load_unless_mixed)
    model, batch, cb = _mixed(monkeypatch, backend, pay=True)
    out = model.generate_batch(batch, generation_config=greedy(8), continuous_batching_config=cb)
    assert skipped and all(step.graphed for step in skipped)
    assert emulated_graphs[0]
    assert [o.generated_tokens for o in out.values()] != eager_tokens(model, batch, 8)


@pytest.mark.parametrize("backend", ["fa3", "trtllm-gen"])
def test_graph_control_skipped_reload_changes_tokens(emulated_graphs, fake_hopper, monkeypatch, backend):
    """Control: with the slots' reload before a replay skipped, the graphs replay a previous step's schedule (fa3)
    or lengths and starts (trtllm-gen: here past the read indices of a smaller graph, failing its requests) and the
    tokens change; the fault is shown to have been applied."""
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", backend)
    skipped = []
    monkeypatch.setattr(graphs.GraphSlot, "load", lambda self, step, staged=None: skipped.append(step))
    model = make_model("deepseek_v3")
    cb, batch = _padded_cb(), prompts(LENGTHS)
    if backend == "trtllm-gen":
        _, cb, batch = _blackwell(monkeypatch, backend)
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=cb)
    made = emulated_graphs[0]
    assert skipped and made  # (trtllm-gen: the next graph's capture already reads past its read indices, and fails)
    assert backend != "fa3" or sum(g.replays for g in made) > 0
    assert [o.generated_tokens for o in out.values()] != eager_tokens(model, batch)


def test_a_model_on_the_reference_runs_without_graphs_saying_why(emulated_graphs, monkeypatch, caplog):
    """A decode the package plans on the host every step (here the reference backend, asked for) is never captured:
    graphs go, with one warning naming why, and the tokens are eager's."""
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "reference")
    made, prepared = emulated_graphs
    model = make_model("deepseek_v3")
    batch = prompts(LENGTHS[:3])
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=_padded_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    assert prepared and not made and not any(g for g, *_ in prepared)
    assert [m for m in package_warnings(caplog) if "without CUDA graphs" in m and "runs on reference" in m]


def test_trtllm_gen_on_pages_it_cannot_read_runs_without_graphs_saying_why(emulated_graphs, monkeypatch, caplog):
    """Transformers' pages of 4 rows hold no 32-row page of trtllm-gen's: its decode falls back per step (to the
    reference here), which no graph can replay, so graphs go at the manager with one warning naming the page size."""
    made, prepared = emulated_graphs
    kernel = blackwell(monkeypatch)
    model = make_model("deepseek_v3")
    batch = prompts(LENGTHS[:3])
    out = model.generate_batch(batch, generation_config=greedy(), continuous_batching_config=_padded_cb())
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    assert prepared and not made and not kernel.calls
    assert [m for m in package_warnings(caplog) if "without CUDA graphs" in m and "pages of 4 tokens" in m]


def test_an_adapter_put_on_after_capture_turns_the_graphs_off(emulated_graphs, monkeypatch, caplog):
    """A persistent manager outlives the check made at its creation: a PEFT LoRA put on kv_b_proj after its graphs
    were captured would never reach a replay (it runs the captured kernels only). Its steps run without graphs from
    then on, after one warning, and give the tokens of eager generate() with the adapter."""
    peft = pytest.importorskip("peft")
    monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", "fa3")
    made, prepared = emulated_graphs
    model = make_model("deepseek_v3")
    batch = prompts(LENGTHS[:4], seed=4)  # (other prompts than the first run's: none of its cached blocks is reused)
    kept = dict(generation_config=greedy(), continuous_batching_config=_padded_cb(), persistent_manager=True)
    try:
        model.generate_batch(prompts(LENGTHS[:4]), **kept)
        assert made and any(g for g, *_ in prepared)
        peft.inject_adapter_in_model(peft.LoraConfig(target_modules=["kv_b_proj"], r=4, lora_alpha=8,
                                                     init_lora_weights=False), model)
        prepared.clear()
        out = model.generate_batch(batch, **kept)
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [o.generated_tokens for o in out.values()] == eager_tokens(model, batch)
    assert prepared and not any(g for g, *_ in prepared)
    assert [m for m in package_warnings(caplog) if "without CUDA graphs from now on" in m]
