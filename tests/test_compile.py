"""The decode path traces into one graph (no graph break), as CUDA graphs need, and computes the same thing."""

from __future__ import annotations

import torch
from conftest import left_padded_batch, make_model, rel_err
from transformers import StaticCache


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
