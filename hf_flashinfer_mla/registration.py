"""Registration with Transformers: the attention function, its mask function, the load-time model check, the
``mla_backend`` options, and the latent layers of the caches built for the model.

Transformers looks attention implementations up by name in two registries: ``AttentionInterface`` (the function
each attention module calls) and ``AttentionMaskInterface`` (the function that builds the step's mask). A name
missing from the second makes mask creation return ``None``, i.e. padding is silently lost, so both are
registered.

Transformers has no hook to validate a custom implementation against a model, and it treats every name containing
"flash" as a flash-attention kernel to import from the Hub. So ``PreTrainedModel._check_and_adjust_attn_implementation``
(which ``from_pretrained``, ``from_config`` and ``set_attn_implementation`` all go through) is wrapped once: for
``"flashinfer_mla"`` it refuses non-MLA models, hooks ``expand_kv`` and skips the Hub lookup; any other name goes
to Transformers' own check untouched. ``get_correct_attn_implementation``, through which ``set_attn_implementation``
sets sub-models (``{"text_config": "flashinfer_mla"}``) up to Transformers 5.24, gets the same check (5.25 checks
sub-models through the first function).

A forced backend is a runtime setting (``capabilities.py``): ``from_pretrained``/``from_config`` take ``mla_backend=``,
validate it at the call and keep it on the loaded model's config under a private name that ``to_dict`` (and so
``save_pretrained``) drops; ``generate()`` validates its ``mla_backend=`` where it validates every other keyword.
A ``DynamicCache`` built from the model's config (by ``generate()``, by the model's forward, by the user) gets this
package's latent layers, and on Blackwell ``generate()``'s static cache gets packed ones.

Two patches let a decode step inside ``generate()`` know its rows without a device sync: generate()'s mask update
hands each 2D mask's `rows.GrowingMask` on to the next, wider mask (and plans the next step there, while the GPU
runs this one), and Transformers' mask preprocessing carries it over to the boolean copy it makes of the 2D mask
before calling the mask function. generate()'s compiled step raises for a step that a CUDA-graph slot of its shape
cannot serve (a replay cannot switch backends). And generate() reads its stop condition a step late on CUDA too
(Transformers' `DeferredStopCheck`, MPS-only there), so the host never waits for the step it just queued.

Continuous batching (``generate_batch``, the manager, ``transformers serve``) gets four wrappers and one table entry,
in one block at the end: the manager refuses what it cannot serve in the caller's thread (when built, and when a
persistent one is handed out again) and turns CUDA graphs off, the paged cache holds the latent (``paged_cache.py``), and
each prepared batch hands its host-side lengths to the attention.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedConfig, PreTrainedModel, StaticCache, masking_utils
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import logging

from . import paged_attention, paged_cache
from .attention import flashinfer_mla_attention_forward
from .cache import MLAStaticLayer, adopt_latent_layers, packed_layout_for
from .capabilities import LOAD_ATTR, requested_backend, validate_backend
from .errors import UnsupportedModelError
from .kernels import graphs
from .masks import flashinfer_mla_mask
from .models import ATTN_NAME, check_model_supported, install_latent_hook
from .plan import plan_of
from .rows import GrowingMask

try:  # (generate() reading its stop condition a step late: in 5.24 and 5.25, absent from older releases)
    from transformers.generation.utils import DeferredStopCheck
except ImportError:
    DeferredStopCheck = None
try:  # (Transformers' multi-token prediction, `generate(use_mtp=True)`; absent before it)
    from transformers.modeling_layers import MtpModel
except ImportError:
    MtpModel = None

logger = logging.get_logger("hf_flashinfer_mla")
PATCHED = "_flashinfer_mla_patch"  # marks the functions this module put into Transformers
# A cache generate() prepared for a flashinfer_mla model (the attribute's value: True), whose stop check may run a
# step late on these devices (`_stop_checked_a_step_late`), unless $HF_FLASHINFER_MLA_DEFER_STOP is "0".
DEFERS_STOP = "_flashinfer_mla_defers_stop"
DEFERRED_STOP_DEVICES = ("cuda",)
DEFER_STOP_ENV = "HF_FLASHINFER_MLA_DEFER_STOP"


def _text_config_key(config, text_config) -> str:
    return next((key for key in config.sub_configs if getattr(config, key, None) is text_config), "text_config")


def _adopt(model: PreTrainedModel, is_init_check: bool, original) -> str:
    """The attention implementation `model` gets when ``"flashinfer_mla"`` is asked for, or an error saying why not.

    A causal LM over MLA (dense or sparse) gets it (with its ``expand_kv`` hooked). A multimodal model whose text
    model is MLA gets it on the text model only: at load time the name, which Transformers has spread over every sub-config,
    is kept on the text config and taken off the others (vision towers and the like get Transformers' default, as
    does the wrapper model itself); the text model's own check then hooks it. After loading, Transformers would hand
    the name to every sub-model unchecked, so there the text model must be named explicitly.
    """
    text_config = check_model_supported(model.config)
    requested_backend(None, text_config)  # an unknown $HF_FLASHINFER_MLA_BACKEND fails at load, not at the first step
    if text_config is model.config:
        if MtpModel is not None and isinstance(model, MtpModel):
            # (its layers are the main model's decoder layers, built on the main model's config: the main model's
            # check hooked their attention class; MtpModel's own module defines none)
            return ATTN_NAME
        install_latent_hook(type(model))
        return ATTN_NAME
    key = _text_config_key(model.config, text_config)
    if not is_init_check:
        raise UnsupportedModelError(
            f"{type(model).__name__} is multimodal: {ATTN_NAME} can run its text model ({text_config.model_type}) "
            f"only. Call model.set_attn_implementation({{{key!r}: {ATTN_NAME!r}}}) to switch the text model alone."
        )
    configs = [model.config]
    while configs:
        config = configs.pop()
        for sub in (getattr(config, k, None) for k in config.sub_configs):
            if isinstance(sub, PreTrainedConfig) and sub is not text_config:
                if sub._attn_implementation == ATTN_NAME:
                    sub._attn_implementation_internal = None  # Transformers' default for this sub-model
                configs.append(sub)
    text_config._attn_implementation_internal = ATTN_NAME
    logger.info(f"{type(model).__name__}: {ATTN_NAME} runs the text model ({key}); other parts keep the default.")
    return original(model, None, is_init_check)


def _checked(original):
    # Wraps both `_check_and_adjust_attn_implementation` (from_pretrained, from_config, set_attn_implementation; from
    # 5.25 also sub-models) and `get_correct_attn_implementation`, through which `set_attn_implementation` sets
    # sub-models (a multimodal model's text model) up to 5.24: without the check there, the text model would run
    # flashinfer_mla with expand_kv unhooked.
    @functools.wraps(original)
    def check(self, attn_implementation, is_init_check=False, **kwargs):
        if attn_implementation != ATTN_NAME:
            return original(self, attn_implementation, is_init_check, **kwargs)
        return _adopt(self, is_init_check, functools.partial(original, **kwargs))

    return check


def _with_load_option(original):
    """`from_pretrained` / `_from_config` (which every ``from_config`` reaches) with an ``mla_backend=`` keyword."""

    @functools.wraps(original)
    def load(cls, *args, mla_backend: str | None = None, **kwargs):
        if mla_backend is not None:
            validate_backend(mla_backend, f"{original.__name__.lstrip('_')}(mla_backend=...)")
        loaded = original(cls, *args, **kwargs)
        if mla_backend is not None:
            model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True gives a tuple
            setattr(model.config.get_text_config(decoder=True), LOAD_ATTR, mla_backend)
        return loaded

    return classmethod(load)


def _not_serialized(original):
    # The load option is a runtime setting of one loaded model: it must not reach config.json (nor the generation
    # config, nor a config's repr), all of which are built from `to_dict`.
    @functools.wraps(original)
    def to_dict(self):
        output = original(self)
        output.pop(LOAD_ATTR, None)
        return output

    return to_dict


def _validated_generate_kwargs(original):
    # generate() checks its model keywords here, before anything runs: the place to refuse an unknown backend, even
    # when no decode step follows. The keyword itself is forwarded to every attention call by the model's forward.
    @functools.wraps(original)
    def _validate_model_kwargs(self, model_kwargs):
        value = model_kwargs.pop("mla_backend", None)  # generate() hands over a copy
        text_config = self.config.get_text_config(decoder=True)
        if value is not None or text_config._attn_implementation == ATTN_NAME:
            requested_backend(value, text_config)
        return original(self, model_kwargs)

    return _validate_model_kwargs


def _latent_layers_for_mla(original):
    # Transformers' DynamicLayer concatenates, copying a layer's whole history on every decode step, and on Blackwell
    # trtllm-gen reads only the packed latent. So a `DynamicCache(config=...)` built for a flashinfer_mla model gets
    # `MLALatentLayer`s (the same content, grown in place, in the layout this device's kernel reads) wherever it is
    # built: by generate(), by the model's forward when it is called without a cache (a loop of the user's own,
    # classifier-free guidance's own forward), or by the user. Subclasses (MLALatentCache, QuantizedCache) and caches
    # built from data keep their own layers.
    @functools.wraps(original)
    def __init__(self, ddp_cache_data=None, config=None, *args, **kwargs):
        original(self, ddp_cache_data, config, *args, **kwargs)
        if (type(self) is DynamicCache and ddp_cache_data is None and config is not None
                and config.get_text_config(decoder=True)._attn_implementation == ATTN_NAME):
            adopt_latent_layers(self)

    return __init__


def _caches_for_mla(original):
    # The cache generate() decodes with is built (or handed over by the user) here, the one place that sees both it
    # and the model. For a flashinfer_mla model it is marked (`DEFERS_STOP`, re-set by every generate() call that
    # uses it) as one whose stop check may run a step late (`_stop_checked_a_step_late`). And on Blackwell the
    # static cache generate() builds for cache_implementation="static" gets `MLAStaticLayer`s, the packed layout
    # trtllm-gen reads inside CUDA graphs (a cache the user passed keeps its layers).
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # renamed in transformers 5.2x
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


def _stop_checked_a_step_late(original):
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


def _growing_masks(original):
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


def _rows_kept_on_copies(original):
    # `create_causal_mask` hands the mask function `attention_mask.to(device, dtype=torch.bool)`, a new tensor:
    # without this the copy would lose the `GrowingMask` of the mask it was made from.
    @functools.wraps(original)
    def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, *args, **kwargs):
        result = original(config, inputs_embeds, attention_mask, *args, **kwargs)
        growing = GrowingMask.of(attention_mask) if isinstance(attention_mask, torch.Tensor) else None
        if growing is not None and isinstance(result[1], torch.Tensor) and result[1] is not attention_mask:
            if result[1].shape == attention_mask.shape and result[1].device == attention_mask.device:
                growing.attach(result[1])
        return result

    return _preprocess_mask_arguments


def _slots_checked_before_compiled_steps(original):
    # A replayed CUDA graph runs no Python: the mask function loads the kernels' fixed-address metadata
    # (kernels/graphs.py) for every step of a captured shape, compiled or not, and records a step a slot's kernel
    # cannot serve, without raising (an uncompiled step of that shape runs anyway). generate() gets its compiled
    # step here: this wrapper raises for such a step, which it knows will replay.
    @functools.wraps(original)
    def get_compiled_call(self, compile_config):
        compiled = original(self, compile_config)
        if self.config.get_text_config(decoder=True)._attn_implementation != ATTN_NAME:
            return compiled

        def compiled_step(*args, **kwargs):
            masks = kwargs.get("attention_mask")
            for mask in masks.values() if isinstance(masks, dict) else (masks,):
                plan = plan_of(mask) if isinstance(mask, torch.Tensor) else None
                if plan is not None:
                    plan.load_graph_slots(replaying=True)
            try:
                return compiled(*args, **kwargs)
            finally:
                graphs.note_mask_planned(None)

        return compiled_step

    return get_compiled_call


# ----------------------------------------------------------------------------------------------------------------
# Continuous batching (generate_batch, init_continuous_batching, transformers serve) over the paged latent cache:
# the logic lives in paged_cache.py and paged_attention.py; these four wrappers, the allocator table's entry and (5.25+) the cache module's
# MLACacheAllocator name are the seams where Transformers offers no hook.
# ----------------------------------------------------------------------------------------------------------------
def _manager_checked(original):
    # The manager is built in the caller's thread, before the background loop: the one place where a model continuous
    # batching cannot serve can raise (the loop turns any error into FAILED requests with empty outputs). It keeps
    # "flashinfer_mla" as a flash implementation (the name contains "flash") and so turns CUDA graphs on, which the
    # host-planned paged kernels cannot replay: they are turned off here, with one log line saying why.
    @functools.wraps(original)
    def __init__(self, model, *args, **kwargs):
        paged_cache.refuse_unservable(model)
        original(self, model, *args, **kwargs)
        if paged_cache.uses_latent(self.model.config.get_text_config()):
            paged_cache.disable_graphs(self.continuous_batching_config)

    return __init__


def _cached_manager_checked(original):
    # A manager kept with persistent_manager=True is handed out again without being built, so its check never runs
    # again: a model switched to another attention since (eager, sdpa) would read the cached latent rows as per-head
    # keys and values and return wrong tokens. The check runs here too.
    # The manager also keeps its paged cache, built for the attention of its first run: from 5.25, where eager and
    # sdpa page the latent too, that is checked as well (paged_cache.refuse_kept_cache).
    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        manager = getattr(self, "_cached_continuous_batching_manager", None)
        if manager is not None:
            paged_cache.refuse_unservable(self)
            paged_cache.refuse_kept_cache(self, manager)
        return original(self, *args, **kwargs)

    return init_continuous_batching


def _latent_paged_cache(original):
    # PagedAttentionCache picks its allocator from a module-level table and sizes tokens from the config's head_dim
    # and key-value heads: per-head K/V rows, which the MLA latent does not fit. For flashinfer_mla models it is built
    # by Transformers' own code with a config view that sizes latent rows, for which the table's full-attention
    # allocator (paged_cache.FullOrLatentAllocator, put there once) builds latent rows.
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if not paged_cache.uses_latent(config):
            return original(self, config, *args, **kwargs)
        return paged_cache.build_paged_cache(original, self, config, *args, **kwargs)

    return __init__


def _paged_steps(original):
    # The attention receives only device tensors (cu_seq_lens, read indices); reading their lengths would wait for
    # the GPU. Here, where Transformers has just laid out the batch on the host, its lengths go to the latent
    # allocator, so every layer of the step plans its kernels without a sync.
    @functools.wraps(original)
    def prepare_batch_tensors(self, *args, **kwargs):
        original(self, *args, **kwargs)
        paged_attention.prepare_step(self.cache, self.requests_in_batch, self.num_q_tokens)

    return prepare_batch_tensors


def _register_continuous_batching() -> None:
    from transformers.generation.continuous_batching import cache as cb_cache, continuous_api, input_outputs

    _patch(continuous_api.ContinuousBatchingManager, "__init__", _manager_checked)
    _patch(continuous_api.ContinuousMixin, "init_continuous_batching", _cached_manager_checked)
    _patch(cb_cache.PagedAttentionCache, "__init__", _latent_paged_cache)
    cb_cache.ATTN_TYPE_TO_ALLOCATOR[paged_cache.FULL_ATTENTION] = paged_cache.FullOrLatentAllocator
    if paged_cache.MLAOrLatentAllocator is not None:
        # 5.25's PagedAttentionCache._create_allocator picks this name from its module for any config with a
        # kv_lora_rank, before the table: our sizing view has one, so the latent rows must come from here too.
        cb_cache.MLACacheAllocator = paged_cache.MLAOrLatentAllocator
    _patch(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", _paged_steps)


def _patch(owner, name: str, wrap, unwrap=lambda f: f) -> None:
    """Replace ``owner.name`` by ``wrap(original)``, once: the wrapper's function carries `PATCHED`."""
    current = getattr(owner, name)
    if not getattr(current, PATCHED, False):
        wrapped = wrap(unwrap(current))
        setattr(getattr(wrapped, "__func__", wrapped), PATCHED, True)  # (a classmethod: on its function)
        setattr(owner, name, wrapped)


