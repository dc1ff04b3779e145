"""Parity with torch's DDP with the Triton kernels in the reducer's loop.

The same checks as tests/test_parity.py (bit for bit at W=2, every backward),
run in the interpreter session (tests/run.sh sets TRITON_INTERPRET=1): the
reducer's pack/unpack are then the very Triton kernel source that runs
compiled on CUDA, not the plain-torch twin.
"""

from __future__ import annotations

import pytest

from tests._dist import STAND_IN, world2  # noqa: F401
from tests._parity import side_by_side
from tests.test_parity import CASES_W2

pytestmark = [pytest.mark.interpret, pytest.mark.timeout(600),
              pytest.mark.skipif(STAND_IN, reason="fastddp's kernels")]

CASES = ["default_deep", "tiny_buckets", "bucket_view_zero", "batched_tiny", "static_graph_tiny",
         "find_unused_per_rank", "no_sync_deep_tiny", "tied_tiny_batched", "mixed_dtype_tiny_batched",
         "view_batched"]


def _case(rank, world_size, name):
    import fastddp.kernels as K

    assert K.backend("cpu") == "interpret", K.backend("cpu")
    model, kwargs, run_kwargs = CASES_W2[name]
    K.reset_launch_count()
    checks = side_by_side(rank, world_size, model, kwargs=kwargs, **run_kwargs).checks
    return checks, K.launch_count(), K.stats()["reference_calls"]


@pytest.mark.parametrize("case", CASES)
def test_parity_w2_triton_in_the_loop(world2, case):
    for checks, launches, ref_calls in world2.run(_case, case):
        assert checks > 0
        assert launches > 0  # the Triton kernels really ran


def _health_interpret(rank, world_size, path):
    import fastddp.kernels as K
    from tests.test_health import _health_body

    assert K.backend("cpu") == "interpret", K.backend("cpu")
    K.reset_launch_count()
    events = _health_body(rank, world_size, path, "fc2.weight", "raise")
    return events, K.launch_count()


@pytest.mark.parametrize("path", ["default", "fused_fp16", "error_feedback"])
def test_health_flag_from_the_triton_pack(world2, path):
    """check_finite with the interpreted kernels setting the flag in the pack launch."""
    for rank, (events, launches) in enumerate(world2.run(_health_interpret, path)):
        assert launches > 0
        assert [e[0] for e in events] == ["ok", "ok", "raised", "ok"], (rank, events)
        msg = events[2][1]
        assert ("'fc2.weight'" in msg) if rank == 1 else ("because of rank(s) [1]" in msg), msg


def _channels_last_body(rank, world_size, view):
    """A channels_last conv net: every conv grad is non-contiguous (dense in
    channels_last order), the buckets keep the params' strides, and each
    bucket still costs one pack and one unpack launch -- with torch's grads."""
    import torch
    from torch import nn

    import fastddp.kernels as K

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        return net.to(memory_format=torch.channels_last)

    def batch(step, micro):
        g = torch.Generator().manual_seed(rank * 11 + step)
        return torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last), None

    launches = []

    def step_fn(d, x, y, step, is_ref):
        K.reset_launch_count()
        loss = d(x).square().mean()
        loss.backward()
        if not is_ref:
            launches.append((K.launch_count(), K.stats()["fallback_tensors"], d.reducer.num_buckets))
        return loss

    run = side_by_side(rank, world_size, build, kwargs=dict(gradient_as_bucket_view=view), steps=3,
                       batch=batch, step_fn=step_fn, optim=None)
    conv_grad = run.test.module[0].weight.grad
    return launches, conv_grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("view", [False, True])
def test_channels_last_convnet_one_pack_one_unpack_per_bucket(world2, view):
    for launches, cl in world2.run(_channels_last_body, view):
        assert cl  # the grad keeps the param's memory format, as torch
        for n, fallbacks, nb in launches[1:]:  # after the rebuild
            assert fallbacks == 0
            # one pack + one unpack per bucket (views: the unpack is not needed)
            assert n == (nb if view else 2 * nb), launches
