"""generate(cache_implementation="static") on the GPU as users run it: the decode step compiled by Transformers'
default compile config (inductor, mode="reduce-overhead": CUDA graphs), in one process, for a sequence of batch
sizes and lengths. The CPU analogue is ``tests/test_compile.py``
(`test_compiled_static_generate_runs_the_graph_op_for_any_sequence_of_shapes`). Run with ``-s`` to print the
compile counts and the error table. Without CUDA the compiled steps run on the CPU stand-ins compiled with
``aot_eager`` (``gpu_suite.compile_config``: the graph op and its slots reloaded before every step, nothing
captured); the tests that count CUDA-graph recordings or GPU memory need CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gpu_suite import CUDA, DEV, compile_config, fresh_process, needs_cuda
from test_gpu_backends import _available, _compare, _model, yardstick
from transformers import LogitsProcessor, LogitsProcessorList

import hf_flashinfer_mla
from hf_flashinfer_mla.kernels import fa, graphs, reference

# (prompt lengths, left-padded into one batch; max_new_tokens): batch 1, 4, 16, then 1 again, with two different
# max_new_tokens. Transformers 5.24 sizes each call's static cache to the largest length asked so far (prompt width +
# max_new_tokens - 1), so the cache length, i.e. the graphs' key length, changes too: 27, 71, 81, 81.
CASES = (
    ((20,), 8),
    ((37, 20, 64, 5), 8),
    ((9, 17, 33, 5, 48, 12, 70, 26, 3, 61, 40, 8, 55, 19, 30, 66), 12),
    ((20,), 8),
)


def _batch(lengths, seed):
    """Random token ids [B, max(lengths)] left-padded with 0, and their mask, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, 4096, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(DEV), mask.to(DEV)


@pytest.fixture(autouse=True)
def _as_in_a_fresh_process():
    """Every test here counts what its own calls compile, capture or record: each starts as in a fresh process, and
    leaves its garbage collected for the next (`gpu_suite.fresh_process`)."""
    fresh_process()
    yield
    fresh_process()


def _fresh_v3():
    """DeepSeek-V3's attention shape on flashinfer_mla (fa3), with no compiled graph, CUDA-graph slot or captured
    route of earlier tests (process caches: their slots would be reloaded too)."""
    _available("fa3")
    hf_flashinfer_mla.reset()
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    return model


class _Replay(LogitsProcessor):
    """Makes generate() pick `tokens` ([B, T], another run's generated tokens) whatever its logits say, so that a
    second run is teacher-forced along the first one's tokens; generate() still reports its raw logits."""

    def __init__(self, tokens: torch.Tensor, prompt_width: int):
        self.tokens, self.prompt_width = tokens, prompt_width

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, t : t + 1], 0.0)


