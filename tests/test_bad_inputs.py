"""Beyond torch: inputs torch's DDP is silent or crashes on, made correct or
clear errors.

Different parameter names at one index across ranks, buffer shapes that
differ across ranks, a second backward over an already reduced forward
(averaged, every reduction path), parameters added, replaced, unfrozen or
reshaped after wrapping, a module cast after wrapping, ``.grad`` replaced or
resized by user code, ranks whose schedules differ (an extra backward or
``no_sync()`` on one rank: an error, never a hang), a meta-device module, a
process group the rank is not a member of, and (debug mode) ranks that
disagree on which parameters got gradients -- a hang or a silently wrong
gradient in torch, the exact average or an error naming the rank and the
parameters here.
"""

from __future__ import annotations

import contextlib
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


def _accelerate_sync_body(rank, world_size, multiple_fwd):
    """accelerate's ``test_sync.py`` patterns with plain torch: ``no_sync``
    steps between synchronising ones (``test_distributed_sync``), and three
    forwards under ``no_sync`` whose last backward is forced to synchronise
    the way ``Accelerator.trigger_sync_in_backward`` does it
    (``require_backward_grad_sync = True`` + ``reducer.prepare_for_backward([])``,
    ``test_distributed_sync_multiple_fwd``).  fastddp's grads equal torch's DDP's."""
    import copy

    from tests._dist import backward_with_sync_triggered, torch_ddp_class

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    out = []
    for cls in (ddp_class(), torch_ddp_class()):
        ddp = cls(copy.deepcopy(base))
        seen = []
        if multiple_fwd:
            losses = []
            for step in range(3):
                with ddp.no_sync():
                    losses.append(ddp(_int_batch(rank, step)).pow(2).mean())
            for step, loss in enumerate(losses):
                if step < 2:
                    loss.backward()
                else:
                    backward_with_sync_triggered(ddp, loss)
                seen.append([p.grad.clone() for p in ddp.parameters()])
        else:
            for step in range(4):
                if step % 2 == 0:
                    with ddp.no_sync():
                        ddp(_int_batch(rank, step)).pow(2).mean().backward()
                else:
                    ddp(_int_batch(rank, step)).pow(2).mean().backward()
                seen.append([p.grad.clone() for p in ddp.parameters()])
        out.append(seen)
    fast, ref = out
    return [(k, i) for k, (a, b) in enumerate(zip(fast, ref)) for i, (x, y) in enumerate(zip(a, b))
            if not torch.allclose(x, y, rtol=1e-6, atol=1e-7)]


@pytest.mark.parametrize("multiple_fwd", [False, True], ids=["no_sync_steps", "trigger_sync_in_backward"])
def test_accelerate_sync_patterns_match_torch(world2, multiple_fwd):
    for rank, bad in enumerate(world2.run(_accelerate_sync_body, multiple_fwd)):
        assert not bad, f"rank {rank}: (step, param) where fastddp's grad differs from torch's DDP: {bad}"


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


def _debug_env(on: bool) -> None:
    """FASTDDP_DEBUG=1 (or unset) in this rank; the settings are read once, so re-read them."""
    from fastddp import settings

    if on:
        os.environ["FASTDDP_DEBUG"] = "1"
    else:
        os.environ.pop("FASTDDP_DEBUG", None)
    settings.reload()


def _added_param_body(rank, world_size, debug):
    if debug:
        _debug_env(True)
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
        _debug_env(False)


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
    _debug_env(True)
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
        _debug_env(False)


def test_debug_mode_ranks_disagree_on_used_params(world2):
    for rank, msg in enumerate(world2.run(_disagree_body, timeout=60)):
        assert "disagree" in msg and "'branch.weight'" in msg and "rank 1" in msg, (rank, msg)
        assert "find_unused_parameters=True" in msg, msg


def _debug_parity_body(rank, world_size):
    """Debug mode changes when buckets are issued, not the gradients."""
    from tests._parity import side_by_side

    def make_test(module, **kwargs):
        ddp = ddp_class()(module, **kwargs)
        assert ddp.stats()["debug"] is True
        return ddp

    _debug_env(True)
    try:
        return side_by_side(rank, world_size, "deep", kwargs=dict(bucket_cap_mb=0.001), make_test=make_test,
                            steps=3, optim=None).checks == 3
    finally:
        _debug_env(False)


