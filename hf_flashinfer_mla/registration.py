"""Registration with Transformers: the attention function, its mask function, and the load-time model check.

Transformers looks attention implementations up by name in two registries: ``AttentionInterface`` (the function
each attention module calls) and ``AttentionMaskInterface`` (the function that builds the step's mask). A name
missing from the second makes mask creation return ``None``, i.e. padding is silently lost, so both are
registered.

Transformers has no hook to validate a custom implementation against a model, and it treats every name containing
"flash" as a flash-attention kernel to import from the Hub. So ``PreTrainedModel._check_and_adjust_attn_implementation``
(which ``from_pretrained``, ``from_config`` and ``set_attn_implementation`` all go through) is wrapped once: for
``"flashinfer_mla"`` it refuses non-MLA models, hooks ``expand_kv`` and skips the Hub lookup; any other name goes
to Transformers' own check untouched. Finally ``generate()``'s default cache gets this package's latent layers.
"""

from __future__ import annotations

import functools

from transformers import AttentionInterface, DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.utils.generic import TransformersKwargs
from transformers.masking_utils import AttentionMaskInterface

from .attention import flashinfer_mla_attention_forward
from .cache import adopt_latent_layers
from .metadata import flashinfer_mla_mask, install_generate_hooks
from .models import ATTN_NAME, check_model_supported, install_latent_hook


def _checked(original):
    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        if attn_implementation != ATTN_NAME:
            return original(self, attn_implementation, is_init_check, **kwargs)
        check_model_supported(self.config)
        install_latent_hook(type(self))
        return ATTN_NAME

    _check_and_adjust_attn_implementation._flashinfer_mla_check = True
    return _check_and_adjust_attn_implementation


def _latent_cache_by_default(original):
    # generate() builds `DynamicCache(config=...)` itself; for flashinfer_mla models its full-attention layers are
    # swapped for `MLALatentLayer` (no per-step history copy). A cache the user passed is left as it is.
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # renamed in transformers 5.2x
        if (
            type(cache) is DynamicCache
            and not getattr(cache, "_is_user_defined", False)
            and self.config.get_text_config(decoder=True)._attn_implementation == ATTN_NAME
        ):
            adopt_latent_layers(cache)
        return result

    _prepare_cache_for_generation._flashinfer_mla_cache = True
    return _prepare_cache_for_generation


def register() -> None:
    """Register ``"flashinfer_mla"`` with Transformers. Importing the package does this; calling it again is a no-op."""
    AttentionInterface.register(ATTN_NAME, flashinfer_mla_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flashinfer_mla_mask)
    install_generate_hooks()  # lets the mask function plan generate()'s decode steps without a device sync
    current = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(current, "_flashinfer_mla_check", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _checked(current)
    # `from_pretrained(..., mla_backend="fa2")` hands a keyword to the config only if the config class has that
    # attribute; a class-level default of None makes the keyword land on (and be saved with) the config.
    if not hasattr(PreTrainedConfig, "mla_backend"):
        PreTrainedConfig.mla_backend = None
    # `generate(..., mla_backend=...)` forwards the keyword to every attention call, but generate() first rejects
    # keywords that are neither in forward's signature nor declared model-agnostic attention kwargs: declare it.
    if "mla_backend" not in TransformersKwargs.__optional_keys__:
        TransformersKwargs.__optional_keys__ = frozenset(TransformersKwargs.__optional_keys__ | {"mla_backend"})
    prepare = GenerationMixin._prepare_cache_for_generation
    if not getattr(prepare, "_flashinfer_mla_cache", False):
        GenerationMixin._prepare_cache_for_generation = _latent_cache_by_default(prepare)
