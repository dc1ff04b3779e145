"""Beyond torch: inputs torch's DDP is silent or crashes on, made clear errors.

Different parameter names at one index across ranks, buffer shapes that
differ across ranks, a second backward over an already reduced forward,
parameters added after wrapping, a meta-device module, a process group the
rank is not a member of, and (debug mode) ranks that disagree on which
parameters got gradients -- a hang in torch, an error naming the rank and the
parameters here.
"""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import ddp_class, fastddp_only, single_rank_group, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model

pytestmark = [pytest.mark.timeout(300), fastddp_only]


def _short_group(world_size):
    return dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=10),
                          backend="gloo")


class _Two(nn.Module):
    def __init__(self, swap: bool):
        super().__init__()
        if swap:  # same shapes, registered in the other order
            self.b = nn.Linear(8, 8)
            self.a = nn.Linear(8, 8)
        else:
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


def _wrap_body(rank, world_size, kind):
    """Wrap a model that differs on rank 1 (or rank 0) in a short-timeout group."""
    model = _Two(swap=rank == 1) if kind == "names" else _Buf(3 if rank == 0 else 5)
    pg = _short_group(world_size)
    try:
        ddp_class()(model, process_group=pg)
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        dist.destroy_process_group(pg)


def test_parameter_names_differ_across_ranks(world2):
    for rank, msg in enumerate(world2.run(_wrap_body, "names")):
        assert msg != "no error", f"rank {rank} accepted parameters registered in another order"
        assert "'a.weight'" in msg and "'b.weight'" in msg and "rank 1" in msg, msg