def register() -> None:
    """Register ``"flashinfer_mla"`` with Transformers. Importing the package does this; calling it again is a no-op."""
    AttentionInterface.register(ATTN_NAME, flashinfer_mla_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flashinfer_mla_mask)
    _patch(PreTrainedModel, "_check_and_adjust_attn_implementation", _checked)
    _patch(PreTrainedModel, "get_correct_attn_implementation", _checked)
    for name in ("from_pretrained", "_from_config"):
        _patch(PreTrainedModel, name, _with_load_option, unwrap=lambda m: m.__func__)
    _patch(PreTrainedConfig, "to_dict", _not_serialized)
    _patch(GenerationMixin, "_validate_model_kwargs", _validated_generate_kwargs)
    _patch(DynamicCache, "__init__", _latent_layers_for_mla)
    _patch(GenerationMixin, "_prepare_cache_for_generation", _caches_for_mla)
    if DeferredStopCheck is not None:
        _patch(DeferredStopCheck, "is_supported", _stop_checked_a_step_late)
    _patch(GenerationMixin, "_update_model_kwargs_for_generation", _growing_masks)
    _patch(masking_utils, "_preprocess_mask_arguments", _rows_kept_on_copies)
    _patch(PreTrainedModel, "get_compiled_call", _slots_checked_before_compiled_steps)
    _register_continuous_batching()