def test_debug_mode_keeps_torch_gradients(world2):
    assert world2.run(_debug_parity_body) == [True, True]


# ------------------------------------------------------------------------
# The module, the gradients or the ranks' schedules changed under DDP: every
# scenario ends in gradients equal to the exact average or in an error that
# names the parameter and the rank (torch's DDP: see each test).

def _net():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _x(rank, step):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank * 100 + step))


def _steps(ddp, rank, steps, first=0):
    for s in range(first, first + steps):
        ddp(_x(rank, s)).sum().backward()


def _scenario_body(rank, world_size, name):
    """Run scenario ``name``; return ``"ok"`` with the grads, or the error text."""
    import contextlib
    import copy

    from torch.nn.parallel.distributed import _MixedPrecision

    debug = name.endswith("_debug")
    short = name.startswith(("extra_backward_one_rank", "no_sync_one_rank"))
    if debug:
        _debug_env(True)
    pg = _short_group(world_size) if short else None
    m = _net()
    base = copy.deepcopy(m)
    try:
        if name == "unfreeze_after_wrapping":
            m[0].weight.requires_grad_(False)
        kw = {"process_group": pg}
        if name in ("replace_param_find_unused", "view_grad_replaced"):
            kw.update(find_unused_parameters=name.startswith("replace"),
                      gradient_as_bucket_view=name.startswith("view"))
        if name == "mixed_precision_second_backward":
            kw["mixed_precision"] = _MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        ddp = ddp_class()(m, **kw)
        if name == "mixed_precision_second_backward":
            out = ddp(_x(rank, 0)).float()
            out.sum().backward(retain_graph=True)
            out.sum().backward()
        elif name == "join_second_backward":
            with ddp.join():
                out = ddp(_x(rank, 0))
                out.sum().backward(retain_graph=True)
                out.sum().backward()
        elif name.startswith("extra_backward_one_rank"):
            _steps(ddp, rank, 2)  # past the bucket rebuild (its broadcast comes first otherwise)
            out = ddp(_x(rank, 2))
            out.sum().backward(retain_graph=True)
            if rank == 0:
                out.sum().backward()
            _steps(ddp, rank, 3, 3)
        elif name == "no_sync_one_rank":
            with ddp.no_sync() if rank == 0 else contextlib.nullcontext():
                _steps(ddp, rank, 1)
            _steps(ddp, rank, 3, 1)
        elif name == "unfreeze_after_wrapping":
            _steps(ddp, rank, 2)  # past the bucket rebuild
            m[0].weight.requires_grad_(True)
            _steps(ddp, rank, 1, 2)
        elif name.startswith("freeze_after_wrapping"):
            _steps(ddp, rank, 2)
            m[0].weight.requires_grad_(False)
            _steps(ddp, rank, 2, 2)
        elif name.startswith("replace_param"):
            _steps(ddp, rank, 2)
            m[0].weight = nn.Parameter(m[0].weight.detach().clone())
            _steps(ddp, rank, 2, 2)
        elif name.startswith(("param_shape_changed", "module_dtype_changed")):
            _steps(ddp, rank, 1 if not debug else 2)  # before the rebuild / after it (debug mode)
            if name.startswith("param_shape"):
                m[2].weight.data = torch.zeros(4, 8)
                m[2].bias.data = torch.zeros(4)
                _steps(ddp, rank, 1, 2)
            else:
                m.double()
                ddp(_x(rank, 2).double()).sum().backward()
        elif name == "grad_dtype_replaced":
            _steps(ddp, rank, 1)
            m[0].weight.grad = m[0].weight.grad.half()
            _steps(ddp, rank, 1, 1)
        elif name == "grad_resized":
            _steps(ddp, rank, 1)
            with torch.no_grad():
                m[0].weight.grad.resize_(4, 8)
            _steps(ddp, rank, 1, 1)
        elif name == "view_grad_replaced":
            _steps(ddp, rank, 1)
            for p in m.parameters():
                p.grad = p.grad.clone()  # no longer views of the buckets
            _steps(ddp, rank, 1, 1)
            m[0].weight.grad = None       # zero_grad(set_to_none) of one parameter
            _steps(ddp, rank, 1, 2)
            ref = [copy.deepcopy(base) for _ in range(world_size)]
            for r, mm in enumerate(ref):
                for s in range(3):
                    if s == 2:
                        mm[0].weight.grad = None
                    mm(_x(r, s)).sum().backward()
            want = [sum(gs) / world_size for gs in zip(*[[p.grad for p in mm.parameters()] for mm in ref])]
            return "ok", [(p.grad - w).abs().max().item() for p, w in zip(m.parameters(), want)]
        else:
            raise AssertionError(name)
        return "ok", [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
    except RuntimeError as e:
        return str(e)
    finally:
        _debug_env(False)
        if pg is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)


