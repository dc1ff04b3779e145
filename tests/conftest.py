"""Shared test fixtures: isolation (seed, kernel counters, backend probe)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_sessionstart(session):
    """Build the native modules now (about a minute each the first time, then
    cached: fastddp/_native.py, kernels/_fp8_native.py), not inside the first
    test's timeout."""
    from fastddp import _native
    from fastddp.kernels import _fp8_native
    _native.countdown_module()
    _fp8_native.module()


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    # .ci/run's leg 2 (the GPU machine's torch) leaves the netns rig's torchrun
    # runs to leg 1: the same tooling, minutes of it, nothing of the stack's own
    rig_off = os.environ.get("FASTDDP_TESTS_RIG", "1") == "0"
    for item in items:
        if "rig" in item.keywords and rig_off:
            item.add_marker(pytest.mark.skip(reason="FASTDDP_TESTS_RIG=0: the netns rig runs on CI's leg 1"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "interpret" in item.keywords and not INTERPRET and not has_cuda:
            item.add_marker(pytest.mark.skip(
                reason="kernel test: run with TRITON_INTERPRET=1 (tests/run.sh does)"))


@pytest.fixture(autouse=True)
def _isolate():
    """Seed every test and zero the kernel counters (a leaked count or backend
    choice once caused order-dependent failures in Liger-Kernel); re-read the
    settings after each test (after monkeypatch has put the environment back),
    so a test's variables never reach the next one."""
    import fastddp.kernels as K
    from fastddp import settings

    torch.manual_seed(0)
    K.reset_launch_count()
    yield
    K.reset_launch_count()
    settings.reload()
