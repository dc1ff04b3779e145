"""The reducer's CUDA path (GPU only; run by bench/gpu_check.sh): exposed
communication timed with CUDA events, no host-device sync in a steady-state
step, multi-device modules refused clearly.  (The record_stream race under a
slow comm stream: tests/test_gpu_reducer.py.)"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl1():
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    if dist.is_initialized():
        yield
        return
    path = os.path.join(tempfile.mkdtemp(prefix="fastddp-nccl-"), "pg")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(n=12):
    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


def test_exposed_comm_timed_with_cuda_events(nccl1):
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(4):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    torch.cuda.synchronize()
    s = m.stats()
    assert "cuda_events" in s["exposed_comm_cuda_source"]
    ms = s["exposed_comm_ms_cuda_last"]
    assert len(ms) >= 3 and all(t >= 0 for t in ms), s


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
def test_steady_state_step_does_not_sync_the_host(nccl1, monkeypatch, find_unused):
    """After the rebuild, a step queues work only: no event/stream/device
    synchronize and no synchronizing copy (torch's sync debug mode errors).
    With find_unused_parameters and every parameter used, the used map is
    uploaded from pinned memory without a wait and never read back."""
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25, gradient_as_bucket_view=True,
          find_unused_parameters=find_unused)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(3):
        m.zero_grad(set_to_none=False)
        m(x).sum().backward()
    torch.cuda.synchronize()
    calls = []
    orig = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (calls.append(1), orig(self))[1])
    loss = m(x).sum()  # the forward's loss is built outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert calls == [], f"{len(calls)} Event.synchronize calls in a steady-state backward"
    if find_unused:
        assert m.reducer.ready.used_map.tensor.is_cuda


@pytest.mark.parametrize("hook", [None, "bf16_fp32acc_hook", "fp8_compress_hook"])
def test_steady_state_step_makes_no_cuda_event(nccl1, monkeypatch, hook):
    """The joins of the comm streams reuse their events (Stream.wait_stream
    would make one per call), and the two-phase modes' second phase, queued
    at issue on its own stream, adds none and no host sync."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25)
    if hook is not None:
        m.register_comm_hook(None, getattr(fh, hook))
    x = torch.randn(32, 256, device="cuda")
    for _ in range(10):  # past the rebuild and the exposed-comm timer's 8 event pairs
        m.zero_grad(set_to_none=False)
        m(x).sum().backward()
    torch.cuda.synchronize()
    made = []
    real = torch.cuda.Event.__init__
    monkeypatch.setattr(torch.cuda.Event, "__init__", lambda self, *a, **k: (made.append(1), real(self, *a, **k))[1])
    loss = m(x).sum()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert made == [], f"{len(made)} CUDA events made in a steady-state backward"


def test_multi_device_module_refused(nccl1):
    from fastddp import DistributedDataParallel as F

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    m = torch.nn.Sequential(torch.nn.Linear(4, 4).to("cuda:0"), torch.nn.Linear(4, 4).to("cuda:1"))
    with pytest.raises(NotImplementedError, match="several devices"):
        F(m)
