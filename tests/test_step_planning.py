"""Per-step planning on the CPU: host-known rows inside generate(), the direct FlashInfer planning path (against a
fake of FlashInfer's generated module, `fake_flashinfer.py`), refused plans, plan adoption across devices, and the
CUDA-graph slots. Whole models run in float64 and are compared with ``eager`` to rounding."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import VOCAB, assert_batch_matches_eager_alone, left_padded_batch, make_model, rel_err
from fake_flashinfer import FakeMLAModule, fake_hopper  # noqa: F401  (fixture)
from flashinfer.mla._batch_mla._backends import _fa_common
from transformers import DynamicCache
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from hf_flashinfer_mla import buffers, cuda_graphs, flashinfer_fa, metadata
from hf_flashinfer_mla.flashinfer_fa import rows_from_mask, rows_from_ranges
from hf_flashinfer_mla.metadata import KVRanges, StepPlan, host_ranges, step_plan

TOL = 1e-6
REAL_SURFACE = flashinfer_fa.generated_surface.__wrapped__  # before `fake_hopper` replaces it


def _spy(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


# ------------------------------------------------------------------------------------------ rows on the host
def _left_padded(b, s, g):
    first = torch.randint(0, s, (b,), generator=g)
    valid = torch.arange(s)[None, :] >= first[:, None]
    return first, valid


@pytest.mark.parametrize("seed", range(6))
def test_rows_from_ranges_equal_rows_from_mask(seed):
    """The host-known ranges give the same CSR arrays and, for any pitch, the same indices as reading the mask."""
    g = torch.Generator().manual_seed(seed)
    b, s = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    q_len = 1 + seed % 4
    first, valid = _left_padded(b, s, g)
    ours, exact = rows_from_ranges(KVRanges(first, s), q_len), rows_from_mask(valid, q_len)
    for name in ("qo_indptr", "kv_indptr", "kv_len"):
        a, e = getattr(ours, name), getattr(exact, name)
        assert a.dtype == torch.int32 and a.device.type == "cpu" and torch.equal(a, e), name
    for pitch in (s, s + 5, 3 * s + 1):
        assert torch.equal(ours.kv_indices(pitch, valid.device), exact.kv_indices(pitch, valid.device))


def test_rows_with_holes_use_positions():
    valid = torch.tensor([[True, False, True, True], [False, True, True, False]])
    rows = rows_from_mask(valid, 1)
    assert rows.first is None
    assert rows.kv_indices(10, valid.device).tolist() == [0, 2, 3, 11, 12]


def test_indices_beyond_int32_are_refused():
    rows = rows_from_ranges(KVRanges(torch.zeros(3, dtype=torch.long), 8), 1)
    with pytest.raises(ValueError, match="int32"):
        rows.kv_indices(2**30, torch.device("cpu"))
    with pytest.raises(ValueError, match="int32"):
        rows.addressing(2**30, torch.device("cpu"))


def test_host_ranged_planning_never_reads_the_device(fake_hopper):
    """With host-known ranges, a step's whole fa3 planning runs on tensors of the meta device, which hold no data:
    any read of the GPU (a sync) would raise here."""
    meta = torch.device("meta")
    plan = StepPlan(torch.ones(3, 1, 1, 40, dtype=torch.bool, device=meta))
    plan.ranges = KVRanges(torch.tensor([0, 5, 39]), 40)
    step = flashinfer_fa.fa_step(plan, "fa3", meta, 4, torch.float64, 32, 8, pitch=64, scale=0.1)
    _, _, kv_indices = step.schedule(64)
    assert step.refused is None and kv_indices.device == meta and kv_indices.numel() >= 3 * 64
    planned = fake_hopper.modules["fa3"].plans[-1]
    assert planned["kv_len"].tolist() == [40, 35, 1] and planned["causal"] is False
    assert planned["kv_indptr"].tolist()[:3] == [0, 64 + 5, 128 + 39]  # each row's run, addressed in place


def test_single_run_rows_plan_offsets_into_the_identity():
    """Rows that are single runs are addressed in place: the page offset of row b is b * pitch + first[b] over a
    fixed identity, and reading the identity there gives exactly the compact CSR indices of the same rows."""
    rows = rows_from_ranges(KVRanges(torch.tensor([3, 0, 7]), 9), 1)
    kv_indptr, identity = rows.addressing(16, torch.device("cpu"))
    assert kv_indptr.dtype == torch.int32 and kv_indptr.tolist() == [3, 16, 39, 48]
    assert identity.numel() >= 48 and torch.equal(identity[:48], torch.arange(48, dtype=torch.int32))
    assert identity is rows.addressing(8, torch.device("cpu"))[1]  # one identity per device, reused
    gathered = torch.cat([identity[s : s + n] for s, n in zip(kv_indptr.tolist(), rows.kv_len.tolist())])
    assert torch.equal(gathered, rows.kv_indices(16, torch.device("cpu")))
    holes = rows_from_mask(torch.tensor([[True, False, True, True], [False, True, True, False]]), 1)
    kv_indptr, indices = holes.addressing(10, torch.device("cpu"))  # not runs: compact CSR, explicit indices
    assert kv_indptr.tolist() == [0, 3, 5] and indices.tolist() == [0, 2, 3, 11, 12]


def test_plans_take_turns_on_two_host_scratches_per_module(fake_hopper):
    """The native planner's 8 MiB host scratch is allocated twice per module, not per plan (allocating pinned
    memory per step cost milliseconds of host time on the H200); plans use the two in turn, every plan gets a whole
    one, and its schedule reaches the step's workspace from there."""
    meta = torch.device("meta")
    for end in (40, 41, 42):
        plan = StepPlan(torch.ones(2, 1, 1, end, dtype=torch.bool, device=meta))
        plan.ranges = KVRanges(torch.tensor([0, 3]), end)
        assert flashinfer_fa.fa_step(plan, "fa3", meta, 4, torch.float64, 32, 8, pitch=64, scale=0.1).refused is None
    plans = fake_hopper.modules["fa3"].plans
    assert [p["kv_len"].tolist() for p in plans] == [[40, 37], [41, 38], [42, 39]]
    addresses = [p["scratch"].data_ptr() for p in plans]
    assert addresses[0] == addresses[2] != addresses[1]
    assert plans[0]["scratch"].numel() == flashinfer_fa.INT_WORKSPACE_BYTES


