"""Per-step planning on the CPU: rows known on the host inside generate() (a `GrowingMask` handed on with each new
2D mask), the direct FlashInfer planning path (against a fake of FlashInfer's generated module,
`fake_flashinfer.py`) and its public-wrapper alternative, refused plans, plan adoption across devices, and the
CUDA-graph slots. Whole models run in float64 and are compared with ``eager`` (or the reference backend) to rounding."""

from __future__ import annotations

import gc
import inspect
import logging

import pytest
pytest.importorskip("flashinfer", reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import (
    VOCAB,
    assert_batch_matches_eager_alone,
    decode_logits,
    GENERATION_MODES,
    assert_same_outputs,
    eager_alone,
    generation_mode,
    left_padded_batch,
    make_model,
    package_warnings,
    rel_err,
    with_4d_masks,
)
from fake_flashinfer import FakeMLAModule, fake_hopper  # noqa: F401  (fixture)
from flashinfer.mla._batch_mla._backends import _fa_common
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import (
    causal_mask_function,
    create_masks_for_generate,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from hf_flashinfer_mla import ENV_VAR, MLALatentCache, buffers, masks, plan
from hf_flashinfer_mla.kernels import Layer, fa, graphs, reference
from hf_flashinfer_mla.masks import host_rows
from hf_flashinfer_mla.plan import StepPlan, attach_plan, plan_of, step_plan
from hf_flashinfer_mla.rows import GrowingMask, Rows

TOL = 1e-6
REAL_SURFACE = fa.generated_surface.__wrapped__  # before `fake_hopper` replaces it
CPU, META = torch.device("cpu"), torch.device("meta")
F64 = torch.float64


def _with_eager_twin():
    """A float64 deepseek_v3 model on flashinfer_mla and an eager model with the same weights."""
    model = make_model("deepseek_v3", dtype=F64)
    eager = make_model("deepseek_v3", attn="eager", dtype=F64)
    eager.load_state_dict(model.state_dict())
    return model, eager


def _spy(monkeypatch, owner, name):
    """Record the calls of ``owner.name`` (a function, or a classmethod of a class) and pass them on."""
    calls = []
    is_classmethod = isinstance(inspect.getattr_static(owner, name), classmethod)
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(spy) if is_classmethod else spy)
    return calls


def _layer(device=CPU, heads=4, pitch=64, scale=0.1) -> Layer:
    """The spec of one fa3 call over the helpers' deepseek_v3 latent (32 + 8), in float64."""
    return Layer(device, F64, F64, heads, 32, 8, pitch, False, scale)


def _host_rows(first, width, q_len=1) -> Rows:
    """Rows known on the host, as generate()'s `GrowingMask` gives them: row b sees ``[first[b], width)``."""
    first = torch.as_tensor(first, dtype=torch.long)
    return GrowingMask(first, first, width).rows(q_len, width)


def _route(step: StepPlan, layer: Layer, requested="fa3"):
    """The step's route for `layer`, as the attention function asks for it (built, not run)."""
    return step.route((layer, requested), layer, requested, False)


# ------------------------------------------------------------------------------------------ rows on the host
def _left_padded(b, s, g):
    first = torch.randint(0, s, (b,), generator=g)
    valid = torch.arange(s)[None, :] >= first[:, None]
    return first, valid


@pytest.mark.parametrize("seed", range(6))
def test_growing_mask_rows_equal_rows_from_mask(seed):
    """The rows generate()'s 2D mask carries (`GrowingMask`, read once, then grown with the mask) give the same CSR
    arrays and, for any pitch, the same page offsets and indices as reading the step's mask."""
    g = torch.Generator().manual_seed(seed)
    b, s = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    q_len = 1 + seed % 4
    first, valid = _left_padded(b, s, g)
    growing = GrowingMask.read(valid.long())  # generate()'s mask: int64 zeros then ones
    assert growing.first.tolist() == first.tolist() and growing.width == s
    for width in (s, s + 3):  # as read, and grown by generate()'s next mask update
        valid = torch.cat([valid, torch.ones(b, width - valid.shape[1], dtype=torch.bool)], -1)
        ours, exact = growing.grown(width).rows(q_len, width), Rows.from_mask(valid, q_len)
        assert ours.end == width and ours.q_len == exact.q_len == q_len
        for a, e in ((ours.lens, exact.lens), (ours.first, exact.first), (ours.qo_indptr(), exact.qo_indptr()),
                     (ours.kv_indptr(), exact.kv_indptr())):
            assert a.device.type == "cpu" and a.dtype == e.dtype and torch.equal(a, e)
        assert ours.lens.dtype == torch.int32
        for pitch in (width, width + 5, 3 * width + 1):
            assert torch.equal(ours.page_offsets(pitch), exact.page_offsets(pitch))
            assert torch.equal(ours.kv_indices(pitch, CPU), exact.kv_indices(pitch, CPU))


def test_growing_mask_rows_only_where_the_mask_spans_the_cache():
    """A `GrowingMask` gives rows only when every row has a visible position and the mask fits the cache."""
    growing = GrowingMask(torch.tensor([2, 1]), torch.tensor([2, 1]), 3)
    assert growing.rows(1, 3).lens.tolist() == [1, 2] and growing.rows(1, 8).end == 3  # a static cache's tail
    assert growing.rows(1, 2) is None  # wider than the cache
    assert GrowingMask(growing.first, growing.first_on_device, 2).rows(1, 2) is None  # row 0 would be empty


@pytest.mark.parametrize("rows", [
    [[1, 0, 1, 1], [1, 1, 1, 1]],  # a hole
    [[1, 1, 0, 0], [1, 1, 1, 1]],  # right padding
    [[0, 0, 0, 0], [1, 1, 1, 1]],  # an empty row
])
def test_masks_that_are_not_left_padding_carry_no_rows(rows):
    """Only a mask whose rows are zeros then ones describes its rows by their left padding."""
    assert GrowingMask.read(torch.tensor(rows)) is None


def test_rows_with_holes_use_positions():
    valid = torch.tensor([[True, False, True, True], [False, True, True, False]])
    rows = Rows.from_mask(valid, 1)
    assert rows.first is None and rows.lens.tolist() == [3, 2]
    assert rows.kv_indices(10, valid.device).tolist() == [0, 2, 3, 11, 12]


def test_indices_beyond_int32_are_refused():
    rows = _host_rows([0, 0, 0], 8)
    with pytest.raises(ValueError, match="int32"):
        rows.kv_indices(2**30, CPU)
    with pytest.raises(ValueError, match="int32"):
        fa.addressing(rows, 2**30, CPU)


def test_host_rows_planning_never_reads_the_device(fake_hopper):
    """With rows known on the host, a step's whole fa3 planning runs on tensors of the meta device, which hold no
    data: any read of the GPU (a sync) would raise here."""
    step = StepPlan(torch.ones(3, 1, 1, 40, dtype=torch.bool, device=META), _host_rows([0, 5, 39], 40))
    route = _route(step, _layer(META))
    assert route.backend == "fa3" and route.meta.engine is not None
    assert route.meta.kv_indices.device == META and route.meta.kv_indices.numel() >= 3 * 64
    planned = fake_hopper.modules["fa3"].plans[-1]
    assert planned["kv_len"].tolist() == [40, 35, 1] and planned["causal"] is False
    assert planned["kv_indptr"].tolist()[:3] == [0, 64 + 5, 128 + 39]  # each row's run, addressed in place


def test_single_run_rows_plan_offsets_into_the_identity():
    """Rows that are single runs are addressed in place: the page offset of row b is b * pitch + first[b] over a
    fixed identity, and reading the identity there gives exactly the compact CSR indices of the same rows."""
    rows = _host_rows([3, 0, 7], 9)
    kv_indptr, identity = fa.addressing(rows, 16, CPU)
    assert kv_indptr.dtype == torch.int32 and kv_indptr.tolist() == [3, 16, 39, 48]
    assert identity.numel() >= 48 and torch.equal(identity[:48], torch.arange(48, dtype=torch.int32))
    assert identity is fa.addressing(rows, 8, CPU)[1]  # one identity per device, reused
    gathered = torch.cat([identity[s : s + n] for s, n in zip(kv_indptr.tolist(), rows.lens.tolist())])
    assert torch.equal(gathered, rows.kv_indices(16, CPU))
    holes = Rows.from_mask(torch.tensor([[True, False, True, True], [False, True, True, False]]), 1)
    kv_indptr, indices = fa.addressing(holes, 10, CPU)  # not runs: compact CSR, explicit indices
    assert kv_indptr.tolist() == [0, 3, 5] and indices.tolist() == [0, 2, 3, 11, 12]


def test_plans_take_turns_on_two_host_scratches_per_module(fake_hopper):
    """The native planner's 8 MiB host scratch is allocated twice per module, not per plan (allocating pinned
    memory per step cost milliseconds of host time on the H200); plans use the two in turn, every plan gets a whole
    one, and its schedule reaches the step's workspace from there."""
    for end in (40, 41, 42):
        step = StepPlan(torch.ones(2, 1, 1, end, dtype=torch.bool, device=META), _host_rows([0, 3], end))
        assert _route(step, _layer(META)).backend == "fa3"
    plans = fake_hopper.modules["fa3"].plans
    assert [p["kv_len"].tolist() for p in plans] == [[40, 37], [41, 38], [42, 39]]
    addresses = [p["scratch"].data_ptr() for p in plans]
    assert addresses[0] == addresses[2] != addresses[1]
    assert plans[0]["scratch"].numel() == fa.INT_WORKSPACE_BYTES


def test_a_scratch_is_reused_only_after_the_gpu_read_it(fake_hopper):
    """A plan two steps ahead of the GPU waits for the copy out of its scratch; a completed copy costs no wait."""
    engine = fa.generated_fa(_layer(), "fa3")

    class Copy:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    rows = _host_rows([0, 3], 9)
    workspace = engine.new_workspace()
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    pending, done = Copy(False), Copy(True)
    engine._scratches = [(engine._scratches[0][0], pending), (engine._scratches[1][0], done)]
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert pending.waited and not done.waited
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert not done.waited
    staged = workspace.view(torch.int32)
    assert staged[:2].tolist() == [2, 3] and staged[5:8].tolist() == [0, 9, 15]  # batch, plan id; kv_indptr


# ------------------------------------------------------------------------------------------ host_rows
def _mask2d(rows):
    return torch.tensor(rows, dtype=torch.bool)


def _growing(mask):
    """`mask` as generate()'s mask update leaves it: its `GrowingMask` attached."""
    GrowingMask.read(mask).attach(mask)
    return mask


def test_host_rows_without_padding_mask_are_known_anywhere():
    growing, rows = host_rows(2, 1, 7, 6, 0, causal_mask_function, None)
    assert growing is None and rows.first.tolist() == [0, 0] and rows.lens.tolist() == [7, 7] and rows.end == 7
    assert host_rows(2, 3, 9, 6, 0, causal_mask_function, None)[1].end == 9
    assert host_rows(2, 1, 7, torch.tensor(6), 0, causal_mask_function, None) == (None, None)  # static: on device
    assert host_rows(2, 1, 7, 7, 0, causal_mask_function, None) == (None, None)  # beyond the cache


def test_host_rows_of_a_padding_mask_come_with_its_growing_mask():
    """A 2D mask gives host rows only with the `GrowingMask` generate()'s mask update attached to it; a mask without
    one (a loop of the user's own, a logits processor's forward) is read exactly, by its step's plan."""
    mask = _mask2d([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert host_rows(2, 1, 4, 3, 0, causal_mask_function, mask) == (None, None)
    _growing(mask)
    growing, rows = host_rows(2, 1, 4, 3, 0, causal_mask_function, mask)
    assert growing is GrowingMask.of(mask) and rows.first.tolist() == [1, 0] and rows.end == 4
    growing, rows = host_rows(2, 1, 10, torch.tensor(3), 0, causal_mask_function, mask)  # static cache, 10 rows
    assert rows.first.tolist() == [1, 0] and rows.lens.tolist() == [3, 4] and rows.end == 4
    # A copy or a slice of the mask (assisted decoding crops it) is a new tensor: it carries no rows.
    assert host_rows(2, 1, 3, 2, 0, causal_mask_function, mask[:, :3]) == (None, None)
    assert host_rows(2, 1, 4, 3, 0, causal_mask_function, mask.clone()) == (None, None)


@pytest.mark.parametrize("args", [
    dict(q_offset=2),  # mask width != cached + new tokens
    dict(kv_offset=1),
    dict(mask_function=sliding_window_causal_mask_function(2)),
    dict(width=5),  # a GrowingMask of another width than the mask it is attached to
])
def test_host_rows_fall_back_to_the_mask(args):
    kwargs = dict(q_offset=3, kv_offset=0, mask_function=causal_mask_function, width=4) | args
    mask = _growing(_mask2d([[0, 1, 1, 1], [1, 1, 1, 1]]))
    GrowingMask.of(mask).grown(kwargs["width"]).attach(mask)
    assert host_rows(2, 1, 4, kwargs["q_offset"], kwargs["kv_offset"], kwargs["mask_function"], mask) == (None, None)


@pytest.mark.parametrize("as_generate", [False, True], ids=["user-loop", "as-generate"])
def test_left_padding_read_once_per_generate_call_else_each_mask(fake_hopper, monkeypatch, as_generate):
    """Decode steps driven as generate() drives them: the left padding is read once per call, after the prefill,
    by the mask update, and handed on with each new mask (no step reads its mask); the step over each mask plans the
    next one ahead. A loop of the user's own grows the mask itself: each step's mask is read exactly, once (shared
    by the layers). Both equal each prompt decoded alone with eager."""
    model = make_model("deepseek_v3")
    reads = _spy(monkeypatch, GrowingMask, "read")
    from_mask = _spy(monkeypatch, Rows, "from_mask")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # over generate()'s own cache (rows at fixed addresses: the next step can be planned)
        ours = decode_logits(model, ids, mask, cache=MLALatentCache(config=model.config), forced=forced,
                             as_generate=as_generate)
    fa3 = fake_hopper.modules["fa3"]
    assert fa3.runs == 4 * model.config.num_hidden_layers
    if as_generate:
        assert len(reads) == 1 and from_mask == []
        assert [p["ahead"] for p in fa3.plans] == [False, True, True, True]
        first = (ids.shape[1] - torch.tensor([len(p) for p in prompts])).tolist()
        assert [p["kv_len"].tolist() for p in fa3.plans] == [[ids.shape[1] + t - f for f in first]
                                                             for t in range(1, 5)]
        with torch.no_grad():
            decode_logits(model, ids, mask, cache=MLALatentCache(config=model.config), forced=forced[:, :2],
                          as_generate=True)
        assert len(reads) == 2 and from_mask == []  # a new call reads it again
    else:
        assert reads == [] and len(from_mask) == 4
        assert [p["ahead"] for p in fa3.plans] == [False] * 4
    for i, alone in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], alone) < TOL


def test_guidance_forward_is_planned_from_its_own_mask(fake_hopper, monkeypatch):
    """Classifier-free guidance runs a second forward per step, on a 2D mask of its own (another width, no padding)
    that generate()'s mask update never sees: those steps are planned from their mask's contents, the main steps
    from the main mask's padding, and neither takes the other's rows. (That the guided generation equals eager's,
    for every family, is test_nested_forwards.py's.)"""
    model = make_model("deepseek_v3")
    from_mask = _spy(monkeypatch, Rows, "from_mask")
    ids, mask, _ = left_padded_batch(lengths=(12, 9))  # prompts of > 8 tokens: prefills take the expanded path
    negative = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))  # unpadded, narrower
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, guidance_scale=1.5,
                   negative_prompt_ids=negative)
    guided = [[10 + t, 10 + t] for t in (1, 2, 3)]  # the guidance forward's 3 decode steps, read off their masks
    assert [valid.sum(-1).tolist() for valid, *_ in from_mask] == guided
    main = [[12 + t, 9 + t] for t in (1, 2, 3, 4)]  # generate()'s (host rows), and the one planned ahead after
    fa3 = fake_hopper.modules["fa3"]
    assert sorted(p["kv_len"].tolist() for p in fa3.plans) == sorted(main + guided)
    assert fa3.runs == 6 * model.config.num_hidden_layers


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


