"""The decode path traces into one graph (no graph break), as CUDA graphs need, and computes the same thing."""

from __future__ import annotations

import pytest

pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import left_padded_batch, make_model, rel_err
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from transformers import StaticCache
from transformers.masking_utils import create_masks_for_generate

from hf_flashinfer_mla import captured_shapes


def _decode_steps(forward, model, steps=4):
    ids, mask, _ = left_padded_batch()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    logits = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
        pos = pos[:, -1:] + 1
        out = forward(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, position_ids=pos, cache=cache,
                      use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)


def test_decode_step_compiles_with_fullgraph_and_matches_eager_mode():
    torch._dynamo.reset()
    # Dense layers only: the MoE's eager experts have data-dependent shapes that no decode graph can hold.
    model = make_model("deepseek_v3", dtype=torch.float32, first_k_dense_replace=2)
    eager_mode = _decode_steps(model, model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    graph_mode = _decode_steps(compiled, model)  # fullgraph=True: any graph break raises
    assert rel_err(graph_mode, eager_mode) < 1e-5


def test_graph_custom_op_is_registered_with_a_fake_implementation():
    op = torch.ops.hf_flashinfer_mla.decode_in_graph
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q = torch.empty(2, 4, 1, 512, dtype=torch.bfloat16)
        # The step (its mask), the operands, the scale and the requested backend ("" = the default rule).
        out = op(torch.empty(2, 1, 1, 9, dtype=torch.bool), q, torch.empty(2, 4, 1, 64, dtype=torch.bfloat16),
                 torch.empty(2, 1, 9, 512, dtype=torch.bfloat16), torch.empty(2, 1, 9, 64, dtype=torch.bfloat16), 0.1,
                 "")
    assert out.shape == q.shape and out.dtype == q.dtype


def test_only_graphs_handed_a_mask_planned_outside_use_graph_wrappers():
    # A replayed CUDA graph runs no Python, so a graph may take the kernels' slots only if the mask function planned
    # its mask outside it (and reloads the slots before every replay), as generate() does with a static cache. A
    # user-compiled forward that traces the mask function, or one handed a 4D mask the mask function never saw (the
    # last plan gone, or one that layers already ran on: an uncompiled step's), takes the reference path.
    from hf_flashinfer_mla.kernels.graphs import mask_planned_outside_graph, note_mask_built_in_graph, note_mask_planned

    def compiled(builds_mask):
        torch._dynamo.reset()  # (each case traces again: the rule is a constant of the graph)

        @torch.compile(backend="eager", fullgraph=True)
        def step(x):
            if builds_mask:
                note_mask_built_in_graph()
            return x + 1 if mask_planned_outside_graph() else x - 1

        return step(torch.zeros(2))

    class Plan:  # what the rule reads of a step's plan
        consumers: set = set()

    fresh = Plan()
    fresh.consumers = set()
    note_mask_planned(fresh)
    assert torch.equal(compiled(builds_mask=False), torch.ones(2))  # generate()'s static-cache steps
    assert torch.equal(compiled(builds_mask=True), -torch.ones(2))
    fresh.consumers.add(1)  # a layer ran on it uncompiled: not this graph's mask
    assert torch.equal(compiled(builds_mask=False), -torch.ones(2))
    del fresh
    assert torch.equal(compiled(builds_mask=False), -torch.ones(2))  # no plan alive: the user's own 4D mask


def _compiled_generate(model, ids, mask, new_tokens):
    """generate() as it runs with a static cache on a GPU: the decode step compiled (here with aot_eager, on the CPU),
    the mask built outside the compiled region before every step."""
    from transformers import CompileConfig

    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True  # Transformers compiles on CUDA only unless told otherwise
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          cache_implementation="static", compile_config=config, output_logits=True,
                          return_dict_in_generate=True)


def test_compiled_static_generate_runs_the_graph_op_for_any_sequence_of_shapes(fake_hopper):
    """Static-cache generate() in one process at batch 1, 4 (left-padded), 2, then 1 again, and with two different
    max_new_tokens: the compiled steps take the graph op on fa3 (FlashInfer's fake, float64 on the CPU), whose
    slots the mask function reloads before every step, never crash when torch makes the batch dynamic, and give the
    tokens and logits of the uncompiled run."""
    torch._dynamo.reset()
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    fa3 = fake_hopper.modules
    runs = []
    for lengths, new_tokens in (((10,), 4), ((7, 4, 9, 5), 4), ((3, 11), 6), ((12,), 4)):
        ids, mask, _ = left_padded_batch(lengths=lengths)
        eager_mode = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                    cache_implementation="static", disable_compile=True, output_logits=True,
                                    return_dict_in_generate=True)
        before = fa3["fa3"].runs
        graph_mode = _compiled_generate(model, ids, mask, new_tokens)
        runs.append(fa3["fa3"].runs - before)
        assert torch.equal(graph_mode.sequences, eager_mode.sequences)
        assert rel_err(torch.stack(graph_mode.logits), torch.stack(eager_mode.logits)) < 1e-10
    # Every compiled decode step (new_tokens - 1 after the expanded prefill of >8 tokens) ran the kernel in each of
    # the two layers.
    assert runs == [2 * (n - 1) for n in (4, 4, 6, 4)]
    slots = {(s.batch, s.q_len) for s in captured_shapes()}
    assert {(1, 1), (4, 1), (2, 1)} <= slots  # one slot per batch size, the first reused by the last call