def test_compiled_static_generate_for_any_sequence_of_batch_sizes(monkeypatch):
    """Static-cache generate() with Transformers' default compile config (CUDA graphs) at batch 1, 4 (left-padded),
    16, then 1 again, with two different max_new_tokens, on DeepSeek-V3's attention shape (128 heads, q_lora,
    YaRN; two dense layers, so no MoE's data-dependent shapes; bf16, random weights). No call crashes; every
    compiled decode step runs FlashInfer's fa3 through a CUDA-graph slot (captured, for each batch size, on the
    graph op's slot, and reloaded before every step), never the reference backend nor the eager route (which a
    graph break or a compile-limit fallback would take); and the logits are those of the uncompiled flashinfer_mla
    run (``disable_compile=True``).

    How the two runs are compared: not by token equality. Both run the same fa3 kernel on the same plans, but
    inductor fuses and reorders the bf16 ops around it (norms, rope, projections), which moves these random-weight
    logits by ~2e-2 relative (``test_gpu_backends.test_cuda_graphs_teacher_forced_match_uncompiled`` measures it)
    and flips greedy choices at near ties, after which two greedy runs legitimately part. So the uncompiled run is
    teacher-forced along the compiled run's tokens (`_Replay`, a logits processor: generate() still reports its raw
    logits) and the logits of every step are compared with the suite's bounds (`yardstick("v3")`): the relative
    error per call and the top-1 agreement over all calls (the bounds the leaky-mask and wrong-scale
    controls of ``test_gpu_backends`` show to be discriminating). Tokens are not compared for equality anywhere.

    The number of dynamo compiles (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``) and of CUDA graphs
    inductor declined (``counters["inductor"]["cudagraph_skips"]``) is printed per call."""
    from torch._dynamo.utils import counters

    bounds = yardstick("v3")  # (measured first: its reference run is not one of this test's steps)
    model = _fresh_v3()
    layers = model.config.num_hidden_layers

    eager_launches, slot_loads, slot_runs, references = [], [], [], []
    real_run, real_build = fa.run, fa.build
    real_slot_run, real_reference = graphs.GraphSlot.run, reference.mla_attention_reference

    def run(meta, layer, *args, **kwargs):
        if not meta.fixed:  # an eager step's own metadata (a slot's is fixed)
            eager_launches.append(layer.heads)
        return real_run(meta, layer, *args, **kwargs)

    def build(backend, step, layer, into=None, staged=None):
        if into is not None:  # a CUDA-graph slot (re)loaded with a step's metadata
            slot_loads.append(step.batch_size)
        return real_build(backend, step, layer, into=into, staged=staged)

    def slot_run(self, *args):
        slot_runs.append((self.backend, self.batch, CUDA and torch.cuda.is_current_stream_capturing()))
        return real_slot_run(self, *args)

    def counted_reference(*args):
        references.append(1)
        return real_reference(*args)

    monkeypatch.setattr(fa, "run", run)
    monkeypatch.setattr(fa, "build", build)
    monkeypatch.setattr(graphs.GraphSlot, "run", slot_run)
    monkeypatch.setattr(reference, "mla_attention_reference", counted_reference)

    agree, compiles = [], 0
    for i, (lengths, new) in enumerate(CASES):
        ids, mask = _batch(lengths, seed=i)
        width, batch = ids.shape[1], ids.shape[0]
        graphs_before, skips_before = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        loads_before, launches_before, runs_before = len(slot_loads), len(eager_launches), len(slot_runs)
        compiled = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  cache_implementation="static", compile_config=compile_config(), output_logits=True,
                                  return_dict_in_generate=True)
        new_graphs = counters["stats"]["unique_graphs"] - graphs_before
        skips = counters["inductor"]["cudagraph_skips"] - skips_before
        compiles += new_graphs
        loads, compiled_launches = len(slot_loads) - loads_before, len(eager_launches) - launches_before
        captured = sorted({b for _, b, capturing in slot_runs[runs_before:] if capturing})

        launches_before = len(eager_launches)
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               cache_implementation="static", disable_compile=True, output_logits=True,
                               return_dict_in_generate=True,
                               logits_processor=LogitsProcessorList([_Replay(compiled.sequences[:, width:], width)]))
        plain_launches = len(eager_launches) - launches_before
        ours, oracle = torch.stack(compiled.logits, 1), torch.stack(plain.logits, 1)  # [B, new, V] float32
        err, top1 = _compare(ours, oracle)
        agree.append((ours.argmax(-1) == oracle.argmax(-1)).flatten())
        print(f"static generate B={batch} new={new}: {new_graphs} compiles (unique graphs; {compiles} so far), "
              f"{skips} cudagraph skips, slots loaded {loads}x, captured batches {captured}; "
              f"vs uncompiled: rel {err:.2e} top1 {top1:.3f}")

        assert compiled.sequences.shape == (batch, width + new)
        assert torch.equal(plain.sequences, compiled.sequences)  # the replay followed the compiled run's tokens
        assert compiled_launches == 0  # no compiled decode step fell back to the eager route
        assert loads >= new - 1  # every compiled decode step (after the prefill) reloaded its slot
        assert plain_launches == layers * (new - 1)  # the oracle ran fa3 eagerly on every decode layer
        assert torch.isfinite(ours).all()
        assert err < bounds.rel
    top1 = torch.cat(agree).float().mean().item()
    captured = {(backend, b) for backend, b, capturing in slot_runs if capturing}
    shapes = hf_flashinfer_mla.captured_shapes()
    slots = {shape.batch for shape in shapes if shape.runs == "fa3"}
    print(f"static generate: {compiles} compiles in all; top-1 agreement over all calls {top1:.3f}; "
          f"fa3 slots for batches {sorted(slots)}")
    assert compiles >= 1  # the decode step was compiled
    if CUDA:  # (the stand-ins' compiled steps run the slots; nothing captures them)
        assert {("fa3", 1), ("fa3", 4), ("fa3", 16)} <= captured  # CUDA graphs captured on fa3 slots, each batch
    assert {1, 4, 16} <= slots and all(shape.runs == "fa3" for shape in shapes)
    assert references == []  # no step, compiled or not, ran the reference backend
    assert top1 >= bounds.top1
    del model
    torch.cuda.empty_cache()


