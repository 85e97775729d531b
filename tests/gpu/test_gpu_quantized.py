"""An FP8 (block-quantized) kv_b_proj on the GPU: absorbed decode against eager on the same quantized weights.

Transformers' FP8 matmul is a Hub kernel (absent offline); as in the CPU tests it is replaced by what it computes,
dequantize + ``F.linear``, for eager and flashinfer_mla alike. Without CUDA it runs on the CPU stand-ins
(``gpu_suite.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_absorption import _fake_fp8_linear, to_fp8_linear
from gpu_suite import CUDA, DEV, DTYPE, needs_cuda
from test_gpu_backends import _compare, _model, _teacher_forced, yardstick
from transformers import DynamicCache
from transformers.integrations import finegrained_fp8

from hf_flashinfer_mla import absorption


def test_fp8_kv_b_proj_v3_teacher_forced_matches_eager(monkeypatch):
    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _fake_fp8_linear)
    model = _model("v3")
    attn_modules = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    for m in attn_modules:
        m.kv_b_proj = to_fp8_linear(m.kv_b_proj, [128, 128] if CUDA else [16, 16]).to(DEV)  # (CPU: a 32-wide latent)
    eager = _teacher_forced(model, DynamicCache(config=model.config))
    model.set_attn_implementation("flashinfer_mla")
    ours = _teacher_forced(model, DynamicCache(config=model.config))
    derived = [getattr(m.kv_b_proj, absorption._DENSE, None) for m in attn_modules]
    assert all(d is not None and d.dtype == DTYPE for d in derived), "decode did not absorb kv_b_proj"
    err, top1 = _compare(ours, eager)
    print(f"v3 FP8 kv_b_proj: flashinfer_mla vs eager rel {err:.2e} top1 {top1:.3f}")
    assert torch.isfinite(ours).all()
    assert yardstick("v3").holds(err, top1)
    del model
    torch.cuda.empty_cache()


@needs_cuda("Transformers quantizes to FP8 at load on a GPU only")
def test_fp8_checkpoint_round_trip_quantize_and_dequantize_at_load(monkeypatch, tmp_path):
    """The checkpoint path users take: a model quantized to FP8 at load by Transformers (FineGrainedFP8Config), saved
    as an FP8 checkpoint, and that checkpoint loaded again with ``dequantize=True``: flashinfer_mla matches eager on
    both, and the dequantized load costs no derived copy (its kv_b_proj is a plain Linear)."""
    import transformers
    from transformers import FineGrainedFP8Config

    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _fake_fp8_linear)
    _model("v3").save_pretrained(tmp_path / "bf16")  # dense MLP: the fake kernel serves every FP8Linear
    results = {}
    # kv_a_proj_with_mqa (576 rows) is not a whole number of 128-row blocks; Transformers leaves its scale
    # uninitialised when it quantizes such a layer at load, so it stays bf16 here (real checkpoints ship the scale).
    keep = ["kv_a_proj_with_mqa", "lm_head"]
    for name, source, qconfig in (("fp8", "bf16", FineGrainedFP8Config(modules_to_not_convert=keep)),
                                  ("dequantized", "fp8", FineGrainedFP8Config(dequantize=True))):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / source, quantization_config=qconfig, attn_implementation="eager", dtype=DTYPE,
            device_map=DEV, use_kernels=False)  # (5.25 kernelizes by default from the Hub, offline here)
        kv_b = model.model.layers[0].self_attn.kv_b_proj
        assert (type(kv_b).__name__ == "FP8Linear") == (name == "fp8")
        eager = _teacher_forced(model, DynamicCache(config=model.config))
        model.set_attn_implementation("flashinfer_mla")
        ours = _teacher_forced(model, DynamicCache(config=model.config))
        assert (getattr(kv_b, absorption._DENSE, None) is not None) == (name == "fp8")
        results[name] = _compare(ours, eager)
        print(f"v3 {name} checkpoint: flashinfer_mla vs eager rel {results[name][0]:.2e} "
              f"top1 {results[name][1]:.3f}")
        if name == "fp8":
            model.save_pretrained(tmp_path / "fp8")
        del model
        torch.cuda.empty_cache()
    for err, top1 in results.values():
        assert yardstick("v3").holds(err, top1)
