"""What generate() does differently for a flashinfer_mla model: the seams of its loop (``registration.py`` lists
them), with the state they serve.

* The cache it prepares (`caches_for_mla`): marked for the late stop check (`DEFERS_STOP`); on Blackwell its static
  cache gets packed `cache.MLAStaticLayer`s, the layout trtllm-gen reads inside CUDA graphs.
* Its stop condition read a step late on CUDA too (`stop_checked_a_step_late`), so the host never waits for the step
  it just queued.
* Its 2D mask, which only grows on the right: each mask's `rows.GrowingMask` handed on to the next, wider one, where
  the next step is planned while the GPU runs this one (`growing_masks`), and kept on the boolean copy Transformers'
  mask preprocessing makes (`rows_kept_on_copies`).

Its compiled step's seam lives with the compiled path (``compiled.py``).
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import DeferredStopCheck

from . import paged_indexer
from .cache import MLAStaticLayer, packed_layout_for
from .models import ATTN_NAME
from .rows import GrowingMask

# A cache generate() prepared for a flashinfer_mla model (the attribute's value: True), whose stop check may run a
# step late on these devices (`stop_checked_a_step_late`), unless $HF_FLASHINFER_MLA_DEFER_STOP is "0".
DEFERS_STOP = "_flashinfer_mla_defers_stop"
DEFERRED_STOP_DEVICES = ("cuda",)
DEFER_STOP_ENV = "HF_FLASHINFER_MLA_DEFER_STOP"


def caches_for_mla(original):
    # The cache generate() decodes with is built (or handed over by the user) here, the one place that sees both it
    # and the model. For a flashinfer_mla model it is marked (`DEFERS_STOP`, re-set by every generate() call that
    # uses it) as one whose stop check may run a step late (`stop_checked_a_step_late`). And on Blackwell the
    # static cache generate() builds for cache_implementation="static" gets `MLAStaticLayer`s, the packed layout
    # trtllm-gen reads inside CUDA graphs (a cache the user passed keeps its layers).
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        mla = self.config.get_text_config(decoder=True)._attn_implementation == ATTN_NAME
        if cache is not None:
            setattr(cache, DEFERS_STOP, mla)
        if (
            type(cache) is StaticCache and not getattr(cache, "_is_user_defined", False) and mla
            and packed_layout_for(self.device)
        ):
            for i, layer in enumerate(cache.layers):
                if type(layer) is StaticLayer and not layer.is_initialized:
                    cache.layers[i] = MLAStaticLayer(layer.max_cache_len)
        return result

    return _prepare_cache_for_generation


def stop_checked_a_step_late(original):
    # Greedy and sampled generate() read "have all rows stopped?" on the host after every step, so the host waits for
    # the GPU each step and only then builds the next one: with CUDA graphs the GPU then idles for the host's share of
    # the step. Transformers (5.24, 5.25) has the cure, `DeferredStopCheck` (read the flag one step late, run one extra
    # forward when every row has stopped and undo it: tokens, scores, logits, and the cache where it is returned),
    # but enables it on MPS only ("we should enable it for cuda if we observe perf gains"). With CUDA graphs the
    # gain on CUDA is large (BENCHMARKS.md, "CUDA-graph step"), so for the caches generate() prepared for a
    # flashinfer_mla model it is enabled on CUDA too, under Transformers' own rules for the rest: never for an
    # assistant, and a returned cache must be croppable.
    # $HF_FLASHINFER_MLA_DEFER_STOP=0 turns it off (the extra step calls logits processors and stopping criteria
    # once more; streamers get each token a step later).
    @functools.wraps(original)
    def is_supported(device, cache, cache_is_returned, is_assistant):
        if (device.type in DEFERRED_STOP_DEVICES and not is_assistant and getattr(cache, DEFERS_STOP, False)
                and os.environ.get(DEFER_STOP_ENV, "1") != "0"):
            return cache.is_croppable or not cache_is_returned
        return original(device, cache, cache_is_returned, is_assistant)

    return staticmethod(is_supported)


def growing_masks(original):
    # generate() appends ones to its 2D mask after every step (`torch.cat`, a new tensor each time): the only place
    # where it is known that the next mask is the previous one grown on the right. The previous mask's padding is
    # read once (after the prefill: one sync, where generate() waits for the first token anyway) and handed on.
    @functools.wraps(original)
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        old = model_kwargs.get("attention_mask")
        result = original(self, outputs, model_kwargs, *args, **kwargs)
        new = result.get("attention_mask") if isinstance(result, dict) else None
        if (
            isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.dim() == new.dim() == 2
            and new.shape[-1] > old.shape[-1]
            and self.config.get_text_config(decoder=True)._attn_implementation == ATTN_NAME
        ):
            growing = GrowingMask.of(old) or GrowingMask.read(old)
            if growing is not None:
                grown = growing.grown(new.shape[-1])
                grown.attach(new)
                if growing.last_plan is not None:
                    growing.last_plan.plan_next(grown)  # this step is queued: plan the next while the GPU runs it
        return result

    return _update_model_kwargs_for_generation


def rows_kept_on_copies(original):
    # `create_causal_mask` hands the mask function `attention_mask.to(device, dtype=torch.bool)`, a new tensor:
    # without this the copy would lose the `GrowingMask` of the mask it was made from. For a paged cache it builds
    # no mask, which a sparse model's layers slice: they get `paged_indexer.step_mask`.
    @functools.wraps(original)
    def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, *args, **kwargs):
        result = original(config, inputs_embeds, attention_mask, *args, **kwargs)
        if result[0] and result[1] is None:
            cache = kwargs.get("cache", args[0] if args else None)
            paged = paged_indexer.step_mask(config, inputs_embeds, cache)
            if paged is not None:
                return (True, paged, *result[2:])
        growing = GrowingMask.of(attention_mask) if isinstance(attention_mask, torch.Tensor) else None
        if growing is not None and isinstance(result[1], torch.Tensor) and result[1] is not attention_mask:
            if result[1].shape == attention_mask.shape and result[1].device == attention_mask.device:
                growing.attach(result[1])
        return result

    return _preprocess_mask_arguments