# ------------------------------------------------------------------------------------------ freed without gc
def _garbage_of_generate(model, **kwargs) -> list:
    """The objects a generate() call left in reference cycles (found by Python's garbage collector, not freed when
    the call returned): the package's own objects and tensors only."""
    ids, mask, _ = left_padded_batch()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kwargs)
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)
                or type(o).__module__.startswith("hf_flashinfer_mla")]
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
    warmed-up call's graphs again: DeepSeek-V2-Lite, H200, 2026-12-01.) The control puts the old cycle back (the
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


# ------------------------------------------------------------------------------------------ whole models, fake fa3
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_on_fa3_matches_eager_alone_planning_once_per_step_without_reading_the_mask(
    fake_hopper, monkeypatch, cache_implementation
):
    model = make_model("deepseek_v3")
    from_mask = _spy(monkeypatch, Rows, "from_mask")
    reads = _spy(monkeypatch, GrowingMask, "read")
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


# ------------------------------------------------------------------------------------------ the public wrapper
def _fake_wrapper(monkeypatch) -> list:
    """Replace FlashInfer's public BatchMLAPagedAttentionWrapper by a fake that checks its arguments, runs
    `FakeMLAModule` on them (its own, not the generated surface's), and records itself in the returned list when it
    is planned (each keeps its ``plans`` and ``runs``)."""
    import flashinfer.mla

    planned = []

    class Wrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, *, backend):
            assert backend == "fa3" and float_workspace_buffer.dtype == torch.uint8 and not use_cuda_graph
            self.module = FakeMLAModule(backend)
            self.plans, self.runs = [], 0

        def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
                 kv_data_type, query_layout, kv_cache_layout):
            assert (page_size, query_layout, kv_cache_layout) == (1, "split", "split")
            assert q_data_type == kv_data_type == F64 and (head_dim_ckv, head_dim_kpe) == (32, 8)
            assert int(metadata.kv_indptr[-1]) == metadata.kv_indices.numel()  # compact CSR, explicit indices
            self.ws = torch.zeros(4096, dtype=torch.uint8)
            self.info, _ = self.module.plan_with_staged_workspace_bytes(
                self.ws, self.ws, torch.zeros(4096, dtype=torch.uint8), metadata.qo_indptr, metadata.kv_indptr,
                metadata.kv_len_arr, num_heads, head_dim_ckv, causal)
            self.kv_indices, self.scale, self.causal = metadata.kv_indices, sm_scale, causal
            self.plans.append(metadata)
            planned.append(self)

        def run(self, *, query, kv_cache):
            self.runs += 1
            out = torch.empty_like(query[0])
            self.module.run(self.ws, self.ws, self.info, *query, *kv_cache, self.kv_indices, out, None,
                            int(self.causal), query[0].shape[1], 1, self.scale, False, 1.0, 1.0, None)
            return out

    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", Wrapper)
    return planned


