"""Registration with Transformers: the attention function and its mask function in Transformers' two registries,
and the table of every other place the package changes Transformers (`SEAMS`).

Transformers looks attention implementations up by name in ``AttentionInterface`` (the function each attention
module calls) and ``AttentionMaskInterface`` (the function that builds the step's mask). A name missing from the
second makes mask creation return ``None``, i.e. padding is silently lost, so both are registered.

Where Transformers offers no hook, the package wraps one of its functions (or replaces a class in one of its
tables). Each such seam is one row of `SEAMS`: the Transformers object, the attribute, the wrapper (which lives in
the module whose state it serves), the releases whose code needs it, why, the feature it serves, and the shape of
the object the wrapper relies on (its parameters, as the tested releases name them). A wrapper leaves every other
attention implementation on Transformers' own path, and is applied once (`PATCHED` marks it).

A release outside the tested ones (``supported.TESTED``) may lack an object or have it in another shape. Each seam
is checked before anything is patched (`shape_problem`): where one does not fit, its feature is recorded as
unavailable (`UNAVAILABLE`) and none of that feature's seams are installed, except at the feature's entry points,
which refuse it for flashinfer_mla models with one line (`require`), in the caller's thread. A generate() seam that
does not fit fails the import itself: every path runs on them. ``docs/design.md`` has the same table with more of
the why.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

from transformers import AttentionInterface, DynamicCache, PreTrainedConfig, PreTrainedModel, masking_utils
from transformers.generation.continuous_batching import cache as cb_cache, continuous_api, input_outputs, model_runner
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface

from . import cache, capabilities, compiled, generation, models, paged_attention, paged_cache
from .attention import flashinfer_mla_attention_forward
from .errors import TransformersVersionError
from .masks import flashinfer_mla_mask
from .models import ATTN_NAME
from .supported import refusal

PATCHED = "_flashinfer_mla_patch"  # marks the functions (and classes) this module put into Transformers

_PM, _GM, _CB = PreTrainedModel, GenerationMixin, continuous_api


# The features a seam serves. A generate() seam that does not fit fails the import (every path runs on them); a
# continuous-batching one refuses continuous batching only, where it is asked for (`Seam.entry`); the server checks
# its own patches when it starts (``serve.py``) and records them as `SERVE`.
GENERATE = "generate"
CONTINUOUS_BATCHING = "continuous batching"
SERVE = "the server"
INSTEAD = {CONTINUOUS_BATCHING: "use generate()"}  # what runs anyway where the feature cannot


class Seam(NamedTuple):
    owner: object  # a class, a module, or a dict (its entry `name` is replaced)
    name: str
    wrap: Callable  # the original -> what replaces it
    versions: str  # the Transformers releases whose code needs the seam
    why: str
    feature: str  # GENERATE or CONTINUOUS_BATCHING
    # What the wrapper relies on: the object's leading parameters as the tested releases name them (a class in a
    # table: its constructor's), or a function of the object giving what does not fit (None where all does).
    shape: tuple | Callable = ()
    adds: bool = False  # a table entry Transformers lacks, added (`wrap` gets None)
    optional: bool = False  # absent from some releases, where nothing needs it: skipped there
    entry: bool = False  # where a user asks for the feature: refuses it for flashinfer_mla models if unavailable


def _parameters(obj) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _takes(obj, names, label: str) -> str | None:
    """What of `names` (its leading parameters, in order) `obj` does not take, said as the reason; None if it does."""
    if obj is None:
        return f"{label} is missing"
    have = _parameters(obj)
    if have is None:
        return f"{label} has no signature"
    if have[: len(names)] != list(names):
        return f"{label} takes ({', '.join(have[: len(names)])}), not ({', '.join(names)})"
    return None


# The allocator classes the latent rows subclass (``paged_cache.LatentAllocator``): built with these keywords, and
# these methods overridden or called with Transformers' own arguments.
_ALLOCATOR_METHODS = {
    "__init__": ("self", "index", "config", "num_key_value_heads", "cache_dtype", "page_size", "layer_indices",
                 "allow_block_sharing"),
    "register_cache_tensor": ("self", "bytes_per_sector", "non_trash_bytes", "cache_tensor", "pool"),
    "_after_cache_tensor_init": ("self", "non_trash_bytes", "bytes_per_sector", "cache_tensor", "pool"),
    "update": ("self", "key_states", "value_states", "layer_idx", "read_index", "write_index"),
    "get_read_indices": ("self", "request_id", "past_length", "query_length"),
    "get_cache_for_block_table": ("self", "layer_idx"),
}


def _allocator_shape(cls) -> str | None:
    for method, names in _ALLOCATOR_METHODS.items():
        why = _takes(getattr(cls, method, None), names, f"{cls.__name__}.{method}")
        if why is not None:
            return why
    return None


SEAMS = (
    Seam(_PM, "_check_and_adjust_attn_implementation", models.checked_implementation, "5.24, 5.25",
         "no hook validates a custom name against a model; refuses non-MLA models, hooks expand_kv", GENERATE,
         ("self", "attn_implementation", "is_init_check")),
    Seam(_PM, "get_correct_attn_implementation", models.checked_implementation, "5.24",
         "set_attn_implementation sets sub-models through it, unchecked", GENERATE,
         ("self", "requested_attention", "is_init_check"), optional=True),
    Seam(_PM, "from_pretrained", capabilities.with_load_option, "5.24, 5.25", "takes and keeps mla_backend=",
         GENERATE, ("pretrained_model_name_or_path",)),
    Seam(_PM, "_from_config", capabilities.with_load_option, "5.24, 5.25", "the same for from_config", GENERATE,
         ("config",)),
    Seam(PreTrainedConfig, "to_dict", capabilities.load_option_not_saved, "5.24, 5.25",
         "the load option never reaches config.json", GENERATE, ("self",)),
    Seam(_GM, "_validate_model_kwargs", capabilities.generate_option_validated, "5.24, 5.25",
         "generate() refuses unknown keywords there: validates and forwards mla_backend=", GENERATE,
         ("self", "model_kwargs")),
    Seam(DynamicCache, "__init__", cache.latent_layers_for_mla, "5.24, 5.25",
         "a DynamicCache(config=...) gets latent layers, grown in place", GENERATE,
         ("self", "ddp_cache_data", "config")),
    Seam(_GM, "_prepare_cache_for_generation", generation.caches_for_mla, "5.24, 5.25",
         "marks generate()'s cache for the late stop check; packed static layers on Blackwell", GENERATE,
         ("self", "generation_config", "model_kwargs")),
    Seam(generation.DeferredStopCheck, "is_supported", generation.stop_checked_a_step_late, "5.24, 5.25",
         "Transformers reads the stop flag a step late on MPS only", GENERATE,
         ("device", "cache", "cache_is_returned", "is_assistant"), optional=True),
    Seam(_GM, "_update_model_kwargs_for_generation", generation.growing_masks, "5.24, 5.25",
         "the one place the next 2D mask is known to be this one grown: plans the next step", GENERATE,
         ("self", "outputs", "model_kwargs")),
    # (continuous batching's: a paged step's sparse layers get their mask through its `cache`, the name 5.24 gave it
    # as its MLA layers began writing the paged cache themselves; without the seam generate() plans from the mask)
    Seam(masking_utils, "_preprocess_mask_arguments", generation.rows_kept_on_copies, "5.24, 5.25",
         "its boolean copy of the 2D mask would lose the GrowingMask; a paged step's sparse layers get their mask",
         CONTINUOUS_BATCHING, ("config", "inputs_embeds", "attention_mask", "cache")),
    Seam(_PM, "get_compiled_call", compiled.slots_checked_before_compiled_steps, "5.24, 5.25",
         "a compiled step raises for a step its CUDA-graph slots cannot serve", GENERATE, ("self", "compile_config")),
    Seam(_CB.ContinuousBatchingManager, "__init__", paged_attention.manager_checked, "5.24, 5.25",
         "refuses unservable models in the caller's thread; decides CUDA graphs (and async batching with them)",
         CONTINUOUS_BATCHING, ("self", "model", "generation_config", "continuous_batching_config"), entry=True),
    Seam(_CB.ContinuousBatchingManager, "switch_to_cb_friendly_attn", paged_attention.latent_attention_kept,
         "5.24, 5.25", "would set a multimodal model whose wrapper runs eager to paged|eager, its MLA text model too",
         CONTINUOUS_BATCHING, ("self", "model")),
    Seam(_CB.ContinuousBatchingManager, "add_request", paged_attention.prompt_checked, "5.24, 5.25",
         "queues an empty prompt, answered with a neighbour's token or failed in the loop: refused, with the fix",
         CONTINUOUS_BATCHING, ("self", "input_ids")),
    Seam(_CB.ContinuousMixin, "generate_batch", paged_attention.prompts_checked, "5.24, 5.25",
         "turns an error while queueing into an empty result: empty prompts refused before the manager starts",
         CONTINUOUS_BATCHING, ("self", "inputs"), entry=True),
    Seam(_CB.ContinuousMixin, "init_continuous_batching", paged_cache.cached_manager_checked, "5.24, 5.25",
         "a kept manager is re-checked, its paged cache against the current attention", CONTINUOUS_BATCHING,
         ("self", "generation_config", "continuous_batching_config"), entry=True),
    Seam(cb_cache.PagedAttentionCache, "__init__", paged_cache.latent_paged_cache, "5.24, 5.25",
         "sizes pages from per-head K/V: built with a LatentSizing view", CONTINUOUS_BATCHING, ("self", "config")),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, "full_attention", paged_cache.latent_or, "5.24, 5.25",
         "the full-attention allocator builds latent rows for a LatentSizing config", CONTINUOUS_BATCHING,
         _allocator_shape),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, "sliding_attention", paged_cache.latent_or, "5.24, 5.25",
         "the same for sliding-window layers (a DSA model's, dots3's): their ring of pages holds latent rows",
         CONTINUOUS_BATCHING, _allocator_shape),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, paged_cache.INDEXED_ATTENTION, paged_cache.indexed_as_full, "5.24, 5.25",
         "its checks know no allocator for DSA layers, which page as full attention (LatentSizing)",
         CONTINUOUS_BATCHING, adds=True),
    Seam(cb_cache, "MLACacheAllocator", paged_cache.latent_or, "5.25",
         "5.25 picks it by name for any config with kv_lora_rank, before the table", CONTINUOUS_BATCHING,
         _ALLOCATOR_METHODS["__init__"][1:], optional=True),
    Seam(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", paged_attention.paged_steps, "5.24, 5.25",
         "hands the step's host lengths to the attention, so planning never syncs; reloads graph slots",
         CONTINUOUS_BATCHING, ("self", "requests_in_batch", "logits_processors", "use_decode_fast_path", "num_q_tokens",
                               "max_kv_read", "use_padding")),
    Seam(model_runner.ModelRunner, "_get_forward_fn", paged_attention.graphs_for_graphed_steps, "5.24, 5.25",
         "graphs every padded varlen step: only steps whose metadata is reloaded before replay are captured",
         CONTINUOUS_BATCHING, ("self", "use_block_table")),
)


# What `register` found: the features it could not install, each with the reason of its first seam that did not fit.
UNAVAILABLE: dict[str, str] = {}

_TABLES = {id(cb_cache.ATTN_TYPE_TO_ALLOCATOR): "continuous_batching.cache.ATTN_TYPE_TO_ALLOCATOR"}


def _where(seam: Seam) -> str:
    owner = seam.owner
    if isinstance(owner, dict):
        return f"{_TABLES.get(id(owner), 'a table')}[{seam.name!r}]"
    name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
    return f"{name.removeprefix('transformers.')}.{seam.name}"


def _current(seam: Seam):
    return seam.owner.get(seam.name) if isinstance(seam.owner, dict) else getattr(seam.owner, seam.name, None)


def shape_problem(seam: Seam) -> str | None:
    """Why `seam` cannot be installed on this Transformers, None where it can: its object missing (unless the seam
    is optional or adds it), or not of the shape the wrapper relies on (`Seam.shape`). Its own wrapper, already in
    place, fits."""
    current = _current(seam)
    if current is None:
        return None if seam.adds or seam.optional else f"{_where(seam)} is missing"
    if getattr(current, PATCHED, False) or not seam.shape:
        return None
    if callable(seam.shape):
        return seam.shape(current)
    return _takes(current, seam.shape, _where(seam))


def require(feature: str, instead: str | None = None) -> None:
    """Raise `TransformersVersionError`, one line naming the installed Transformers and the fix (and `instead`, what
    runs anyway), where `feature` cannot run on it."""
    why = UNAVAILABLE.get(feature)
    if why is not None:
        raise TransformersVersionError(refusal(f"{feature} with {ATTN_NAME}", why,
                                               INSTEAD.get(feature, "") if instead is None else instead))


def refused_where_unavailable(feature: str, original: Callable) -> Callable:
    """What an entry point of an unavailable `feature` becomes: it refuses flashinfer_mla models (the model is
    `self` or the first argument), and runs Transformers' own code for any other."""

    @functools.wraps(original)
    def refused(self, *args, **kwargs):
        model = self if isinstance(self, PreTrainedModel) else (args[0] if args else kwargs.get("model"))
        config = getattr(model, "config", None)
        if config is not None and config.get_text_config(decoder=True)._attn_implementation == ATTN_NAME:
            require(feature)
        return original(self, *args, **kwargs)

    return refused


