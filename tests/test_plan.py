"""The step's plan (`plan.StepPlan`): one per forward step, shared by the layers and planned ahead inside generate();
where it routes a step a kernel refuses (with one warning) or that needs gradients; its adoption by the copies of a
mask that accelerate hands to layers on another device; and its lifetime, freed with its mask. Whole models run in
float64 on the fa3 stand-in (`fake_flashinfer.py`), against ``eager`` or the reference backend, to rounding."""

from __future__ import annotations

import gc
import logging

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import (
    VOCAB,
    GENERATION_MODES,
    assert_batch_matches_eager_alone,
    assert_same_outputs,
    decode_logits,
    eager_alone,
    fa_layer,
    generation_mode,
    left_padded_batch,
    make_model,
    package_warnings,
    rel_err,
    route_of,
    rows_on_host,
    spy,
)
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from flashinfer.mla._batch_mla._backends import _fa_common
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_masks_for_generate

from hf_flashinfer_mla import ENV_VAR, masks, plan
from hf_flashinfer_mla.plan import StepPlan, attach_plan, plan_of, step_plan
from hf_flashinfer_mla.rows import GrowingMask, Rows

TOL = 1e-6
META = torch.device("meta")


def test_host_rows_planning_never_reads_the_device(fake_hopper):
    """With rows known on the host, a step's whole fa3 planning runs on tensors of the meta device, which hold no
    data: any read of the GPU (a sync) would raise here."""
    step = StepPlan(torch.ones(3, 1, 1, 40, dtype=torch.bool, device=META), rows_on_host([0, 5, 39], 40))
    route = route_of(step, fa_layer(META))
    assert route.backend == "fa3" and route.meta.engine is not None
    assert route.meta.kv_indices.device == META and route.meta.kv_indices.numel() >= 3 * 64
    planned = fake_hopper.modules["fa3"].plans[-1]
    assert planned["kv_len"].tolist() == [40, 35, 1] and planned["causal"] is False
    assert planned["kv_indptr"].tolist()[:3] == [0, 64 + 5, 128 + 39]  # each row's run, addressed in place


@pytest.mark.parametrize("mode", GENERATION_MODES)
def test_generation_modes_on_the_kernel_match_the_reference(fake_hopper, monkeypatch, mode):
    """Assisted generation (another model, or the model as its own assistant: cropped caches, 5-token verify steps),
    rows that stop early at eos, chained calls over one cache with holes in the mask, beam search, sampling several
    sequences per prompt and classifier-free guidance with a negative prompt, run on the fa3 stand-in,
    against the same calls on the reference backend. The stand-in attends over the rows it was *planned* with (read
    back from its workspace), where the reference reads the step's live mask, so wrong rows show here and in no
    comparison with eager on the CPU. Each mode reaches its own source of rows: assisted steps come without a 2D
    mask (rows from the cache's length), eos steps from generate()'s grown masks (`GrowingMask`, planned ahead), the
    chained calls' holes from the mask itself (`Rows.from_mask`); a fault of one row in each source fails its modes.
    (Against eager: ``test_dense_models.py``, ``test_nested_forwards.py``.)"""
    ours = generation_mode(mode)
    fa3 = fake_hopper.modules["fa3"]
    runs = fa3.runs
    assert runs > 0
    monkeypatch.setenv(ENV_VAR, "reference")
    ref = generation_mode(mode)
    assert fa3.runs == runs  # the second pass ran the reference only
    assert_same_outputs(ours, ref, TOL)


def _ours(o) -> bool:
    return isinstance(o, torch.Tensor) or str(getattr(type(o), "__module__", "")).startswith("hf_flashinfer_mla")


