"""The FP8 latent cache (``MLALatentCache(config, dtype=torch.float8_e4m3fn)``) on the CPU.

Oracle: ``eager`` over a cache that holds exactly the values the FP8 cache represents (each update quantized with the
same scales and stored dequantized), so any difference is the attention's, not the quantization's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import decode_logits, left_padded_batch, make_model, rel_err
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_flashinfer_mla import MLALatentCache, MLALatentLayer
from hf_flashinfer_mla.cache import FP8, FP8_HEADROOM, FP8_MAX, LatentScales, latent_scales, quantize_fp8

SCALES = LatentScales(latent=0.004, rope=0.02)


class FakeQuantLayer(DynamicLayer):
    """A float layer holding exactly what an FP8 `MLALatentLayer` with `scales` represents."""

    def __init__(self, scales: LatentScales):
        super().__init__()
        self.scales = scales

    def update(self, key_states, value_states, *args, **kwargs):
        k = quantize_fp8(key_states, self.scales.latent).to(key_states.dtype) * self.scales.latent
        v = quantize_fp8(value_states, self.scales.rope).to(value_states.dtype) * self.scales.rope
        return super().update(k, v, *args, **kwargs)


def fake_quant_cache(config, scales=SCALES) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [FakeQuantLayer(scales) for _ in cache.layers]
    cache.layer_class_to_replicate = lambda: FakeQuantLayer(scales)
    return cache


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_teacher_forced_matches_eager_on_the_same_quantized_latent(model_type):
    model = make_model(model_type)
    ids, mask, _ = left_padded_batch(lengths=(9, 9, 9))  # eager is NaN on padded float64 rows
    forced = torch.randint(1, 90, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = MLALatentCache(config=model.config, dtype=FP8, scales=SCALES)
        ours = decode_logits(model, ids, mask, cache=cache, forced=forced)
        assert cache.layers[0].keys.dtype == FP8 and latent_scales(cache.layers[0].keys) == SCALES
        bf = decode_logits(model, ids, mask, cache=MLALatentCache(config=model.config), forced=forced)
        model.set_attn_implementation("eager")
        oracle = decode_logits(model, ids, mask, cache=fake_quant_cache(model.config), forced=forced)
    assert rel_err(ours, oracle) < 1e-6  # float64 model, float32 RMSNorm inside
    assert rel_err(bf, oracle) > 1e-4  # the quantization is really there (a no-op FP8 path would pass above)


def test_generate_padded_beams_and_prompt_lookup_match_eager():
    """Left padding, beam search (reorder), and prompt-lookup decoding (crop) over the FP8 cache, float32."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    runs = [dict(num_beams=2), dict(prompt_lookup_num_tokens=3), dict(do_sample=False)]
    for kwargs in runs:
        kwargs = {"do_sample": False, "max_new_tokens": 6, **kwargs}
        batch = ids if "prompt_lookup_num_tokens" not in kwargs else ids[:1, -7:]  # prompt lookup: batch of one
        m = mask if batch is ids else mask[:1, -7:]
        model.set_attn_implementation("flashinfer_mla")
        ours = model.generate(input_ids=batch, attention_mask=m,
                              cache=MLALatentCache(config=model.config, dtype=FP8, scales=SCALES), **kwargs)
        model.set_attn_implementation("eager")
        theirs = model.generate(input_ids=batch, attention_mask=m, cache=fake_quant_cache(model.config), **kwargs)
        assert torch.equal(ours, theirs), kwargs


def test_scales_measured_from_the_prefill_and_saturation():
    layer = MLALatentLayer(dtype=FP8)
    k = torch.randn(2, 1, 5, 32) * 3
    v = torch.randn(2, 1, 5, 8) * 0.5
    layer.update(k, v)
    assert layer.scales.latent == pytest.approx(FP8_HEADROOM * k.abs().max().item() / FP8_MAX, rel=1e-6)
    assert layer.scales.rope == pytest.approx(FP8_HEADROOM * v.abs().max().item() / FP8_MAX, rel=1e-6)
    huge = torch.full((2, 1, 1, 32), 1e9)
    keys, values = layer.update(huge, -huge[..., :8])
    last = keys[:, :, -1].float() * layer.scales.latent
    assert torch.isfinite(keys.float()).all() and torch.isfinite(values.float()).all()
    assert torch.allclose(last, torch.full_like(last, FP8_MAX * layer.scales.latent))
    assert torch.equal(values[:, :, -1].float(), torch.full_like(values[:, :, -1].float(), -FP8_MAX))
    # crop, reorder and batch selection keep the FP8 storage and the scales
    layer.crop(-1)
    layer.reorder_cache(torch.tensor([1, 0]))
    assert layer.keys.dtype == FP8 and layer.keys.shape[2] == 5 and latent_scales(layer.keys) == layer.scales


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        MLALatentLayer(dtype=torch.float16)
    with pytest.raises(ValueError, match="config"):
        MLALatentCache(dtype=FP8)
    with pytest.raises(ValueError, match="pass dtype=torch.float8_e4m3fn"):  # scales without FP8 would be ignored
        MLALatentLayer(scales=LatentScales(0.01, 0.01))
    for bad in (0.0, -0.01, float("nan"), float("inf")):  # each gave wrong or NaN logits without a word
        with pytest.raises(ValueError, match="finite and positive"):
            MLALatentLayer(dtype=FP8, scales=LatentScales(0.01, bad))


