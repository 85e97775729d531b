"""CUDA-graph slots of fa3/fa2 (`kernels.graphs.GraphSlot`): the metadata a replayed graph reads lives at fixed
addresses and is reloaded in place once per step, from the schedule planned ahead where generate() planned one; the
shapes admitted to a graph are never refused by FlashInfer's validator. On the fa3 stand-in (`fake_flashinfer.py`)."""

from __future__ import annotations

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import bool_mask, fa_layer, make_model, rel_err, rows_on_host
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from flashinfer.mla._batch_mla._backends import _fa_common

from hf_flashinfer_mla import buffers, masks
from hf_flashinfer_mla.kernels import Layer, fa, graphs, reference
from hf_flashinfer_mla.compiled import route_in_graph
from hf_flashinfer_mla.plan import StepPlan, attach_plan, plan_of
from hf_flashinfer_mla.rows import GrowingMask

CPU = torch.device("cpu")
F64 = torch.float64


def _graph_step(first, end, kv_len=16, mask=None):
    """A decode step over a static cache of `kv_len` rows, its rows known on the host (or read off `mask`)."""
    if mask is None:
        first = torch.tensor(first)
        growing = GrowingMask(first, first, end)
        return StepPlan(growing.mask(len(first), 1, kv_len, CPU), growing.rows(1, kv_len))
    return StepPlan(mask)


def _scheduled(slot) -> int:
    """Which of the fake module's plans the slot's workspace holds."""
    return int(slot.meta.int_workspace.view(torch.int32)[1])