def _garbage_of_generate(model, **kwargs) -> list:
    """The objects a generate() call left in reference cycles (found by Python's garbage collector, not freed when
    the call returned): the package's own objects and tensors only, and only those the call made. (Objects alive
    before it, an earlier test's compiled graphs' fake tensors among them, are held until it returns, so none of them
    can turn up here, whatever ran before.)"""
    ids, mask, _ = left_padded_batch()
    gc.collect()
    earlier = [o for o in gc.get_objects() if _ours(o)]  # noqa: F841  (held: see above)
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kwargs)
        gc.collect()
        return [o for o in gc.garbage if _ours(o)]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("kernel", ["reference", "fa3"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_a_steps_plan_mask_and_metadata_are_freed_with_its_mask(request, monkeypatch, kernel, cache_implementation):
    """A step's mask, its plan, rows and kernel metadata form no reference cycle: they are freed when generate()
    drops the mask, not whenever Python's garbage collector runs. (On a GPU, device memory freed at random moments
    moved the next generate()'s static cache to other addresses, and torch's CUDA-graph trees recorded every
    warmed-up call's graphs again.) The control puts the old cycle back (the
    plan holding its mask) and must find it."""
    if kernel == "fa3":
        request.getfixturevalue("fake_hopper")
    model = make_model("deepseek_v3")
    assert _garbage_of_generate(model, cache_implementation=cache_implementation) == []

    original = StepPlan.__init__

    def holding_its_mask(self, mask, *args, **kwargs):  # the control: plan -> mask -> plan
        original(self, mask, *args, **kwargs)
        self.held = mask

    monkeypatch.setattr(StepPlan, "__init__", holding_its_mask)
    kinds = {type(o).__name__ for o in _garbage_of_generate(model, cache_implementation=cache_implementation)}
    assert {"StepPlan", "Tensor"} <= kinds


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_on_fa3_matches_eager_alone_planning_once_per_step_without_reading_the_mask(
    fake_hopper, monkeypatch, cache_implementation
):
    model = make_model("deepseek_v3")
    from_mask = spy(monkeypatch, Rows, "from_mask")
    reads = spy(monkeypatch, GrowingMask, "read")
    ids, mask, prompts = left_padded_batch()
    new_tokens = 6
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, cache_implementation=cache_implementation)
    fa3 = fake_hopper.modules["fa3"]
    decode_steps = new_tokens - 1  # the 9-token prefill takes the expanded path
    # One plan per step, shared by the layers. The first decode step plans when it runs; every later one was
    # planned ahead, while generate() had the previous step queued. After the last step one more is planned ahead
    # and never used, where the cache has room for another token (the static cache is sized for exactly this call).
    unused = {"dynamic": 1, "static": 0}[cache_implementation]
    assert [p["ahead"] for p in fa3.plans] == [False] + [True] * (decode_steps - 1 + unused)
    assert fa3.runs == decode_steps * model.config.num_hidden_layers
    assert from_mask == [] and len(reads) == 1  # the left padding, read once; no step read its mask
    first = [ids.shape[1] - len(p) for p in prompts]
    for step, planned in enumerate(fa3.plans):
        width = ids.shape[1] + step + 1
        assert planned["kv_len"].tolist() == [width - f for f in first] and planned["causal"] is False
    assert_batch_matches_eager_alone(model, out, prompts, new_tokens, TOL)


@torch.no_grad()
def test_transformers_own_cache_layers_decode_on_the_kernel_as_eager(fake_hopper):
    """A cache built without the model's config (``DynamicCache()``) keeps Transformers' own `DynamicLayer`, which
    concatenates its latent every step into new tensors: fa3 reads those in place too, and the logits are eager's.
    (Caches built from the model's config get the package's layers, which the rest of the suite decodes over.)"""
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (len(prompts), 4), generator=torch.Generator().manual_seed(8))
    cache = DynamicCache()
    ours = decode_logits(model, ids, mask, cache=cache, forced=forced)
    assert cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers)
    assert fake_hopper.modules["fa3"].runs == forced.shape[1] * model.config.num_hidden_layers
    for b, theirs in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[b], theirs) < TOL