def test_a_scratch_is_reused_only_after_the_gpu_read_it(fake_hopper):
    """A plan two steps ahead of the GPU waits for the copy out of its scratch; a completed copy costs no wait."""
    engine = flashinfer_fa.generated_fa(torch.device("cpu"), "fa3", 4, torch.float64, 32, 8)

    class Copy:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    rows = rows_from_ranges(KVRanges(torch.tensor([0, 3]), 9), 1)
    workspace = engine.new_workspace()
    engine.plan(rows, rows.kv_indptr, False, workspace)
    engine.plan(rows, rows.kv_indptr, False, workspace)
    pending, done = Copy(False), Copy(True)
    engine._scratches = [(engine._scratches[0][0], pending), (engine._scratches[1][0], done)]
    engine.plan(rows, rows.kv_indptr, False, workspace)
    assert pending.waited and not done.waited
    engine.plan(rows, rows.kv_indptr, False, workspace)
    assert not done.waited
    staged = workspace.view(torch.int32)
    assert staged[:2].tolist() == [2, 3] and staged[5:8].tolist() == [0, 9, 15]  # batch, plan id; kv_indptr


# ------------------------------------------------------------------------------------------ host_ranges
def _mask2d(rows):
    return torch.tensor(rows, dtype=torch.bool)


class _Call:
    """Enter an extending generate() scope as the generate() hooks would."""

    def __enter__(self):
        self.token = metadata._generate_call.set(metadata._GenerateCall(extending=True))
        return metadata._generate_call.get()

    def __exit__(self, *exc):
        metadata._generate_call.reset(self.token)


