"""The reducer on CUDA (NCCL, 1 rank): gradients equal torch DDP's, the
comm-stream plumbing leaves correct grads for the optimizer, and each bucket
costs exactly one pack and one unpack launch.  Skipped without a GPU; run by
bench/gpu_check.sh."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from tests._dist import torch_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl1():
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    path = os.path.join(tempfile.mkdtemp(prefix="fastddp-nccl-"), "pg")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


@pytest.mark.parametrize("opts", [{}, {"batched_grad_copy": True}, {"gradient_as_bucket_view": True},
                                  {"bucket_cap_mb": 0.25}, {"bucket_cap_mb": 0.25, "batched_grad_copy": True}],
                         ids=["default", "batched", "view", "tiny", "tiny-batched"])
def test_cuda_grads_equal_torch_ddp(nccl1, opts):
    from fastddp import DistributedDataParallel as F

    base = _model()
    a = torch_reference(copy.deepcopy(base), device_ids=[0], **opts)
    b = F(copy.deepcopy(base), device_ids=[0], **opts)
    oa = torch.optim.SGD(a.parameters(), lr=0.01)
    ob = torch.optim.SGD(b.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad)
        oa.step()
        ob.step()
    torch.cuda.synchronize()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("hook", [None, "fp16_compress_hook", "bf16_compress_hook"])
def test_cuda_one_pack_one_unpack_launch_per_bucket(nccl1, hook):
    import fastddp.hooks as fh
    import fastddp.kernels as K
    from fastddp import DistributedDataParallel as F

    m = F(_model(), device_ids=[0], bucket_cap_mb=0.25, batched_grad_copy=True)
    if hook:
        m.register_comm_hook(None, getattr(fh, hook))
    x = torch.randn(32, 256, device="cuda")
    for _ in range(2):  # the rebuild happens before the second forward
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    m.zero_grad(set_to_none=True)
    K.reset_launch_count()
    m(x).sum().backward()
    torch.cuda.synchronize()
    nb = len(m.reducer._buckets)
    assert nb > 1
    assert K.launch_count() == 2 * nb, (K.stats(), nb)
    assert K.stats()["reference_calls"] == 0