def test_prompt_lookup_decoding_multi_token_causal_plans(fake_hopper):
    """Assisted (prompt-lookup) decoding verifies several tokens per step: causal fa3 plans, equal to eager."""
    model = make_model("deepseek_v3")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    ours = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    plans = fake_hopper.modules["fa3"].plans
    assert any(p["causal"] and int(p["qo_indptr"][1]) > 1 for p in plans)
    model.set_attn_implementation("eager")
    assert torch.equal(ours, model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("fa2_accepts", [False, True])
def test_refused_causal_plan_falls_back_with_one_warning(fake_hopper, caplog, fa2_accepts):
    """20 heads and 8-token steps: FlashInfer's causal tile bound (its real validator) refuses the steps whose
    cached length is 2 mod 64 (here two of them). Those steps run on fa2 if it accepts, else on the reference
    backend; every step equals eager, and one warning names the backends that refused for that reason and where
    the steps run (not one per backend, step or context)."""
    real = _fa_common._validate_fa_plan_workload

    def validate(qo_indptr, kv_len_arr, num_heads, causal, device, backend, kv_data_type):
        if backend == "fa2" and fa2_accepts:
            return None
        return real(qo_indptr, kv_len_arr, num_heads, causal, device, backend, kv_data_type)

    fake_hopper.validate_workload = validate
    model = make_model("deepseek_v3", num_attention_heads=20, num_key_value_heads=20, num_hidden_layers=2,
                       first_k_dense_replace=2)
    g = torch.Generator().manual_seed(4)
    prompt, forced = torch.randint(1, VOCAB, (1, 10), generator=g), torch.randint(1, VOCAB, (1, 128), generator=g)
    ones = torch.ones_like(prompt)
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"), torch.no_grad():
        # cached lengths 18, 26, ..., 66 (refused), ..., 130 (refused), 138
        ours = decode_logits(model, prompt, ones, forced=forced, chunks=[8] * 16)
    warnings = [m for m in package_warnings(caplog) if "decline" in m]
    fallback = "fa2" if fa2_accepts else "reference"
    refusing = "fa3 declines" if fa2_accepts else "fa3 and fa2 decline"
    assert len(warnings) == 1 and warnings[0].startswith(f"flashinfer_mla: {refusing} some decode steps at 20 heads")
    assert warnings[0].endswith(f"those steps run on {fallback}."), warnings
    fa3 = fake_hopper.modules["fa3"]
    assert len(fa3.plans) == 14 and fa3.runs == 14 * 2  # 16 steps, two refused before planning
    assert fake_hopper.modules["fa2"].runs == (2 * 2 if fa2_accepts else 0)
    model.set_attn_implementation("eager")
    assert rel_err(ours, decode_logits(model, prompt, ones, forced=forced, chunks=[8] * 16)) < TOL


def test_decode_with_gradients_takes_the_differentiable_path(fake_hopper, caplog):
    """A training forward of a few tokens over a cache (the absorbed path) must not run FlashInfer's kernels, which
    have no backward: the step takes the reference backend and kv_b_proj gets the gradient eager gives it."""
    grads = {}
    for attn in ("flashinfer_mla", "eager"):
        model = make_model("deepseek_v3", num_hidden_layers=1, first_k_dense_replace=1)
        model.set_attn_implementation(attn)
        prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            cache = model(input_ids=prompt[:, :9], cache=DynamicCache(config=model.config), use_cache=True).cache
        with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
            loss = model(input_ids=prompt[:, 9:], cache=cache, use_cache=True).logits.square().sum()
        loss.backward()
        grads[attn] = model.model.layers[0].self_attn.kv_b_proj.weight.grad
    assert "fa3" not in fake_hopper.modules or fake_hopper.modules["fa3"].runs == 0
    assert sum("autograd recording" in r.getMessage() for r in caplog.records) == 1
    assert grads["flashinfer_mla"] is not None and rel_err(grads["flashinfer_mla"], grads["eager"]) < TOL


class _Module:
    def __init__(self, config, layer_idx=0):
        self.config, self.layer_idx = config, layer_idx


def test_adoption_rule():
    config, other = object(), object()
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    step = attach_plan(mask, config=config)
    l0, l1, stranger = _Module(config), _Module(config, 1), _Module(other, 1)
    copy = mask.clone()
    assert step_plan(mask, l0) is step
    assert step.adoptable_by(copy, l1)  # a copy reaching a layer that has not run on the plan
    assert not step.adoptable_by(copy, l0)  # a layer that ran on it is at a new step
    assert not step.adoptable_by(copy, stranger)  # another model
    assert not step.adoptable_by(copy, _Module(config, 0))  # another model's first layer, on the same config
    assert step.adoptable_by(copy, _Module(config, None))  # a module built without a layer_idx: no order to check
    assert not step.adoptable_by(torch.ones(2, 1, 1, 6, dtype=torch.bool), l1)  # another shape
    assert not step.adoptable_by(torch.zeros(2, 1, 1, 5), l1)  # another dtype
    assert step_plan(copy, l1) is step
    assert step_plan(copy.clone(), stranger) is not step  # another model's layer never adopts it
    fresh = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    new = step_plan(fresh, l0)  # l0 already ran on `step`: a new step, an exact plan of its own
    assert new is not step and plan_of(fresh) is new


@torch.no_grad()
def test_a_plan_no_layer_ran_on_is_never_adopted(fake_hopper):
    """A step's plan that no layer has run on is not known to be the plan of the step being run: generate() builds a
    static cache's mask (and its plan) outside the compiled step, whose CUDA graph then runs the layers without
    Python. A plan-less mask of the same shape reaching the first layer afterwards (a user's own 4D mask, of other
    rows) gets an exact plan of its own, and the step equals Transformers' sdpa."""
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 2), generator=torch.Generator().manual_seed(9))
    max_len = ids.shape[1] + 4

    def planned_elsewhere_then_4d(attention_mask, cache, position_ids, **kwargs):
        # The step of another batch of this shape (no padding) planned as generate() plans a compiled step ...
        create_masks_for_generate(config=model.config, inputs_embeds=torch.empty(3, 1, 0, dtype=model.dtype),
                                  attention_mask=torch.ones_like(attention_mask), cache=cache,
                                  position_ids=position_ids)
        # ... then the user's own step, on a 4D mask of its own rows.
        am = torch.zeros(attention_mask.shape[0], 1, 1, max_len, dtype=torch.bool)
        am[:, 0, 0, : attention_mask.shape[1]] = attention_mask.bool()
        return model(attention_mask=am, cache=cache, position_ids=position_ids, **kwargs)

    def run():
        return decode_logits(model, ids, mask, cache=StaticCache(config=model.config, max_cache_len=max_len),
                             forced=forced, forward=planned_elsewhere_then_4d)

    ours = run()
    model.set_attn_implementation("sdpa")  # (batched float64 eager: NaN in fully masked padding rows)
    assert rel_err(ours, run()) < TOL
    config = object()
    step = attach_plan(torch.ones(2, 1, 1, 5, dtype=torch.bool), config=config)
    assert not step.adoptable_by(torch.ones(2, 1, 1, 5, dtype=torch.bool), _Module(config))