def test_host_ranges_without_padding_mask_are_known_anywhere():
    r = host_ranges(2, 1, 7, 6, 0, causal_mask_function, None)
    assert r.first.tolist() == [0, 0] and r.end == 7
    assert host_ranges(2, 3, 9, 6, 0, causal_mask_function, None).end == 9
    assert host_ranges(2, 1, 7, torch.tensor(6), 0, causal_mask_function, None) is None  # static cache: on device


def test_host_ranges_need_generate_for_a_padding_mask():
    mask = _mask2d([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert host_ranges(2, 1, 4, 3, 0, causal_mask_function, mask) is None  # a user's own loop: read the mask
    token = metadata._generate_call.set(metadata._GenerateCall(extending=False))
    try:
        assert host_ranges(2, 1, 4, 3, 0, causal_mask_function, mask) is None  # prefill (maybe chunked)
    finally:
        metadata._generate_call.reset(token)
    with _Call():
        r = host_ranges(2, 1, 4, 3, 0, causal_mask_function, mask)
        assert r.first.tolist() == [1, 0] and r.end == 4
        r = host_ranges(2, 1, 4, torch.tensor(3), 0, causal_mask_function, mask)  # static cache in generate()
        assert r.first.tolist() == [1, 0] and r.end == 4


@pytest.mark.parametrize("rows, args", [
    ([[1, 0, 1, 1], [1, 1, 1, 1]], {}),  # a hole
    ([[1, 1, 0, 0], [1, 1, 1, 1]], {}),  # right padding
    ([[0, 0, 0, 0], [1, 1, 1, 1]], {}),  # an empty row
    ([[0, 1, 1, 1], [1, 1, 1, 1]], dict(q_offset=2)),  # mask width != cached + new tokens
    ([[0, 1, 1, 1], [1, 1, 1, 1]], dict(kv_offset=1)),
    ([[0, 1, 1, 1], [1, 1, 1, 1]], dict(mask_function=sliding_window_causal_mask_function(2))),
])
def test_host_ranges_fall_back_to_the_mask(rows, args):
    kwargs = dict(q_offset=3, kv_offset=0, mask_function=causal_mask_function) | args
    with _Call():
        assert host_ranges(2, 1, 4, kwargs["q_offset"], kwargs["kv_offset"], kwargs["mask_function"],
                           _mask2d(rows)) is None


def test_left_padding_read_once_per_generate_call(monkeypatch):
    reads = _spy(monkeypatch, metadata, "_read_left_padding")
    with _Call():
        for width in (5, 6, 7):
            mask = torch.cat([_mask2d([[0, 0, 1], [0, 1, 1]]), torch.ones(2, width - 3, dtype=torch.bool)], -1)
            assert host_ranges(2, 1, width, width - 1, 0, causal_mask_function, mask).first.tolist() == [2, 1]
        # Assisted decoding crops from the right; the fixed left padding still applies while every row has a token.
        assert host_ranges(2, 1, 3, 2, 0, causal_mask_function, mask[:, :3]).end == 3
        assert host_ranges(2, 1, 2, 1, 0, causal_mask_function, mask[:, :2]) is None  # row 0 would be empty
    assert len(reads) == 1
    with _Call():  # a new generate() call reads it again
        host_ranges(2, 1, 5, 4, 0, causal_mask_function, mask[:, :5])
    assert len(reads) == 2


# ------------------------------------------------------------------------------------------ whole models, fake fa3
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_on_fa3_matches_eager_alone_planning_once_per_step_without_reading_the_mask(
    fake_hopper, monkeypatch, cache_implementation
):
    model = make_model("deepseek_v3")
    from_mask = _spy(monkeypatch, flashinfer_fa, "rows_from_mask")
    reads = _spy(monkeypatch, metadata, "_read_left_padding")
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
    first = [0, 0, 0]
    for i, p in enumerate(prompts):
        first[i] = ids.shape[1] - len(p)
    for step, planned in enumerate(fa3.plans):
        width = ids.shape[1] + step + 1
        assert planned["kv_len"].tolist() == [width - f for f in first] and planned["causal"] is False
    assert_batch_matches_eager_alone(model, out, prompts, new_tokens, TOL)


def test_user_loop_plans_from_the_mask_and_matches(fake_hopper, monkeypatch):
    """Outside generate() the rows are read off the mask (one sync a step), and the result is the same."""
    from conftest import decode_logits

    model = make_model("deepseek_v3")
    from_mask = _spy(monkeypatch, flashinfer_fa, "rows_from_mask")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, cache=DynamicCache(config=model.config), forced=forced)
    assert len(from_mask) == 4 and len(fake_hopper.modules["fa3"].plans) == 4
    model.set_attn_implementation("eager")
    for i, p in enumerate(prompts):
        alone = decode_logits(model, p[None], torch.ones(1, len(p), dtype=torch.long),
                              cache=DynamicCache(config=model.config), forced=forced[i : i + 1])
        assert rel_err(ours[i], alone[0]) < TOL


def test_prompt_lookup_decoding_multi_token_causal_plans(fake_hopper):
    """Assisted (prompt-lookup) decoding verifies several tokens per step: causal fa3 plans, equal to eager."""
    model = make_model("deepseek_v3")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    ours = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    plans = fake_hopper.modules["fa3"].plans
    assert any(p["causal"] and int(p["qo_indptr"][1]) > 1 for p in plans)
    model.set_attn_implementation("eager")
    assert torch.equal(ours, model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False))


