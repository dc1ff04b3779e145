"""join() for uneven inputs, the remaining constructor arguments, stats()."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests._dist import (STAND_IN, single_rank_group, torch_ddp_accepts, torch_ddp_class,  # noqa: F401
                         torch_reference, world2, world3)
from tests._models import loss_fn, make_batch, make_model
from tests._parity import side_by_side

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(STAND_IN, reason="fastddp side by side with torch inside the test")]


# ------------------------------------------------------------------- join

class _JoinDivisor:
    __slots__ = ("divisor",)

    def __init__(self, divisor):
        self.divisor = divisor


def _divide_then_allreduce(state, bucket):
    """``default_hooks.allreduce_hook`` with the divisor torch's
    ``batched_grad_copy`` rule uses under join (the world size with
    ``divide_by_initial_world_size``, else the ranks not joined yet); joined
    ranks run it on zeros."""
    t = bucket.buffer().div_(state.divisor)
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def _join_run(rank, world, cls_name, opts, div_init, hook, emulate=()):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    n_batches = [2 + 2 * r for r in range(world)]  # uneven: rank r has 2 + 2r batches
    divisor = None
    if cls_name == "torch":
        # torch's batched rule where this torch lacks it (or ``emulate`` says
        # so): a raw copy (a hook is registered) divided by the join divisor
        emulated = opts.get("batched_grad_copy") and (
            "batched_grad_copy" in emulate or not torch_ddp_accepts("batched_grad_copy"))
        m = torch_reference(make_model("deep"), hook=bool(emulated), emulate=emulate, **opts)
        if emulated:
            divisor = _JoinDivisor(world)
            m.register_comm_hook(divisor, _divide_then_allreduce)
    else:
        m = F(make_model("deep"), **opts)
    if hook:
        m.register_comm_hook(None, getattr(fh, hook))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    grads = []
    with m.join(divide_by_initial_world_size=div_init):
        for i in range(n_batches[rank]):
            if divisor is not None and not div_init:
                divisor.divisor = sum(n > i for n in n_batches)
            x, y = make_batch("deep", rank, i)
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
    return grads, [p.detach().clone() for p in m.parameters()]


def _join_both(rank, world, opts, div_init, hook):
    t = _join_run(rank, world, "torch", opts, div_init, None if hook else None)
    f = _join_run(rank, world, "fastddp", opts, div_init, hook)
    same_grads = all(torch.equal(a, b) for ga, gb in zip(t[0], f[0]) for a, b in zip(ga, gb))
    same_final = all(torch.equal(a, b) for a, b in zip(t[1], f[1]))
    # every rank ends with the model of the last rank to join
    ref = [p.clone() for p in f[1]]
    for p in ref:
        dist.broadcast(p, src=world - 1)
    synced = all(torch.equal(a, b) for a, b in zip(ref, f[1]))
    return same_grads, same_final, synced


@pytest.mark.parametrize("div_init", [True, False])
@pytest.mark.parametrize("opts", [{}, {"bucket_cap_mb": 0.001, "batched_grad_copy": True},
                                  {"gradient_as_bucket_view": True}], ids=["default", "tiny-batched", "view"])
def test_join_uneven_inputs_equal_torch(world3, opts, div_init):
    # W=3 and still bit for bit: both wrappers use the same bucket layout, so
    # gloo sums every element in the same order
    for same_grads, same_final, synced in world3.run(_join_both, opts, div_init, None):
        assert same_grads and same_final and synced


def _join_emulation(rank, world, opts, div_init):
    t = _join_run(rank, world, "torch", opts, div_init, None)
    e = _join_run(rank, world, "torch", opts, div_init, None, emulate=("batched_grad_copy",))
    same_grads = all(torch.equal(a, b) for ga, gb in zip(t[0], e[0]) for a, b in zip(ga, gb))
    return same_grads and all(torch.equal(a, b) for a, b in zip(t[1], e[1]))


@pytest.mark.skipif(not torch_ddp_accepts("batched_grad_copy"),
                    reason="this torch's DDP lacks batched_grad_copy: nothing to check the emulation against "
                           "(test_join_uneven_inputs_equal_torch still runs fastddp with it, against the emulation)")
@pytest.mark.parametrize("div_init", [True, False])
def test_join_reference_emulation(world3, div_init):
    """What the join test compares fastddp with on a torch without
    ``batched_grad_copy`` is, bit for bit, torch 2.13's DDP with it."""
    opts = {"bucket_cap_mb": 0.001, "batched_grad_copy": True}
    assert world3.run(_join_emulation, opts, div_init) == [True] * 3