def test_other_flashinfer_releases_use_the_public_wrapper(fake_hopper, monkeypatch):
    """The generated-module surface is private: any release other than the tested ones goes through
    BatchMLAPagedAttentionWrapper.plan/run (here a fake that checks its arguments)."""
    import flashinfer

    planned = _fake_wrapper(monkeypatch)
    assert REAL_SURFACE() is not None  # the installed release (0.7.4) is a tested one
    monkeypatch.setattr(flashinfer, "__version__", "0.7.5")
    assert REAL_SURFACE() is None
    monkeypatch.setattr(fa, "generated_surface", REAL_SURFACE)
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert len(planned) == 3 and all(w.runs == model.config.num_hidden_layers for w in planned)  # one per step
    assert_batch_matches_eager_alone(model, out, prompts, 4, TOL)


@pytest.mark.parametrize("planner", ["wrapper", "direct"])
def test_planner_env_picks_the_planner(fake_hopper, monkeypatch, planner):
    """``HF_FLASHINFER_MLA_FA_PLANNER=wrapper`` makes every fa3 step plan and run through FlashInfer's public
    wrapper, even on a release whose generated module is known; any other value keeps the generated module. Either
    way the steps equal eager."""
    planned = _fake_wrapper(monkeypatch)
    monkeypatch.setenv(fa.PLANNER_ENV, planner)
    model = make_model("deepseek_v3")
    ids, mask, prompts = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 3), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = decode_logits(model, ids, mask, forced=forced, as_generate=True)
    layers = model.config.num_hidden_layers
    generated = fake_hopper.modules.get("fa3")
    if planner == "wrapper":
        assert len(planned) == 3 and [w.runs for w in planned] == [layers] * 3
        assert generated is None or (generated.plans == [] and generated.runs == 0)
    else:
        assert planned == [] and len(generated.plans) == 3 and generated.runs == 3 * layers
    for i, alone in enumerate(eager_alone(model, prompts, forced)):
        assert rel_err(ours[i], alone) < TOL