@torch.no_grad()
def _chunked_logits(model, prompt, forced, chunk, **kwargs):
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, cache=cache, use_cache=True)
    logits = []
    for t in range(0, forced.shape[1], chunk):
        out = model(input_ids=forced[:, t : t + chunk], cache=out.cache, use_cache=True, **kwargs)
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("fa2_accepts", [False, True])
def test_refused_causal_plan_falls_back_with_one_warning(fake_hopper, monkeypatch, caplog, fa2_accepts):
    """20 heads and 8-token steps: FlashInfer's causal tile bound (its real validator) refuses the steps whose
    cached length is 2 mod 64. Those steps run on fa2 if it accepts, else on the reference backend; every step
    equals eager, and one warning is logged."""
    real = _fa_common._validate_fa_plan_workload

    def validate(qo_indptr, kv_len_arr, num_heads, causal, device, backend, kv_data_type):
        if backend == "fa2" and fa2_accepts:
            return None
        return real(qo_indptr, kv_len_arr, num_heads, causal, device, backend, kv_data_type)

    fake_hopper.validate_workload = validate
    model = make_model("deepseek_v3", num_attention_heads=20, num_key_value_heads=20, num_hidden_layers=2,
                       first_k_dense_replace=2)
    g = torch.Generator().manual_seed(4)
    prompt, forced = torch.randint(1, VOCAB, (1, 10), generator=g), torch.randint(1, VOCAB, (1, 64), generator=g)
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        ours = _chunked_logits(model, prompt, forced, 8)  # cached lengths 18, 26, ..., 66 (refused), ..., 74
    warnings = [r for r in caplog.records if "declines" in r.getMessage()]
    assert len(warnings) == 1 and ("on fa2" if fa2_accepts else "on reference") in warnings[0].getMessage()
    fa3 = fake_hopper.modules["fa3"]
    assert len(fa3.plans) == 7 and fa3.runs == 7 * 2  # 8 steps, one refused before planning
    if fa2_accepts:
        assert fake_hopper.modules["fa2"].runs == 2
    model.set_attn_implementation("eager")
    assert rel_err(ours, _chunked_logits(model, prompt, forced, 8)) < TOL


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