def _join_fused(rank, world):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(make_model("mlp"), bucket_cap_mb=0.001)
    m.register_comm_hook(None, fh.bf16_compress_hook)
    with m.join():
        for i in range(1 + rank):
            x, y = make_batch("mlp", rank, i)
            m.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
    return [p.detach().clone() for p in m.parameters()]


def test_join_with_fused_compression_shadows_on_the_wire(world2):
    a, b = world2.run(_join_fused)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _join_throw(rank, world):
    from fastddp import DistributedDataParallel as F

    m = F(make_model("mlp"))
    try:
        with m.join(throw_on_early_termination=True):
            for i in range(1 + 2 * rank):
                x, y = make_batch("mlp", rank, i)
                loss_fn(m(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_join_throw_on_early_termination_raises_on_every_rank(world2):
    msgs = world2.run(_join_throw)
    assert all("exhausted" in m for m in msgs), msgs  # torch's Join raises on every rank


def _join_zero(rank, world):
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from fastddp import DistributedDataParallel as F

    m = F(make_model("mlp"))
    opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
    with Join([m, opt]):
        for i in range(2 + rank):
            x, y = make_batch("mlp", rank, i)
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in m.parameters()]


def test_join_with_zero_redundancy_optimizer(world2):
    a, b = world2.run(_join_zero)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------- remaining arguments

def _delay_parity(rank, world):
    from fastddp import DistributedDataParallel as F

    def delayed(cls):
        def build(m, **kwargs):
            named = [("fc3.weight", m.fc3.weight), ("fc3.bias", m.fc3.bias)]
            return cls(m, delay_all_reduce_named_params=named, param_to_hook_all_reduce=m.fc1.weight, **kwargs)
        return build

    def step_fn(ddp, x, y, step, is_ref):
        loss = loss_fn(ddp(x), y)
        loss.backward()
        if is_ref:
            dist.barrier()  # torch never waits for its delayed all-reduce
        return loss

    run = side_by_side(rank, world, "mlp", make_ref=delayed(torch_ddp_class()), make_test=delayed(F), steps=3,
                       step_fn=step_fn, optim=None)
    return run.checks == 3


def test_delay_all_reduce_named_params_equal_torch(world2):
    assert world2.run(_delay_parity) == [True, True]


def _mesh_parity(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from fastddp import DistributedDataParallel as F

    mesh = init_device_mesh("cpu", (world,))
    run = side_by_side(rank, world, "mlp", kwargs=dict(device_mesh=mesh), make_ref=torch_ddp_class(), make_test=F,
                       steps=1, optim=None)
    return run.checks == 1


def test_device_mesh_1d_equals_torch(world2):
    assert world2.run(_mesh_parity) == [True, True]


def test_bad_argument_combinations_are_refused_clearly(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from fastddp import DistributedDataParallel as F

    with single_rank_group(tmp_path):
        m = make_model("mlp")
        with pytest.raises(RuntimeError, match="Only 1D device mesh"):
            F(m, device_mesh=init_device_mesh("cpu", (1, 1)))
        with pytest.raises(RuntimeError, match="both process_group and device_mesh"):
            F(m, process_group=dist.group.WORLD, device_mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match="at the same time"):
            F(m, delay_all_reduce_named_params=[("fc3.weight", m.fc3.weight)])
        with pytest.raises(ValueError, match="device_ids can only be None or contain a single element"):
            F(m, device_ids=[0, 1])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            F(m, check_reduction=True)
        assert any("check_reduction" in str(x.message) for x in w)


def test_set_static_graph_and_stats(tmp_path):
    from fastddp import DistributedDataParallel as F

    with single_rank_group(tmp_path):
        m = F(make_model("deep"), bucket_cap_mb=0.001)
        m._set_static_graph()
        with pytest.warns(UserWarning, match="no need to set it again"):
            m._set_static_graph()
        for step in range(3):
            x, y = make_batch("deep", 0, step)
            m.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
        s = m.stats()
        assert s["world_size"] == 1 and s["iterations"] == 3 and s["steps_reduced"] == 3
        assert s["has_rebuilt_buckets"] and len(s["buckets"]) > 1
        names = [n for b in s["buckets"] for n in b["params"]]
        assert sorted(names) == sorted(n for n, _ in m.module.named_parameters())
        assert s["bytes_on_wire"] > 0 and s["collectives"] >= len(s["buckets"])
        assert len(s["exposed_comm_ms_last"]) == 3
        assert s["kernels"]["pack_calls"] > 0
        m2 = F(make_model("mlp"))
        x, y = make_batch("mlp", 0, 0)
        loss_fn(m2(x), y).backward()
        with pytest.raises(RuntimeError, match="before the first forward"):
            m2._set_static_graph()