def test_graph_slot_is_reloaded_in_place_once_per_step(fake_hopper, monkeypatch):
    """A CUDA-graph slot's metadata lives at fixed addresses and is rebuilt there by every step of its shape
    (batch, query length, static cache length), once per step however many times the step asks (generate()'s
    compiled step, then the graph op's warm-up run); a step with holes writes explicit indices for itself only.
    Slots of other shapes are left alone."""
    layer = fa_layer(pitch=16, scale=0.25)
    key = ("fa3", layer, 2, 1, 16)  # backend, layer, batch, query length, mask length
    slot = graphs.slot(key, fa, "fa3", layer, _graph_step([3, 0], 10))  # made and first loaded on first use
    assert isinstance(slot, graphs.GraphSlot) and graphs.slot(key, fa, "fa3", layer, None) is slot  # kept
    other_batch = graphs.slot(("fa3", layer, 3, 1, 16), fa, "fa3", layer, _graph_step([3, 0, 1], 10))
    wider = fa_layer(pitch=24, scale=0.25)
    other_len = graphs.slot(("fa3", wider, 2, 1, 24), fa, "fa3", wider, _graph_step([3, 0], 10, kv_len=24))
    others = [(s, _scheduled(s)) for s in (other_batch, other_len)]
    fa3 = fake_hopper.modules["fa3"]
    indices, workspace = slot.meta.kv_indices, slot.meta.int_workspace
    for end in (11, 12, 13):
        before = len(fa3.plans)
        step = _graph_step([3, 0], end)
        step.load_graph_slots()
        step.load_graph_slots()  # a second ask on the same step does not plan again
        route = route_in_graph(step, None, layer, "fa3")  # nor does the graph op's warm-up run on it
        assert route.backend == "fa3" and route.slot is slot
        assert len(fa3.plans) == before + 1 and fa3.plans[-1]["kv_len"].tolist() == [end - 3, end]
        assert _scheduled(slot) == len(fa3.plans) - 1
        assert slot.meta.kv_indices is indices and slot.meta.int_workspace is workspace  # fixed addresses
        assert indices.tolist() == list(range(32))  # the identity: only the schedule changes per step
        assert fa3.plans[-1]["kv_indptr"].tolist() == [3, 16, 32]
        assert [(s, _scheduled(s)) for s in (other_batch, other_len)] == others  # other shapes: not reloaded
    holes = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    holes[0, ..., 5] = holes[1, ..., 12:] = False  # a user's mask with a hole: explicit indices for one step
    _graph_step(None, None, mask=holes).load_graph_slots()
    assert indices[:27].tolist() == [0, 1, 2, 3, 4] + list(range(6, 16)) + list(range(16, 28))
    last = _graph_step([3, 0], 12)
    last.load_graph_slots()
    assert slot.meta.kv_indices is indices and indices.tolist() == list(range(32))  # the identity is back
    # Slots plan during CUDA-graph warm-up, whose allocations belong to the graph's pool: never the process-wide
    # identity of eager steps.
    assert "identity" not in buffers.held(CPU)
    g = torch.Generator().manual_seed(0)  # head-major operands, as every kernel call takes them
    q_lat, q_pe = torch.randn(4, 2, 32, generator=g, dtype=F64), torch.randn(2, 4, 8, generator=g, dtype=F64)
    kv, k_rot = torch.randn(2, 1, 16, 32, generator=g, dtype=F64), torch.randn(2, 1, 16, 8, generator=g, dtype=F64)
    out = slot.run(q_lat, q_pe, kv, k_rot)
    assert fa3.runs == 1 and rel_err(out, reference.attend(last.mask, 0.25, q_lat, q_pe, kv, k_rot)) < 1e-12
    slot.meta.layout = slot.meta.layout[:-1] + (1,)  # as if FlashInfer's schedule layout moved between steps
    with pytest.raises(RuntimeError, match="schedule layout"):
        _graph_step([3, 0], 13).load_graph_slots()


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_graph_shapes_admitted_are_never_refused(monkeypatch, backend):
    """`refusal_for_every_step` against FlashInfer's own validator: an admitted shape is accepted at every cached
    length; a shape it rejects is refused at some length (so the reference fallback in graphs is not needless)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(_fa_common, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(_fa_common, "_get_fa_shared_memory_limits", lambda device: (233472, 232448))
    refused = _fa_common._validate_fa_plan_workload.__globals__["_BackendPlanUnsupportedError"]
    cuda = torch.device("cuda:0")
    for heads in (1, 4, 16, 20, 24, 32, 64, 96, 128):
        for q_len in (1, 2, 3, 8):
            for batch in (1, 4):
                layer = Layer(cuda, torch.bfloat16, torch.bfloat16, heads, 512, 64, 4096, False, 0.1)
                admitted = fa.refusal_for_every_step(layer, batch, q_len) is None
                outcomes = []
                for kv in range(q_len, q_len + 200):
                    try:
                        _fa_common._validate_fa_plan_workload(
                            torch.arange(batch + 1, dtype=torch.int32) * q_len,
                            torch.full((batch,), kv, dtype=torch.int32), heads, q_len > 1, "cuda:0", backend,
                            torch.bfloat16)
                        outcomes.append(True)
                    except refused:
                        outcomes.append(False)
                if admitted:
                    assert all(outcomes), (heads, q_len, batch)
                elif q_len > 1:
                    assert not all(outcomes), (heads, q_len, batch)


def test_graph_slot_uploads_the_schedule_planned_ahead(fake_hopper):
    """generate()'s mask update, once it has queued a step, plans the next one over the grown mask
    (`StepPlan.plan_next`): its mask, its plan, and each CUDA-graph slot's schedule, uploaded at once (stream-ordered
    after the replay in flight, which reads the slot's previous schedule). The mask function hands that step out
    as it is; a step that finds its slot holding another forward's schedule (one of the same shape run in between)
    loads its own again; nothing is planned ahead for a step that would not fit in the cache."""
    model = make_model("deepseek_v3")  # only its generate() mask update runs
    layer = fa_layer(pitch=16, scale=0.25)
    fa3 = fake_hopper.modules

    def grow(mask2d):  # generate()'s update after a step: the next mask, the next step planned ahead
        return model._update_model_kwargs_for_generation({}, {"attention_mask": mask2d})["attention_mask"]

    def step(mask2d):  # the mask function over a static cache of 16 rows, then generate()'s compiled step
        mask = masks.flashinfer_mla_mask(batch_size=2, q_length=1, kv_length=16, q_offset=mask2d.shape[1] - 1,
                                         attention_mask=mask2d, device=CPU)
        plan_of(mask).load_graph_slots()  # what generate()'s compiled step does before each call
        return plan_of(mask)

    mask2d = grow(bool_mask([[0, 0, 0] + [1] * 6, [1] * 9]).long())  # after the prefill: width 10
    first = step(mask2d)
    assert route_in_graph(first, None, layer, "fa3").backend == "fa3"  # the graph op's warm-up makes the slot
    [(_, slot)] = graphs.slots_for(2, 1, 16)
    plans = fa3["fa3"].plans
    assert len(plans) == 1 and _scheduled(slot) == 0
    mask2d = grow(mask2d)
    assert len(plans) == 2 and plans[1]["ahead"] and plans[1]["kv_len"].tolist() == [8, 11]
    assert _scheduled(slot) == 1  # uploaded already
    step(mask2d)
    assert len(plans) == 2 and _scheduled(slot) == 1  # the step planned ahead, handed out: no plan, no upload
    mask2d = grow(mask2d)  # plans width 12 ahead
    assert len(plans) == 3 and plans[2]["ahead"] and _scheduled(slot) == 2
    other = attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool), rows_on_host([3, 0], 13))  # a forward in between
    other.load_graph_slots()
    assert len(plans) == 4 and _scheduled(slot) == 3 and plans[3]["kv_len"].tolist() == [10, 13]
    step(mask2d)  # the slot holds the other forward's schedule: this step loads its own again
    assert len(plans) == 5 and _scheduled(slot) == 4 and plans[4]["kv_len"].tolist() == [9, 12]
    mask2d = grow(mask2d)
    for _ in range(3):
        step(mask2d)
        mask2d = grow(mask2d)
    assert mask2d.shape[1] == 16 and plans[-1]["kv_len"].tolist() == [13, 16]
    count = len(plans)
    step(mask2d)
    grow(mask2d)  # the next step would not fit in the cache: nothing is planned ahead
    assert len(plans) == count and _scheduled(slot) == count - 1