def test_other_flashinfer_releases_use_the_public_wrapper(fake_hopper, monkeypatch):
    """The generated-module surface is private: any release other than the tested ones goes through
    BatchMLAPagedAttentionWrapper.plan/run (here a fake that checks its arguments)."""
    import flashinfer
    import flashinfer.mla

    planned = []

    class Wrapper:
        def __init__(self, workspace, backend):
            assert backend == "fa3" and workspace.dtype == torch.uint8
            self.module = FakeMLAModule(backend)

        def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
                 kv_data_type, query_layout, kv_cache_layout):
            assert (page_size, query_layout, kv_cache_layout) == (1, "split", "split")
            self.ws = torch.zeros(4096, dtype=torch.uint8)
            self.info, _ = self.module.plan_with_staged_workspace_bytes(
                self.ws, self.ws, torch.zeros(4096, dtype=torch.uint8), metadata.qo_indptr, metadata.kv_indptr,
                metadata.kv_len_arr, num_heads, head_dim_ckv, causal)
            self.kv_indices, self.scale, self.causal = metadata.kv_indices, sm_scale, causal
            planned.append(self)

        def run(self, *, query, kv_cache):
            out = torch.empty_like(query[0])
            self.module.run(self.ws, self.ws, self.info, *query, *kv_cache, self.kv_indices, out, None,
                            int(self.causal), query[0].shape[1], 1, self.scale, False, 1.0, 1.0, None)
            return out

    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", Wrapper)
    assert REAL_SURFACE() is not None  # the installed release (0.7.4) is a tested one
    monkeypatch.setattr(flashinfer, "__version__", "0.7.5")
    assert REAL_SURFACE() is None
    monkeypatch.setattr(flashinfer_fa, "generated_surface", REAL_SURFACE)
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert len(planned) == 3  # one wrapper planned per step
    assert_batch_matches_eager_alone(model, out, prompts, 4, TOL)


def test_planner_env_forces_the_wrapper(fake_hopper, monkeypatch):
    monkeypatch.setenv(flashinfer_fa.PLANNER_ENV, "wrapper")
    assert not flashinfer_fa.uses_generated_module()
    monkeypatch.setenv(flashinfer_fa.PLANNER_ENV, "direct")
    assert flashinfer_fa.uses_generated_module()


# ------------------------------------------------------------------------------------------ adoption across devices
class _Layer:
    def __init__(self, config):
        self.config = config


def test_adoption_rule():
    config, other = object(), object()
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    plan = metadata.attach_plan(mask)
    l0, l1, stranger = _Layer(config), _Layer(config), _Layer(other)
    copy = mask.clone()
    assert not plan.adoptable_by(copy, l1)  # nobody ran on it yet: not known to be this step's
    assert step_plan(mask, l0) is plan
    assert plan.adoptable_by(copy, l1)  # a copy reaching a layer that has not run on the plan
    assert not plan.adoptable_by(copy, l0)  # a layer that ran on it is at a new step
    assert not plan.adoptable_by(copy, stranger)  # another model
    assert not plan.adoptable_by(torch.ones(2, 1, 1, 6, dtype=torch.bool), l1)  # another shape
    assert not plan.adoptable_by(torch.zeros(2, 1, 1, 5), l1)  # another dtype
    assert step_plan(copy, l1) is plan
    fresh = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    new = step_plan(fresh, l0)  # l0 already ran on `plan`: a new step, an exact plan of its own
    assert new is not plan and metadata.plan_of(fresh) is new


def _split_like_accelerate(model, first_copied_layer):
    """Hand every decoder layer from `first_copied_layer` on a copy of the mask, as accelerate's hooks do for
    layers on another device."""

    def copy_mask(module, args, kwargs):
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = kwargs["attention_mask"].clone()
        return args, kwargs

    return [layer.register_forward_pre_hook(copy_mask, with_kwargs=True)
            for layer in model.model.layers[first_copied_layer:]]


