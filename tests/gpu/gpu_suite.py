"""What the GPU suite runs on, here: FlashInfer's kernels on a CUDA GPU, or, on a machine without one, the CPU
stand-ins of ``tests/fake_flashinfer.py`` (`fake_hopper`: FlashInfer's generated fa3/fa2 module and its ragged
prefill on a pretend H100, FlashInfer's own host-side validators included).

A test's body is the same on both (``conftest.py`` puts the stand-ins in place on the CPU); what differs is
`TARGET`: the device, the dtype of the models and operands (bf16 on the GPU; float32 on the CPU, where eager's
float64 is NaN over left padding, and the stand-ins compute in the operands' dtype), and the latent (DeepSeek's
512 + 64 on the GPU, the stand-ins' 32 + 8). Model configs are written at their GPU sizes and pass through `sized`,
which keeps their structure (layers, head counts, q_lora or not, MoE, YaRN, indexer, sliding window) and shrinks
their widths on the CPU. What only the GPU shows (the kernels' bf16 numerics against a yardstick, CUDA-graph capture
and replay, the FP8 kernel, CUDA streams and syncs) is marked `needs_cuda` per test, with the reason.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
from transformers import CompileConfig

import hf_flashinfer_mla
from hf_flashinfer_mla import capabilities

CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Target:
    device: torch.device
    dtype: torch.dtype  # of the models and the kernels' operands
    rank: int  # the latent the kernels are built for: kv_lora_rank + qk_rope_head_dim
    rope: int
    stand_in: bool


TARGET = (Target(torch.device("cuda"), torch.bfloat16, 512, 64, False) if CUDA
          else Target(torch.device("cpu"), torch.float32, 32, 8, True))
DEV, DTYPE, RANK, ROPE = TARGET.device, TARGET.dtype, TARGET.rank, TARGET.rope

# On the stand-ins every path (kernel, reference, eager, sdpa) computes in float32, so the distance between two of
# them is rounding, which no factor turns into a bound: there a bound is at least this, the tolerance of the CPU
# suite's float32 comparisons (tests/test_copied_inputs.py), and a fault (a wrong scale, leaked padding, a wrong
# selection) lands orders of magnitude beyond it.
ROUNDING = 1e-5

# Config entries `sized` shrinks on the CPU (the GPU keeps what the test wrote): widths only.
_TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, head_dim=24, index_n_heads=8, index_head_dim=16,
             swa_q_lora_rank=24, swa_kv_lora_rank=48, swa_head_dim=32, swa_qk_nope_head_dim=24, swa_v_head_dim=16)


def sized(**config):
    """A model config's keywords as written (GPU sizes) on the GPU; on the CPU the same model with widths the
    stand-ins take in seconds: hidden and MLP widths, the latent (32 + 8), head dims, the indexer's; a q_lora rank
    where there is one. Sliding-window layers keep a latent of their own (48 + 8), which the kernels do not take."""
    if CUDA:
        return config
    tiny = {key: _TINY[key] for key in config if key in _TINY}
    if config.get("q_lora_rank") is not None:
        tiny["q_lora_rank"] = 24
    return {**config, **tiny}


def needs_cuda(why: str):
    """Skip a test without CUDA: it shows what the stand-ins cannot (`why`)."""
    return pytest.mark.skipif(not CUDA, reason=f"needs a CUDA GPU: {why}")


def kernel_backend() -> str:
    """The FlashInfer decode kernel of this GPU (the stand-ins' pretend Hopper: fa3)."""
    return "fa3" if capabilities.device_capability(DEV) == (9, 0) else "fa2"


def compile_config(**kwargs) -> CompileConfig | None:
    """The compile config of a static-cache generate() as users run it: None (Transformers' default: inductor with
    CUDA graphs) on the GPU; on the CPU the decode step compiled with ``aot_eager`` (the graph op and its slots,
    reloaded before every step, as ``tests/test_compile.py`` runs it; nothing is captured)."""
    if CUDA:
        return CompileConfig(**kwargs) if kwargs else None
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True  # (Transformers compiles on CUDA only unless told otherwise)
    return config


def fresh_process() -> None:
    """What a fresh process has, as far as a test that counts compiles, CUDA-graph recordings or addresses can
    tell: torch's compiled code and the package's process caches reset (`hf_flashinfer_mla.reset`), then every
    earlier test's garbage collected and the caching allocator's free blocks handed back. A compiled model is a
    reference cycle (through its compiled call), freed by whichever later collection: GPU memory freed in the middle
    of a later test's generate() moves that call's allocations, and its static cache at other addresses records its
    CUDA graphs again, so what a test counts would depend on what ran before it in its process."""
    hf_flashinfer_mla.reset()
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
