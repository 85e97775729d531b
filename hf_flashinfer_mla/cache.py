"""A dynamic cache for the MLA latent that grows in place instead of concatenating.

Transformers' ``DynamicLayer.update`` concatenates, i.e. copies the whole history of every layer on every decode
step: for a long context that copy costs more memory traffic than the attention itself. `MLALatentLayer` keeps
the latent in one preallocated buffer, packed as ``[batch, 1, capacity, kv_lora_rank + rope]`` rows, writes each
step's new tokens into the next free rows, and hands Transformers views of the filled part; when full it grows
geometrically (1.5x), so a token is copied O(1) times on average. The packed rows are also the layout Blackwell's
trtllm-gen kernel reads, and the capacity is kept a multiple of its page size.

``generate()`` uses it automatically for ``flashinfer_mla`` models (``registration.py`` swaps the full-attention
layers of the default `DynamicCache`); `MLALatentCache` is the same thing to pass explicitly as ``cache=``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ROUND_TOKENS = 256  # capacity granularity: a multiple of every trtllm-gen page size (32, 64)


class MLALatentLayer(DynamicLayer):
    """One layer's latent (``keys``: ``[B, 1, S, kv_lora_rank]``, ``values``: ``[B, 1, S, rope]``) in packed rows."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._buffer: torch.Tensor | None = None
        self._length = 0
        self._rank = key_states.shape[-1]
        self.is_initialized = True

    def _refresh_views(self) -> None:
        filled = self._buffer[:, :, : self._length]
        self.keys, self.values = filled[..., : self._rank], filled[..., self._rank :]

    def _grow(self, batch: int, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        old = self._buffer
        # Headroom on the first allocation (a prompt of exactly 256k tokens must not copy itself at the first
        # decode step), then 1.5x growth: O(1) copies per token with a lower peak than doubling.
        capacity = needed + ROUND_TOKENS if old is None else max(needed, old.shape[2] * 3 // 2)
        capacity = -(-capacity // ROUND_TOKENS) * ROUND_TOKENS
        width = like_k.shape[-1] + like_v.shape[-1]
        buffer = torch.empty((batch, 1, capacity, width), dtype=like_k.dtype, device=like_k.device)
        if old is not None and self._length:
            buffer[:, :, : self._length] = old[:, :, : self._length]
        self._buffer = buffer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        needed = self._length + n
        if self._buffer is None or needed > self._buffer.shape[2]:
            self._grow(key_states.shape[0], needed, key_states, value_states)
        rows = self._buffer[:, :, self._length : needed]
        rows[..., : self._rank] = key_states
        rows[..., self._rank :] = value_states
        self._length = needed
        self._refresh_views()
        return self.keys, self.values

    # Transformers' batch and length operations, applied to the buffer rather than to the views.
    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized and self._buffer is not None:
            self._length = max(self._length + tokens_to_remove, 0)
            self._refresh_views()

    def _map_buffer(self, fn) -> None:
        if self.is_initialized and self._buffer is not None:
            self._buffer = fn(self._buffer)
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
        self._buffer, self._length = None, 0
        self.keys = self.values = None
        self.is_initialized = False


def adopt_latent_layers(cache: DynamicCache) -> DynamicCache:
    """Replace the plain full-attention layers of an *empty* `DynamicCache` by `MLALatentLayer` (in place)."""
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = MLALatentLayer
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = MLALatentLayer()
    return cache


class MLALatentCache(DynamicCache):
    """`DynamicCache` whose full-attention layers are `MLALatentLayer`: pass as ``generate(..., cache=...)``."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        adopt_latent_layers(self)