def _split_like_accelerate(model, first_copied_layer):
    """Hand every decoder layer from `first_copied_layer` on a copy of the mask, as accelerate's hooks do for
    layers on another device."""

    def copy_mask(module, args, kwargs):
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = kwargs["attention_mask"].clone()
        return args, kwargs

    return [layer.register_forward_pre_hook(copy_mask, with_kwargs=True)
            for layer in model.model.layers[first_copied_layer:]]


@pytest.mark.parametrize("first_copied, built_per_step, adopted_per_step", [
    (0, 2, 3), (2, 1, 2), (4, 1, 0),
])
def test_copied_masks_plan_once_per_device_per_step(fake_hopper, monkeypatch, first_copied, built_per_step,
                                                    adopted_per_step):
    """Layers before `first_copied` on one "device", the rest on another (masks copied, as accelerate does): fa3
    plans once per step whatever the split. The copies adopt the step's plan; when layer 0 already gets a copy,
    the mask function's plan has not been used by any layer, so the first copy gets a plan of its own (never a
    plan that might be stale) and the other copies adopt that one."""
    model = make_model("deepseek_v3", num_hidden_layers=4)
    ids, mask, prompts = left_padded_batch()
    hooks = _split_like_accelerate(model, first_copied)
    built = []
    for owner in (masks, plan):  # the mask function's plans, and the plans of copies that adopt none
        original = owner.attach_plan
        monkeypatch.setattr(owner, "attach_plan", lambda *a, _original=original, **k: built.append(a)
                            or _original(*a, **k))
    adoptions = []
    adoptable = StepPlan.adoptable_by
    monkeypatch.setattr(StepPlan, "adoptable_by", lambda self, m, mod: adoptions.append(adoptable(self, m, mod))
                        or adoptions[-1])
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    steps = 3
    fa3 = fake_hopper.modules["fa3"]
    # Steps whose layers run on the mask function's plan (rows known on the host) are planned ahead, the first one
    # excepted, and so is a step after the last; a first copy's own plan reads its rows off the mask.
    ahead = [False] * steps if first_copied == 0 else [False, True, True, True]
    assert [p["ahead"] for p in fa3.plans] == ahead and fa3.runs == steps * 4
    # (+ 1: generate()'s mask update plans the step after the last, which never runs)
    assert len(built) == steps * built_per_step + 1 and sum(adoptions) == steps * adopted_per_step
    assert_batch_matches_eager_alone(model, out, prompts, 4, TOL)


