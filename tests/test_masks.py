"""The mask function (`masks.flashinfer_mla_mask`, `masks.host_rows`) and the masks a decode step is planned from:
generate()'s 2D mask with the rows it carries, a forward's own 2D mask (guidance, a loop of the user's own, a mask
written in place), and a user's 4D masks (additive, per head, broadcast over the batch, wider than the cache). Whole
models run in float64 on the fa3 stand-in (`fake_flashinfer.py`) and the reference backend, against ``eager``."""

from __future__ import annotations

import logging

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch
from helpers import (
    VOCAB,
    bool_mask,
    decode_logits,
    eager_alone,
    left_padded_batch,
    make_model,
    package_warnings,
    rel_err,
    spy,
    with_4d_masks,
)
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from transformers import DynamicCache
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

from hf_flashinfer_mla import MLALatentCache, masks, plan
from hf_flashinfer_mla.masks import host_rows
from hf_flashinfer_mla.plan import plan_of
from hf_flashinfer_mla.rows import GrowingMask, Rows

TOL = 1e-6
CPU = torch.device("cpu")
F64 = torch.float64


def _with_eager_twin():
    """A float64 deepseek_v3 model on flashinfer_mla and an eager model with the same weights."""
    model = make_model("deepseek_v3", dtype=F64)
    eager = make_model("deepseek_v3", attn="eager", dtype=F64)
    eager.load_state_dict(model.state_dict())
    return model, eager


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
    mask = bool_mask([[0, 1, 1, 1], [1, 1, 1, 1]])
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
    mask = _growing(bool_mask([[0, 1, 1, 1], [1, 1, 1, 1]]))
    GrowingMask.of(mask).grown(kwargs["width"]).attach(mask)
    assert host_rows(2, 1, 4, kwargs["q_offset"], kwargs["kv_offset"], kwargs["mask_function"], mask) == (None, None)


@pytest.mark.parametrize("seed", range(4))
def test_decode_masks_from_host_rows_equal_sdpas(seed, monkeypatch):
    """Where a decode step's rows are known on the host (generate()'s 2D mask with its `GrowingMask`, or no 2D mask
    at all) its mask is built from them (`GrowingMask.mask`), not by ``sdpa_mask``: it must be the very tensor
    sdpa_mask would give, for left padding, 1-8 query tokens and a static cache's unfilled tail; and its plan has
    the rows without reading the mask."""
    g = torch.Generator().manual_seed(seed)
    built_by_sdpa = spy(monkeypatch, masks, "sdpa_mask")
    from_mask = spy(monkeypatch, Rows, "from_mask")
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


@pytest.mark.parametrize("as_generate", [False, True], ids=["user-loop", "as-generate"])
def test_left_padding_read_once_per_generate_call_else_each_mask(fake_hopper, monkeypatch, as_generate):
    """Decode steps driven as generate() drives them: the left padding is read once per call, after the prefill,
    by the mask update, and handed on with each new mask (no step reads its mask); the step over each mask plans the
    next one ahead. A loop of the user's own grows the mask itself: each step's mask is read exactly, once (shared
    by the layers). Both equal each prompt decoded alone with eager."""
    model = make_model("deepseek_v3")
    reads = spy(monkeypatch, GrowingMask, "read")
    from_mask = spy(monkeypatch, Rows, "from_mask")
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
    from_mask = spy(monkeypatch, Rows, "from_mask")
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
