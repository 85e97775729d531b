"""Forwards nested inside ``generate()``: a second forward that runs while the main decode loop is under way must
never share the main loop's padding (nor the main loop take over the nested forward's).

Two real cases run such forwards:

* classifier-free guidance (``guidance_scale != 1``): Transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor``
  steps the *same* model over the unconditional prompt (the last prompt token, or ``negative_prompt_ids`` with
  their own padding), with its own cache and 2D mask, once per generated token;
* a logits processor (a reward model, a draft model, a watermark detector...) that steps *another* model over its
  own batch during the main generate().

Both forwards have the main batch's size and device, and both come with a 2D mask that only grows on the right, so
a per-generate() memo of "the left padding of this (device, batch)" hands one forward the padding of the other.

The oracle is Transformers' ``eager`` on the same weights: the same model object, switched with
``set_attn_implementation("eager")`` and back. Batched eager is exact in float32 (in float64 its fully masked
left-padding rows turn into NaN), so the batched comparisons run in float32; a second comparison
runs in float64 against each row generated alone, unpadded, with eager.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB, SecondModelStepper, additive_mask, assert_batch_matches_eager_alone, assisted_generate, decode_logits,
    generate_alone_with_eager, left_padded_batch, make_model, rel_err, with_4d_masks,
)
from transformers import DynamicCache, LogitsProcessorList

NEW_TOKENS = 6
TOL32 = 1e-5  # batched flashinfer_mla vs batched eager, float32
TOL64 = 1e-6  # batched flashinfer_mla vs each row alone with eager, float64 (RMSNorm computes in float32)

MAIN_LENGTHS = (7, 4, 9)  # left padding (2, 5, 0)
# The unconditional prompt of classifier-free guidance: the last prompt token (None: an all-ones mask), or a negative
# prompt whose padding differs from the main prompt's in every row: 8 wide (padding (5, 0, 3); its prefill is short
# enough to take the absorbed path, so it reads its padding before the main decode does) or 10 wide (padding
# (0, 4, 3); its prefill is expanded, so the main decode reads its padding first).
NEGATIVE = {"last-token": None, "negative-8": (3, 8, 5), "negative-10": (10, 6, 7)}


def eager_twin(model, fn):
    """``fn()`` run with eager attention on the same model object (switched back to flashinfer_mla afterwards)."""
    model.set_attn_implementation("eager")
    try:
        return fn()
    finally:
        model.set_attn_implementation("flashinfer_mla")


def assert_same_generation(ours, ref, tol: float) -> None:
    """Two generate() outputs (return_dict_in_generate, output_logits, output_scores) agree: the tokens exactly,
    the raw logits and the processed scores of every step to `tol`. Reports the first step that differs."""
    assert len(ours.logits) == len(ref.logits) == len(ours.scores) == len(ref.scores)
    for step in range(len(ref.logits)):
        for name in ("logits", "scores"):  # raw logits: the main forward; scores: also the guidance's forward
            a, b = getattr(ours, name)[step], getattr(ref, name)[step]
            assert rel_err(a, b) < tol, f"step {step}: {name} differ from eager by up to {(a - b).abs().max():.3g}"
    assert torch.equal(ours.sequences, ref.sequences)


# ------------------------------------------------------------------------------------------ classifier-free guidance
def cfg_generate(model, ids, mask, negative=None):
    kwargs = {}
    if negative is not None:
        kwargs = dict(negative_prompt_ids=negative[0], negative_prompt_attention_mask=negative[1])
    return model.generate(
        input_ids=ids, attention_mask=mask, guidance_scale=1.5, max_new_tokens=NEW_TOKENS, do_sample=False,
        output_logits=True, output_scores=True, return_dict_in_generate=True, **kwargs,
    )


@pytest.mark.parametrize("unconditional", list(NEGATIVE))
def test_guidance_matches_batched_eager(model_type, unconditional):
    """Classifier-free guidance on a left-padded batch equals eager's, step by step (float32).

    Guards against the unconditional forward (same model, same batch size, its own all-ones or differently padded
    2D mask) and the main decode steps sharing one memo of the batch's left padding: whichever of the two reads it
    first would impose its padding on the other (the main rows then attend to their padding, or the unconditional
    rows lose real tokens), changing the raw logits, the guided scores and the tokens.
    """
    model = make_model(model_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=MAIN_LENGTHS)
    lengths = NEGATIVE[unconditional]
    negative = None if lengths is None else left_padded_batch(seed=3, lengths=lengths)[:2]
    ours = cfg_generate(model, ids, mask, negative)
    ref = eager_twin(model, lambda: cfg_generate(model, ids, mask, negative))
    assert_same_generation(ours, ref, TOL32)


@pytest.mark.parametrize("unconditional", list(NEGATIVE))
def test_guidance_matches_eager_alone_float64(model_type, unconditional):
    """The same guided generation in float64, against each row generated alone (unpadded prompt, unpadded negative
    prompt) with eager: the oracle shares no padding at all. (The unconditional forward gets no position ids, so
    its padded rows sit at shifted positions; rope is relative, so that changes nothing beyond rounding.)"""
    lengths = NEGATIVE[unconditional]
    if model_type == "mistral4" and lengths is not None:
        pytest.skip("mistral4's Llama-4 query scaling depends on the absolute position, which the unconditional "
                    "forward shifts by the padding (it gets no position ids): the unpadded oracle differs by design "
                    "(the float32 batched-eager test covers it)")
    model = make_model(model_type, dtype=torch.float64)
    ids, mask, prompts = left_padded_batch(lengths=MAIN_LENGTHS)
    negative = None if lengths is None else left_padded_batch(seed=3, lengths=lengths)
    ours = cfg_generate(model, ids, mask, None if negative is None else negative[:2])

    def alone(i):
        row_negative = None
        if negative is not None:
            p = negative[2][i][None]
            row_negative = (p, torch.ones_like(p))
        p = prompts[i][None]
        return cfg_generate(model, p, torch.ones_like(p), row_negative)

    refs = eager_twin(model, lambda: [alone(i) for i in range(len(prompts))])
    for i, ref in enumerate(refs):
        for name in ("logits", "scores"):
            a = torch.stack([step[i] for step in getattr(ours, name)])
            b = torch.cat(getattr(ref, name))
            assert rel_err(a, b) < TOL64, f"row {i}: {name} differ from eager alone by up to {(a - b).abs().max():.3g}"
        assert torch.equal(ours.sequences[i, -NEW_TOKENS:], ref.sequences[0, -NEW_TOKENS:])


# ------------------------------------------------------------------ a second model stepped by a logits processor
def stepped_alone(model, ids, mask, steps: int, four_d: bool = False) -> torch.Tensor:
    stepper = SecondModelStepper(model, ids, mask, four_d)
    with torch.no_grad():
        for _ in range(steps):
            stepper.step()
    return stepper.recorded()


def main_generate(model, ids, mask, processors=()):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
        output_scores=True, return_dict_in_generate=True, logits_processor=LogitsProcessorList(list(processors)),
    )


# Second model: (family, seed). deepseek_v2 seed 1 is another model of another family; deepseek_v3 seed 1 is another
# model of the main model's own family (same config class, other weights).
SECOND_MODELS = [("deepseek_v2", 1), ("deepseek_v3", 1)]
# The second batch has the main batch's size (3), with other padding: width 8 (its prefill is short enough to take
# the absorbed path, so the second model reads its padding before the main decode does) and width 11; and, as a
# control, a batch of 2 (another batch size: no memo keyed by batch size can confuse it with the main batch).
SECOND_LENGTHS = [(5, 8, 2), (11, 6, 3), (10, 3)]


@pytest.mark.parametrize("second_lengths", SECOND_LENGTHS, ids=lambda n: "x".join(map(str, n)))
@pytest.mark.parametrize("second", SECOND_MODELS, ids=lambda s: f"{s[0]}-seed{s[1]}")
def test_second_model_stepped_inside_generate_matches_eager(second, second_lengths):
    """A logits processor steps a second flashinfer_mla model during the main generate() (float32).

    Its logits must equal the same loop run alone with eager, and the main generation (which the processor does not
    change) must equal the main model's eager generation. Guards against the second model's decode steps using
    the main loop's left padding (same device and batch size), or the main loop using the second model's.
    """
    main = make_model("deepseek_v3", dtype=torch.float32)
    other = make_model(second[0], dtype=torch.float32, seed=second[1])
    ids, mask, _ = left_padded_batch(lengths=MAIN_LENGTHS)
    ids2, mask2, _ = left_padded_batch(seed=4, lengths=second_lengths)

    stepper = SecondModelStepper(other, ids2, mask2)
    ours = main_generate(main, ids, mask, [stepper])
    assert len(stepper.logits) == NEW_TOKENS  # one processor call per generated token

    ref_main = eager_twin(main, lambda: main_generate(main, ids, mask))
    ref_other = eager_twin(other, lambda: stepped_alone(other, ids2, mask2, NEW_TOKENS))
    theirs = stepper.recorded()
    # Both sides are checked before failing: which of the two is wrong shows which one's padding was imposed.
    second_diff = [(theirs[:, s] - ref_other[:, s]).abs().max().item() for s in range(NEW_TOKENS)]
    main_diff = [(a - b).abs().max().item() for a, b in zip(ours.logits, ref_main.logits)]
    second_ok = all(rel_err(theirs[:, s], ref_other[:, s]) < TOL32 for s in range(NEW_TOKENS))
    main_ok = all(rel_err(a, b) < TOL32 for a, b in zip(ours.logits, ref_main.logits))
    assert second_ok and main_ok, (
        f"max |logit - eager| per step: second model {[f'{d:.3g}' for d in second_diff]}, "
        f"main model {[f'{d:.3g}' for d in main_diff]}"
    )
    assert_same_generation(ours, ref_main, TOL32)


@pytest.mark.parametrize("second_lengths", SECOND_LENGTHS, ids=lambda n: "x".join(map(str, n)))
def test_second_model_stepped_inside_generate_matches_eager_alone_float64(second_lengths):
    """The same in float64, against each second-model row stepped alone (unpadded) with eager, and each main row
    generated alone with eager."""
    main = make_model("deepseek_v3", dtype=torch.float64)
    other = make_model("deepseek_v2", dtype=torch.float64, seed=1)
    ids, mask, prompts = left_padded_batch(lengths=MAIN_LENGTHS)
    ids2, mask2, prompts2 = left_padded_batch(seed=4, lengths=second_lengths)

    stepper = SecondModelStepper(other, ids2, mask2)
    ours = main_generate(main, ids, mask, [stepper])
    theirs = stepper.recorded()
    refs = eager_twin(other, lambda: [stepped_alone(other, p[None], torch.ones(1, len(p), dtype=torch.long), NEW_TOKENS)
                                      for p in prompts2])
    second_diff = [(theirs[i] - ref[0]).abs().max().item() for i, ref in enumerate(refs)]
    main_refs = generate_alone_with_eager(main, prompts, NEW_TOKENS)[1]
    main_diff = [(torch.stack([step[i] for step in ours.logits]) - ref).abs().max().item()
                 for i, ref in enumerate(main_refs)]
    assert all(rel_err(theirs[i], ref[0]) < TOL64 for i, ref in enumerate(refs)) and all(
        rel_err(torch.stack([step[i] for step in ours.logits]), ref) < TOL64 for i, ref in enumerate(main_refs)
    ), (f"max |logit - eager alone| per row: second model {[f'{d:.3g}' for d in second_diff]}, "
        f"main model {[f'{d:.3g}' for d in main_diff]}")
    assert_batch_matches_eager_alone(main, ours, prompts, NEW_TOKENS, TOL64)


@torch.no_grad()
def test_two_models_on_one_config_with_4d_masks_of_their_own_match_eager():
    """Two models built on one config object (``type(a)(a.config)`` does not copy it), stepped in turn, each with 4D
    float masks of its own of the same shape and other padding (float32): each model's steps are planned from its
    own masks. (The second model's layers took over the first's plan, off by 0.7: a mask without a plan adopted its
    config's current step, a rule meant for the copies of one mask made for layers on other devices.)"""
    a = make_model("deepseek_v3", dtype=torch.float32)
    b = type(a)(a.config).eval()
    b.load_state_dict(make_model("deepseek_v3", dtype=torch.float32, seed=3).state_dict())
    assert b.config is a.config
    ids, mask, _ = left_padded_batch(lengths=MAIN_LENGTHS)
    ids2, mask2, _ = left_padded_batch(seed=4, lengths=(5, 9, 2))  # as wide as the main batch, other padding
    forced = torch.randint(1, VOCAB, (3, NEW_TOKENS), generator=torch.Generator().manual_seed(6))
    stepper = SecondModelStepper(b, ids2, mask2, four_d=True)
    stepper.step()  # its prefill

    def both(input_ids, attention_mask, **kwargs):  # a's step, then b's, while a's mask is still alive
        mask = additive_mask(attention_mask, input_ids.shape[1], "plain", torch.float32)
        out = a(input_ids=input_ids, attention_mask=mask, **kwargs)
        stepper.step()
        return out

    ours_a = decode_logits(a, ids, mask, forced=forced, forward=both)
    a.set_attn_implementation("eager")  # (for both models: they share the config)
    try:
        ref_a = decode_logits(a, ids, mask, forced=forced, forward=with_4d_masks(a, "plain", dtype=torch.float32))
        ref_b = stepped_alone(b, ids2, mask2, NEW_TOKENS + 1, four_d=True)
    finally:
        a.set_attn_implementation("flashinfer_mla")
    errs = {"a": rel_err(ours_a, ref_a), "b": rel_err(stepper.recorded(), ref_b)}
    assert all(e < TOL32 for e in errs.values()), errs


# ------------------------------------------------------------------------------ several generate() calls in a row
# Batch 3 padded, batch 1, batch 2 padded, then batch 3 again with other padding (the first call's batch size), and
# batch 3 unpadded.
CALLS = [(1, (7, 4, 9)), (2, (5,)), (3, (3, 8)), (5, (9, 2, 6)), (6, (6, 6, 6))]


def test_successive_generate_calls_match_eager():
    """Several generate() calls on one model in one process, with different batch sizes and paddings, each equal
    to eager's batched generation (float32) and to each row generated alone (float64). Guards against padding (or
    any other per-call state) of one generate() call leaking into the next, in particular into a later call with
    the same batch size."""
    model32 = make_model("deepseek_v3", dtype=torch.float32)
    model64 = make_model("deepseek_v3", dtype=torch.float64)
    for seed, lengths in CALLS:
        ids, mask, prompts = left_padded_batch(seed=seed, lengths=lengths)
        ours = main_generate(model32, ids, mask)
        assert_same_generation(ours, eager_twin(model32, lambda: main_generate(model32, ids, mask)), TOL32)
        assert_batch_matches_eager_alone(model64, main_generate(model64, ids, mask), prompts, NEW_TOKENS, TOL64)


# Assisted generation: the assistant is a second model stepped inside generate() (its own cache and masks), and the
# main model verifies each draft of 4 tokens in one forward of 5 (absorbed: <= 8 tokens).
ASSISTANTS = {"another-model": ("deepseek_v2", 1), "the-model-itself": None}


@pytest.mark.parametrize("assistant", ASSISTANTS)
def test_assisted_generation_matches_eager(assistant):
    """``generate(assistant_model=...)`` with both models on flashinfer_mla, against both on eager (float32; batch 1,
    as Transformers requires). Another model's drafts are rejected, so its cache is cropped and fed again after
    every verify step. The model as its own assistant runs two caches of one model inside one generate(), and its
    drafts are accepted. Tokens and every step's logits must be eager's."""
    main = make_model("deepseek_v3", dtype=torch.float32)
    spec = ASSISTANTS[assistant]
    helper = main if spec is None else make_model(spec[0], dtype=torch.float32, seed=spec[1])
    _, _, prompts = left_padded_batch(lengths=MAIN_LENGTHS)
    for prompt in prompts:
        ours = assisted_generate(main, helper, prompt)
        ref = eager_twin(main, (lambda: assisted_generate(main, helper, prompt)) if helper is main
                         else lambda: eager_twin(helper, lambda: assisted_generate(main, helper, prompt)))
        assert_same_generation(ours, ref, TOL32)