def _errors(world, name, timeout=120):
    res = world.run(_scenario_body, name, timeout=timeout)
    assert all(isinstance(r, str) for r in res), f"{name}: no error on some rank: {res}"
    return res


def test_mixed_precision_second_backward_is_an_error(world2):
    """The first backward's end freed the fp16 copies the retained graph
    saved: torch errors inside its own machinery; fastddp names the cause."""
    for rank, msg in enumerate(_errors(world2, "mixed_precision_second_backward")):
        assert "second backward" in msg and "mixed_precision" in msg and f"rank {rank}" in msg, msg


def test_second_backward_inside_join_is_an_error(world2):
    """Ranks that joined shadow one backward per forward: a second one could
    not be matched (torch's DDP leaves it local)."""
    for rank, msg in enumerate(_errors(world2, "join_second_backward")):
        assert "second backward" in msg and "join()" in msg and f"rank {rank}" in msg, msg


def test_extra_backward_on_one_rank_debug_mode(world2):
    """Rank 0 alone runs a second backward: its buckets would be averaged
    with rank 1's next step.  Debug mode says so before any collective."""
    for msg in _errors(world2, "extra_backward_one_rank_debug"):
        assert "disagree on how many backwards" in msg and "rank 0: 3 + 1 extra" in msg, msg


def test_extra_backward_on_one_rank_is_an_error_not_a_hang(world2):
    """Without debug mode the collectives pair up wrongly until one rank waits
    alone: an error within the group's timeout (10 s here), never a hang.
    (torch's DDP leaves rank 0's second backward local: no error, averaged
    away by the next step only if the grads are not zeroed.)  The rank left
    waiting errors by the timeout, or sooner when the other rank's group is
    already gone (its reducer freed, its sockets closed)."""
    res = world2.run(_scenario_body, "extra_backward_one_rank", timeout=90)
    assert any(isinstance(r, str) and ("Timed out" in r or "Connection closed by peer" in r) for r in res), res


def test_no_sync_on_one_rank_is_an_error_not_a_hang(world2):
    """no_sync() on rank 0 only: as in torch, one rank ends waiting alone,
    and the group's timeout turns that into an error there (the other rank
    may finish with mispaired averages, as in torch: only debug mode's
    check, or the error on its peer, shows it)."""
    res = world2.run(_scenario_body, "no_sync_one_rank", timeout=90)
    assert any(isinstance(r, str) and ("Timed out" in r or "Connection closed by peer" in r) for r in res), res


def test_parameter_unfrozen_after_wrapping(world2):
    """Fine-tuning's unfreeze after wrapping: torch's DDP trains the parameter
    with local gradients (the ranks drift apart); fastddp refuses."""
    for rank, msg in enumerate(_errors(world2, "unfreeze_after_wrapping")):
        assert "'0.weight'" in msg and "requires_grad=False when the model was wrapped" in msg, msg
        assert f"rank {rank}" in msg and "Wrap the model again" in msg, msg


def test_parameter_frozen_after_wrapping(world2):
    """As torch: the parameter no longer gets gradients, the reduction
    cannot finish, the error names it."""
    for rank, msg in enumerate(_errors(world2, "freeze_after_wrapping")):
        assert "'0.weight'" in msg and f"rank {rank}" in msg and "requires_grad=False" in msg, msg


def test_parameter_replaced_after_wrapping(world2):
    """module.weight = nn.Parameter(...): the old one never gets a gradient
    again; the error names it (torch's too, without the name)."""
    for msg in _errors(world2, "replace_param"):
        assert "'0.weight'" in msg and "replaced" in msg, msg