def test_reset_measures_the_next_prompts_scales_and_keeps_given_ones():
    """Measured scales belong to the prompt they were measured on: after ``reset()`` a reused cache measures the next
    prompt's (its rows saturated at +-448 otherwise), exactly as a fresh cache does. Scales the caller gave stay."""
    small, large = torch.randn(1, 1, 1, 32) * 0.1, torch.randn(1, 1, 40, 32) * 3
    reused, fresh = MLALatentLayer(dtype=FP8), MLALatentLayer(dtype=FP8)
    reused.update(small, small[..., :8])
    reused.reset()
    reused.update(large, large[..., :8])
    fresh.update(large, large[..., :8])
    assert reused.scales == fresh.scales
    given = LatentScales(0.05, 0.02)
    layer = MLALatentLayer(dtype=FP8, scales=given)
    layer.update(large, large[..., :8])
    layer.reset()
    layer.update(small, small[..., :8])
    assert layer.scales == given


@pytest.mark.parametrize("model_type", ["glm5_next", "mistral_large4", "dots3_note_text"])
def test_the_cache_built_from_the_models_own_config_serves_layers_of_other_widths(model_type):
    """``MLALatentCache(model.config)`` on models whose layers differ from the config's global widths (a NoPE layer
    without rope, sliding-window layers of their own latent width): the same tokens as the default cache, in FP8 too
    (measured scales: a NoPE layer's rope part is empty)."""
    model = make_model(model_type, dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 9))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    default = model.generate(**kwargs)
    ours = model.generate(**kwargs, cache=MLALatentCache(model.config))
    assert torch.equal(ours.sequences, default.sequences)
    fp8 = model.generate(**kwargs, cache=MLALatentCache(model.config, dtype=FP8))
    assert torch.isfinite(torch.stack(fp8.logits)).all()
    assert rel_err(fp8.logits[0], default.logits[0]) < 0.1  # the first step (same tokens so far): FP8's rounding


def test_a_batch_the_cache_does_not_hold_is_refused():
    """A forward of another batch size than the cache holds fails at once, as DynamicCache fails, even where the
    cache must grow (where a growth would broadcast the cached rows into the new batch)."""
    from hf_flashinfer_mla import CacheLayoutError

    layer = MLALatentLayer()
    layer.update(torch.randn(1, 1, 4, 32), torch.randn(1, 1, 4, 8))
    for tokens in (3, 600):  # within the capacity, and past it
        with pytest.raises(CacheLayoutError, match="holds 1 sequences and this forward brings 2"):
            layer.update(torch.randn(2, 1, tokens, 32), torch.randn(2, 1, tokens, 8))


@torch.no_grad()
def test_a_copied_fp8_cache_reads_the_models_implementation_when_it_is_used():
    """Transformers' recipe for reusing a prompt's cache is ``copy.deepcopy(cache)``. A copy serves the same model:
    it checks the attention implementation the model runs when the copy is used, not the one it ran when it was
    copied: a copy taken while the model ran eager serves it under flashinfer_mla, and one taken under
    flashinfer_mla and used under eager gets the package's error, not a failure inside a matmul."""
    import copy

    from hf_flashinfer_mla import CacheLayoutError

    model = make_model("deepseek_v3", dtype=torch.float32)
    prefix = torch.randint(1, 90, (1, 10), generator=torch.Generator().manual_seed(3))
    full = torch.cat([prefix, torch.tensor([[5, 6, 7]])], dim=-1)
    prompt_cache = model(input_ids=prefix, cache=MLALatentCache(config=model.config, dtype=FP8)).cache
    expected = model.generate(full, cache=copy.deepcopy(prompt_cache), max_new_tokens=3, do_sample=False)
    model.set_attn_implementation("eager")
    taken_under_eager = copy.deepcopy(prompt_cache)
    with pytest.raises(CacheLayoutError, match="runs 'eager'"):
        model.generate(full, cache=copy.deepcopy(prompt_cache), max_new_tokens=3, do_sample=False)
    model.set_attn_implementation("flashinfer_mla")
    assert torch.equal(model.generate(full, cache=taken_under_eager, max_new_tokens=3, do_sample=False), expected)
