"""Fixtures and pytest configuration of the suite. The library the tests share (the model registry, the decode loop,
the eager oracles) is ``helpers.py``."""

from __future__ import annotations

import os

import pytest
from transformers.utils import logging

import hf_flashinfer_mla  # noqa: F401  (registers "flashinfer_mla")
from helpers import FAMILIES


@pytest.fixture(scope="session", autouse=True)
def _torchelastic_logs_in_pytest_tmp(tmp_path_factory):
    """torchrun (tests/test_tensor_parallel_cpu.py) writes its workers' logs under
    ``tempfile.mkdtemp(prefix="torchelastic_")`` in the system temp dir unless it is given ``--log-dir``
    (torch.distributed.elastic's DefaultLogsSpecs), and never removes that folder: one ``torchelastic_*`` left in
    /tmp per run. torchrun reads ``--log-dir`` from ``PET_LOG_DIR`` too, so every torchrun this pytest run starts with
    its environment inherited logs into the run's pytest temp dir instead, which pytest prunes (it keeps the last
    three runs', where a failed run's rank logs can still be read). A ``PET_LOG_DIR`` set by the user wins."""
    if "PET_LOG_DIR" in os.environ:
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setenv("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchelastic")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _fresh_log_once():
    """Each test sees every warn-once/info-once message afresh (they are cached per process by Transformers)."""
    logging.warning_once.cache_clear()
    logging.info_once.cache_clear()
    yield


@pytest.fixture(params=list(FAMILIES))
def model_type(request):
    return request.param
