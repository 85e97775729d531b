"""The GPU suite's fixtures: what its tests run on (``gpu_suite.py``). On a CUDA machine FlashInfer's kernels;
elsewhere the CPU stand-ins, so that CI runs every test of ``tests/gpu`` that they can express."""

from __future__ import annotations

import pytest
import torch
from gpu_suite import TARGET

from hf_flashinfer_mla import capabilities

try:  # (the stand-ins check the package against FlashInfer's host code, which the lighter CPU install leaves out)
    import flashinfer.mla
    from fake_flashinfer import FakeMLAWrapper, fake_hopper  # noqa: F401  (fixture)
except (Exception, pytest.skip.Exception) as exc:
    STAND_INS_MISSING = f"the CPU stand-ins need FlashInfer's host code (flashinfer-python): {exc}"
else:
    STAND_INS_MISSING = None


@pytest.fixture(autouse=True)
def on_target(request, monkeypatch):
    """The stand-ins' pretend Hopper (`fake_hopper`) on a machine without CUDA, taking the suite's float32 models,
    with FlashInfer's public MLA wrapper (`FakeMLAWrapper`) for the tests that plan through it; nothing on a GPU."""
    if TARGET.stand_in:
        if STAND_INS_MISSING:
            pytest.skip(STAND_INS_MISSING)
        request.getfixturevalue("fake_hopper")
        monkeypatch.setattr(capabilities, "KERNEL_DTYPES", (TARGET.dtype,))
        monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", FakeMLAWrapper)
        monkeypatch.setattr(FakeMLAWrapper, "instances", [])
    yield TARGET


@pytest.fixture(scope="module", autouse=True)
def _one_thread_on_the_cpu():
    """On the CPU, the tiny models' ops take microseconds each: more threads only wait on each other (several times
    slower on a shared machine). Module-scoped, so that a module's own fixtures (its models' eager runs) get it."""
    if not TARGET.stand_in:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