def test_parameter_replaced_after_wrapping_find_unused(world2):
    """With find_unused_parameters torch's DDP counts the old parameter as
    unused and leaves the new one's gradients local (silently per rank);
    fastddp's graph walk meets the new one and refuses."""
    for rank, msg in enumerate(_errors(world2, "replace_param_find_unused")):
        assert "'0.weight'" in msg and "not among the parameters DDP averages" in msg, msg
        assert f"rank {rank}" in msg, msg


@pytest.mark.parametrize("debug", [False, True])
def test_parameter_shape_changed_after_wrapping(world2, debug):
    """.data of another shape: the bucket slot no longer fits.  Caught at the
    bucket rebuild (the 2nd forward), or at every forward in debug mode."""
    for rank, msg in enumerate(_errors(world2, "param_shape_changed" + ("_debug" if debug else ""))):
        assert "'2.weight'" in msg and "(4, 8)" in msg and "(2, 8)" in msg and f"rank {rank}" in msg, msg


@pytest.mark.parametrize("debug", [False, True])
def test_module_dtype_changed_after_wrapping(world2, debug):
    """module.double() after wrapping: torch's DDP reduces in its float32
    buckets and leaves the ranks' float64 gradients different (silently);
    fastddp says to change the module before wrapping it."""
    for rank, msg in enumerate(_errors(world2, "module_dtype_changed" + ("_debug" if debug else ""))):
        assert "torch.float64" in msg and "torch.float32" in msg and f"rank {rank}" in msg, msg


def test_grad_replaced_with_another_dtype(world2):
    """p.grad = p.grad.half(): torch itself refuses the assignment (grad_dtype)."""
    for msg in _errors(world2, "grad_dtype_replaced"):
        assert "grad_dtype" in msg, msg


def test_grad_resized_by_user(world2):
    """p.grad.resize_(...): the next backward's accumulation fails (autograd's
    error, as under torch's DDP), before any bucket reads it."""
    for msg in _errors(world2, "grad_resized"):
        assert "must match the size" in msg, msg


def test_bucket_view_grads_replaced_by_user(world2):
    """gradient_as_bucket_view, then user code replaces every .grad by a copy
    and sets one to None: the next reductions still give the exact average."""
    for status, errs in world2.run(_scenario_body, "view_grad_replaced"):
        assert status == "ok" and max(errs) < 1e-6, errs


# Ranks whose DDP settings differ: their collectives would not pair up (gloo
# aborts the process on a size mismatch, or a rank waits out the group's
# timeout, 30 minutes by default; torch's DDP does both).  fastddp.agree
# compares them at construction and at the first synchronising forward.

def _settings_body(rank, world_size, case):
    """Rank 0 builds (or registers) something rank 1 does not; returns the
    error text, or ``"ok"`` and whether the ranks' grads are equal."""
    import fastddp
    import fastddp.hooks as fh
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    first = rank == 0
    kw = {"bucket_cap": {"bucket_cap_mb": 0.0001 if first else 25},
          "find_unused": {"find_unused_parameters": first},
          "static_graph": {"static_graph": first},
          "bucket_view": {"gradient_as_bucket_view": first},
          "wire": {"options": fastddp.Options(wire="fp8")} if first else {},
          "wire_no_init_sync": {"init_sync": False, **({"options": fastddp.Options(wire="bf16")} if first else {})},
          "batched_grad_copy": {"batched_grad_copy": first}}.get(case, {})
    from fastddp import agree

    real_crc, real_settings = agree._sources_crc, agree.settings
    if case == "sources" and first:  # another checkout of the same version on rank 0's host
        agree._sources_crc = lambda: 0x1234
    if case == "settings_list" and first:  # another fastddp, which compares one more setting
        agree.settings = lambda ddp: real_settings(ddp) + [("a newer setting", "1")]
    try:
        ddp = ddp_class()(_net(), **kw)
        if case == "fp8_hook" and first:
            ddp.register_comm_hook(fh.FP8CompressionState(), fh.fp8_compress_hook)
        elif case == "fp8_block":
            ddp.register_comm_hook(fh.FP8CompressionState(block_size=128 if first else 256), fh.fp8_compress_hook)
        elif case == "torch_hook" and first:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ctx = ddp.join() if case == "join_before_any_step" else contextlib.nullcontext()
        with ctx:
            _steps(ddp, rank, 3 if case != "join_before_any_step" or first else 0)
    except RuntimeError as e:
        return str(e)
    finally:
        agree._sources_crc, agree.settings = real_crc, real_settings
    g = _net_grads(ddp.module)
    everyone = [torch.empty_like(g) for _ in range(world_size)]
    dist.all_gather(everyone, g)
    # (joined before any step: rank 1 has no grads; rank 0's are its own three steps' average with zeros)
    return "ok", case == "join_before_any_step" or bool(torch.equal(everyone[0], everyone[1]))


