"""Shared test setup: GPU marker handling, output poisoning, the device to test on."""

from __future__ import annotations

import pytest
import torch

import stages  # noqa: F401  (chooses the Triton interpreter when there is no GPU, before triton loads)
from stages import contract

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none here (run on the GPU with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every stage output starts as NaN, so an element a kernel forgets to write fails the test."""
    contract.poison_outputs = True
    yield
    contract.poison_outputs = False


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def fake_stages():
    """Register fake stages for the duration of a test (yields ``stages.register``), then restore
    the registry."""
    saved = dict(stages.STAGES)
    yield stages.register
    stages.STAGES.clear()
    stages.STAGES.update(saved)


@pytest.fixture
def ws_padded_head_dims(monkeypatch):
    """``hopper_ws.PADDED_HEAD_DIMS`` on (and for ``compile``'s child process, through the environment),
    with every plan and choice cached under the other setting forgotten, before and after."""
    from stages.c_optimized import backward, configs, hopper_ws, kernels

    def clear():
        for cached in (kernels._select, configs.choose_config, configs.shape_aware_config, backward.backward_plan):
            cached.cache_clear()
        kernels._LAYOUT_PLANS.clear()
        backward._KEPT.clear()

    monkeypatch.setattr(hopper_ws, "PADDED_HEAD_DIMS", True)
    monkeypatch.setenv("LAB_WS_PADDED_HEAD_DIMS", "1")
    clear()
    yield
    monkeypatch.undo()
    clear()
