"""A dynamic cache for the MLA latent that grows in place instead of concatenating.

Transformers' ``DynamicLayer.update`` concatenates, i.e. copies the whole history of every layer on every decode
step: for a long context that copy costs more memory traffic than the attention itself. `MLALatentLayer` keeps
the latent in preallocated buffers, writes each step's new tokens into the next free rows, and hands Transformers
views of the filled part; when full it grows geometrically (1.5x), so a token is copied O(1) times on average.

The layout is chosen for the kernel that will read it, from the device, at the first allocation:

* split (Hopper, Ampere, CPU): the latent ``[batch, 1, capacity, kv_lora_rank]`` and the rotary key ``[batch, 1,
  capacity, rope]`` in two buffers, which FlashInfer's fa3/fa2 read in place (as fast as the packed layout:
  BENCHMARKS.md, "One layer's decode kernel");
* packed (Blackwell, SM100/SM103): both in one ``[batch, 1, capacity, kv_lora_rank + rope]`` buffer, the paged
  layout trtllm-gen reads (``trtllm.packed_pages``); the capacity is kept a multiple of its page size.

Every ``DynamicCache(config=...)`` built for a ``flashinfer_mla`` model uses it (``registration.py`` swaps its
full-attention layers): the one ``generate()`` builds, the one the model's forward builds when called without a
cache, one of the user's own. `MLALatentCache` is the same thing with options (layout, FP8), to pass as ``cache=``.

FP8 latent (``MLALatentCache(config, dtype=torch.float8_e4m3fn)``): the latent and the rotary key are stored as
``float8_e4m3fn`` with one scale each per layer (``stored = value / scale``), half the bytes of bf16, so twice the
context fits and a decode step reads half as much. The scales are fixed at the layer's first update (the prefill):
given by the caller (``scales=``, e.g. a checkpoint's calibrated ``kv_scale``), or measured there as
``FP8_HEADROOM * amax / 448`` so later tokens up to twice the prefill's largest value are represented; anything
larger saturates to +-448 * scale (never inf or NaN). The views handed to Transformers are the FP8 storage itself;
`latent_scales` reads their scales, which the attention needs: fa3/fa2 on Hopper read the FP8 rows in place, every
other reader (prefill, the reference backend, other GPUs) dequantizes what it reads (`dequantize_latent`).
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, StaticLayer

from . import capabilities
from .errors import CacheLayoutError
from .models import ATTN_NAME, PER_LAYER, global_value

ROUND_TOKENS = 256  # capacity granularity: a multiple of every trtllm-gen page size (32, 64)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_HEADROOM = 2.0  # measured scales leave room for values up to twice the prefill's largest
_SCALES_ATTR = "_flashinfer_mla_scales"


@dataclass(frozen=True)
class LatentScales:
    """One layer's FP8 dequantization scales: value = stored * scale, for the latent and the rotary key."""

    latent: float
    rope: float