def test_direct_and_wrapper_planners_agree_with_the_reference(fake_hopper, monkeypatch):
    """FlashInfer's generated module planned directly (page offsets into the identity) and its public wrapper (compact
    CSR indices) must hand the kernel the same pages, lengths and mask mode for every step, decode and multi-token
    (causal) steps alike, and give the logits of the reference backend."""
    planned = _fake_wrapper(monkeypatch)
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    forced = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(8))
    chunks = [1, 3, 1, 1]

    def run(**kwargs):  # (Transformers' own layers: their rows move every step, so no step is planned ahead)
        with torch.no_grad():
            return decode_logits(model, ids, mask, cache=DynamicCache(), forced=forced, chunks=chunks,
                                 as_generate=True, **kwargs)

    reference = run(mla_backend="reference")
    assert fake_hopper.modules == {} and planned == []
    direct = run(mla_backend="fa3")
    monkeypatch.setenv(fa.PLANNER_ENV, "wrapper")
    wrapper = run(mla_backend="fa3")
    direct_plans = fake_hopper.modules["fa3"].plans  # one per step
    assert len(planned) == len(direct_plans) == len(chunks)
    identity = buffers.identity_rows(CPU, 1)
    for d, w in zip(direct_plans, planned):
        assert torch.equal(d["kv_len"], w.plans[0].kv_len_arr) and torch.equal(d["qo_indptr"], w.plans[0].qo_indptr)
        pages = [identity[s : s + n] for s, n in zip(d["kv_indptr"][:-1].tolist(), d["kv_len"].tolist())]
        assert torch.equal(torch.cat(pages), w.plans[0].kv_indices)
        assert d["causal"] is w.causal
    assert [d["causal"] for d in direct_plans] == [n > 1 for n in chunks]
    assert rel_err(direct, reference) < 1e-12 and rel_err(wrapper, reference) < 1e-12


