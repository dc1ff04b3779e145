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


def _backward_without_sync(loss) -> None:
    """``loss.backward()`` under torch's sync debug mode "error": a host-device
    sync or a synchronizing copy inside it raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
    _backward_without_sync(m(x).sum())  # the forward's loss is built outside the checked region
    torch.cuda.synchronize()
    assert calls == [], f"{len(calls)} Event.synchronize calls in a steady-state backward"
    if find_unused:
        assert m.reducer.ready.used_map.tensor.is_cuda


def test_fresh_grads_with_bucket_views_never_wait_for_a_table(nccl1, monkeypatch):
    """zero_grad(set_to_none=True) with bucket views: fresh gradients every step,
    record_stream'ed, so their addresses change while the GPU lags.  Behind a
    long GPU sleep the host queues eight whole steps (their pack tables
    included) with no table wait and no Event.synchronize, and the gradients
    are still torch's."""
    import fastddp.kernels as K
    from fastddp import DistributedDataParallel as F

    ref = _model()
    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25, gradient_as_bucket_view=True)
    x = torch.randn(32, 256, device="cuda")
    for _ in range(3):  # past the rebuild
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    torch.cuda.synchronize()
    calls = []
    orig = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (calls.append(1), orig(self))[1])
    before = K.stats()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(2_000_000_000)  # ~1 s: every step below queues behind it
    t1.record()
    for _ in range(8):
        m.zero_grad(set_to_none=True)
        _backward_without_sync(m(x).sum())
    lagged = not t1.query()  # the host queued all eight steps before the sleep ended
    torch.cuda.synchronize()
    waits = K.stats()["table_waits"] - before["table_waits"]
    assert waits == 0 and calls == [], f"{waits} table waits, {len(calls)} Event.synchronize calls"
    assert lagged, "the host did not get ahead of the GPU: the check saw no lag"
    ref(x).sum().backward()
    for p, q in zip(m.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


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
    _backward_without_sync(m(x).sum())
    torch.cuda.synchronize()
    assert made == [], f"{len(made)} CUDA events made in a steady-state backward"


def test_check_finite_syncs_once_per_step(nccl1, monkeypatch):
    """check_finite must read the flags on the host before any reduced value
    reaches .grad ("raise" raises there): one stream synchronize per step,
    after a non_blocking copy into pinned memory made once; no event
    synchronize, no CUDA event made, no other sync."""
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25, gradient_as_bucket_view=True, check_finite="raise")
    x = torch.randn(32, 256, device="cuda")
    for _ in range(10):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    torch.cuda.synchronize()
    syncs, made = [], []
    real_sync, real_ev = torch.cuda.Stream.synchronize, torch.cuda.Event.__init__
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: (syncs.append("stream"), real_sync(self))[1])
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: syncs.append("event"))
    monkeypatch.setattr(torch.cuda.Event, "__init__", lambda self, *a, **k: (made.append(1), real_ev(self, *a, **k))[1])
    m.zero_grad(set_to_none=True)
    m(x).sum().backward()
    torch.cuda.synchronize()
    assert syncs == ["stream"] and made == [], (syncs, len(made))


def test_multi_device_module_refused(nccl1):
    from fastddp import DistributedDataParallel as F

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    m = torch.nn.Sequential(torch.nn.Linear(4, 4).to("cuda:0"), torch.nn.Linear(4, 4).to("cuda:1"))
    with pytest.raises(NotImplementedError, match="several devices"):
        F(m)