def latent_scales(kv_latent: torch.Tensor) -> LatentScales | None:
    """The scales of an FP8 latent view handed out by `MLALatentLayer`, None for any other tensor."""
    return getattr(kv_latent, _SCALES_ATTR, None)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as float8_e4m3fn, saturating at +-448 (a plain cast would turn overflow into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_latent(kv_latent: torch.Tensor, k_rot: torch.Tensor, dtype: torch.dtype):
    """The latent views in `dtype`: FP8 views are dequantized with their scales, others returned unchanged."""
    scales = latent_scales(kv_latent)
    if kv_latent.dtype != FP8:
        return kv_latent, k_rot
    if scales is None:
        raise ValueError(
            "an FP8 latent reached flashinfer_mla without its scales; FP8 caches must be "
            "hf_flashinfer_mla.MLALatentCache(config, dtype=torch.float8_e4m3fn)"
        )
    return kv_latent.to(dtype) * scales.latent, k_rot.to(dtype) * scales.rope


def packed_layout_for(device: torch.device) -> bool:
    """Whether the kernel that decodes on `device` reads packed rows (trtllm-gen on Blackwell)."""
    return capabilities.device_capability(device) in capabilities.BLACKWELL


class MLALatentLayer(DynamicLayer):
    """One layer's latent (``keys``: ``[B, 1, S, kv_lora_rank]``, ``values``: ``[B, 1, S, rope]``), growing in place.

    ``packed=None`` (the default) picks the layout from the device at the first update (see the module docstring);
    True or False forces packed rows or split buffers. ``dtype=torch.float8_e4m3fn`` stores the latent in FP8 with
    per-layer `LatentScales` (``scales``, or measured from the first update); None stores what the model computes.
    """

    def __init__(self, packed: bool | None = None, dtype: torch.dtype | None = None,
                 scales: LatentScales | None = None):
        super().__init__()
        if dtype not in (None, FP8):
            raise ValueError(f"MLALatentLayer stores the model's own dtype (dtype=None) or {FP8}, not {dtype}")
        if scales is not None and dtype != FP8:
            raise ValueError("scales= sets the FP8 latent's scales: pass dtype=torch.float8_e4m3fn with it")
        if scales is not None and not all(math.isfinite(v) and v > 0 for v in (scales.latent, scales.rope)):
            raise ValueError(f"FP8 latent scales must be finite and positive, got {scales}")
        self.packed_request = packed
        self.storage_dtype = dtype
        self.given_scales = self.scales = scales  # (measured ones are measured again after `reset`)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)  # (as DynamicLayer's, until the
        self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)  # first update)
        self._buffers: tuple[torch.Tensor, ...] | None = None  # (packed,) or (latent, rope)
        self._length = 0
        self._handed: list[weakref.ref] = []  # views handed out since the buffers were allocated (`_in_place_ok`)
        self._rank = key_states.shape[-1]
        self.packed = self.packed_request if self.packed_request is not None else packed_layout_for(self.device)
        if self.storage_dtype == FP8 and self.scales is None:
            # Fixed from the first update (the prefill): one host read per layer, outside the decode loop. (A layer
            # without rope, NoPE, has an empty rope part: its scale is never used.)
            amax = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in (key_states, value_states)])
            amax = amax.float().clamp_min(1e-6).tolist()
            self.scales = LatentScales(*(FP8_HEADROOM * a / FP8_MAX for a in amax))
        self.is_initialized = True

    @property
    def _buffer(self) -> torch.Tensor | None:
        """The packed ``[B, 1, capacity, L + R]`` buffer (packed layout only)."""
        buffers = getattr(self, "_buffers", None)
        return buffers[0] if buffers and self.packed else None

    @property
    def capacity(self) -> int:
        return self._buffers[0].shape[2] if self.is_initialized and self._buffers else 0

    def _refresh_views(self) -> None:
        if self.packed:
            filled = self._buffers[0][:, :, : self._length]
            self.keys, self.values = filled[..., : self._rank], filled[..., self._rank :]
        else:
            self.keys, self.values = (b[:, :, : self._length] for b in self._buffers)
        if not torch.compiler.is_compiling():
            self._handed = [r for r in self._handed if r() is not None] + [weakref.ref(self.keys),
                                                                            weakref.ref(self.values)]
        if self.storage_dtype == FP8:
            setattr(self.keys, _SCALES_ATTR, self.scales)
            setattr(self.values, _SCALES_ATTR, self.scales)

    def __getstate__(self) -> dict:
        # (copies, pickles and torch.save hold no weak references: the views a copy hands out are its own)
        return {**self.__dict__, "_handed": []}

    def _in_place_ok(self, states: torch.Tensor) -> bool:
        """Whether this update may write into the buffers in place. Transformers' DynamicLayer never writes into a
        tensor it handed out (it concatenates into new ones), and code relies on that: autograd, which saved views
        of the buffers for a backward through several forwards; inference-mode buffers, which cannot be written
        outside inference mode; a view taken before a `crop` (a snapshot to restore), whose rows the next update
        would overwrite. Those updates copy the kept rows into new buffers first, as DynamicLayer's concatenation
        copies them; generate()'s steps write in place."""
        buffer = self._buffers[0]
        if buffer.requires_grad or (states.requires_grad and torch.is_grad_enabled()):
            return False
        if buffer.is_inference() and not torch.is_inference_mode_enabled():
            return False
        return not any(v is not None and v.shape[-2] > self._length for v in (r() for r in self._handed))

    def _grow(self, batch: int, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        old = self._buffers
        self._handed = []
        # Headroom on the first allocation (a prompt of exactly 256k tokens must not copy itself at the first
        # decode step), then 1.5x growth: O(1) copies per token with a lower peak than doubling.
        capacity = needed + ROUND_TOKENS if old is None else max(needed, old[0].shape[2] * 3 // 2)
        if old is not None and needed <= old[0].shape[2]:  # (a copy to write into: the capacity is kept)
            capacity = old[0].shape[2]
        capacity = -(-capacity // ROUND_TOKENS) * ROUND_TOKENS
        widths = [like_k.shape[-1] + like_v.shape[-1]] if self.packed else [like_k.shape[-1], like_v.shape[-1]]
        dtype = self._promoted(like_k)
        new = tuple(torch.empty((batch, 1, capacity, w), dtype=dtype, device=like_k.device) for w in widths)
        for i, dst in enumerate(new):
            kept = self._length if old is not None else 0
            if kept:
                dst[:, :, :kept] = old[i][:, :, :kept]
            dst[:, :, kept:].zero_()  # never hand out uninitialised memory, even past the valid rows
        self._buffers = new

    def _promoted(self, states: torch.Tensor) -> torch.dtype:
        """The buffers' dtype once `states` join them: FP8 storage stays FP8; otherwise the type promotion
        DynamicLayer's concatenation applies (float32 rows continued by a model moved to float64 become float64)."""
        if self.storage_dtype is not None:
            return self.storage_dtype
        return states.dtype if self._buffers is None else torch.promote_types(self._buffers[0].dtype, states.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        needed = self._length + n
        if self._buffers is not None and key_states.shape[0] != self._buffers[0].shape[0]:
            raise CacheLayoutError(  # (a growth would broadcast the old rows into the new batch, silently)
                f"the cache holds {self._buffers[0].shape[0]} sequences and this forward brings {key_states.shape[0]}"
                ": reorder or repeat the cache first (batch_select_indices, batch_repeat_interleave), or start a "
                "new one")
        if (self._buffers is None or needed > self.capacity or not self._in_place_ok(key_states)
                or self._promoted(key_states) != self._buffers[0].dtype):
            self._grow(key_states.shape[0], needed, key_states, value_states)
        if self.storage_dtype == FP8:
            key_states = quantize_fp8(key_states, self.scales.latent)
            value_states = quantize_fp8(value_states, self.scales.rope)
        if self.packed:
            rows = self._buffers[0][:, :, self._length : needed]
            rows[..., : self._rank] = key_states
            rows[..., self._rank :] = value_states
        else:
            self._buffers[0][:, :, self._length : needed] = key_states
            self._buffers[1][:, :, self._length : needed] = value_states
        self._length = needed
        self._refresh_views()
        return self.keys, self.values

    def reserve(self, tokens: int) -> None:
        """Grow the capacity to at least `tokens` rows per sequence now (one copy of what is cached), so that a
        known final length (prompt + max_new_tokens) never regrows. Needs one update first (batch, widths)."""
        if not self.is_initialized or self._buffers is None:
            raise ValueError("reserve() needs the layer's first update (it fixes batch size and widths)")
        if tokens > self.capacity:
            k, v = self.keys[:, :, :0], self.values[:, :, :0]
            self._grow(self._buffers[0].shape[0], tokens, k, v)
            self._refresh_views()

    # Transformers' batch and length operations, applied to the buffer rather than to the views.
    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized and self._buffers is not None:
            self._length = max(self._length + tokens_to_remove, 0)
            self._refresh_views()

    def _map_buffer(self, fn) -> None:
        if self.is_initialized and self._buffers is not None:
            self._buffers, self._handed = tuple(fn(b) for b in self._buffers), []
            self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_buffer(lambda b: b.index_select(0, beam_idx.to(b.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_buffer(lambda b: b.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_buffer(lambda b: b[indices])

    def offload(self):
        self._map_buffer(lambda b: b.to("cpu", non_blocking=True))

    def prefetch(self):
        self._map_buffer(lambda b: b.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self._buffers, self._length = None, 0
        self.keys = self.values = None
        self.scales = self.given_scales  # measured scales belong to the prompt they were measured on
        self.is_initialized = False


class MLAIndexedLayer(MLALatentLayer):
    """`MLALatentLayer` of a sparse (DSA) layer: it also keeps the indexer's keys (``[B, S, index_head_dim]``), grown
    in place beside the latent (Transformers' `DynamicIndexedLayer` concatenates both every step). The indexer
    writes the keys of the tokens the layer's `update` has just added, so they take the same rows; layers that reuse
    another layer's selection never call `update_indexer` and allocate nothing for it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._index_keys: torch.Tensor | None = None  # [B, 1, capacity, index_head_dim]
        self._index_beside: torch.Tensor | None = None  # the latent buffer they were allocated beside
        self.indexer_keys = self.indexer_position_ids = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        n = indexer_key_states.shape[1]
        if n > self._length:
            raise CacheLayoutError("update_indexer() wrote more tokens than the layer's update() cached")
        if self._index_keys is None or self._index_beside is not self._buffers[0]:
            # (the latent has new buffers: grown, or copied rather than written in place, see `_in_place_ok`)
            self._index_keys, self._index_beside = self._grown(self._index_keys, indexer_key_states), self._buffers[0]
        self._index_keys[:, 0, self._length - n : self._length] = indexer_key_states
        self._hand_index_keys()
        return self.indexer_keys

    def _hand_index_keys(self) -> None:
        # (a handed-out view, as the latent's: `_in_place_ok` then copies rather than overwrite rows it covers)
        self.indexer_keys = self._index_keys[:, 0, : self._length]
        if not torch.compiler.is_compiling():
            self._handed.append(weakref.ref(self.indexer_keys))

    def _grown(self, old, like):
        new = like.new_zeros((self._buffers[0].shape[0], 1, self.capacity, like.shape[-1]))
        if old is not None:
            kept = min(old.shape[2], self._length)
            new[:, :, :kept] = old[:, :, :kept]
        return new

    def _refresh_views(self) -> None:
        super()._refresh_views()
        if getattr(self, "_index_keys", None) is not None:
            self._hand_index_keys()

    def _map_buffer(self, fn) -> None:
        if self._index_keys is not None:
            self._index_keys = fn(self._index_keys)
        super()._map_buffer(fn)
        self._index_beside = self._buffers[0] if self._buffers is not None else None

    def reset(self) -> None:
        super().reset()
        self._index_keys = self._index_beside = self.indexer_keys = None


class MLAStaticLayer(StaticLayer):
    """A `StaticLayer` whose latent and rotary key share one packed ``[B, 1, capacity, L + R]`` buffer (the
    capacity rounded up to `ROUND_TOKENS`): the paged layout trtllm-gen reads, so that ``generate(...,
    cache_implementation="static")``'s CUDA graphs run trtllm-gen on Blackwell. ``generate()`` builds its static
    cache with these layers for ``flashinfer_mla`` models on SM100/SM103 (``generation.py``)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, rank = key_states.device, key_states.shape[-1]
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = rank, value_states.shape[-1]
        capacity = -(-self.max_cache_len // ROUND_TOKENS) * ROUND_TOKENS
        self.packed = torch.zeros((self.batch_size, 1, capacity, rank + self.v_head_dim), dtype=key_states.dtype,
                                  device=self.device)
        self.keys = self.packed[:, :, : self.max_cache_len, :rank]
        self.values = self.packed[:, :, : self.max_cache_len, rank:]
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # as StaticLayer: fixed addresses for CUDA graphs
            for t in (self.packed, self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    # Transformers' versions replace `keys`/`values` by new tensors, which would unpack them.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.packed.copy_(self.packed.index_select(0, beam_idx.to(self.device)))

    def offload(self):
        raise NotImplementedError("the packed static latent cache does not offload; use the dynamic cache")


def adopt_latent_layers(cache: DynamicCache, packed: bool | None = None, dtype: torch.dtype | None = None,
                        scales=None) -> DynamicCache:
    """Replace the plain full-attention layers of an *empty* `DynamicCache` by `MLALatentLayer`, and its sparse (DSA)
    layers by `MLAIndexedLayer` (in place).

    ``scales``: one `LatentScales` for every layer, or a sequence with one per layer index (FP8 only)."""

    def layer_scales(i):
        return scales[i] if isinstance(scales, (list, tuple)) else scales

    if cache.layer_class_to_replicate is DynamicLayer:
        options = (packed, dtype, layer_scales(-1))
        cache.layer_class_to_replicate = (
            functools.partial(MLALatentLayer, *options) if any(o is not None for o in options) else MLALatentLayer
        )
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = MLALatentLayer(packed, dtype, layer_scales(i))
        elif type(layer) is DynamicIndexedLayer and not layer.is_initialized:
            cache.layers[i] = MLAIndexedLayer(packed, dtype, layer_scales(i))
    return cache


class MLALatentCache(DynamicCache):
    """`DynamicCache` whose full-attention layers are `MLALatentLayer`: pass as ``generate(..., cache=...)``.

    ``packed`` forces the layout of every layer (None: chosen from the device, see `MLALatentLayer`).
    ``dtype=torch.float8_e4m3fn`` stores the latent in FP8 (see the module docstring); ``scales`` fixes its
    per-layer `LatentScales` (one for all layers, or a sequence indexed by layer) instead of measuring them.

    The cache's layers come from `config`: built from another model's config, it could keep sliding-window layers
    the model does not have (and truncate its latent) or too few layers, so each layer's first update checks that
    it receives the latent its config describes, and raises naming both otherwise.
    """

    def __init__(self, config=None, packed: bool | None = None, dtype: torch.dtype | None = None, scales=None,
                 **kwargs):
        if dtype == FP8 and config is None:
            raise ValueError("MLALatentCache(dtype=torch.float8_e4m3fn) needs the model's config")
        super().__init__(config=config, **kwargs)
        adopt_latent_layers(self, packed, dtype, scales)
        self._config = None if config is None else config.get_text_config(decoder=True)
        self._checked: set[int] = set()

    def __deepcopy__(self, memo):
        # A copy (Transformers' recipe for reusing a prompt's cache) serves the same model: it shares its config,
        # whose attention implementation `update` reads now, not when the copy was taken.
        if self._config is not None:
            memo[id(self._config)] = self._config
        new = memo[id(self)] = type(self).__new__(type(self))
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self._checked:
            self._check_layer(key_states, value_states, layer_idx)
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, MLALatentLayer) and layer.storage_dtype == FP8:
            if self._config._attn_implementation != ATTN_NAME:
                raise CacheLayoutError(
                    f"an FP8 MLALatentCache is read by attn_implementation={ATTN_NAME!r} only, and this model runs "
                    f"{self._config._attn_implementation!r}: use {ATTN_NAME!r}, or a bf16 cache (no dtype=) for it."
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_layer(self, key_states, value_states, layer_idx: int) -> None:
        """The first update of a layer: the states must be the latent the cache's config describes (MLA attention
        calls update with ``[B, 1, S, kv_lora_rank]`` and ``[B, 1, S, rope]``)."""
        config, name = self._config, getattr(self._config, "model_type", None)
        latent = key_states.dim() == 4 and key_states.shape[1] == 1
        if config is not None and latent:
            dims = (global_value(config, "kv_lora_rank"), global_value(config, "qk_rope_head_dim"))
            got = (key_states.shape[-1], value_states.shape[-1])
            problem = None
            if self.layer_class_to_replicate is None and layer_idx >= len(self.layers):
                problem = f"it has {len(self.layers)} layers and the model's layer {layer_idx} writes to it"
            elif (dims[0] not in (None, PER_LAYER) and dims[0] != got[0]
                  or dims[1] not in (None, PER_LAYER) and got[1] not in (dims[1], 0)):  # (0: a NoPE layer)
                problem = f"its config describes a latent of {dims[0]} + {dims[1]}, the model writes {got[0]} + {got[1]}"
            elif dims[0] is None and (not isinstance(self.layers[layer_idx], (MLALatentLayer, DynamicLayer))
                                      or getattr(self.layers[layer_idx], "is_sliding", False)):
                # (an MLA config's own sliding-window layers hold its latent too; a config without a latent is
                # another model's)
                problem = f"its layer {layer_idx} is a {type(self.layers[layer_idx]).__name__}, not a full-attention layer"
            if problem:
                raise CacheLayoutError(
                    f"MLALatentCache was built from the config of another model ({name}): {problem}. Build it from "
                    "the model's own config: MLALatentCache(model.config)."
                )
        self._checked.add(layer_idx)


# Seam (``registration.py``): Transformers' DynamicCache, built from a config, knows nothing of this package's layers
def latent_layers_for_mla(original):
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