# ------------------------------------------------------------------------------------------ adoption across devices
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


# ------------------------------------------------------------------------------------------ CUDA-graph slots
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
    layer = _layer(pitch=16, scale=0.25)
    key = ("fa3", layer, 2, 1, 16)  # backend, layer, batch, query length, mask length
    slot = graphs.slot(key, fa, "fa3", layer, _graph_step([3, 0], 10))  # made and first loaded on first use
    assert isinstance(slot, graphs.GraphSlot) and graphs.slot(key, fa, "fa3", layer, None) is slot  # kept
    other_batch = graphs.slot(("fa3", layer, 3, 1, 16), fa, "fa3", layer, _graph_step([3, 0, 1], 10))
    wider = _layer(pitch=24, scale=0.25)
    other_len = graphs.slot(("fa3", wider, 2, 1, 24), fa, "fa3", wider, _graph_step([3, 0], 10, kv_len=24))
    others = [(s, _scheduled(s)) for s in (other_batch, other_len)]
    fa3 = fake_hopper.modules["fa3"]
    indices, workspace = slot.meta.kv_indices, slot.meta.int_workspace
    for end in (11, 12, 13):
        before = len(fa3.plans)
        step = _graph_step([3, 0], end)
        step.load_graph_slots()
        step.load_graph_slots()  # a second ask on the same step does not plan again
        route = step.graph_route(None, layer, "fa3")  # nor does the graph op's warm-up run on it
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
    layer = _layer(pitch=16, scale=0.25)
    fa3 = fake_hopper.modules

    def grow(mask2d):  # generate()'s update after a step: the next mask, the next step planned ahead
        return model._update_model_kwargs_for_generation({}, {"attention_mask": mask2d})["attention_mask"]

    def step(mask2d):  # the mask function over a static cache of 16 rows, then generate()'s compiled step
        mask = masks.flashinfer_mla_mask(batch_size=2, q_length=1, kv_length=16, q_offset=mask2d.shape[1] - 1,
                                         attention_mask=mask2d, device=CPU)
        plan_of(mask).load_graph_slots()  # what generate()'s compiled step does before each call
        return plan_of(mask)

    mask2d = grow(_mask2d([[0, 0, 0] + [1] * 6, [1] * 9]).long())  # after the prefill: width 10
    first = step(mask2d)
    assert first.graph_route(None, layer, "fa3").backend == "fa3"  # the graph op's warm-up makes the slot
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
    other = attach_plan(torch.ones(2, 1, 1, 16, dtype=torch.bool), _host_rows([3, 0], 13))  # a forward in between
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