def _net_grads(m):
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in m.parameters()])


@pytest.mark.parametrize("case, names", [
    ("bucket_cap", "bucket_cap_mb is 0.0001 on rank 0, 25.0 on rank 1"),
    ("find_unused", "find_unused_parameters is True on rank 0, False on rank 1"),
    ("static_graph", "static_graph is True on rank 0, False on rank 1"),
    ("bucket_view", "gradient_as_bucket_view is True on rank 0, False on rank 1"),
    ("wire", "options.wire is 'fp8' on rank 0, None on rank 1"),
    ("wire_no_init_sync", "options.wire is 'bf16' on rank 0, None on rank 1"),
    ("fp8_hook", "comm hook is fastddp.hooks.fp8_compress_hook on rank 0, None on rank 1"),
    ("fp8_block", "block_size=128.0, error_feedback=True, exempt=None, chunk_bytes=None, tune_buckets=True) on rank 0"),
    ("torch_hook", "comm hook is torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook on "
                   "rank 0, None on rank 1"),
    ("sources", "fastddp version is '0.1.0, sources 00001234' on rank 0, '0.1.0, sources "),
    ("settings_list", "the ranks run different fastddp: they compare different lists of settings"),
])
def test_settings_that_differ_across_ranks_are_an_error_not_a_hang(world2, case, names):
    """Every rank raises the same error, naming the setting and its value on
    each rank, at construction (arguments, options, environment) or at the
    first forward (a hook, or init_sync=False); the hook's two-phase group
    (made at its first step) never leaves a rank waiting in new_group."""
    msgs = world2.run(_settings_body, case, timeout=60)
    assert msgs[0] == msgs[1], msgs
    msg = msgs[0]
    assert isinstance(msg, str) and "settings differ" in msg and names in msg, msg
    assert "the same fastddp, the same constructor arguments" in msg and "FASTDDP_*" in msg, msg


@pytest.mark.parametrize("case", ["same", "batched_grad_copy", "join_before_any_step"])
def test_settings_that_agree_or_stay_local_pass(world2, case):
    """Equal settings pass (one all-gather at construction, one at the first
    step); batched_grad_copy (how a rank copies into its buckets, no
    collective) may differ; a rank that joins before any step takes part in
    the first step's check from join()'s loop."""
    for status, equal in world2.run(_settings_body, case, timeout=60):
        assert status == "ok" and equal, (status, equal)


def test_settings_check_sees_every_option(tmp_path):
    """Every field of fastddp.Options is compared, and the hook and its state
    once registered; values are written so that equal means equal on every
    rank (a function by name, a tensor by shape, a process group by type)."""
    import dataclasses

    import fastddp
    import fastddp.hooks as fh
    from fastddp import agree

    with single_rank_group(tmp_path):
        ddp = ddp_class()(_net())
        before = dict(agree.settings(ddp))
        ddp.register_comm_hook(fh.FP8CompressionState(exempt=[ddp.module[0].bias]), fh.fp8_compress_hook)
        after = dict(agree.settings(ddp))
        group = agree._canon(dist.group.WORLD)
    assert {f"options.{f.name}" for f in dataclasses.fields(fastddp.Options)} <= set(before)
    assert before["comm hook"] == "None" and after["comm hook"] == "fastddp.hooks.fp8_compress_hook"
    assert "exempt=(tensor(8,)), " in after["comm hook state"], after["comm hook state"]
    assert {"bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
            "mixed_precision", "check_finite"} <= set(before)
    assert group == "ProcessGroup"
    assert agree._canon({2, 1}) == "{1.0, 2.0}" and agree._canon([1.5, None]) == "(1.5, None)"
    assert agree._canon(25) == agree._canon(25.0) != agree._canon(True)  # one cap however it is written