@needs_cuda("CUDA-graph recordings (a static input at another address records again)")
def test_warmed_up_static_generate_records_no_cuda_graph(monkeypatch):
    """Every static-cache generate() builds a new static cache (Transformers 5.24), whose tensors are static inputs
    of the CUDA graphs: a call whose cache lands at other addresses records its graphs again, which costs more than
    the call's replays save. Freed memory is reused at the same addresses only when every call allocates and frees in
    the same order; a step's plan that formed a reference cycle with its mask would be freed whenever Python's
    garbage collector ran, and DeepSeek-V2-Lite at batch 1 would record once per call, slower than sdpa. So calls of
    one shape, after the first two (compile, then the addresses of the compiled process), record nothing. The
    control keeps each call's cache alive, as a caller keeping ``out.cache`` does, which moves the next call's
    cache: it must see recordings."""
    model = _fresh_v3()
    captures = []
    real_capture_end = torch.cuda.graphs.CUDAGraph.capture_end

    def capture_end(self, *args, **kwargs):
        captures.append(1)
        return real_capture_end(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_end", capture_end)
    ids, mask = _batch((20, 13), seed=0)

    def recordings(kept=None) -> int:
        before = len(captures)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             cache_implementation="static", return_dict_in_generate=True)
        if kept is not None:
            kept.append(out.cache)
        return len(captures) - before

    per_call = [recordings() for _ in range(5)]
    kept = []
    control = [recordings(kept) for _ in range(3)]
    print(f"CUDA-graph recordings per static generate() call: {per_call}; keeping each call's cache: {control}")
    assert per_call[0] >= 1 and per_call[2:] == [0, 0, 0]
    assert all(n >= 1 for n in control[1:])  # the control moved the cache, and recordings were counted
    del model, kept
    torch.cuda.empty_cache()


@needs_cuda("CUDA-graph recordings (a static input at another address records again)")
def test_a_static_cache_kept_across_calls_records_no_cuda_graph_after_the_first(monkeypatch):
    """The README's way to keep CUDA graphs replaying across static-cache generate() calls: one `StaticCache`, reset
    and passed to every call. With cache_implementation="static" Transformers builds a new cache per call, and where
    the prefill's activations take the blocks the last call's cache freed, its tensors land at other addresses and
    CUDA graphs record again (DeepSeek-V3's shape, batch 32, 4k, on an H200: in 4 calls of 5, sdpa alike;
    ``scripts/dev/probe_rerecord.py``). Calls of one batch size with other prompts and paddings on the kept cache
    record nothing after the first two, and their logits are an uncompiled run's, teacher-forced along their
    tokens. The control builds a new cache while the kept one lives: it must record."""
    from transformers import StaticCache

    model = _fresh_v3()
    captures = []
    real_capture_end = torch.cuda.graphs.CUDAGraph.capture_end

    def capture_end(self, *args, **kwargs):
        captures.append(1)
        return real_capture_end(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_end", capture_end)
    cache = StaticCache(config=model.config, max_cache_len=80)
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(((20, 13, 41, 7), (5, 60, 33, 18), (70, 2, 9, 44)))]
    per_call, outputs = [], []
    for ids, mask in batches + batches[:2]:
        before = len(captures)
        with torch.inference_mode():
            cache.reset()
            outputs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                          cache=cache, output_logits=True, return_dict_in_generate=True))
        per_call.append(len(captures) - before)
    before = len(captures)
    ids, mask = batches[0]
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                   cache=StaticCache(config=model.config, max_cache_len=80))
    control = len(captures) - before
    errors = []
    for (ids, mask), out in zip(batches + batches[:2], outputs):
        width = ids.shape[1]
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               disable_compile=True, output_logits=True, return_dict_in_generate=True,
                               logits_processor=LogitsProcessorList([_Replay(out.sequences[:, width:], width)]))
        assert torch.equal(plain.sequences, out.sequences)  # the replay followed the kept cache's tokens
        errors.append(_compare(torch.stack(out.logits, 1), torch.stack(plain.logits, 1)))
    print(f"CUDA-graph recordings per generate() call on a kept static cache: {per_call}; a new cache while it "
          f"lives: {control}; vs uncompiled (rel, top1): {[(f'{e:.3e}', round(t, 3)) for e, t in errors]}")
    assert per_call[0] >= 1 and per_call[2:] == [0, 0, 0]
    for again, first in ((3, 0), (4, 1)):  # the kept cache carries nothing from one call into the next
        assert torch.equal(outputs[again].sequences, outputs[first].sequences)
        assert torch.equal(torch.stack(outputs[again].logits), torch.stack(outputs[first].logits))
    assert control >= 1  # the recordings were counted, and a cache at other addresses records again
    assert all(yardstick("v3").holds(err, top1) for err, top1 in errors)
    del model, cache, outputs
    torch.cuda.empty_cache()


