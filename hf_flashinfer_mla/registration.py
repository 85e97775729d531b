"""Registration with Transformers: the attention function and its mask function in Transformers' two registries,
and the table of every other place the package changes Transformers (`SEAMS`).

Transformers looks attention implementations up by name in ``AttentionInterface`` (the function each attention
module calls) and ``AttentionMaskInterface`` (the function that builds the step's mask). A name missing from the
second makes mask creation return ``None``, i.e. padding is silently lost, so both are registered.

Where Transformers offers no hook, the package wraps one of its functions (or replaces a class in one of its
tables). Each such seam is one row of `SEAMS`: the Transformers object, the attribute, the wrapper (which lives in
the module whose state it serves), the releases whose code needs it, and why. A wrapper leaves every other
attention implementation on Transformers' own path, and is applied once (`PATCHED` marks it); a seam whose object
a release lacks is skipped. ``docs/design.md`` has the same table with more of the why.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from transformers import AttentionInterface, DynamicCache, PreTrainedConfig, PreTrainedModel, masking_utils
from transformers.generation.continuous_batching import cache as cb_cache, continuous_api, input_outputs, model_runner
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface

from . import cache, capabilities, compiled, generation, models, paged_attention, paged_cache
from .attention import flashinfer_mla_attention_forward
from .masks import flashinfer_mla_mask
from .models import ATTN_NAME

PATCHED = "_flashinfer_mla_patch"  # marks the functions (and classes) this module put into Transformers

_PM, _GM, _CB = PreTrainedModel, GenerationMixin, continuous_api


class Seam(NamedTuple):
    owner: object  # a class, a module, or a dict (its entry `name` is replaced)
    name: str
    wrap: Callable  # the original -> what replaces it
    versions: str  # the Transformers releases whose code needs the seam
    why: str
    adds: bool = False  # a table entry Transformers lacks, added (`wrap` gets None)


SEAMS = (
    Seam(_PM, "_check_and_adjust_attn_implementation", models.checked_implementation, "5.24, 5.25",
         "no hook validates a custom name against a model; refuses non-MLA models, hooks expand_kv"),
    Seam(_PM, "get_correct_attn_implementation", models.checked_implementation, "5.24",
         "set_attn_implementation sets sub-models through it, unchecked"),
    Seam(_PM, "from_pretrained", capabilities.with_load_option, "5.24, 5.25", "takes and keeps mla_backend="),
    Seam(_PM, "_from_config", capabilities.with_load_option, "5.24, 5.25", "the same for from_config"),
    Seam(PreTrainedConfig, "to_dict", capabilities.load_option_not_saved, "5.24, 5.25",
         "the load option never reaches config.json"),
    Seam(_GM, "_validate_model_kwargs", capabilities.generate_option_validated, "5.24, 5.25",
         "generate() refuses unknown keywords there: validates and forwards mla_backend="),
    Seam(DynamicCache, "__init__", cache.latent_layers_for_mla, "5.24, 5.25",
         "a DynamicCache(config=...) gets latent layers, grown in place"),
    Seam(_GM, "_prepare_cache_for_generation", generation.caches_for_mla, "5.24, 5.25",
         "marks generate()'s cache for the late stop check; packed static layers on Blackwell"),
    Seam(generation.DeferredStopCheck, "is_supported", generation.stop_checked_a_step_late, "5.24, 5.25",
         "Transformers reads the stop flag a step late on MPS only"),
    Seam(_GM, "_update_model_kwargs_for_generation", generation.growing_masks, "5.24, 5.25",
         "the one place the next 2D mask is known to be this one grown: plans the next step"),
    Seam(masking_utils, "_preprocess_mask_arguments", generation.rows_kept_on_copies, "5.24, 5.25",
         "its boolean copy of the 2D mask would lose the GrowingMask"),
    Seam(_PM, "get_compiled_call", compiled.slots_checked_before_compiled_steps, "5.24, 5.25",
         "a compiled step raises for a step its CUDA-graph slots cannot serve"),
    Seam(_CB.ContinuousBatchingManager, "__init__", paged_attention.manager_checked, "5.24, 5.25",
         "refuses unservable models in the caller's thread; decides CUDA graphs; async batching off"),
    Seam(_CB.ContinuousBatchingManager, "switch_to_cb_friendly_attn", paged_attention.latent_attention_kept,
         "5.24, 5.25", "would set a multimodal model whose wrapper runs eager to paged|eager, its MLA text model too"),
    Seam(_CB.ContinuousBatchingManager, "add_request", paged_attention.prompt_checked, "5.24, 5.25",
         "queues an empty prompt, answered with a neighbour's token or failed in the loop: refused, with the fix"),
    Seam(_CB.ContinuousMixin, "generate_batch", paged_attention.prompts_checked, "5.24, 5.25",
         "turns an error while queueing into an empty result: empty prompts refused before the manager starts"),
    Seam(_CB.ContinuousMixin, "init_continuous_batching", paged_cache.cached_manager_checked, "5.24, 5.25",
         "a kept manager is re-checked, its paged cache against the current attention"),
    Seam(cb_cache.PagedAttentionCache, "__init__", paged_cache.latent_paged_cache, "5.24, 5.25",
         "sizes pages from per-head K/V: built with a LatentSizing view"),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, "full_attention", paged_cache.latent_or, "5.24, 5.25",
         "the full-attention allocator builds latent rows for a LatentSizing config"),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, "sliding_attention", paged_cache.latent_or, "5.24, 5.25",
         "the same for sliding-window layers (a DSA model's, dots3's): their ring of pages holds latent rows"),
    Seam(cb_cache.ATTN_TYPE_TO_ALLOCATOR, paged_cache.INDEXED_ATTENTION, paged_cache.indexed_as_full, "5.24, 5.25",
         "its checks know no allocator for DSA layers, which page as full attention (LatentSizing)", adds=True),
    Seam(cb_cache, "MLACacheAllocator", paged_cache.latent_or, "5.25",
         "5.25 picks it by name for any config with kv_lora_rank, before the table"),
    Seam(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", paged_attention.paged_steps, "5.24, 5.25",
         "hands the step's host lengths to the attention, so planning never syncs; reloads graph slots"),
    Seam(model_runner.ModelRunner, "_get_forward_fn", paged_attention.graphs_for_graphed_steps, "5.24, 5.25",
         "graphs every padded varlen step: only steps whose metadata is reloaded before replay are captured"),
)


def _patch(seam: Seam) -> None:
    """Replace ``owner.name`` (or ``owner[name]``) by ``wrap(original)``, once; skipped where the release lacks it."""
    table = isinstance(seam.owner, dict)
    current = seam.owner.get(seam.name) if table else getattr(seam.owner, seam.name, None)
    if seam.owner is None or (current is None and not seam.adds) or getattr(current, PATCHED, False):
        return
    wrapped = seam.wrap(current)
    setattr(getattr(wrapped, "__func__", wrapped), PATCHED, True)  # (a classmethod or staticmethod: on its function)
    if table:
        seam.owner[seam.name] = wrapped
    else:
        setattr(seam.owner, seam.name, wrapped)


def register() -> None:
    """Register ``"flashinfer_mla"`` with Transformers. Importing the package does this; calling it again is a no-op."""
    AttentionInterface.register(ATTN_NAME, flashinfer_mla_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flashinfer_mla_mask)
    for seam in SEAMS:
        _patch(seam)
