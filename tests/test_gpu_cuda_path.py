"""The reducer's CUDA path (GPU only; run by bench/gpu_check.sh): exposed
communication timed with CUDA events, no host-device sync in a steady-state
step, multi-device modules refused clearly, bucket views under a slow comm
stream keep torch's gradients (the record_stream race)."""

from __future__ import annotations

import copy
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


def test_steady_state_step_does_not_sync_the_host(nccl1, monkeypatch):
    """After the rebuild, a step queues work only: no event/stream/device
    synchronize and no synchronizing copy (torch's sync debug mode errors)."""
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25, gradient_as_bucket_view=True)
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


def test_multi_device_module_refused(nccl1):
    from fastddp import DistributedDataParallel as F

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    m = torch.nn.Sequential(torch.nn.Linear(4, 4).to("cuda:0"), torch.nn.Linear(4, 4).to("cuda:1"))
    with pytest.raises(NotImplementedError, match="several devices"):
        F(m)


def test_bucket_views_with_a_slow_comm_stream_keep_torch_grads(nccl1):
    """gradient_as_bucket_view with set_to_none: each step's fresh .grad is
    replaced by its bucket view right after its pack is queued.  With the comm
    stream held back, a missing record_stream lets later backward kernels
    overwrite those grads before the pack reads them."""
    from fastddp import DistributedDataParallel as F

    base = _model(16)
    a = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[0],
                                                  gradient_as_bucket_view=True, bucket_cap_mb=0.25)
    b = F(copy.deepcopy(base), device_ids=[0], gradient_as_bucket_view=True, bucket_cap_mb=0.25)
    stream = b.reducer.comm_stream
    assert stream is not None
    orig_pack = type(b.reducer)._pack

    def slow_pack(self, bucket):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the pack runs well after backward moved on
        orig_pack(self, bucket)

    type(b.reducer)._pack = slow_pack
    try:
        for step in range(4):
            x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for m in (a, b):
                m.zero_grad(set_to_none=True)
                m(x).pow(2).mean().backward()
            torch.cuda.synchronize()
            for pa, pb in zip(a.parameters(), b.parameters()):
                assert torch.equal(pa.grad, pb.grad), f"step {step}"
    finally:
        type(b.reducer)._pack = orig_pack
