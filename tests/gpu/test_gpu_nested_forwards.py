"""Forwards inside generate() on the GPU: classifier-free guidance's unconditional forward and a second model
stepped by a logits processor, both on FlashInfer's fa3, in an eager-mode generate() and inside a static-cache one
compiled with CUDA graphs. Each such forward is planned from its own mask while the step around it was planned
ahead from generate()'s rows (and, compiled, replays a graph slot): on the GPU the planners' pinned host scratches
and their copies to the device are asynchronous, so a nested forward that reused the scratch of a step the GPU had
not read yet, or a step that took the nested forward's rows, would read wrong rows here and nowhere on the CPU
(``tests/test_nested_forwards.py`` compares the same modes with eager through the kernel stand-ins).

The oracle is the same generate() on the package's PyTorch reference backend (``$HF_FLASHINFER_MLA_BACKEND``, so
that the nested forwards run it too), uncompiled, teacher-forced along our tokens; the bounds are the suite's
(`test_gpu_backends.yardstick`). A control feeds the nested forward a mask without its padding and shows the same
comparison fails. ``-s`` prints the errors. Without CUDA it runs on the CPU stand-ins, the static-cache
generate() compiled with ``aot_eager`` (``gpu_suite.compile_config``): the planners' order there is the host's
own, so only the GPU shows asynchronous copies ordered against the kernels.
"""

from __future__ import annotations

import pytest
import torch
from gpu_suite import compile_config
from helpers import SecondModelStepper
from test_gpu_backends import _available, _compare, _model, yardstick
from test_gpu_graphs import _batch, _Replay
from transformers import LogitsProcessorList
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

import hf_flashinfer_mla
from hf_flashinfer_mla.capabilities import ENV_VAR
from hf_flashinfer_mla.kernels import fa, reference

PROMPTS = (37, 20, 64, 5, 48, 12, 26, 3)  # the main batch, left-padded
NESTED = (9, 30, 3, 21, 14, 2, 27, 6)  # the negative prompts / the second model's batch: other widths and padding
NEW = 10


def _guidance(model, ids, mask) -> UnbatchedClassifierFreeGuidanceLogitsProcessor:
    """Transformers' own guidance processor over the negative prompts `ids` (generate() takes a processor of the
    type it would build in its place), recording the last-token logits of each of its unconditional forwards."""
    guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model, unconditional_ids=ids,
                                                              unconditional_attention_mask=mask, use_cache=True)
    guidance.logits, unconditional = [], guidance.get_unconditional_logits

    def recorded(input_ids):
        logits = unconditional(input_ids)
        guidance.logits.append(logits[:, -1].float())
        return logits

    guidance.get_unconditional_logits = recorded
    return guidance


def _models():
    _available("fa3")
    hf_flashinfer_mla.reset()
    main, second = _model("v3"), _model("v2-lite")
    for m in (main, second):
        m.set_attn_implementation("flashinfer_mla")
    return main, second