def _patch(seam: Seam, wrapped) -> None:
    """Put `wrapped` at ``owner.name`` (or ``owner[name]``), marked as this package's."""
    setattr(getattr(wrapped, "__func__", wrapped), PATCHED, True)  # (a classmethod or staticmethod: on its function)
    if isinstance(seam.owner, dict):
        seam.owner[seam.name] = wrapped
    else:
        setattr(seam.owner, seam.name, wrapped)


def register() -> None:
    """Register ``"flashinfer_mla"`` with Transformers. Importing the package does this; calling it again is a no-op.

    Every seam is checked and its wrapper built before anything is patched: a feature with a seam that does not fit
    gets none of its seams (its entry points refuse it instead), and a generate() seam that does not fit raises
    `TransformersVersionError` with Transformers untouched."""
    wrappers = {}
    for i, seam in enumerate(SEAMS):
        current = _current(seam)
        why = shape_problem(seam)
        if why is None and (current is not None or seam.adds) and not getattr(current, PATCHED, False):
            try:
                wrappers[i] = seam.wrap(current)
            except Exception as error:  # noqa: BLE001  (a wrapper that cannot take this release's object)
                why = f"{_where(seam)} cannot be wrapped ({type(error).__name__}: {error})"
        if why is not None:
            UNAVAILABLE.setdefault(seam.feature, why)
    if GENERATE in UNAVAILABLE:
        raise TransformersVersionError(refusal("hf_flashinfer_mla", UNAVAILABLE[GENERATE]))
    AttentionInterface.register(ATTN_NAME, flashinfer_mla_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flashinfer_mla_mask)
    for i, seam in enumerate(SEAMS):
        current = _current(seam)
        if seam.feature not in UNAVAILABLE:
            if i in wrappers:
                _patch(seam, wrappers[i])
        elif seam.entry and current is not None and not getattr(current, PATCHED, False):
            _patch(seam, refused_where_unavailable(seam.feature, current))