def test_decode_plans_skip_flashinfers_validator_where_the_bound_proves_acceptance(fake_hopper, monkeypatch):
    """FlashInfer's Python validator walks every sequence of every plan. A non-causal plan whose work items
    (`work_items_bound`) fit the scheduler's capacity is accepted at any lengths, so it is not called for one;
    causal plans, and plans beyond the bound, are still validated."""
    engine = fa.generated_fa(_layer(), "fa3")
    validated = []
    monkeypatch.setattr(fake_hopper, "validate_workload", lambda *args: validated.append(args))
    engine.sms = 132
    workspace = engine.new_workspace()
    rows = _host_rows([0, 3], 9)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert validated == []
    causal = _host_rows([0, 3], 9, q_len=2)
    engine.plan(causal, causal.kv_indptr(), True, workspace)
    assert len(validated) == 1
    monkeypatch.setattr(fa, "MAX_WORK_ITEMS", 133)  # two sequences' tiles + 132 SMs exceed it
    engine.plan(rows, rows.kv_indptr(), False, workspace)
    assert len(validated) == 2
    engine.sms = None  # an SM count that is not known (not a CUDA device): always validated
    monkeypatch.setattr(fa, "MAX_WORK_ITEMS", 16384)
    engine.plan(rows, rows.kv_indptr(), False, workspace)
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
                    assert count <= fa.work_items_bound(batch, q_len, heads, 132), (batch, q_len, kv)


@pytest.mark.parametrize("seed", range(4))
def test_decode_masks_from_host_rows_equal_sdpas(seed, monkeypatch):
    """Where a decode step's rows are known on the host (generate()'s 2D mask with its `GrowingMask`, or no 2D mask
    at all) its mask is built from them (`GrowingMask.mask`), not by ``sdpa_mask``: it must be the very tensor
    sdpa_mask would give, for left padding, 1-8 query tokens and a static cache's unfilled tail; and its plan has
    the rows without reading the mask."""
    g = torch.Generator().manual_seed(seed)
    built_by_sdpa = _spy(monkeypatch, masks, "sdpa_mask")
    from_mask = _spy(monkeypatch, Rows, "from_mask")
    for q_len in (1, 2, 8):
        batch, width = 3, int(torch.randint(10, 40, (1,), generator=g))
        kv_len = width + int(torch.randint(0, 5, (1,), generator=g))  # > width: a static cache's tail
        first = torch.randint(0, width - q_len, (batch,), generator=g)
        padding = _growing((torch.arange(width)[None, :] >= first[:, None]).long())
        for attention_mask in (padding, None):
            args = dict(batch_size=batch, q_length=q_len, kv_length=kv_len if attention_mask is not None else width,
                        q_offset=width - q_len, attention_mask=attention_mask, device=CPU)
            mask = masks.flashinfer_mla_mask(**args)
            expected = sdpa_mask(**args, allow_is_causal_skip=False)
            assert mask.dtype == torch.bool and mask.is_contiguous() and torch.equal(mask, expected), (q_len, first)
            rows = plan_of(mask).rows()
            assert rows.end == width and rows.first.tolist() == (first.tolist() if attention_mask is not None
                                                                 else [0] * batch)
    assert built_by_sdpa == [] and from_mask == []  # every mask above came from the rows, and so did each plan