class _Buf(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("stats", torch.zeros(n))

    def forward(self, x):
        return self.fc(x) + self.stats.sum()


def test_buffer_shapes_differ_across_ranks(world2):
    for rank, msg in enumerate(world2.run(_wrap_body, "buffers")):
        assert msg != "no error", f"rank {rank} accepted buffers that differ across ranks"
        assert "buffer" in msg and "'stats'" in msg and "[3]" in msg and "[5]" in msg, msg


class _TwoHeads(nn.Module):
    """A trunk and two heads, small integer weights: with small integer inputs
    every gradient, its halving and its sum are exact in fp32 and fp16, so a
    second backward's reduction can be checked with ``torch.equal``."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_((torch.arange(p.numel()).reshape(p.shape) + i) % 5 - 2)

    def forward(self, x):
        h = self.trunk(x)
        return self.a(h), self.b(h)


def _int_batch(rank, step):
    return ((torch.arange(12).reshape(3, 4) * (rank + 2) + step) % 5 - 2).float()


def _two_losses(outs, k, only_a):
    a, b = outs
    if k == 0:
        return a.sum() + 2 * b.sum()
    return (k + 2) * a.sum() if only_a else (k + 2) * a.sum() - b.sum()


def _local_grads(model, world_size, steps, n_backward, only_a):
    """What each rank's backwards accumulate locally, averaged over the ranks."""
    import copy

    per_rank = []
    for r in range(world_size):
        m = copy.deepcopy(model)
        for step in range(steps):
            outs = m(_int_batch(r, step))
            for k in range(n_backward):
                _two_losses(outs, k, only_a).backward(retain_graph=k < n_backward - 1)
        per_rank.append([p.grad.clone() for p in m.parameters()])
    return [sum(gs) / world_size for gs in zip(*per_rank)]


def _hook_of(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "allreduce":
        return default_hooks.allreduce_hook
    if name == "fp16":
        return default_hooks.fp16_compress_hook
    if name == "python":  # not one of torch's: runs as a plain Python comm hook
        return lambda state, bucket: default_hooks.allreduce_hook(state, bucket)
    return None


def _second_backward_body(rank, world_size, kwargs, hook, n_backward, only_a):
    import copy

    base = _TwoHeads()
    ddp = ddp_class()(copy.deepcopy(base), **kwargs)
    if hook:
        ddp.register_comm_hook(None, _hook_of(hook))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "LOCAL gradients" warning any more
        for step in range(2):  # grads accumulate over the steps (no zero_grad)
            outs = ddp(_int_batch(rank, step))
            for k in range(n_backward):
                _two_losses(outs, k, only_a).backward(retain_graph=k < n_backward - 1)
    got = [p.grad.clone() for p in ddp.module.parameters()]
    want = _local_grads(base, world_size, 2, n_backward, only_a)
    bad = [n for (n, _), g, w in zip(ddp.module.named_parameters(), got, want) if not torch.equal(g, w)]
    return bad, [g.sum().item() for g in got]


SECOND_BACKWARD = {
    "default": ({}, None, 2, False),
    "three_backwards": ({}, None, 3, False),
    "buckets_per_param": ({"bucket_cap_mb": 1e-6}, None, 2, False),
    "bucket_view": ({"gradient_as_bucket_view": True}, None, 2, False),
    "batched_grad_copy": ({"batched_grad_copy": True}, None, 2, False),
    "find_unused_loss2_skips_a_head": ({"find_unused_parameters": True}, None, 2, True),
    "static_graph": ({"static_graph": True}, None, 2, False),
    "allreduce_hook": ({}, "allreduce", 2, False),
    "python_hook": ({}, "python", 2, False),
    "fp16_hook": ({}, "fp16", 2, False),
    "fp16_hook_bucket_view": ({"gradient_as_bucket_view": True}, "fp16", 2, False),
}


@pytest.mark.parametrize("case", sorted(SECOND_BACKWARD))
def test_second_backward_over_one_forward_is_averaged(world2, case):
    """Two losses through one forward (retain_graph=True): torch's DDP leaves
    each rank with avg(g1) + its own local g2 (silently different per rank);
    fastddp reduces every backward: .grad == avg over ranks of g1 + g2."""
    res = world2.run(_second_backward_body, *SECOND_BACKWARD[case])
    for rank, (bad, sums) in enumerate(res):
        assert not bad, f"rank {rank}: {bad} differ from the average of the local gradients"
    assert res[0][1] == res[1][1], "the ranks' gradients differ"


def _local_step_body(rank, world_size):
    """The pattern torch's docs allow besides no_sync(): accumulate through
    ``ddp.module`` (local), reduce with the last micro-batch through DDP."""
    import copy

    base = _TwoHeads()
    ddp = ddp_class()(copy.deepcopy(base))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _two_losses(ddp(_int_batch(rank, 0)), 0, False).backward()  # a reduced step first
        for p in ddp.module.parameters():
            p.grad = None
        _two_losses(ddp.module(_int_batch(rank, 1)), 0, False).backward()  # local
        local = [p.grad.clone() for p in ddp.module.parameters()]
        _two_losses(ddp(_int_batch(rank, 2)), 0, False).backward()  # reduces both
    return local, [p.grad.clone() for p in ddp.module.parameters()]


def test_local_step_through_module_then_ddp_step(world2):
    (l0, g0), (l1, g1) = world2.run(_local_step_body)
    assert not all(torch.equal(a, b) for a, b in zip(l0, l1)), "the local step should differ per rank"
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def _added_param_body(rank, world_size, debug):
    if debug:
        os.environ["FASTDDP_DEBUG"] = "1"
    try:
        m = make_model("mlp")
        ddp = ddp_class()(m)
        x, y = make_batch("mlp", rank, 0)
        loss_fn(ddp(x), y).backward()
        m.extra = nn.Linear(2, 2)  # added after wrapping: never reduced
        events = []
        for step in range(3):
            try:
                loss_fn(ddp(x), y).backward()
                events.append("ok")
            except RuntimeError as e:
                events.append(str(e))
                break
        return events
    finally:
        os.environ.pop("FASTDDP_DEBUG", None)


@pytest.mark.parametrize("debug", [False, True])
def test_parameter_added_after_wrapping(world2, debug):
    for events in world2.run(_added_param_body, debug):
        assert events[-1] != "ok", events
        assert "'extra.weight'" in events[-1] and "after it was wrapped" in events[-1], events
        # at the rebuild (the next forward) without debug mode, at the first forward with it
        assert len(events) == 1, events


def test_meta_device_module(tmp_path):
    with single_rank_group(tmp_path):
        with torch.device("meta"):
            m = nn.Linear(4, 4)
        with pytest.raises(RuntimeError) as ei:
            ddp_class()(m)
    msg = str(ei.value)
    assert "meta" in msg and "'weight'" in msg and "to_empty" in msg, msg


def _non_member_body(rank, world_size):
    pg = dist.new_group([0], backend="gloo")
    if rank == 0:
        return "member"
    try:
        ddp_class()(make_model("mlp"), process_group=pg)
        return "no error"
    except RuntimeError as e:
        return str(e)


def test_process_group_without_this_rank(world2):
    res = world2.run(_non_member_body)
    assert res[0] == "member"
    assert "not a member" in res[1] and "global rank 1" in res[1], res[1]


def _disagree_body(rank, world_size):
    """Rank 1 leaves the branch out, rank 0 uses it, no find_unused: in torch
    one rank waits in a bucket's all-reduce until the other exits."""
    os.environ["FASTDDP_DEBUG"] = "1"
    try:
        pg = _short_group(world_size)
        m = make_model("branch_always")
        ddp = ddp_class()(m, process_group=pg)
        m.schedule = "always" if rank == 0 else "never"
        x, y = make_batch("branch_always", rank, 0)
        try:
            loss_fn(ddp(x), y).backward()
            return "no error"
        except RuntimeError as e:
            return str(e)
        finally:
            dist.destroy_process_group(pg)
    finally:
        os.environ.pop("FASTDDP_DEBUG", None)


def test_debug_mode_ranks_disagree_on_used_params(world2):
    for rank, msg in enumerate(world2.run(_disagree_body, timeout=60)):
        assert "disagree" in msg and "'branch.weight'" in msg and "rank 1" in msg, (rank, msg)
        assert "find_unused_parameters=True" in msg, msg


def _debug_parity_body(rank, world_size):
    """Debug mode changes when buckets are issued, not the gradients."""
    import copy

    from tests._dist import torch_ddp_class
    from tests.test_parity import compare_grads

    os.environ["FASTDDP_DEBUG"] = "1"
    try:
        base = make_model("deep")
        ref_m, test_m = copy.deepcopy(base), copy.deepcopy(base)
        ref = torch_ddp_class()(ref_m, bucket_cap_mb=0.001)
        test = ddp_class()(test_m, bucket_cap_mb=0.001)
        assert test.stats()["debug"] is True
        for step in range(3):
            x, y = make_batch("deep", rank, step)
            for d in (ref, test):
                d.module.zero_grad(set_to_none=True)
                loss_fn(d(x), y).backward()
            compare_grads(ref_m, test_m, f"rank {rank} step {step}")
        return True
    finally:
        os.environ.pop("FASTDDP_DEBUG", None)


def test_debug_mode_keeps_torch_gradients(world2):
    assert world2.run(_debug_parity_body) == [True, True]