@pytest.mark.parametrize("first_copied, built_per_step, adopted_per_step", [(0, 2, 3), (2, 1, 2), (4, 1, 0)])
def test_copied_masks_plan_once_per_device_per_step(fake_hopper, monkeypatch, first_copied, built_per_step,
                                                    adopted_per_step):
    """Layers before `first_copied` on one "device", the rest on another (masks copied, as accelerate does): fa3
    plans once per step whatever the split. The copies adopt the step's plan; when layer 0 already gets a copy,
    the mask function's plan has not been used by any layer, so the first copy gets a plan of its own (never a
    plan that might be stale) and the other copies adopt that one."""
    model = make_model("deepseek_v3", num_hidden_layers=4)
    ids, mask, prompts = left_padded_batch()
    hooks = _split_like_accelerate(model, first_copied)
    built = _spy(monkeypatch, metadata, "attach_plan")
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
    assert len(built) == steps * built_per_step and sum(adoptions) == steps * adopted_per_step
    assert_batch_matches_eager_alone(model, out, prompts, 4, TOL)


@torch.no_grad()
def test_user_4d_masks_get_fresh_plans_every_step(fake_hopper):
    """A user's own 4D mask reaches the layers without a plan, step after step, with the same shape (a static
    cache): each step gets its own plan (adopting the previous step's, of the same shape, would attend one token
    short) and the result equals the run on 2D masks."""
    from transformers import StaticCache

    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    max_len = ids.shape[1] + 8
    runs = {}
    for kind in ("2d", "4d"):
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        m, pos = mask, (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=m, position_ids=pos, cache=cache, use_cache=True)
        logits = []
        for t in range(forced.shape[1]):
            m, pos = torch.cat([m, torch.ones_like(m[:, :1])], -1), pos[:, -1:] + 1
            am = m
            if kind == "4d":  # the user's own boolean mask: padding, the cached tokens and the new one
                am = torch.zeros(m.shape[0], 1, 1, max_len, dtype=torch.bool)
                am[:, 0, 0, : m.shape[1]] = m.bool()
            out = model(input_ids=forced[:, t : t + 1], attention_mask=am, position_ids=pos, cache=cache,
                        use_cache=True)
            logits.append(out.logits)
        runs[kind] = torch.cat(logits, 1)
    assert len(fake_hopper.modules["fa3"].plans) == 2 * forced.shape[1]  # one per step, on fa3
    assert rel_err(runs["4d"], runs["2d"]) < TOL