def test_reset_forgets_captured_shapes_and_buffers_and_generate_compiles_again(fake_hopper):
    """`hf_flashinfer_mla.reset()` is what a fresh process has: no captured shape, no device buffer held, and torch's
    compiled code gone with them. The same model's compiled generate() afterwards (Transformers keeps its compiled
    call on the model) compiles again, makes new slots, and gives the tokens and logits of the call before."""
    import hf_flashinfer_mla
    from hf_flashinfer_mla import buffers

    torch._dynamo.reset()
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    before = _compiled_generate(model, ids, mask, 4)
    runs = fake_hopper.modules["fa3"].runs
    assert [(s.backend, s.runs, s.batch, s.q_len) for s in captured_shapes()] == [("fa3", "fa3", 3, 1)]
    assert "workspace" in buffers.held("cpu") and runs == 2 * 3  # 2 layers x 3 decode steps
    hf_flashinfer_mla.reset()
    assert captured_shapes() == [] and buffers.held("cpu") == {}
    after = _compiled_generate(model, ids, mask, 4)
    assert [(s.runs, s.batch) for s in captured_shapes()] == [("fa3", 3)]
    assert fake_hopper.modules["fa3"].runs == 2 * runs  # (the fake hands out one module per backend)
    assert torch.equal(after.sequences, before.sequences)
    assert rel_err(torch.stack(after.logits), torch.stack(before.logits)) < 1e-12


@torch.no_grad()
@pytest.mark.parametrize("masks", ["mask function", "the caller's own"])
def test_a_compiled_forward_takes_graph_slots_only_for_masks_the_mask_function_planned(fake_hopper, masks):
    """A forward compiled by the caller (not by generate()), handed 4D masks each step. Masks from Transformers'
    ``create_masks_for_generate`` went through the mask function, which reloads the CUDA-graph slots before each
    step: the graph runs fa3 through them. A 4D mask of the caller's own never reaches the mask function, so nothing
    would reload a slot before a replay (on a GPU the replays would attend over the captured step's rows): the graph
    runs the reference backend. Both give the uncompiled run's logits."""
    torch._dynamo.reset()
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    steps = 4
    max_len = left_padded_batch()[0].shape[1] + steps + 3

    def with_4d(forward):
        def step(attention_mask, cache, position_ids, **kwargs):
            if masks == "mask function":
                mask4d = create_masks_for_generate(config=model.config, inputs_embeds=torch.empty(
                    attention_mask.shape[0], 1, 0, dtype=model.dtype), attention_mask=attention_mask, cache=cache,
                    position_ids=position_ids)
            else:
                mask4d = torch.zeros(attention_mask.shape[0], 1, 1, max_len, dtype=torch.bool)
                mask4d[:, 0, 0, : attention_mask.shape[1]] = attention_mask.bool()
            return forward(attention_mask=mask4d, cache=cache, position_ids=position_ids, **kwargs)

        return step

    plain = _decode_steps(with_4d(model), model, steps)
    runs = fake_hopper.modules["fa3"].runs
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    graph_mode = _decode_steps(with_4d(compiled), model, steps)
    slot_runs = fake_hopper.modules["fa3"].runs - runs
    assert rel_err(graph_mode, plain) < 1e-10
    assert slot_runs == (2 * steps if masks == "mask function" else 0)  # two layers per step, or the reference


@torch.no_grad()
def test_the_callers_own_masks_after_a_loop_over_the_mask_functions_take_no_graph_slots(fake_hopper):
    """A compiled loop over ``create_masks_for_generate``'s masks, whose last step's mask (and plan, on which no
    layer ran: the graph ran them) stays alive, as torch's CUDA-graph trees or a reference cycle may keep it; then the
    caller's own 4D masks, uncompiled, and the same loop compiled anew. The compiled loop must not take the earlier
    plan for one of its own masks (on the H200 its replays ran the captured step's rows: logits off by 1.19): the
    caller's own masks reaching a layer forget the plan noted last, and the graphs run the reference backend."""
    torch._dynamo.reset()
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    steps, kept = 4, []
    max_len = left_padded_batch()[0].shape[1] + steps + 3

    def with_4d(forward, own):
        def step(attention_mask, cache, position_ids, **kwargs):
            if own:
                mask4d = torch.zeros(attention_mask.shape[0], 1, 1, max_len, dtype=torch.bool)
                mask4d[:, 0, 0, : attention_mask.shape[1]] = attention_mask.bool()
            else:
                mask4d = create_masks_for_generate(config=model.config, inputs_embeds=torch.empty(
                    attention_mask.shape[0], 1, 0, dtype=model.dtype), attention_mask=attention_mask, cache=cache,
                    position_ids=position_ids)
                kept.append(mask4d)
            return forward(attention_mask=mask4d, cache=cache, position_ids=position_ids, **kwargs)

        return step

    _decode_steps(with_4d(torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False), own=False),
                  model, steps)
    plain = _decode_steps(with_4d(model, own=True), model, steps)
    torch._dynamo.reset()
    runs = fake_hopper.modules["fa3"].runs
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    graph_mode = _decode_steps(with_4d(compiled, own=True), model, steps)
    assert rel_err(graph_mode, plain) < 1e-10
    assert fake_hopper.modules["fa3"].runs == runs  # the reference, not the slots
    assert len(kept) == steps