@needs_cuda("the GPU memory reset() frees")
def test_reset_frees_the_graph_buffers_and_generate_compiles_again():
    """`hf_flashinfer_mla.reset()` after a compiled static generate(): torch's CUDA graphs and the package's
    fixed-address buffers go (GPU memory drops by at least the float workspace FlashInfer's kernels share),
    `captured_shapes()` is empty, and the same model's next compiled generate() compiles again, captures its shape on
    fa3 again and gives the same tokens and logits."""
    import gc

    from hf_flashinfer_mla import buffers

    model = _fresh_v3()
    ids, mask = _batch((20, 13), seed=0)

    def run():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              cache_implementation="static", output_logits=True, return_dict_in_generate=True)

    first = run()
    assert [(s.runs, s.batch) for s in hf_flashinfer_mla.captured_shapes()] == [("fa3", 2)]
    assert "workspace" in buffers.held(DEV)
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(DEV)
    hf_flashinfer_mla.reset()
    gc.collect()
    freed = held - torch.cuda.memory_allocated(DEV)
    print(f"reset(): {freed / 2**20:.0f} MiB freed (the float workspace alone: {buffers.WORKSPACE_BYTES / 2**20:.0f})")
    assert hf_flashinfer_mla.captured_shapes() == [] and buffers.held(DEV) == {}
    assert freed >= buffers.WORKSPACE_BYTES
    again = run()
    assert [(s.runs, s.batch) for s in hf_flashinfer_mla.captured_shapes()] == [("fa3", 2)]
    assert torch.equal(again.sequences, first.sequences)
    err, _ = _compare(torch.stack(again.logits, 1), torch.stack(first.logits, 1))
    print(f"reset(): the compiled generate() after it vs before: logits rel err {err:.2e}")
    assert err < yardstick("v3").rel
    del model, first, again
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_generate_reading_its_stop_condition_a_step_late_matches_checking_every_step(monkeypatch,
                                                                                     cache_implementation):
    """generate() reads "have all rows stopped?" a step late on CUDA for flashinfer_mla models
    (``generation.py``; ``tests/test_deferred_stop.py`` on the CPU), so the host queues step t + 1, and plans step
    t + 2, while the GPU still runs step t. A left-padded batch whose rows all stop at eos before max_new_tokens,
    compiled with CUDA graphs (static) or not (dynamic), on fa3: the same tokens and logits as with
    ``$HF_FLASHINFER_MLA_DEFER_STOP=0`` (every step checked), the extra step undone (counted), and the returned
    caches of equal length."""
    from hf_flashinfer_mla import generation

    DeferredStopCheck = generation.DeferredStopCheck
    if DeferredStopCheck is None:
        pytest.skip("this Transformers checks every step")
    if not CUDA:  # the CUDA path on the CPU, as tests/test_deferred_stop.py runs it
        from test_deferred_stop import HostEvent

        monkeypatch.setattr(generation, "DEFERRED_STOP_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(torch, "Event", HostEvent)
    model = _fresh_v3()
    undone, finish = [], DeferredStopCheck.finish

    def counted(self):
        undone.append(finish(self))
        return undone[-1]

    monkeypatch.setattr(DeferredStopCheck, "finish", counted)
    ids, mask = _batch((20, 13, 41, 7), seed=3)
    width = ids.shape[1]

    def run(eos=None):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=0, cache_implementation=cache_implementation,
                              compile_config=compile_config(), output_logits=True, return_dict_in_generate=True)

    monkeypatch.setenv(generation.DEFER_STOP_ENV, "0")
    greedy = run().sequences[:, width:]
    eos = sorted({int(greedy[i, 2 + 2 * i]) for i in range(ids.shape[0])})  # row i stops by step 2 + 2i
    every = run(eos)
    assert undone == []
    monkeypatch.delenv(generation.DEFER_STOP_ENV)
    late = run(eos)
    again = run(eos)
    new = every.sequences.shape[1] - width
    err, _ = _compare(torch.stack(late.logits, 1), torch.stack(every.logits, 1))
    print(f"generate() a step late ({cache_implementation}): {new} of 12 new tokens, steps undone {undone}, "
          f"logits vs every step checked: rel {err:.2e}")
    assert undone == [1, 1]  # each deferred call ran one step too many and undid it
    assert new < 12
    for out in (late, again):
        assert torch.equal(out.sequences, every.sequences)
        assert len(out.logits) == new and err < yardstick("v3").rel
        assert int(out.cache.get_seq_length()) == int(every.cache.get_seq_length()) == width + new - 1
    del model, every, late, again
    torch.cuda.empty_cache()
