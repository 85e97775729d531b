"""Which Transformers models can run ``flashinfer_mla``, and the two hooks this package puts into them.

Every MLA attention class in Transformers, dense or sparse (DSA), caches the compressed latent and only afterwards calls
``self.expand_kv(kv_nope, k_rot)``, which pushes the *whole* cached history through ``kv_b_proj`` on every step.
When a model runs ``flashinfer_mla`` that call is made to hand back the latent unchanged; the attention function
(``attention.py``) then decides per step whether to expand it once (prefill) or to attend over it directly
(absorbed decode). With any other attention implementation the original ``expand_kv`` runs untouched.

The second hook is on the class's ``_apply`` (what ``.to()``, ``.half()``, ``.cuda()`` run): it drops the absorbed
views of the layer's ``kv_b_proj`` weight (``absorption._views``), which would otherwise keep the weight's old memory
alive until the layer's next decode, as sdpa does not (a DeepSeek-V3 moved off its GPU would leave 2 GiB behind).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.modeling_layers import MtpModel
from transformers.utils import logging

from .absorption import forget_views
from .capabilities import ATTN_NAME, requested_backend
from .errors import UnsupportedModelError

logger = logging.get_logger("hf_flashinfer_mla")

# Dense MLA model types: their attention classes call `expand_kv` and then the attention interface with the
# standard arguments, so absorbing `kv_b_proj` into the query is exact.
DENSE_MLA_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "minicpm3",
    "mistral4",
    "longcat_flash",
    "youtu",
    "kimi_linear",
    "axk1",
    "bailing_hybrid",
    "sarvam_mla",  # (a config of its own; Transformers builds DeepseekV3ForCausalLM for it)
)

# MLA with DeepSeek Sparse Attention (DSA): an indexer picks `index_topk` cached positions per query token after
# `expand_kv`, and the attention interface receives them as `indices=` (eager and sdpa get them folded into the mask
# instead). The attention function decodes over the selected latent rows and folds them into the prefill mask
# itself. Listed by the type of the model whose attention they are (a multimodal model's text model type).
SPARSE_MLA_MODEL_TYPES = (
    "deepseek_v32",
    "glm_moe_dsa",
    "glm5_next_text",
    "hy_v4",
    "hy_v4_vl_text",
    "axk2",
    "mistral_large4_text",
    "dots3_note_text",
)
SUPPORTED_MODEL_TYPES = DENSE_MLA_MODEL_TYPES + SPARSE_MLA_MODEL_TYPES

# The names users pass, and the ones messages use: the "model_type" of a checkpoint's config.json. A multimodal
# checkpoint names itself, not its MLA text model (the types above name the attention's model), and Kimi-K2.5's say
# `kimi_k25` around a `deepseek_v3` text model.
_CHECKPOINT_TYPE_OF_TEXT_TYPE = {
    "glm5_next_text": "glm5_next",
    "hy_v4_vl_text": "hy_v4_vl",
    "mistral_large4_text": "mistral_large4",
    "dots3_note_text": "dots3_note",
}
CHECKPOINT_MODEL_TYPES = (*(_CHECKPOINT_TYPE_OF_TEXT_TYPE.get(t, t) for t in SUPPORTED_MODEL_TYPES), "kimi_k25")


PER_LAYER = "per layer"  # (`global_value`: a value the model's layers do not share)


def global_value(config, name: str):
    """`config`'s one value of `name`: None where it has none, `PER_LAYER` where its layers differ (dots3's
    sliding-window layers have a latent width of their own, and Transformers refuses to read one value for all)."""
    from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

    try:
        return getattr(config, name, None)
    except AmbiguousGlobalPerLayerAttributeError:
        return PER_LAYER


def layer_config(config, layer: int):
    """Layer `layer`'s config: its own where the model's layers differ (``per_layer_config``), else `config`."""
    return config.per_layer_config[layer] if getattr(config, "is_heterogeneous", False) else config


def checkpoint_model_type(model_type: str) -> str:
    """The name a checkpoint's config.json gives the model whose MLA text model has type `model_type`."""
    return _CHECKPOINT_TYPE_OF_TEXT_TYPE.get(model_type, model_type)


def _supported_list() -> str:
    return ", ".join(CHECKPOINT_MODEL_TYPES)


def check_model_supported(config):
    """The config the model's MLA attention is built from, or `UnsupportedModelError` saying why there is none.

    That is `config` itself for a causal LM, and the decoder text config (``config.get_text_config(decoder=True)``)
    for a multimodal model whose text model is an MLA model (Kimi-K2.5: ``kimi_k25`` around ``deepseek_v3``).
    Called at load time (``from_pretrained``/``from_config``/``set_attn_implementation``), so an unsupported model
    fails before any weight is read rather than giving a wrong answer later.
    """
    text = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    text_type = text.get("model_type") if isinstance(text, dict) else getattr(text, "model_type", None)
    what = f'model_type "{model_type}"' if text is config else f'model_type "{model_type}" (text model "{text_type}")'
    if text_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f'attn_implementation="{ATTN_NAME}" needs a Multi-head Latent Attention model; {what} is not one. '
            f'Load it with attn_implementation="sdpa" (or "eager"). Supported model types: {_supported_list()}.'
        )
    if isinstance(text, dict):
        raise UnsupportedModelError(
            f"the text_config of {what} is a plain dict, not a PreTrainedConfig, so its text model's attention cannot "
            f"be set apart from the rest of the model; convert it first (config.text_config = "
            f"AutoConfig.for_model(**config.text_config)) and load again."
        )
    return text


