"""The FP8 latent cache (``MLALatentCache(config, dtype=torch.float8_e4m3fn)``) on the CPU.

Oracle: ``eager`` over a cache that holds exactly the values the FP8 cache represents (each update quantized with the
same scales and stored dequantized), so any difference is the attention's, not the quantization's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, left_padded_batch, make_model, rel_err
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
