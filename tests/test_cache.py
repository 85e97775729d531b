"""`MLALatentLayer` / `MLALatentCache` behave like Transformers' `DynamicLayer` / `DynamicCache` (same content after
every operation) while writing in place into page-rounded buffers, in both layouts: split (latent and rope in two
buffers, what fa3/fa2 read fastest) and packed (one row per token, what Blackwell's trtllm-gen reads)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_flashinfer_mla import MLALatentCache, MLALatentLayer, capabilities
from hf_flashinfer_mla.cache import ROUND_TOKENS, adopt_latent_layers
from hf_flashinfer_mla.kernels import cache_pitch
from hf_flashinfer_mla.kernels.fa import cache_rows
from hf_flashinfer_mla.kernels.trtllm import packed_pages

RANK, ROPE = 512, 64


@pytest.fixture(params=[False, True], ids=["split", "packed"])
def packed(request):
    return request.param


def _ptr(layer: MLALatentLayer) -> int:
    return layer._buffers[0].data_ptr()


class Pair:
    """Drives an MLALatentLayer and a DynamicLayer through the same operations and compares them."""

    def __init__(self, batch, seed=0, rank=RANK, rope=ROPE, dtype=torch.float32, packed=False):
        self.g = torch.Generator().manual_seed(seed)
        self.batch, self.rank, self.rope, self.dtype = batch, rank, rope, dtype
        self.mla, self.ref = MLALatentLayer(packed), DynamicLayer()

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
        cap = self.mla.capacity
        assert cap % ROUND_TOKENS == 0 and cap >= self.mla.get_seq_length()
        assert all(b.shape[2] == cap for b in self.mla._buffers)
        # Both views read the layer's own storage, in the layout it was given.
        assert self.mla.keys.data_ptr() == _ptr(self.mla)
        assert (packed_pages(self.mla.keys, self.mla.values) is not None) == self.mla.packed


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
def test_updates_match_dynamic_layer(batch, steps, packed):
    pair = Pair(batch, seed=sum(steps), packed=packed)
    for n in steps:
        pair.update(n)
    assert pair.mla.get_seq_length() == sum(steps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_updates_match_dynamic_layer_dtypes(dtype, packed):
    pair = Pair(2, seed=3, dtype=dtype, packed=packed)
    for n in (9, 1, 1):
        pair.update(n)
    assert all(b.dtype == dtype for b in pair.mla._buffers)


def test_other_latent_dims(packed):
    """MiniCPM3-like 256 + 32 latent: same behaviour, split at the key width."""
    pair = Pair(2, seed=4, rank=256, rope=32, packed=packed)
    for n in (7, 1, 300, 1):
        pair.update(n)
    assert [b.shape[-1] for b in pair.mla._buffers] == ([288] if packed else [256, 32])


def test_layout_is_packed_rows():
    pair = Pair(2, seed=5, packed=True)
    pair.update(10)
    buf = pair.mla._buffer
    assert buf.shape == (2, 1, 2 * ROUND_TOKENS, RANK + ROPE)  # 10 tokens + 256 headroom, rounded up
    assert pair.mla.keys.data_ptr() == buf.data_ptr()
    assert pair.mla.values.data_ptr() == buf.data_ptr() + RANK * buf.element_size()
    assert pair.mla.keys.stride(2) == RANK + ROPE and pair.mla.values.stride(2) == RANK + ROPE
    assert packed_pages(pair.mla.keys, pair.mla.values) is not None


def test_layout_is_split_buffers():
    pair = Pair(2, seed=5, packed=False)
    pair.update(10)
    latent, rope = pair.mla._buffers
    assert latent.shape == (2, 1, 2 * ROUND_TOKENS, RANK) and rope.shape == (2, 1, 2 * ROUND_TOKENS, ROPE)
    assert pair.mla._buffer is None  # no packed buffer
    assert pair.mla.keys.data_ptr() == latent.data_ptr() and pair.mla.values.data_ptr() == rope.data_ptr()
    assert pair.mla.keys.stride(2) == RANK and pair.mla.values.stride(2) == ROPE  # dense rows, as fa3 reads fastest
    assert packed_pages(pair.mla.keys, pair.mla.values) is None
    # The kernel's row view reads both in place, with the capacity as the pitch between sequences.
    ckv, kpe = cache_rows(pair.mla.keys), cache_rows(pair.mla.values)
    assert cache_pitch(pair.mla.keys) == cache_pitch(pair.mla.values) == 2 * ROUND_TOKENS
    assert ckv.data_ptr() == latent.data_ptr() and kpe.data_ptr() == rope.data_ptr()


@pytest.mark.parametrize("capability, expect_packed", [(None, False), ((8, 0), False), ((9, 0), False),
                                                        ((10, 0), True), ((10, 3), True), ((12, 0), False)])
def test_layout_follows_the_device_kernel(monkeypatch, capability, expect_packed):
    """Packed rows only where trtllm-gen decodes (SM100/SM103), split buffers everywhere else; chosen at the first
    allocation, and an explicit choice wins."""
    seen = []
    monkeypatch.setattr(capabilities, "device_capability", lambda device: seen.append(device) or capability)
    layer = MLALatentLayer()
    layer.update(torch.randn(2, 1, 3, RANK), torch.randn(2, 1, 3, ROPE))
    assert seen == [torch.device("cpu")]
    assert layer.packed is expect_packed
    assert (layer._buffer is not None) is expect_packed and len(layer._buffers) == (1 if expect_packed else 2)
    forced = MLALatentLayer(packed=not expect_packed)
    forced.update(torch.randn(2, 1, 3, RANK), torch.randn(2, 1, 3, ROPE))
    assert forced.packed is (not expect_packed)


def test_growth_keeps_content_and_capacity_rounds(packed):
    pair = Pair(3, seed=6, packed=packed)
    caps = []
    for n in (100, 100, 100, 1, 500, 1, 1):
        pair.update(n)  # content compared against DynamicLayer after every step
        caps.append(pair.mla.capacity)
    assert all(c % ROUND_TOKENS == 0 for c in caps)
    assert caps == sorted(caps)  # never shrinks
    assert caps[0] == 512  # 100 tokens + 256 headroom, rounded up
    assert caps[2] == 512 and caps[4] == 1024  # 801 tokens > 512: max(801, 1.5 * 512) rounded up to 1024


def test_growth_is_geometric(packed):
    layer = MLALatentLayer(packed)
    g = torch.Generator().manual_seed(7)
    reallocations = 0
    last = None
    for _ in range(2000):
        layer.update(torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 4, generator=g))
        ptr = _ptr(layer)
        if ptr != last:
            reallocations += 1
            last = ptr
    # 2000 one-token steps: capacities 512, 768, 1280 (1.5x = 1152, rounded), 2048 (1920 rounded): 1.5x growth.
    assert reallocations == 4
    assert layer.capacity == 2048


def test_decode_step_does_not_reallocate_when_capacity_suffices(packed):
    pair = Pair(2, seed=8, packed=packed)
    pair.update(200)
    buffers = pair.mla._buffers
    ptrs = [b.data_ptr() for b in buffers]
    for _ in range(312):  # up to exactly the capacity, 512
        pair.update(1)
        assert pair.mla._buffers is buffers
        assert [b.data_ptr() for b in pair.mla._buffers] == ptrs
        assert pair.mla.keys.data_ptr() == ptrs[0]
    assert pair.mla.get_seq_length() == 512
    pair.update(1)  # 513 > 512: grows once, by 1.5x
    assert _ptr(pair.mla) != ptrs[0]
    assert pair.mla.capacity == 768


def test_first_update_capacity_is_multiple_of_256(packed):
    for n in (1, 63, 64, 255, 256, 257, 1000):
        layer = MLALatentLayer(packed)
        layer.update(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 2))
        cap = layer.capacity
        assert cap % ROUND_TOKENS == 0 and n + ROUND_TOKENS <= cap < n + 2 * ROUND_TOKENS


def test_crop(packed):
    pair = Pair(2, seed=9, packed=packed)
    pair.update(40)
    pair.update(1)
    buffers = pair.mla._buffers
    pair.apply("crop", -5)
    assert pair.mla.get_seq_length() == 36
    pair.apply("crop", 0)  # no-op
    assert pair.mla.get_seq_length() == 36
    assert pair.mla._buffers is buffers  # cropping keeps the buffers
    pair.update(3)  # overwrites the cropped rows
    pair.update(1)
    assert pair.mla.get_seq_length() == 40
    assert pair.mla._buffers is buffers


def test_crop_everything_then_update(packed):
    pair = Pair(2, seed=10, packed=packed)
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


def test_reorder_cache(packed):
    pair = Pair(4, seed=12, packed=packed)
    pair.update(30)
    pair.update(1)
    pair.apply("reorder_cache", torch.tensor([3, 3, 0, 1]))
    pair.update(1)
    pair.apply("reorder_cache", torch.tensor([1, 0, 2, 2]))
    pair.update(2)
    assert pair.mla.capacity % ROUND_TOKENS == 0  # check() also asserts the layout survived


def test_reorder_keeps_capacity_no_realloc_on_next_decode(packed):
    pair = Pair(3, seed=13, packed=packed)
    pair.update(20)
    pair.apply("reorder_cache", torch.tensor([2, 1, 0]))
    buffers = pair.mla._buffers
    pair.update(1)
    assert pair.mla._buffers is buffers


def test_batch_repeat_interleave(packed):
    pair = Pair(2, seed=14, packed=packed)
    pair.update(12)
    pair.apply("batch_repeat_interleave", 3)
    assert pair.mla.keys.shape[0] == 6
    pair.batch = 6
    pair.update(1)
    pair.update(1)


def test_batch_select_indices(packed):
    pair = Pair(5, seed=15, packed=packed)
    pair.update(9)
    pair.update(1)
    pair.apply("batch_select_indices", torch.tensor([0, 2, 4]))
    assert pair.mla.keys.shape[0] == 3
    pair.batch = 3
    pair.update(1)
    pair.apply("batch_select_indices", torch.tensor([True, False, True]))
    pair.batch = 2
    pair.update(2)


def test_beam_search_like_sequence(packed):
    pair = Pair(2, seed=16, packed=packed)
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


def test_reset(packed):
    pair = Pair(2, seed=17, packed=packed)
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


def test_offload_prefetch_move_buffers_and_views(packed):
    """offload()/prefetch() move the layer's buffers, and the views handed to Transformers follow them. On the CPU
    offloading to "cpu" moves nothing, so the layer is made to live on the meta device: prefetch() must move both
    buffers and views there (meta tensors carry no data: shapes and devices are checked there; a CPU round trip first
    checks the data)."""
    pair = Pair(2, seed=19, packed=packed)
    pair.update(6)
    pair.mla.offload()
    pair.mla.prefetch()
    pair.check()  # the data survived the round trip
    pair.update(1)
    shapes = (pair.mla.keys.shape, pair.mla.values.shape)
    pair.mla.device = torch.device("meta")  # as if it lived on an accelerator
    pair.mla.prefetch()
    assert {b.device.type for b in pair.mla._buffers} == {"meta"}
    assert (pair.mla.keys.device.type, pair.mla.values.device.type) == ("meta", "meta")
    assert (pair.mla.keys.shape, pair.mla.values.shape) == shapes


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


@pytest.mark.parametrize("with_config", [True, False])
def test_cache_layout_can_be_forced(packed, with_config):
    cache = MLALatentCache(config=_tiny_config(2) if with_config else None, packed=packed)
    for idx in range(2):
        cache.update(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 8), idx)
    assert [layer.packed for layer in cache.layers] == [packed, packed]


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


# ------------------------------------------------------------------------------------------- caches that do not fit
def test_cache_from_another_models_config_is_refused_naming_both():
    """An MLALatentCache built from another model's config would keep that model's sliding-window layers (and
    truncate the latent to the window) or have too few layers: the first update refuses it, naming the config's
    model and what does not match, instead of giving other tokens than eager."""
    from helpers import left_padded_batch, make_model
    from transformers import MistralConfig

    from hf_flashinfer_mla import CacheLayoutError

    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch()
    sliding = MistralConfig(num_hidden_layers=2, sliding_window=4, hidden_size=32, num_attention_heads=4,
                            layer_types=["sliding_attention", "sliding_attention"])
    fewer = make_model("deepseek_v3", num_hidden_layers=1).config
    other_dims = make_model("minicpm3").config
    for config, expected in ((sliding, "mistral"), (fewer, "1 layers"), (other_dims, r"24 \+ 4")):
        with pytest.raises(CacheLayoutError, match=expected):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           cache=MLALatentCache(config))


def test_fp8_cache_given_to_eager_names_the_fix():
    from helpers import left_padded_batch, make_model

    from hf_flashinfer_mla import CacheLayoutError

    model = make_model("deepseek_v3", attn="sdpa", dtype=torch.bfloat16)
    ids, mask, _ = left_padded_batch()
    with pytest.raises(CacheLayoutError, match="flashinfer_mla.*bf16 cache"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       cache=MLALatentCache(model.config, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("packed", [False, True])
def test_capacity_past_the_filled_rows_is_zero(packed):
    """The latent buffers never expose uninitialised memory (a tool reading the cache's tensors, torch.export, a
    state dict, would see garbage, and a read past the valid rows NaN): new capacity is zeroed, at the first
    allocation and at every growth."""
    layer = MLALatentLayer(packed)
    torch.manual_seed(0)
    for n in (5, ROUND_TOKENS + 40, 3 * ROUND_TOKENS):  # the first allocation, then two growths
        layer.update(torch.randn(2, 1, n, RANK) + 1, torch.randn(2, 1, n, ROPE) + 1)
        for buffer in layer._buffers:
            assert torch.count_nonzero(buffer[:, :, layer.get_seq_length():]) == 0
            assert torch.isfinite(buffer).all()


def test_warnings_inside_generate_point_at_the_caller():
    """A deprecation warning Transformers raises inside generate() names the caller's line, not a frame of this
    package (generate() itself is not wrapped)."""
    import warnings

    from helpers import left_padded_batch, make_model
    from transformers import DynamicCache

    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       past_key_values=DynamicCache(config=model.config))  # deprecated name of `cache`
    deprecated = [w for w in caught if "past_key_values" in str(w.message)]
    assert deprecated and all(w.filename == __file__ for w in deprecated), [(w.filename, w.lineno) for w in caught]