# ------------------------------------------------------------------------------------------ CUDA-graph slots
def test_graph_slot_is_replanned_in_place_once_per_step(fake_hopper, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_slots", {})
    monkeypatch.setattr(buffers, "_identities", {})
    cpu = torch.device("cpu")
    key = (cpu, "fa3", 4, torch.float64, 32, 8, 0.25, 2, 1, 16)
    slot = cuda_graphs._slots[key] = cuda_graphs.GraphSlot(key)
    other = cuda_graphs._slots[key[:-1] + (24,)] = cuda_graphs.GraphSlot(key[:-1] + (24,))
    indices, workspace = slot.kv_indices, slot.int_workspace
    fa3 = fake_hopper.modules["fa3"]
    for end in (10, 11, 12):
        plan = metadata.attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool))
        plan.ranges = KVRanges(torch.tensor([3, 0]), end)
        cuda_graphs.plan_graph_slots(plan)
        cuda_graphs.plan_graph_slots(plan)  # the op's eager run on the same step does not plan again
        assert len(fa3.plans) == end - 9 and fa3.plans[-1]["kv_len"].tolist() == [end - 3, end]
        assert slot.kv_indices is indices and slot.int_workspace is workspace  # fixed addresses
        assert indices.tolist() == list(range(32))  # the identity: only the schedule changes per step
        assert fa3.plans[-1]["kv_indptr"].tolist() == [3, 16, 32]
        assert other.plan_info is None  # another pitch: another shape, not planned
    holes = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    holes[0, ..., 5] = holes[1, ..., 12:] = False  # a user's mask with a hole: explicit indices for one step
    cuda_graphs.plan_graph_slots(metadata.attach_plan(holes))
    assert indices[:27].tolist() == [0, 1, 2, 3, 4] + list(range(6, 16)) + list(range(16, 28))
    plan = metadata.attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool))
    plan.ranges = KVRanges(torch.tensor([3, 0]), 12)
    cuda_graphs.plan_graph_slots(plan)
    assert slot.kv_indices is indices and indices.tolist() == list(range(32))  # the identity is back
    # Slots plan during CUDA-graph warm-up, whose allocations belong to the graph's pool: never the process-wide
    # identity of eager steps.
    assert buffers._identities == {}
    q = torch.randn(2, 4, 32, dtype=torch.float64)
    out = slot.run(q, torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(32, 1, 32, dtype=torch.float64),
                   torch.randn(32, 1, 8, dtype=torch.float64))
    assert out.shape == q.shape and fa3.runs == 1
    slot.layout = slot.layout[:-1] + (1,)  # as if FlashInfer's schedule layout moved between steps
    plan = metadata.attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool))
    plan.ranges = KVRanges(torch.tensor([3, 0]), 13)
    with pytest.raises(RuntimeError, match="schedule layout"):
        cuda_graphs.plan_graph_slots(plan)


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_graph_shapes_admitted_are_never_refused(monkeypatch, backend):
    """`plan_always_accepted` against FlashInfer's own validator: an admitted shape is accepted at every cached
    length; a shape it rejects is refused at some length (so the reference fallback in graphs is not needless)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(_fa_common, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(_fa_common, "_get_fa_shared_memory_limits", lambda device: (233472, 232448))
    refused = _fa_common._validate_fa_plan_workload.__globals__["_BackendPlanUnsupportedError"]
    for heads in (1, 4, 16, 20, 24, 32, 64, 96, 128):
        for q_len in (1, 2, 3, 8):
            for batch in (1, 4):
                admitted = cuda_graphs.plan_always_accepted("cuda:0", batch, q_len, heads)
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


def test_graph_slot_uploads_the_schedule_planned_ahead(fake_hopper, monkeypatch):
    """`StepPlan.plan_next` (generate() has queued the step) makes the slot compute the next step's schedule on the
    host only: the replay still in flight reads the slot's workspace. The next step uploads it if its rows are the
    predicted ones, and plans anew otherwise."""
    monkeypatch.setattr(cuda_graphs, "_slots", {})
    key = (torch.device("cpu"), "fa3", 4, torch.float64, 32, 8, 0.25, 2, 1, 16)
    slot = cuda_graphs._slots[key] = cuda_graphs.GraphSlot(key)
    fa3 = fake_hopper.modules["fa3"]
    first = torch.tensor([3, 0])

    def step(end):
        plan = metadata.attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool), KVRanges(first, end))
        cuda_graphs.plan_graph_slots(plan)
        return plan

    def planned_id():  # which of the fake's plans the slot's workspace holds
        return int(slot.int_workspace.view(torch.int32)[1])

    plan = step(10)
    assert len(fa3.plans) == 1 and planned_id() == 0
    plan.plan_next(11)
    assert len(fa3.plans) == 2 and fa3.plans[1]["ahead"] and fa3.plans[1]["kv_len"].tolist() == [8, 11]
    assert planned_id() == 0  # not uploaded yet: the slot's workspace still holds this step's schedule
    plan = step(11)
    assert len(fa3.plans) == 2 and planned_id() == 1  # the schedule planned ahead, uploaded; no plan of its own
    plan.plan_next(12)
    step(13)  # not the predicted rows (two tokens were accepted, say): planned anew
    assert len(fa3.plans) == 4 and planned_id() == 3 and fa3.plans[3]["kv_len"].tolist() == [10, 13]
    step(16).plan_next(17)  # the next step would not fit in the cache: nothing is planned ahead
    assert len(fa3.plans) == 5


def test_decode_plans_skip_flashinfers_validator_where_the_bound_proves_acceptance(fake_hopper, monkeypatch):
    """FlashInfer's Python validator walks every sequence of every plan. A non-causal plan whose work items
    (`work_items_bound`) fit the scheduler's capacity is accepted at any lengths, so it is not called for one;
    causal plans, and plans beyond the bound, are still validated."""
    engine = flashinfer_fa.generated_fa(torch.device("cpu"), "fa3", 4, torch.float64, 32, 8)
    validated = []
    monkeypatch.setattr(fake_hopper, "validate_workload", lambda *args: validated.append(args))
    engine.sms = 132
    workspace = engine.new_workspace()
    rows = rows_from_ranges(KVRanges(torch.tensor([0, 3]), 9), 1)
    engine.plan(rows, rows.kv_indptr, False, workspace)
    assert validated == []
    causal = rows_from_ranges(KVRanges(torch.tensor([0, 3]), 9), 2)
    engine.plan(causal, causal.kv_indptr, True, workspace)
    assert len(validated) == 1
    monkeypatch.setattr(flashinfer_fa, "MAX_WORK_ITEMS", 133)  # two sequences' tiles + 132 SMs exceed it
    engine.plan(rows, rows.kv_indptr, False, workspace)
    assert len(validated) == 2
    engine.sms = None  # an SM count that is not known (not a CUDA device): always validated
    monkeypatch.setattr(flashinfer_fa, "MAX_WORK_ITEMS", 16384)
    engine.plan(rows, rows.kv_indptr, False, workspace)
    assert len(validated) == 3


@pytest.mark.parametrize("heads", [1, 16, 20, 64, 128])
def test_work_items_bound_covers_flashinfers_count(heads):
    """`work_items_bound` against FlashInfer's own count of a plan's work items (`_fa_plan_work_count`, which
    mirrors its scheduler), for uneven batches of long and short sequences, decode and 2-8 token steps."""
    g = torch.Generator().manual_seed(heads)
    for batch in (1, 3, 32, 300):
        for q_len in (1, 2, 8):
            for scale in (10, 5000, 300000):
                kv = (torch.rand(batch, generator=g) * scale).long().clamp(min=q_len).tolist()
                for causal in (False, True):
                    count = _fa_common._fa_plan_work_count([q_len] * batch, kv, heads, 132, causal)
                    assert count <= flashinfer_fa.work_items_bound(batch, q_len, heads, 132), (batch, q_len, kv)


@pytest.mark.parametrize("seed", range(4))
def test_decode_masks_from_host_ranges_equal_sdpas(seed, monkeypatch):
    """Inside generate() a decode step's mask is built from its host-known rows (`KVRanges.mask`), not by
    ``sdpa_mask``: it must be the very tensor sdpa_mask would give, for left padding, 1-8 query tokens, a static
    cache's unfilled tail, and no 2D mask at all."""
    from transformers.masking_utils import sdpa_mask

    g = torch.Generator().manual_seed(seed)
    built_by_sdpa = _spy(monkeypatch, metadata, "sdpa_mask")
    for q_len in (1, 2, 8):
        batch, width = 3, int(torch.randint(10, 40, (1,), generator=g))
        kv_len = width + int(torch.randint(0, 5, (1,), generator=g))  # > width: a static cache's tail
        first = torch.randint(0, width - q_len, (batch,), generator=g)
        padding = torch.arange(width)[None, :] >= first[:, None]
        for attention_mask in (padding, None):
            with _Call():
                args = dict(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=width - q_len,
                            attention_mask=attention_mask, device=torch.device("cpu"))
                if attention_mask is None:
                    args["kv_length"] = kv_len = width
                mask = metadata.flashinfer_mla_mask(**args)
            expected = sdpa_mask(**args, allow_is_causal_skip=False)
            assert mask.dtype == torch.bool and mask.is_contiguous() and torch.equal(mask, expected), (q_len, first)
            assert metadata.plan_of(mask).ranges is not None
    assert built_by_sdpa == []  # every mask above came from the rows
