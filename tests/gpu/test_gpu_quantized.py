"""An FP8 (block-quantized) kv_b_proj on the GPU: absorbed decode against eager on the same quantized weights.

Transformers' FP8 matmul is a Hub kernel (absent offline); as in the CPU tests it is replaced by what it computes,
dequantize + ``F.linear``, for eager and flashinfer_mla alike. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_absorption import _fake_fp8_linear, to_fp8_linear
from test_gpu_backends import DEV, LOGIT_TOL, TOP1_MIN, _compare, _model, _teacher_forced
from transformers import DynamicCache
from transformers.integrations import finegrained_fp8

from hf_flashinfer_mla import absorption

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fp8_kv_b_proj_v3_teacher_forced_matches_eager(monkeypatch):
    monkeypatch.setattr(finegrained_fp8, "fp8_linear", _fake_fp8_linear)
    model = _model("v3")
    attn_modules = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    for m in attn_modules:
        m.kv_b_proj = to_fp8_linear(m.kv_b_proj, [128, 128]).to(DEV)
    eager = _teacher_forced(model, DynamicCache(config=model.config))
    model.set_attn_implementation("flashinfer_mla")
    ours = _teacher_forced(model, DynamicCache(config=model.config))
    derived = [getattr(m.kv_b_proj, absorption._DENSE, None) for m in attn_modules]
    assert all(d is not None and d.dtype == torch.bfloat16 for d in derived), "decode did not absorb kv_b_proj"
    err, top1 = _compare(ours, eager)
    print(f"v3 FP8 kv_b_proj: flashinfer_mla vs eager rel {err:.2e} top1 {top1:.3f}")
    assert torch.isfinite(ours).all()
    assert err < LOGIT_TOL and top1 >= TOP1_MIN
    del model
    torch.cuda.empty_cache()
