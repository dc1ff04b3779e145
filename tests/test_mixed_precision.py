"""mixed_precision (torch's _MixedPrecision): low-precision forward/backward,
full-precision masters, reduction in reduce_dtype through the fused cast.

torch's own implementation needs CUDA events and fails on CPU, so the
reference here is an emulation: a param_dtype copy of the current masters run
on the same data, each rank's grad scaled by 1/W in fp32, cast to
reduce_dtype, summed in reduce_dtype (rank order), upcast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests._dist import STAND_IN, world2  # noqa: F401

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(STAND_IN, reason="torch's mixed precision needs CUDA")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _emulated_grads(module, x, world, reduce_dtype, param_dtype):
    emu = copy.deepcopy(module).to(param_dtype)
    emu(x.to(param_dtype)).float().pow(2).mean().backward()
    out = []
    for q in emu.parameters():
        wire = (q.grad.float() * (1.0 / world)).to(reduce_dtype)
        parts = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(parts, wire)
        total = parts[0].clone()
        for t in parts[1:]:
            total = total + t
        out.append(total.float())
    return out


def _mp_run(rank, world, reduce_name, opts, no_sync):
    from torch.nn.parallel.distributed import _MixedPrecision
    from fastddp import DistributedDataParallel as F

    reduce_dtype = getattr(torch, reduce_name)
    cfg = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, buffer_dtype=torch.bfloat16)
    m = F(_model(), mixed_precision=cfg, **opts)
    seen = []
    m.module[0].register_forward_hook(lambda mod, i, o: seen.append((mod.weight.dtype, o.dtype)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    bad = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(6, 8, generator=g)
        before = copy.deepcopy(m.module)
        opt.zero_grad(set_to_none=True)
        if no_sync:
            with m.no_sync():
                m(torch.randn(6, 8, generator=g)).float().pow(2).mean().backward()
            opt.zero_grad(set_to_none=True)  # only the synced micro-step counts below
        m(x).float().pow(2).mean().backward()
        want = _emulated_grads(before, x, world, reduce_dtype, torch.bfloat16)
        for i, (p, w) in enumerate(zip(m.parameters(), want)):
            if p.dtype != torch.float32 or p.grad is None or p.grad.dtype != torch.float32 \
                    or not torch.equal(p.grad, w):
                bad.append((step, i))
        opt.step()
    with torch.no_grad():
        m(torch.randn(6, 8))  # eval-style forward: no backward will follow
    full_after_no_grad = all(p.dtype == torch.float32 for p in m.parameters())
    return bad, seen[0], full_after_no_grad, [str(b.dtype) for b in m.module.buffers() if b.is_floating_point()]


@pytest.mark.parametrize("reduce_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("opts", [{}, {"batched_grad_copy": False, "bucket_cap_mb": 0.0001}], ids=["one", "tiny"])
def test_mixed_precision_matches_emulation(world2, reduce_name, opts):
    for bad, seen, full, bufs in world2.run(_mp_run, reduce_name, opts, False):
        assert bad == []
        assert seen == (torch.bfloat16, torch.bfloat16)  # forward computed in param_dtype
        assert full  # masters are full precision outside forward/backward
        assert set(bufs) == {"torch.bfloat16"}


def test_mixed_precision_after_no_sync_steps(world2):
    for bad, _, full, _ in world2.run(_mp_run, "float32", {}, True):
        assert bad == [] and full


def test_mixed_precision_refuses_bucket_view_and_hooks(tmp_path):
    from torch.nn.parallel.distributed import _MixedPrecision
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F
    from tests._dist import single_rank_group

    cfg = _MixedPrecision(param_dtype=torch.bfloat16)
    with single_rank_group(tmp_path):
        with pytest.raises(ValueError, match="gradient_as_bucket_view"):
            F(_model(), mixed_precision=cfg, gradient_as_bucket_view=True)
        m = F(_model(), mixed_precision=cfg)
        with pytest.raises(RuntimeError, match="register_comm_hook"):
            m.register_comm_hook(None, fh.fp16_compress_hook)