@torch.no_grad()
@pytest.mark.parametrize("use_cache", [False, True])
def test_a_short_right_padded_forward_runs_the_reference_not_a_causal_kernel(fake_hopper, caplog, use_cache):
    """A forward of at most 8 tokens takes the decode path. Right-padded, its earlier query tokens do not see a prefix
    of the last one's rows that ends where a causal kernel ends it (the padding tokens come last), so fa3 and fa2
    refuse the step, saying why, and the reference gives each valid token eager's logits. The control shows the
    refusal is what keeps it right: a causal kernel planned from the last token's rows alone is off."""
    model, eager = _with_eager_twin()
    g = torch.Generator().manual_seed(0)
    lengths = (5, 8, 3)
    ids, mask = torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.randint(1, VOCAB, (n,), generator=g), 1

    def worst() -> float:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=use_cache).logits
        return max((logits[i, :n] - eager(input_ids=ids[i : i + 1, :n], use_cache=False).logits[0]).abs().max().item()
                   for i, n in enumerate(lengths))

    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        assert worst() < 1e-6
    assert any("the step's mask is not causal within the step" in w for w in package_warnings(caplog))
    assert fake_hopper.modules.get("fa3") is None or fake_hopper.modules["fa3"].runs == 0
    # The control: a builder that takes every row (rows 0 and 2 also show fewer positions than the step has query
    # tokens, which kernels refuse too) sends the step to fa3, which then attends over the wrong rows.
    from hf_flashinfer_mla.kernels import fa

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa, "refuse_inexpressible", lambda rows: None)
        assert worst() > 1e-2 and fake_hopper.modules["fa3"].runs > 0


@torch.no_grad()
def test_a_2d_mask_written_in_place_between_steps_is_read_again(fake_hopper):
    """A loop of the user's own grows the 2D mask with generate()'s mask update, then hides a prompt token in place
    before the next step. The padding recorded on the mask (and the step planned ahead from it) no longer describes
    it: the tensor's version counter moved, so the step is planned from the mask itself, and every later step too;
    the logits stay eager's."""
    model, eager = _with_eager_twin()
    ids, mask, _ = left_padded_batch(lengths=(9, 4, 7))  # row 0 unpadded: eager's float64 batch is finite there
    logits = {}
    for name, m in (("ours", model), ("eager", eager)):
        cache = MLALatentCache(m.config) if name == "ours" else DynamicCache(config=m.config)
        msk = mask.clone()
        out = m(input_ids=ids, attention_mask=msk, position_ids=(msk.cumsum(-1) - 1).clamp(min=0), cache=cache)
        pos, steps = msk.sum(-1, keepdim=True), []
        for step in range(4):
            msk = m._update_model_kwargs_for_generation(out, {"attention_mask": msk})["attention_mask"]
            if step == 2:
                msk[0, 3] = 0  # in place: hide one prompt token of row 0
            out = m(input_ids=torch.full((3, 1), 5 + step), attention_mask=msk, position_ids=pos + step, cache=cache)
            steps.append(out.logits[0, -1])
        logits[name] = torch.stack(steps)
    diff = (logits["ours"] - logits["eager"]).abs().amax(-1)
    assert diff.max() < 1e-6, diff.tolist()
    assert fake_hopper.modules["fa3"].runs > 0  # the steps ran the (fake) kernel, not only the reference



@torch.no_grad()
@pytest.mark.parametrize("kind", ["alibi", "finite"])
@pytest.mark.parametrize("kernel", [True, False], ids=["fa3", "reference"])
def test_an_additive_mask_that_adds_a_bias_gets_eagers_logits(request, caplog, kind, kernel):
    """A 4D float mask of the user's own is additive, as eager reads it: its values where it shows a position (an
    ALiBi-like bias, or 0 beside a finite masking value such as -1e4, which then masks through its size alone)
    are added to the scores. Decode steps of 1 and 3 tokens over such masks give eager's logits: the reference adds
    the mask's values, and fa3, which can only show or hide a row, refuses the step with one warning. The control:
    rows that do not report the bias send the step to fa3, which drops it."""
    fake = request.getfixturevalue("fake_hopper") if kernel else None
    model, eager = _with_eager_twin()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 2] = 0  # a hole in row 1's history (no padding: eager's float64 batch is finite)
    forced = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))

    def run(m):
        return decode_logits(m, ids, mask, forced=forced, chunks=[1, 3, 1], forward=with_4d_masks(m, kind))

    expected = run(eager)
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        assert (run(model) - expected).abs().max() < 1e-6
    if not kernel:
        return
    assert any("the step's float mask adds a bias to the scores" in w for w in package_warnings(caplog))
    assert fake.modules.get("fa3") is None or fake.modules["fa3"].runs == 0
    real_from_mask = Rows.from_mask.__func__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Rows, "from_mask", classmethod(lambda cls, valid, q_len, queries=None, additive=None: (
            real_from_mask(cls, valid, q_len, queries))))
        assert (run(model) - expected).abs().max() > 1e-2 and fake.modules["fa3"].runs > 0


