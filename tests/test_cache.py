"""`MLALatentLayer` / `MLALatentCache` behave like Transformers' `DynamicLayer` / `DynamicCache` (same content after
every operation) while writing in place into a packed, page-rounded buffer."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_flashinfer_mla import MLALatentCache, MLALatentLayer
from hf_flashinfer_mla.cache import ROUND_TOKENS, adopt_latent_layers
from hf_flashinfer_mla.trtllm import packed_pages

RANK, ROPE = 512, 64


class Pair:
    """Drives an MLALatentLayer and a DynamicLayer through the same operations and compares them."""

    def __init__(self, batch, seed=0, rank=RANK, rope=ROPE, dtype=torch.float32):
        self.g = torch.Generator().manual_seed(seed)
        self.batch, self.rank, self.rope, self.dtype = batch, rank, rope, dtype
        self.mla, self.ref = MLALatentLayer(), DynamicLayer()

    def states(self, n, batch=None):
        b = self.batch if batch is None else batch
        kv = torch.randn(b, 1, n, self.rank, generator=self.g).to(self.dtype)
        rot = torch.randn(b, 1, n, self.rope, generator=self.g).to(self.dtype)
        return kv, rot

    def update(self, n):
        kv, rot = self.states(n)
        out_mla = self.mla.update(kv, rot)
        out_ref = self.ref.update(kv.clone(), rot.clone())
        assert torch.equal(out_mla[0], out_ref[0])
        assert torch.equal(out_mla[1], out_ref[1])
        assert out_mla[0] is self.mla.keys and out_mla[1] is self.mla.values
        self.check()
        return out_mla

    def apply(self, name, *args):
        getattr(self.mla, name)(*args)
        getattr(self.ref, name)(*args)
        self.check()

    def check(self):
        assert self.mla.get_seq_length() == self.ref.get_seq_length()
        if self.ref.get_seq_length() == 0:
            return
        assert self.mla.keys.shape == self.ref.keys.shape
        assert self.mla.values.shape == self.ref.values.shape
        assert self.mla.keys.dtype == self.ref.keys.dtype
        assert torch.equal(self.mla.keys, self.ref.keys)
        assert torch.equal(self.mla.values, self.ref.values)
        assert self.mla.get_mask_sizes(1) == self.ref.get_mask_sizes(1)
        cap = self.mla._buffer.shape[2]
        assert cap % ROUND_TOKENS == 0 and cap >= self.mla.get_seq_length()


@pytest.mark.parametrize(
    "batch, steps",
    [
        (1, [1]),
        (2, [5, 1, 1, 1]),
        (3, [17] + [1] * 10),
        (2, [255, 1, 1, 1]),
        (2, [256, 1]),
        (1, [300, 1, 250, 1]),
        (2, [1] * 20),
        (4, [600, 3, 1]),
    ],
)
def test_updates_match_dynamic_layer(batch, steps):
    pair = Pair(batch, seed=sum(steps))
    for n in steps:
        pair.update(n)
    assert pair.mla.get_seq_length() == sum(steps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_updates_match_dynamic_layer_dtypes(dtype):
    pair = Pair(2, seed=3, dtype=dtype)
    for n in (9, 1, 1):
        pair.update(n)
    assert pair.mla._buffer.dtype == dtype


def test_other_latent_dims():
    """MiniCPM3-like 256 + 32 latent: same behaviour, split at the key width."""
    pair = Pair(2, seed=4, rank=256, rope=32)
    for n in (7, 1, 300, 1):
        pair.update(n)
    assert pair.mla._buffer.shape[-1] == 288


def test_layout_is_packed_rows():
    pair = Pair(2, seed=5)
    pair.update(10)
    buf = pair.mla._buffer
    assert buf.shape == (2, 1, 2 * ROUND_TOKENS, RANK + ROPE)  # 10 tokens + 256 headroom, rounded up
    assert pair.mla.keys.data_ptr() == buf.data_ptr()
    assert pair.mla.values.data_ptr() == buf.data_ptr() + RANK * buf.element_size()
    assert pair.mla.keys.stride(2) == RANK + ROPE and pair.mla.values.stride(2) == RANK + ROPE
    assert packed_pages(pair.mla.keys, pair.mla.values) is not None


def test_growth_keeps_content_and_capacity_rounds():
    pair = Pair(3, seed=6)
    caps = []
    for n in (100, 100, 100, 1, 500, 1, 1):
        pair.update(n)  # content compared against DynamicLayer after every step
        caps.append(pair.mla._buffer.shape[2])
    assert all(c % ROUND_TOKENS == 0 for c in caps)
    assert caps == sorted(caps)  # never shrinks
    assert caps[0] == 512  # 100 tokens + 256 headroom, rounded up
    assert caps[2] == 512 and caps[4] == 1024  # 801 tokens > 512: max(801, 1.5 * 512) rounded up to 1024


def test_growth_is_geometric():
    layer = MLALatentLayer()
    g = torch.Generator().manual_seed(7)
    reallocations = 0
    last = None
    for _ in range(2000):
        layer.update(torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 4, generator=g))
        ptr = layer._buffer.data_ptr()
        if ptr != last:
            reallocations += 1
            last = ptr
    # 2000 one-token steps: capacities 512, 768, 1280 (1.5x = 1152, rounded), 2048 (1920 rounded): 1.5x growth.
    assert reallocations == 4
    assert layer._buffer.shape[2] == 2048


def test_decode_step_does_not_reallocate_when_capacity_suffices():
    pair = Pair(2, seed=8)
    pair.update(200)
    buf = pair.mla._buffer
    ptr = buf.data_ptr()
    for _ in range(312):  # up to exactly the capacity, 512
        pair.update(1)
        assert pair.mla._buffer is buf
        assert pair.mla._buffer.data_ptr() == ptr
        assert pair.mla.keys.data_ptr() == ptr
    assert pair.mla.get_seq_length() == 512
    pair.update(1)  # 513 > 512: grows once, by 1.5x
    assert pair.mla._buffer.data_ptr() != ptr
    assert pair.mla._buffer.shape[2] == 768


def test_first_update_capacity_is_multiple_of_256():
    for n in (1, 63, 64, 255, 256, 257, 1000):
        layer = MLALatentLayer()
        layer.update(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 2))
        cap = layer._buffer.shape[2]
        assert cap % ROUND_TOKENS == 0 and n + ROUND_TOKENS <= cap < n + 2 * ROUND_TOKENS


def test_crop():
    pair = Pair(2, seed=9)
    pair.update(40)
    pair.update(1)
    buf = pair.mla._buffer
    pair.apply("crop", -5)
    assert pair.mla.get_seq_length() == 36
    pair.apply("crop", 0)  # no-op
    assert pair.mla.get_seq_length() == 36
    assert pair.mla._buffer is buf  # cropping keeps the buffer
    pair.update(3)  # overwrites the cropped rows
    pair.update(1)
    assert pair.mla.get_seq_length() == 40
    assert pair.mla._buffer is buf


def test_crop_everything_then_update():
    pair = Pair(2, seed=10)
    pair.update(8)
    pair.apply("crop", -8)
    assert pair.mla.get_seq_length() == 0
    pair.update(4)
    assert pair.mla.get_seq_length() == 4


def test_crop_more_than_length():
    layer = MLALatentLayer()
    layer.update(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 4))
    layer.crop(-50)
    assert layer.get_seq_length() == 0
    assert layer.keys.shape == (1, 1, 0, 8)


def test_crop_positive_raises_like_dynamic_layer():
    pair = Pair(1, seed=11)
    pair.update(10)
    with pytest.raises(ValueError):
        pair.ref.crop(3)
    with pytest.raises(ValueError):
        pair.mla.crop(3)
    pair.check()


def test_crop_uninitialised_is_noop():
    layer = MLALatentLayer()
    layer.crop(-3)
    assert layer.get_seq_length() == 0


def test_reorder_cache():
    pair = Pair(4, seed=12)
    pair.update(30)
    pair.update(1)
    pair.apply("reorder_cache", torch.tensor([3, 3, 0, 1]))
    pair.update(1)
    pair.apply("reorder_cache", torch.tensor([1, 0, 2, 2]))
    pair.update(2)
    cap = pair.mla._buffer.shape[2]
    assert cap % ROUND_TOKENS == 0
    assert packed_pages(pair.mla.keys, pair.mla.values) is not None


def test_reorder_keeps_capacity_no_realloc_on_next_decode():
    pair = Pair(3, seed=13)
    pair.update(20)
    pair.apply("reorder_cache", torch.tensor([2, 1, 0]))
    buf = pair.mla._buffer
    pair.update(1)
    assert pair.mla._buffer is buf


def test_batch_repeat_interleave():
    pair = Pair(2, seed=14)
    pair.update(12)
    pair.apply("batch_repeat_interleave", 3)
    assert pair.mla.keys.shape[0] == 6
    pair.batch = 6
    pair.update(1)
    pair.update(1)


def test_batch_select_indices():
    pair = Pair(5, seed=15)
    pair.update(9)
    pair.update(1)
    pair.apply("batch_select_indices", torch.tensor([0, 2, 4]))
    assert pair.mla.keys.shape[0] == 3
    pair.batch = 3
    pair.update(1)
    pair.apply("batch_select_indices", torch.tensor([True, False, True]))
    pair.batch = 2
    pair.update(2)


def test_beam_search_like_sequence():
    pair = Pair(2, seed=16)
    pair.update(7)
    pair.apply("batch_repeat_interleave", 2)
    pair.batch = 4
    for beams in ([0, 0, 2, 3], [1, 0, 3, 3], [2, 1, 0, 3]):
        pair.update(1)
        pair.apply("reorder_cache", torch.tensor(beams))
    pair.apply("crop", -2)
    pair.apply("batch_select_indices", torch.tensor([1, 3]))
    pair.batch = 2
    pair.update(1)


def test_reset():
    pair = Pair(2, seed=17)
    pair.update(10)
    pair.apply("reset")
    assert pair.mla.get_seq_length() == 0
    assert not pair.mla.is_initialized
    assert pair.mla.keys is None and pair.mla.values is None
    # Usable again, with a different batch size and width after reset.
    pair.batch = 3
    pair.update(4)
    pair.update(1)
    assert pair.mla.get_seq_length() == 5


def test_get_seq_length_lifecycle():
    layer = MLALatentLayer()
    assert layer.get_seq_length() == 0
    g = torch.Generator().manual_seed(18)
    total = 0
    for n in (3, 1, 1, 70):
        layer.update(torch.randn(2, 1, n, 16, generator=g), torch.randn(2, 1, n, 8, generator=g))
        total += n
        assert layer.get_seq_length() == total
        assert layer.keys.shape[2] == total
    layer.crop(-4)
    assert layer.get_seq_length() == total - 4


def test_ops_on_empty_layer_are_noops():
    layer = MLALatentLayer()
    layer.reorder_cache(torch.tensor([0]))
    layer.batch_repeat_interleave(2)
    layer.batch_select_indices(torch.tensor([0]))
    layer.reset()
    assert layer.get_seq_length() == 0


def test_offload_prefetch_cpu_roundtrip():
    pair = Pair(2, seed=19)
    pair.update(6)
    pair.mla.offload()
    pair.mla.prefetch()
    pair.check()
    pair.update(1)


# ---------------------------------------------------------------------------------------------------- cache level


def _tiny_config(layers=3):
    return DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )


def test_cache_from_config_has_latent_layers():
    cache = MLALatentCache(config=_tiny_config(3))
    assert isinstance(cache, DynamicCache)
    assert len(cache.layers) == 3
    assert all(type(layer) is MLALatentLayer for layer in cache.layers)


def test_cache_without_config_replicates_latent_layers():
    cache = MLALatentCache()
    assert cache.layer_class_to_replicate is MLALatentLayer
    cache.update(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 8), 2)
    assert len(cache.layers) == 3
    assert all(type(layer) is MLALatentLayer for layer in cache.layers)


def test_cache_matches_dynamic_cache():
    cfg = _tiny_config(2)
    ours, theirs = MLALatentCache(config=cfg), DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(20)

    def step(n, batch):
        for idx in range(2):
            kv, rot = torch.randn(batch, 1, n, 16, generator=g), torch.randn(batch, 1, n, 8, generator=g)
            a = ours.update(kv, rot, idx)
            b = theirs.update(kv.clone(), rot.clone(), idx)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def same():
        assert ours.get_seq_length() == theirs.get_seq_length()
        for la, lb in zip(ours.layers, theirs.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)

    step(11, 2)
    step(1, 2)
    same()
    ours.batch_repeat_interleave(2)
    theirs.batch_repeat_interleave(2)
    same()
    step(1, 4)
    ours.reorder_cache(torch.tensor([3, 2, 1, 0]))
    theirs.reorder_cache(torch.tensor([3, 2, 1, 0]))
    same()
    ours.crop(-3)
    theirs.crop(-3)
    same()
    ours.batch_select_indices(torch.tensor([0, 3]))
    theirs.batch_select_indices(torch.tensor([0, 3]))
    same()
    step(2, 2)
    same()
    assert ours.get_seq_length() == 11 + 1 + 1 - 3 + 2
    ours.reset()
    assert ours.get_seq_length() == 0


def test_adopt_latent_layers_only_replaces_empty_plain_layers():
    cache = DynamicCache(config=_tiny_config(3))
    cache.update(torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 8), 0)  # layer 0 already holds data
    adopt_latent_layers(cache)
    assert type(cache.layers[0]) is DynamicLayer
    assert cache.layers[0].get_seq_length() == 2
    assert all(type(layer) is MLALatentLayer for layer in cache.layers[1:])
