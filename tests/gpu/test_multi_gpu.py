"""A model split across two GPUs (accelerate device map): each device plans and runs with its own buffers.

Skipped unless two CUDA devices are visible. Run with ``python -m pytest -q tests/gpu/test_multi_gpu.py -s``.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from transformers import DynamicCache

from hf_flashinfer_mla import buffers, flashinfer_fa

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_split_model_matches_single_gpu():
    from test_gpu_backends import _compare, _model, _teacher_forced, LOGIT_TOL, TOP1_MIN

    model = _model("v2-lite")  # on cuda:0, eager
    model.set_attn_implementation("flashinfer_mla")
    single = _teacher_forced(model, DynamicCache(config=model.config))
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                  "model.norm": 1, "lm_head": 1}
    model = dispatch_model(model.to("cpu"), device_map=device_map)
    split = _teacher_forced(model, DynamicCache(config=model.config))
    err, top1 = _compare(split, single)
    print(f"two GPUs vs one: logits rel err {err:.2e}, top-1 {top1:.3f}")
    assert err < LOGIT_TOL and top1 >= TOP1_MIN
    devices = {key[0] for key in flashinfer_fa._wrappers}
    assert {torch.device("cuda", 0), torch.device("cuda", 1)} <= devices
    assert {torch.device("cuda", 0), torch.device("cuda", 1)} <= set(buffers._workspaces)