def is_mla_attention(module: nn.Module) -> bool:
    """True for an MLA attention module of a supported model (it owns `kv_b_proj` and `expand_kv`), dense or sparse.
    (Read off the module's dict and class: every layer of every step asks, and ``hasattr`` on a submodule goes
    through ``nn.Module.__getattr__``.)"""
    return "kv_b_proj" in module._modules and hasattr(type(module), "expand_kv")


def original_expand_kv(module: nn.Module):
    """The model's own `expand_kv`, bound to `module`, bypassing this package's hook (used for prefill)."""
    fn = type(module).expand_kv
    return functools.partial(getattr(fn, "__wrapped__", fn), module)


def attention_with_sinks(module, query, key_states, value_states, attention_mask, dropout, scaling):
    """A layer with attention sinks over its expanded keys and values (prefill): SDPA has no sinks, so this runs the
    model's own eager attention (HY-V4's ``eager_attention_forward``, which reads ``module.sinks``), with the mask
    made additive as it expects."""
    eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(f"{type(module).__name__} passes attention sinks (s_aux) but its modeling module "
                                    "has no eager_attention_forward to prefill them with; use attn_implementation="
                                    '"eager"')
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key_states, value_states, attention_mask, scaling=scaling, dropout=dropout)


def _latent_passthrough(expand_kv):
    @functools.wraps(expand_kv)
    def expand_kv_or_pass_latent(self, kv_nope, k_rot):
        # Under flashinfer_mla the attention function receives the cached latent itself (key=kv_nope,
        # value=k_rot) and expands it only where it has to (prefill). Other implementations are untouched.
        if self.config._attn_implementation == ATTN_NAME:
            return kv_nope, k_rot
        return expand_kv(self, kv_nope, k_rot)

    expand_kv_or_pass_latent._flashinfer_mla_hook = True
    return expand_kv_or_pass_latent


def _views_forgotten(apply):
    @functools.wraps(apply)
    def _apply(self, fn, *args, **kwargs):
        forget_views(self)  # (the weight is about to get new storage: see the module's docstring)
        return apply(self, fn, *args, **kwargs)

    _apply._flashinfer_mla_hook = True
    return _apply


def install_latent_hook(model_class: type) -> list[type]:
    """Wrap `expand_kv` and `_apply` of every MLA attention class in `model_class`'s modeling module (idempotent).

    Returns the attention classes that carry the hooks.
    """
    module = importlib.import_module(model_class.__module__)
    hooked = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if not (issubclass(cls, nn.Module) and "expand_kv" in vars(cls)):
            continue
        if not getattr(cls.expand_kv, "_flashinfer_mla_hook", False):
            cls.expand_kv = _latent_passthrough(cls.expand_kv)
        if not getattr(cls._apply, "_flashinfer_mla_hook", False):
            cls._apply = _views_forgotten(cls._apply)
        hooked.append(cls)
    if not hooked:
        raise UnsupportedModelError(
            f"{model_class.__name__} (module {model_class.__module__}) defines no MLA attention class with "
            f"`expand_kv`: the model's remote code (trust_remote_code) copies an older attention class; load it "
            f"without remote code. "
            f"Supported model types: {_supported_list()}."
        )
    return hooked


# ------------------------------------------------------------------------------------------------------------------
# Seam (``registration.py``): Transformers has no hook to validate a custom attention name against a model
# ------------------------------------------------------------------------------------------------------------------
def _text_config_key(config, text_config) -> str:
    return next((key for key in config.sub_configs if getattr(config, key, None) is text_config), "text_config")


def _adopt(model, is_init_check: bool, original) -> str:
    """The attention implementation `model` gets when ``"flashinfer_mla"`` is asked for, or an error saying why not.

    A causal LM over MLA (dense or sparse) gets it (with its ``expand_kv`` hooked). A multimodal model whose text
    model is MLA gets it on the text model only: at load time the name, which Transformers has spread over every
    sub-config, is kept on the text config and taken off the others (vision towers and the like get Transformers'
    default, as does the wrapper model itself); the text model's own check then hooks it. After loading, Transformers would hand
    the name to every sub-model unchecked, so there the text model must be named explicitly.
    """
    text_config = check_model_supported(model.config)
    requested_backend(None, text_config)  # an unknown $HF_FLASHINFER_MLA_BACKEND fails at load, not at the first step
    if text_config is model.config:
        if isinstance(model, MtpModel):
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


def checked_implementation(original):
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
