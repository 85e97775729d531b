"""The decode path traces into one graph (no graph break), as CUDA graphs need, and computes the same thing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from conftest import left_padded_batch, make_model, rel_err
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from transformers import StaticCache
from transformers.masking_utils import create_masks_for_generate

from hf_flashinfer_mla import cuda_graphs


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
    op = torch.ops.hf_flashinfer_mla.fa_decode_graph
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q = torch.empty(2, 4, 1, 512, dtype=torch.bfloat16)
        # The same argument order as the eager entry point: backend, step (here its mask), operands, scale.
        out = op("fa3", torch.empty(2, 1, 1, 9, dtype=torch.bool), q, torch.empty(2, 4, 1, 64, dtype=torch.bfloat16),
                 torch.empty(2, 1, 9, 512, dtype=torch.bfloat16), torch.empty(2, 1, 9, 64, dtype=torch.bfloat16), 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_graphs_that_build_their_own_mask_do_not_use_graph_wrappers():
    # A user-compiled forward traces the mask function: nothing would re-plan FlashInfer before a CUDA-graph replay,
    # so such graphs must take the reference path. generate()'s static-cache graphs get the mask from outside.
    from hf_flashinfer_mla.cuda_graphs import mask_planned_outside_graph, note_mask_built_in_graph

    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def builds_mask(x):
        note_mask_built_in_graph()
        return x + 1 if mask_planned_outside_graph() else x - 1

    @torch.compile(backend="eager", fullgraph=True)
    def receives_mask(x):
        return x + 1 if mask_planned_outside_graph() else x - 1

    x = torch.zeros(2)
    assert torch.equal(builds_mask(x), x - 1)
    assert torch.equal(receives_mask(x), x + 1)


def _static_steps_as_generate(forward, model, steps=4):
    """Decode steps over a StaticCache as generate() runs them: the 4D mask (and the planning) built eagerly before
    each call of `forward`, inside generate()'s decode scope (rows known on the host)."""
    from hf_flashinfer_mla import metadata

    ids, mask, _ = left_padded_batch()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    token = metadata._generate_call.set(metadata._GenerateCall(extending=True))
    logits = []
    try:
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            pos = pos[:, -1:] + 1
            embeds = torch.empty(mask.shape[0], 1, 0, dtype=model.dtype)
            mask4d = create_masks_for_generate(config=model.config, inputs_embeds=embeds, attention_mask=mask,
                                               cache=cache, position_ids=pos)
            out = forward(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask4d, position_ids=pos,
                          cache=cache, use_cache=True)
            logits.append(out.logits)
    finally:
        metadata._generate_call.reset(token)
    return torch.cat(logits, 1)


def test_compiled_decode_runs_the_graph_op_on_slots_planned_by_the_mask_function(fake_hopper, monkeypatch):
    """The compiled decode step takes the fa3 graph op (here on FlashInfer's fake, float64 on the CPU): its slot is
    planned by the mask function before each call (once per step, from rows known on the host) and the result
    equals the uncompiled step."""
    monkeypatch.setattr(cuda_graphs, "_slots", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    torch._dynamo.reset()
    model = make_model("deepseek_v3", first_k_dense_replace=2)
    with torch.no_grad():
        eager_mode = _static_steps_as_generate(model, model)
    fa3 = fake_hopper.modules["fa3"]
    eager_plans, eager_runs = len(fa3.plans), fa3.runs
    assert eager_plans == 4 and not cuda_graphs._slots  # eager mode: one plan per step, no graph slots
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():  # as in generate()
        graph_mode = _static_steps_as_generate(compiled, model)
    assert len(cuda_graphs._slots) == 1  # one decode shape
    assert len(fa3.plans) - eager_plans == 4  # once per step: the op found its slot planned for the step
    assert fa3.runs - eager_runs == 4 * model.config.num_hidden_layers
    assert rel_err(graph_mode, eager_mode) < 1e-10