def _per_head(mask: torch.Tensor) -> torch.Tensor:
    """The mask repeated for 4 heads, head h also hiding position h."""
    heads = mask.repeat(1, 4, 1, 1)
    for h in range(4):
        heads[:, h, :, h] = torch.finfo(mask.dtype).min
    return heads


@torch.no_grad()
@pytest.mark.parametrize("form", ["per_head", "one_for_the_batch"])
@pytest.mark.parametrize("kernel", [True, False], ids=["fa3", "reference"])
def test_4d_masks_per_head_or_broadcast_over_the_batch_get_eagers_logits(request, caplog, form, kernel):
    """A user's 4D mask may hold a row per head (``[B, H, q, S]``) or one row for the whole batch (``[1, 1, q, S]``),
    as eager and sdpa broadcast them. A kernel plans one set of rows per sequence, so fa3 refuses a mask per head
    (one warning; the reference applies each head's) and runs a batch-wide mask expanded to the batch, once per step
    (each step gets one plan, not one per layer)."""
    fake = request.getfixturevalue("fake_hopper") if kernel else None
    model, eager = _with_eager_twin()
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    forced = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))
    reshape = _per_head if form == "per_head" else (lambda m: m[:1])

    def run(m):
        return decode_logits(m, ids, mask, forced=forced, chunks=[1, 3, 1],
                             forward=with_4d_masks(m, "plain", reshape))

    expected = run(eager)
    plans, attach = [], plan.attach_plan  # (counted, not recorded: holding a mask would keep it alive)
    request.getfixturevalue("monkeypatch").setattr(plan, "attach_plan", lambda *a, **k: plans.append(1) or attach(
        *a, **k))
    with caplog.at_level(logging.WARNING, logger="hf_flashinfer_mla"):
        assert (run(model) - expected).abs().max() < 1e-6
    assert len(plans) == 3  # the three decode steps
    if kernel and form == "per_head":
        assert any("the step's mask has a row per head" in w for w in package_warnings(caplog))
        assert fake.modules.get("fa3") is None or fake.modules["fa3"].runs == 0
    elif kernel:
        assert fake.modules["fa3"].runs > 0


@torch.no_grad()
def test_a_4d_mask_wider_than_the_cache_is_refused_naming_the_cause(fake_hopper):
    """eager and sdpa refuse a mask whose width is not the cache's length; a kernel would read rows past the cache,
    so the decode step refuses it too, saying what must match."""
    model = make_model("deepseek_v3", dtype=F64)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = MLALatentCache(model.config)
    model(input_ids=ids, cache=cache)
    wide = torch.ones(2, 1, 1, 9, dtype=torch.bool)  # the cache will hold 7 rows
    with pytest.raises(ValueError, match="covers 9 positions but the cache holds 7"):
        model(input_ids=ids[:, :1], attention_mask=wide, position_ids=torch.full((2, 1), 6), cache=cache)


@torch.no_grad()
def test_an_additive_mask_is_added_at_its_own_precision_as_eager_adds_it():
    """eager adds a float32 mask to bfloat16 scores in float32 (type promotion): a constant offset on every position
    a row shows then changes nothing after the softmax. Added in bfloat16 it would round the scores at the offset's
    magnitude."""
    model = make_model("deepseek_v3", dtype=torch.bfloat16)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    forced = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))

    def run(offset):
        def shifted(mask):
            return torch.where(mask > torch.finfo(mask.dtype).min / 2, mask + offset, mask)
        return decode_logits(model, ids, torch.ones_like(ids), forced=forced,
                             forward=with_4d_masks(model, "plain", lambda m: shifted(m.float())))

    assert rel_err(run(-64.0), run(0.0)) < 1e-3


def test_a_finite_masking_value_is_refused_for_its_bias_first():
    """A -1e4 mask over a step of 3 tokens shows every position to the kernels' rows, so it is also not causal; the
    refusal names the cause the user can act on, the mask's values."""
    valid = torch.ones(1, 6, dtype=torch.bool)
    additive = torch.zeros(1, 1, 3, 6).masked_fill(~torch.ones(3, 6, dtype=torch.bool).tril(3), -1e4)
    rows = Rows.from_mask(valid, 3, torch.ones(1, 1, 3, 6, dtype=torch.bool), additive)
    assert rows.refusal.startswith("the step's float mask adds a bias")