@torch.no_grad()
def test_user_4d_masks_get_fresh_plans_every_step(fake_hopper):
    """A user's own 4D mask reaches the layers without a plan, step after step, with the same shape (a static
    cache): each step gets its own plan (adopting the previous step's, of the same shape, would attend one token
    short) and the result equals the run on 2D masks."""
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    max_len = ids.shape[1] + 8

    def with_4d_mask(attention_mask, **kwargs):  # the user's own boolean mask: padding, cached tokens, the new one
        am = torch.zeros(attention_mask.shape[0], 1, 1, max_len, dtype=torch.bool)
        am[:, 0, 0, : attention_mask.shape[1]] = attention_mask.bool()
        return model(attention_mask=am, **kwargs)

    runs = {
        kind: decode_logits(model, ids, mask, cache=StaticCache(config=model.config, max_cache_len=max_len),
                            forced=forced, forward=forward)
        for kind, forward in (("2d", None), ("4d", with_4d_mask))
    }
    assert len(fake_hopper.modules["fa3"].plans) == 2 * forced.shape[1]  # one per step, on fa3
    assert rel_err(runs["4d"], runs["2d"]) < TOL


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_a_4d_mask_rewritten_in_place_is_planned_again_every_step(fake_hopper, dtype):
    """A loop that keeps one 4D mask tensor of the static cache's shape and rewrites it in place for every step (as
    constant-address loops do), boolean or additive: each step is planned from what the tensor holds now. A plan
    kept on the tensor from its first step would run every later step on the first step's rows."""
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    max_len = ids.shape[1] + 8
    buffer = torch.zeros(ids.shape[0], 1, 1, max_len, dtype=dtype)

    def rewritten(attention_mask, **kwargs):
        visible = torch.zeros(buffer.shape, dtype=torch.bool)
        visible[:, 0, 0, : attention_mask.shape[1]] = attention_mask.bool()
        buffer.copy_(visible if dtype == torch.bool
                     else torch.zeros(buffer.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min))
        return model(attention_mask=buffer, **kwargs)

    runs = {
        kind: decode_logits(model, ids, mask, cache=StaticCache(config=model.config, max_cache_len=max_len),
                            forced=forced, forward=forward)
        for kind, forward in (("2d", None), ("rewritten", rewritten))
    }
    assert rel_err(runs["rewritten"], runs["2d"]) < TOL
    assert len(fake_hopper.modules["fa3"].plans) == 2 * forced.shape[1]  # one per step, on fa3