def _run(nested, main, second, cache, nested_mask=None, follow=None):
    """One generate() of `main` with `nested` ("guidance" or "second-model") forwards inside it. Returns
    ``(tokens, main logits [B, NEW, V], nested logits [B, NEW, V], tokens the second model was fed)``: the nested
    logits are the last-token logits of guidance's unconditional forwards, or of the second model's. `nested_mask`
    replaces the nested batch's mask (the control); `follow` (another run's result) teacher-forces this run,
    uncompiled, along that run's tokens, the second model's included."""
    ids, mask = _batch(PROMPTS, seed=0)
    nested_ids, own_mask = _batch(NESTED, seed=1)
    nested_mask = own_mask if nested_mask is None else nested_mask
    width = ids.shape[1]
    extra = {}
    if nested == "guidance":
        recorder = _guidance(main, nested_ids, nested_mask)
        extra["guidance_scale"] = 1.5
    else:
        recorder = SecondModelStepper(second, nested_ids, nested_mask, forced=None if follow is None else follow[3])
    processors = [recorder]
    if follow is not None:
        processors.append(_Replay(follow[0][:, width:], width))
        extra["disable_compile"] = True
    out = main.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                        cache_implementation=cache, compile_config=compile_config(), output_logits=True,
                        return_dict_in_generate=True, logits_processor=LogitsProcessorList(processors), **extra)
    fed = torch.cat(recorder.fed, 1) if nested == "second-model" else None
    return out.sequences, torch.stack(out.logits, 1), torch.stack(recorder.logits, 1), fed


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("nested", ["guidance", "second-model"])
def test_forwards_inside_generate_on_fa3_match_the_reference(nested, cache, monkeypatch):
    """`nested` forwards inside generate() (eager mode, or static cache with CUDA graphs), all decode layers on fa3:
    the main model's and the nested forward's logits equal the reference backend's along the same tokens; a mask
    without the nested batch's padding fails the same comparison."""
    main, second = _models()
    layers, launches, references = main.config.num_hidden_layers, [], []
    real_run, real_reference = fa.run, reference.mla_attention_reference

    def run(meta, layer, *args, **kwargs):
        launches.append((layer.heads, meta.fixed))  # fixed: a CUDA-graph slot's metadata
        return real_run(meta, layer, *args, **kwargs)

    def counted_reference(*args):
        references.append(1)
        return real_reference(*args)

    monkeypatch.setattr(fa, "run", run)
    monkeypatch.setattr(reference, "mla_attention_reference", counted_reference)
    ours = _run(nested, main, second, cache)
    # Every decode layer of every nested forward ran fa3 eagerly (its own metadata, never a slot's); the main steps
    # ran it eagerly too, or through slots (compiled: the captured graph replays them without calling fa.run).
    nested_heads = main.config.num_attention_heads if nested == "guidance" else second.config.num_attention_heads
    eager_runs = [h for h, fixed in launches if not fixed]
    main_eager = layers * (NEW - 1) if cache == "dynamic" else 0
    if nested == "guidance":
        assert len(eager_runs) == main_eager + layers * (NEW - 1)
    else:
        assert eager_runs.count(nested_heads) == second.config.num_hidden_layers * (NEW - 1)
        assert eager_runs.count(main.config.num_attention_heads) == main_eager
    assert references == []

    monkeypatch.setenv(ENV_VAR, "reference")
    oracle = _run(nested, main, second, cache, follow=ours)
    assert references  # the oracle ran the reference backend
    assert torch.equal(oracle[0], ours[0])  # it followed our tokens
    if nested == "second-model":
        assert torch.equal(oracle[3], ours[3])  # and the second model followed its own
    main_err, main_top1 = _compare(ours[1], oracle[1])
    nested_err, nested_top1 = _compare(ours[2], oracle[2])
    monkeypatch.delenv(ENV_VAR)

    # Control: on fa3 along the same tokens, the nested batch's mask without its padding (every position attended):
    # the same comparison fails.
    _, nested_mask = _batch(NESTED, seed=1)
    assert not nested_mask.all()  # the fault is real: the batch has padding to drop
    wrong = _run(nested, main, second, "dynamic", nested_mask=torch.ones_like(nested_mask), follow=ours)
    assert torch.equal(wrong[0], ours[0])
    wrong_err, wrong_top1 = _compare(wrong[2], oracle[2])
    print(f"{nested} inside {cache} generate on fa3 vs reference: main rel {main_err:.2e} top1 {main_top1:.3f}; "
          f"nested rel {nested_err:.2e} top1 {nested_top1:.3f}; control (padding dropped) rel {wrong_err:.2e} "
          f"top1 {wrong_top1:.3f}")
    assert torch.isfinite(ours[1]).all() and torch.isfinite(ours[2]).all()
    # The main model's top-1 is printed, not bounded: over these 80 positions of near-tied random-weight logits it
    # is 0.91-0.98 on an H200, too noisy for one call; the suite bounds it over more positions
    # (``test_gpu_graphs``, ``test_gpu_backends``). This test is about the nested forwards' logits.
    main_bounds, nested_bounds = yardstick("v3"), yardstick("v3" if nested == "guidance" else "v2-lite")
    assert main_err < main_bounds.rel
    assert nested_bounds.holds(nested_err, nested_top1)
    assert not nested_bounds.holds(wrong_err, wrong_top1)
    del main, second
    torch.cuda.empty_cache()
