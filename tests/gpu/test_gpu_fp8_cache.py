"""The FP8 latent cache on Hopper: fa3 reads float8_e4m3fn latent rows in place (bf16 queries).

Kernel level: fa3 over an FP8 cache against the float64 reference over the same values dequantized. Model level: 64
teacher-forced decode steps of the V2-Lite and V3 shapes with the FP8 cache against the bf16 latent cache; the bound
is shown to be discriminating by a control that doubles the dequantization scales the kernel is given (wrapping
``kernels.fa.run``, the launch of every fa3 layer, and asserting that it reached every decode layer). Needs CUDA:
the stand-ins read no FP8 latent (``tests/test_fp8_cache.py`` checks the cache and its dequantized reads on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from gpu_suite import DEV, needs_cuda
from test_gpu_backends import KERNEL_TOL, SHAPES, _available, _compare, _decode, _model, _teacher_forced, rel

import hf_flashinfer_mla
from hf_flashinfer_mla.cache import FP8, latent_scales
from hf_flashinfer_mla.kernels import fa
from hf_flashinfer_mla.plan import StepPlan, decode_latent

# (the stand-ins read no FP8 latent in place: their kernels' operands are float32)
FP8_KERNEL = "FlashInfer's fa3 reading an FP8 latent in place (bf16 queries)"

# FP8 e4m3 keeps 3 mantissa bits: ~4% relative error per cached value, which these random-weight models (near-tied
# logits) amplify. Measured on an H200, FP8 vs bf16 cache: V2-Lite rel 9.4e-2 / top-1 0.85, V3 shape
# rel 1.75e-1 / top-1 0.65; the 2x-scale control: rel 0.52-0.53 / top-1 0.22-0.25. The bound sits between the two.
FP8_LOGIT_TOL = 3e-1
FP8_TOP1_MIN = 0.5


@needs_cuda(FP8_KERNEL)
@pytest.mark.parametrize("heads", [16, 128])
def test_fa3_reads_fp8_latent_in_place(heads):
    _available("fa3")
    g = torch.Generator(device=DEV).manual_seed(0)
    b, s = 4, 300
    layer = hf_flashinfer_mla.MLALatentLayer(dtype=FP8)
    layer.update(torch.randn(b, 1, s, 512, device=DEV, dtype=torch.bfloat16, generator=g),
                 torch.randn(b, 1, s, 64, device=DEV, dtype=torch.bfloat16, generator=g) * 4)
    kv, kr = layer.keys, layer.values
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device=DEV)
    for i, p in enumerate([0, 17, 64, 299]):
        mask[i, ..., :p] = False
    q_lat = torch.randn(b, heads, 1, 512, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    q_pe = torch.randn(b, heads, 1, 64, device=DEV, dtype=torch.bfloat16, generator=g) * 0.05
    scales = latent_scales(kv)
    step, scale = StepPlan(mask), 192**-0.5
    ref = decode_latent(step, "reference", q_lat.double(), q_pe.double(), kv.double() * scales.latent,
                        kr.double() * scales.rope, scale)
    out, route = _decode(step, "fa3", q_lat, q_pe, kv, kr, scale)
    err = rel(out, ref)
    print(f"fa3 FP8 latent H={heads}: rel err {err:.2e} (scales {scales})")
    # fa3 itself read the FP8 rows in place (not a fallback, not a dequantized copy)
    assert route.backend == "fa3" and route.dequantize is None and route.layer.kv_dtype == FP8
    assert torch.isfinite(out).all() and err < KERNEL_TOL


def _fa_launches(monkeypatch, factor=1.0):
    """Record the dequantization scales every fa2/fa3 launch is given (None: the cache is not read as FP8), and
    hand the kernel `factor` times them (the control's fault)."""
    seen = []
    real = fa.run

    def run(meta, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales=None, *rest):
        seen.append(kv_scales)
        if kv_scales is not None:
            kv_scales = tuple(factor * s for s in kv_scales)
        return real(meta, layer, q_lat, q_pe, kv_latent, k_rot, kv_scales, *rest)

    monkeypatch.setattr(fa, "run", run)
    return seen


@needs_cuda(FP8_KERNEL)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_cache_64_steps_against_bf16_cache_with_control(shape, monkeypatch):
    _available("fa3")
    model = _model(shape)
    model.set_attn_implementation("flashinfer_mla")
    layers = model.config.num_hidden_layers
    bf16 = _teacher_forced(model, hf_flashinfer_mla.MLALatentCache(config=model.config))
    fp8_cache = hf_flashinfer_mla.MLALatentCache(config=model.config, dtype=FP8)
    with monkeypatch.context() as m:
        launches = _fa_launches(m)
        ours = _teacher_forced(model, fp8_cache)
    assert fp8_cache.layers[0].keys.dtype == FP8
    # every decode layer of every step launched fa3 on the FP8 rows in place, with their scales
    assert len(launches) == 64 * layers and all(s is not None for s in launches)
    err, top1 = _compare(ours, bf16)
    with monkeypatch.context() as m:
        calls = _fa_launches(m, factor=2.0)
        wrong = _compare(_teacher_forced(model, hf_flashinfer_mla.MLALatentCache(config=model.config, dtype=FP8)),
                         bf16)
    assert len(calls) == 64 * layers and all(s is not None for s in calls)  # the control reached every layer
    scales = [layer.scales for layer in fp8_cache.layers]
    print(f"{shape} FP8 cache vs bf16 cache: rel {err:.2e} top1 {top1:.3f}; control (2x scale): rel {wrong[0]:.2e} "
          f"top1 {wrong[1]:.3f}; scales {scales}")
    assert torch.isfinite(ours).all()
    assert err < FP8_LOGIT_TOL and top1 >= FP8_TOP1_MIN
    assert wrong[0] >= FP8_LOGIT_TOL or wrong[1] < FP8_TOP1_MIN
    del model
    torch.cuda.empty_cache()
