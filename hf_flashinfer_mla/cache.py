"""A dynamic cache for the MLA latent that grows in place instead of concatenating.

Transformers' ``DynamicLayer.update`` concatenates, i.e. copies the whole history of every layer on every decode
step: for a long context that copy costs more memory traffic than the attention itself. `MLALatentLayer` keeps
the latent in preallocated buffers, writes each step's new tokens into the next free rows, and hands Transformers
views of the filled part; when full it grows geometrically (1.5x), so a token is copied O(1) times on average.

The layout is chosen for the kernel that will read it, from the device, at the first allocation:

* split (Hopper, Ampere, CPU): the latent ``[batch, 1, capacity, kv_lora_rank]`` and the rotary key ``[batch, 1,
  capacity, rope]`` in two buffers, the layout FlashInfer's fa3/fa2 read fastest (on an H200, one layer at 16
  heads: 74% of copy bandwidth, against 63% on packed rows);
* packed (Blackwell, SM100/SM103): both in one ``[batch, 1, capacity, kv_lora_rank + rope]`` buffer, the paged
  layout trtllm-gen reads (``trtllm.packed_pages``); the capacity is kept a multiple of its page size.

``generate()`` uses it automatically for ``flashinfer_mla`` models (``registration.py`` swaps the full-attention
layers of the default `DynamicCache`); `MLALatentCache` is the same thing to pass explicitly as ``cache=``.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import dispatch

ROUND_TOKENS = 256  # capacity granularity: a multiple of every trtllm-gen page size (32, 64)


def packed_layout_for(device: torch.device) -> bool:
    """Whether the kernel that decodes on `device` reads packed rows (trtllm-gen on Blackwell)."""
    return dispatch.device_capability(device) in dispatch.BLACKWELL


class MLALatentLayer(DynamicLayer):
    """One layer's latent (``keys``: ``[B, 1, S, kv_lora_rank]``, ``values``: ``[B, 1, S, rope]``), growing in place.

    ``packed=None`` (the default) picks the layout from the device at the first update (see the module docstring);
    True or False forces packed rows or split buffers.
    """

    def __init__(self, packed: bool | None = None):
        super().__init__()
        self.packed_request = packed

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._buffers: tuple[torch.Tensor, ...] | None = None  # (packed,) or (latent, rope)
        self._length = 0
        self._rank = key_states.shape[-1]
        self.packed = self.packed_request if self.packed_request is not None else packed_layout_for(self.device)
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

    def _grow(self, batch: int, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        old = self._buffers
        # Headroom on the first allocation (a prompt of exactly 256k tokens must not copy itself at the first
        # decode step), then 1.5x growth: O(1) copies per token with a lower peak than doubling.
        capacity = needed + ROUND_TOKENS if old is None else max(needed, old[0].shape[2] * 3 // 2)
        capacity = -(-capacity // ROUND_TOKENS) * ROUND_TOKENS
        widths = [like_k.shape[-1] + like_v.shape[-1]] if self.packed else [like_k.shape[-1], like_v.shape[-1]]
        new = tuple(
            torch.empty((batch, 1, capacity, w), dtype=like_k.dtype, device=like_k.device) for w in widths
        )
        if old is not None and self._length:
            for dst, src in zip(new, old):
                dst[:, :, : self._length] = src[:, :, : self._length]
        self._buffers = new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        needed = self._length + n
        if self._buffers is None or needed > self.capacity:
            self._grow(key_states.shape[0], needed, key_states, value_states)
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
            self._buffers = tuple(fn(b) for b in self._buffers)
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
        self.is_initialized = False


def adopt_latent_layers(cache: DynamicCache, packed: bool | None = None) -> DynamicCache:
    """Replace the plain full-attention layers of an *empty* `DynamicCache` by `MLALatentLayer` (in place)."""
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = MLALatentLayer if packed is None else functools.partial(MLALatentLayer, packed)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = MLALatentLayer(packed)
    return cache


class MLALatentCache(DynamicCache):
    """`DynamicCache` whose full-attention layers are `MLALatentLayer`: pass as ``generate(..., cache=...)``.

    ``packed`` forces the layout of every layer (None: chosen from the device, see `MLALatentLayer`)."""

    def __init__(self, config=None, packed: bool | None = None, **kwargs):
        super().__init__(config=config, **kwargs)
        adopt_latent_layers(self, packed)
