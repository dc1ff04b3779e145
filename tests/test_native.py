"""The native readiness hooks (fastddp/_native.py, fastddp/csrc/countdown.cpp):
the C++ countdown behind every reducer where it builds, and the Python hooks
it replaces.

The whole suite runs on the native hooks (tests/run.sh builds them first);
here: the countdown's own contract, its modes, gradients bit-equal to the
Python hooks' in every mode, the fallback and its message, the build without
ninja, and what it changes for the user (no reference cycle, AccumulateGrad
nodes replaced under mixed precision, a parameter changed after wrapping).
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn

from fastddp.kernels._native_build import switch

from tests._dist import REPO_ROOT, fastddp_only, setting, single_rank_group, world2  # noqa: F401 (fixture)

pytestmark = fastddp_only

OFF = switch("FASTDDP_NATIVE") == "off"


def _native_env(value: str | None):
    return setting("FASTDDP_NATIVE", value)


def _module():
    from fastddp import _native
    mod = _native.countdown_module()
    assert mod is not None, ("the native readiness hooks did not build here (a C++ compiler and "
                             "torch's headers are needed); FASTDDP_NATIVE=0 runs without them")
    return mod


# ------------------------------------------------------------ the countdown
@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_countdown_contract():
    """FAST: one call per bucket, when its last parameter is in; a second
    mark of a parameter goes to Python flagged; PY: every hook to Python;
    IDLE: nothing.  A Python error in a callback is the backward's error."""
    from fastddp import _native
    mod = _module()
    lin = nn.Linear(4, 3)
    ps = list(lin.parameters())
    ev = []
    cd = mod.Countdown(ps, lambda b: ev.append(("bucket", b)), lambda i, twice: ev.append(("hook", i, twice)),
                       [None, None])
    cd.set_buckets([1, 0])  # weight in bucket 1, bias in bucket 0
    x = torch.randn(2, 4)

    cd.arm(_native.FAST, [1, 1])
    lin(x).sum().backward()
    assert sorted(ev) == [("bucket", 0), ("bucket", 1)] and cd.marked() == b"\x01\x01"

    ev.clear()
    cd.arm(_native.FAST, [1, 1])
    y = lin(x).sum()
    y.backward(retain_graph=True)
    y.backward()  # every parameter marked a second time
    assert sorted(ev) == [("bucket", 0), ("bucket", 1), ("hook", 0, True), ("hook", 1, True)]

    ev.clear()
    cd.arm(_native.PY, [1, 1])
    lin(x).sum().backward()
    assert sorted(ev) == [("hook", 0, False), ("hook", 1, False)]

    ev.clear()
    cd.set_mode(_native.IDLE)
    lin(x).sum().backward()
    assert ev == [] and cd.mode() == _native.IDLE

    def boom(b):
        raise ValueError(f"bucket {b} refused")
    cd2 = mod.Countdown(ps, boom, lambda i, twice: None, [None, None])
    cd2.set_buckets([0, 0])
    cd2.arm(_native.FAST, [2])
    with pytest.raises(ValueError, match="bucket 0 refused"):
        lin(x).sum().backward()
    cd2.remove()
    assert not cd2.attached

    cd.remove()  # hooks gone: nothing fires any more
    cd.set_mode(_native.PY)
    lin(x).sum().backward()
    assert ev == []


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_countdown_follows_a_replaced_accumulator():
    """torch gives a parameter a new AccumulateGrad node when its data changes
    dtype (mixed precision's swap); refresh() moves the hook there."""
    from fastddp import _native
    mod = _module()
    lin = nn.Linear(4, 3)
    ps = list(lin.parameters())
    ev = []
    cd = mod.Countdown(ps, lambda b: ev.append(b), lambda i, twice: None, [None, None])
    cd.set_buckets([0, 0])
    assert cd.refresh() == 0
    lin.double()  # p.data = p.data.double(): new AccumulateGrad nodes
    assert cd.refresh() == 2 and cd.refresh() == 0
    cd.arm(_native.FAST, [2])
    lin(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert ev == [0]


# ----------------------------------------------------------- in the reducer
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_reducer_modes_follow_the_iteration():
    from fastddp import DistributedDataParallel as DDP, _native
    with single_rank_group():
        ddp = DDP(_model(), bucket_cap_mb=0.0005)
        r = ddp.reducer
        assert r.native is not None and r.arming.handles == []
        for step in range(3):
            out = ddp(torch.randn(4, 8))
            if step >= 1:  # after the rebuild's ready order is learnt: the countdown alone
                assert r.native.mode() == _native.FAST
            out.sum().backward()
            assert r.native.mode() == _native.IDLE  # a no_sync backward costs no Python
        assert r.num_buckets > 1  # (after the rebuild)
        with ddp.no_sync():
            ddp(torch.randn(4, 8)).sum().backward()
        ddp(torch.randn(4, 8)).sum().backward()
        fu = DDP(_model(), find_unused_parameters=True)
        fu(torch.randn(4, 8)).sum().backward()
        assert fu.reducer.native.mode() == _native.PY  # the unused-parameter walk needs every hook
        del ddp, fu, r


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_no_sync_before_the_first_synced_step_costs_no_python_per_gradient():
    """A new reducer's hooks are idle as between steps: no_sync() from the
    first step calls no Python per gradient, and the grads stay local
    (torch's); static_graph, find_unused_parameters and the debug check
    track every hook from the start."""
    from fastddp import DistributedDataParallel as DDP, _native
    with single_rank_group():
        ddp = DDP(_model())
        r = ddp.reducer
        assert r.native.mode() == _native.IDLE
        calls = []
        body = r._hook_body
        r._hook_body = lambda i: (calls.append(i), body(i))
        x = torch.randn(4, 8)
        with ddp.no_sync():
            for _ in range(2):
                ddp(x).sum().backward()
        assert calls == [] and r.steps_reduced == 0
        ref = _model()
        for _ in range(2):
            ref(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ddp.module.parameters(), ref.parameters()))
        ddp(x).sum().backward()  # the first synced step after them is reduced as usual
        assert r.steps_reduced == 1
        for kwargs in ({"static_graph": True}, {"find_unused_parameters": True}):
            assert DDP(_model(), **kwargs).reducer.native.mode() == _native.PY, kwargs


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_reducer_is_freed():
    """The C++ hooks hold the reducer weakly: the cycle collector cannot see
    references held in C++, so a strong one would keep every wrapped model
    (and its buckets) alive for the life of the process."""
    from fastddp import DistributedDataParallel as DDP
    with single_rank_group():
        ddp = DDP(_model())
        ddp(torch.randn(4, 8)).sum().backward()
        ref = weakref.ref(ddp.reducer)
        del ddp
        gc.collect()
        assert ref() is None


def _half_eval_body(rank, world_size):
    """An eval in half precision between training steps (model.half() ...
    model.float()) gives every parameter a new AccumulateGrad node: the
    gradients after it are still averaged."""
    from fastddp import DistributedDataParallel as DDP
    m = _model()
    ddp = DDP(m)
    out = []
    for step in range(4):
        if step == 2:
            m.half()
            with torch.no_grad():
                ddp(torch.randn(4, 8).half())
            m.float()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        ddp(x).sum().backward()
        out.append([p.grad.clone() for p in m.parameters()])
        for p in m.parameters():
            p.grad = None
    return out


def test_dtype_round_trip_after_wrapping_still_averages(world2):
    a, b = world2.run(_half_eval_body)
    for step, (ga, gb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert torch.equal(x, y), f"step {step} param {i}: the ranks' gradients differ (not averaged)"


def _grads_body(rank, world_size, native):
    """Steps in every readiness mode; the grads after each (bitwise compared
    across the two kinds of hooks by the test)."""
    import torch.distributed as dist

    import fastddp.reducer
    from fastddp import DistributedDataParallel as DDP
    threshold, fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL, 0
    try:  # every plain configuration copies early (the model's tensors are tiny)
        return _grads_steps(rank, native)
    finally:
        fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = threshold


def _grads_steps(rank, native):
    import torch.distributed as dist

    from fastddp import DistributedDataParallel as DDP
    with _native_env(native):
        out = []
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        view = {"gradient_as_bucket_view": True}
        for kw in ({}, {"batched_grad_copy": True}, {"hook": default_hooks.allreduce_hook},
                   view, {**view, "batched_grad_copy": True},
                   {**view, "bucket_cap_mb": 0.0005}, {**view, "hook": default_hooks.allreduce_hook},
                   {"find_unused_parameters": True}, {"static_graph": True}, {"bucket_cap_mb": 0.0005}):
            kw = dict(kw)
            hook = kw.pop("hook", None)
            ddp = DDP(_model(), **kw)
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            assert (ddp.reducer.native is None) == (native == "0")
            for step in range(6):
                g = torch.Generator().manual_seed(rank * 100 + step)
                x = torch.randn(4, 8, generator=g)
                if step == 1:  # gradient accumulation
                    with ddp.no_sync():
                        ddp(x).sum().backward()
                    ddp(x * 2).sum().backward()
                elif step == 2 and "static_graph" not in kw:  # two losses through one forward
                    y = ddp(x)
                    y.sum().backward(retain_graph=True)
                    (y * y).sum().backward()
                else:
                    ddp(x).sum().backward()
                out.append([p.grad.clone() for p in ddp.parameters()])
                for k, p in enumerate(ddp.parameters()):
                    if step != 3 or k % 2:  # step 4: some grads fresh, some (views) accumulated
                        p.grad = None
            dist.barrier()
            del ddp
        return out


def _early_vs_torch_body(rank, world_size):
    """Every path that copies early (threshold 0) against torch's own DDP, same
    process group, fresh grads each step (zero_grad(set_to_none=True))."""
    import fastddp.reducer
    from fastddp import DistributedDataParallel as DDP
    from tests._dist import torch_reference  # (torch 2.11 has no batched_grad_copy: emulated bit for bit)
    threshold, fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL, 0
    try:
        out = []
        view = {"gradient_as_bucket_view": True}
        for kw in ({}, {"batched_grad_copy": True}, view, {**view, "batched_grad_copy": True}):
            ours, theirs = DDP(_model(), **kw), torch_reference(_model(), **kw)
            for step in range(3):
                g = torch.Generator().manual_seed(rank * 100 + step)
                x = torch.randn(4, 8, generator=g)
                for d in (ours, theirs):
                    for p in d.parameters():
                        p.grad = None
                    d(x).sum().backward()
                out.append((kw, step, all(torch.equal(a.grad, b.grad)
                                          for a, b in zip(ours.parameters(), theirs.parameters())),
                            ours.reducer.native is None or set(ours.reducer.native.filled_marks()) == {1}
                            or step == 0))
        return out
    finally:
        fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = threshold


def test_early_copies_equal_torchs_gradients(world2):
    if OFF:
        pytest.skip("FASTDDP_NATIVE=0")
    for res in world2.run(_early_vs_torch_body):
        for kw, step, equal, early in res:
            assert equal, f"{kw} step {step}: not bit-equal to torch's DDP"
            assert early, f"{kw} step {step}: the early copy did not run"


def test_native_and_python_hooks_give_the_same_gradients(world2):
    if OFF:
        pytest.skip("FASTDDP_NATIVE=0")
    nat = world2.run(_grads_body, "1")
    py = world2.run(_grads_body, "0")
    for rank in range(2):
        assert len(nat[rank]) == len(py[rank])
        for k, (a, b) in enumerate(zip(nat[rank], py[rank])):
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"rank {rank} case/step {k} param {i}: native {x} python {y}"


class _Recorder:
    """The native countdown with its data-path answers recorded (the rest
    passed through: it stands in for the reducer's countdown, which every
    new plan hands to the step context)."""

    def __init__(self, native):
        self.native, self.packs, self.unpacks = native, [], []

    def __getattr__(self, name):
        return getattr(self.native, name)

    def pack(self, *args, **kw):
        self.packs.append(self.native.pack(*args, **kw))
        return self.packs[-1]

    def unpack(self, *args, **kw):
        self.unpacks.append(self.native.unpack(*args, **kw))
        return self.unpacks[-1]


def _native_data_path_body(rank, world_size):
    """The default, batched, bucket-view and comm-hook paths with small
    tensors (no early copy): each bucket packed and unpacked by one native
    call, the grads bit-equal to torch's DDP in the same group.  A backward
    with create_graph (grads that are graphs; torch's DDP refuses it) goes to
    the Python path: equal to fastddp without the native data path."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from fastddp import DistributedDataParallel as DDP
    from tests._dist import torch_reference
    out = []
    view = {"gradient_as_bucket_view": True}
    cap = {"bucket_cap_mb": 0.0002}
    for kw in ({}, {"batched_grad_copy": True}, view, {**view, "batched_grad_copy": True}, "hook"):
        opts = {} if kw == "hook" else kw
        ours, theirs = DDP(_model(), **cap, **opts), torch_reference(_model(), **cap, **opts)
        if kw == "hook":
            for d in (ours, theirs):
                d.register_comm_hook(None, default_hooks.allreduce_hook)
        ours.reducer.arming.chain = None  # each bucket through Python (the chain: the test after this one)
        rec = ours.reducer.arming.native = ours.reducer.ctx.native = _Recorder(ours.reducer.arming.native)
        steps = 4 if not kw else 3
        for step in range(steps):
            graph = step == 3
            if graph:  # no optimizer step in between: a fresh model has the same weights
                theirs = DDP(_model(), **cap)
                theirs.reducer.ctx.native = None
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
            for d in (ours, theirs):
                for p in d.parameters():
                    p.grad = None
                d(x).pow(2).sum().backward(create_graph=graph)
            equal = all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
            out.append((str(kw), step, equal, list(rec.packs), list(rec.unpacks), len(ours.reducer.buckets)))
            rec.packs.clear()
            rec.unpacks.clear()
        for d in (ours, theirs):
            for p in d.parameters():
                p.grad = None  # (create_graph: grads that reference the graph)
    return out


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_the_data_path_contract():
    """Countdown.pack/unpack on one bucket: the grads scaled into the slots
    (1/W), the slots back into the grads; a missing grad declined (1 / -2);
    after remove() no slot is taken (the parameters are gone): declined,
    never a read of a released parameter."""
    mod = _module()
    lin = nn.Linear(4, 3)
    ps = list(lin.parameters())
    cd = mod.Countdown(ps, lambda b: None, lambda i, t: None, [None, None])
    flat = torch.zeros(sum(p.numel() for p in ps))
    views = [flat[:12].view(3, 4), flat[12:].view(3)]
    cd.clear_slots(1)
    cd.set_slots(0, [0, 1], views, flat)
    assert cd.pack(0, 1, 2.0, False) == 1 and cd.unpack(0, False) == -2  # no grads yet
    lin(torch.randn(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in ps]
    assert cd.pack(0, 1, 2.0, False) == 0
    assert all(torch.equal(v, g * 0.5) for v, g in zip(views, grads))
    flat.mul_(3)
    assert cd.unpack(0, False) == -1
    assert all(torch.equal(p.grad, g * 0.5 * 3) for p, g in zip(ps, grads))
    cd.remove()
    cd.set_slots(0, [0, 1], views, flat)
    assert cd.pack(0, 1, 2.0, False) == 1 and cd.unpack(0, False) == -2


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_a_plan_the_native_data_path_cannot_serve_costs_no_call():
    """The step context gets the countdown only where it holds some bucket's
    slots: bf16 buckets (and GPU ones) make no native pack or unpack call."""
    from fastddp import DistributedDataParallel as DDP
    with single_rank_group():
        served = DDP(nn.Linear(4, 3))
        unserved = DDP(nn.Linear(4, 3).to(torch.bfloat16))
        assert served.reducer.ctx.native is served.reducer.arming.native is not None
        assert unserved.reducer.arming.native is not None and unserved.reducer.ctx.native is None
        unserved(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
        del served, unserved


def test_the_native_data_path_packs_and_unpacks_each_bucket(world2):
    if OFF:
        pytest.skip("FASTDDP_NATIVE=0")
    for res in world2.run(_native_data_path_body):
        for kw, step, equal, packs, unpacks, nb in res:
            assert equal, f"{kw} step {step}: not bit-equal to torch's DDP"
            assert nb > 1 or step == 0, "the test wants several buckets (after torch's rebuild)"
            if step == 3:  # create_graph: every pack declined, the Python path served it
                assert packs == [1] * nb, (kw, step, packs)
            elif step > 0:  # the first step of view mode aliases; later ones find the views (ALL_VIEWS)
                want = 2 if "gradient_as_bucket_view" in kw and step > 0 else 0
                assert packs == [0] * nb or (want == 2 and packs == [want] * nb), (kw, step, packs)
                assert unpacks == [-1] * nb, (kw, step, unpacks)


def _issue_chain_body(rank, world_size, early_min):
    """The native issue chain (fastddp/reducer/chain.py) on the default,
    batched and bucket-view paths, several buckets: bit-equal to torch's DDP
    in the same group, Python called once a step (not once a bucket: from
    the chain's end-of-backward callback, after its waits and unpacks), the
    collectives counted as the Python path counts them.  A create_graph
    backward (grads that are graphs: the native pack declines) hands the
    iteration to Python at its first bucket: equal to fastddp without the
    native data path."""
    import fastddp.reducer
    from fastddp import DistributedDataParallel as DDP, kernels
    from tests._dist import torch_reference
    threshold, fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL, early_min
    out = []
    try:
        view = {"gradient_as_bucket_view": True}
        cap = {"bucket_cap_mb": 0.0002}
        for kw in ({}, {"batched_grad_copy": True}, view, {**view, "batched_grad_copy": True}):
            ours, theirs = DDP(_model(), **cap, **kw), torch_reference(_model(), **cap, **kw)
            r = ours.reducer
            calls = {"bucket": [], "chain": []}
            ready, chain = r._native_bucket_ready, r._native_chain
            r._native_bucket_ready = lambda b: (calls["bucket"].append(b), ready(b))[1]
            r._native_chain = lambda b, at: (calls["chain"].append(b), chain(b, at))[1]
            for step in range(4):
                graph = step == 3
                if graph:  # no optimizer step in between: a fresh model has the same weights
                    theirs = DDP(_model(), **cap, **kw)
                    theirs.reducer.ctx.native = theirs.reducer.arming.chain = None
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
                st = ours.stats()
                before = (st["collectives"], st["bytes_on_wire"], kernels.stats().get("pack_calls", 0))
                for d in (ours, theirs):
                    for p in d.parameters():
                        p.grad = None
                    d(x).pow(2).sum().backward(create_graph=graph)
                equal = all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
                st = ours.stats()  # (the chain's own counts and the Python path's)
                counted = (st["collectives"] - before[0], st["bytes_on_wire"] - before[1],
                           kernels.stats().get("pack_calls", 0) - before[2])
                flat_bytes = sum(b.flat.numel() * b.flat.element_size() for b in r.buckets)
                out.append((str(kw), step, equal, r.arming.chaining, list(calls["bucket"]), list(calls["chain"]),
                            len(r.buckets), counted, flat_bytes))
                calls["bucket"].clear()
                calls["chain"].clear()
            for d in (ours, theirs):
                for p in d.parameters():
                    p.grad = None  # (create_graph: grads that reference the graph)
        return out
    finally:
        fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL = threshold


@pytest.mark.parametrize("early", [False, True], ids=["one-pack", "early-copy"])
def test_the_issue_chain_calls_python_once_a_step(world2, early):
    if OFF:
        pytest.skip("FASTDDP_NATIVE=0")
    from fastddp.reducer.arming import EARLY_COPY_MIN_NUMEL
    for res in world2.run(_issue_chain_body, 0 if early else EARLY_COPY_MIN_NUMEL):
        for kw, step, equal, chaining, bucket_calls, chain_calls, nb, counted, flat_bytes in res:
            assert equal, f"{kw} step {step}: not bit-equal to torch's DDP"
            assert chaining or step == 0, f"{kw} step {step}: the chain was not armed"  # (0: the ready order)
            collectives, nbytes, packs = counted
            assert (collectives, nbytes) == (nb, flat_bytes), (kw, step, counted)
            if step == 3:  # create_graph: the first bucket hands over, the others go through Python
                assert chain_calls == bucket_calls[:1], (kw, step, chain_calls, bucket_calls)
                assert sorted(bucket_calls) == list(range(nb)), (kw, step, bucket_calls)
            elif step > 0:  # (step 0: one bucket before torch's rebuild)
                assert nb > 1, "the test wants several buckets (after torch's rebuild)"
                # once, from the chain's end-of-backward callback: every bucket reduced and unpacked
                assert (bucket_calls, chain_calls) == ([], [-3 - nb]), (kw, step, bucket_calls, chain_calls)
                # one native pack a bucket (.grad = None each step), none where the early copy filled it
                assert packs == (0 if early else nb), (kw, step, packs)


def _chain_finish_body(rank, world_size):
    """The chain's finalize (wait and unpack in C++) against torch's DDP in
    the same group: a plain step (every bucket unpacked natively), and a
    step where a hook on the input's gradient (the last one computed) sets
    the last layer's .grad to None after its bucket was packed and issued:
    the native unpack declines that bucket and Python's unpack goes on
    from it (a fresh .grad with the reduced value, as torch's)."""
    from fastddp import DistributedDataParallel as DDP, kernels
    from tests._dist import torch_reference
    out = []
    cap = {"bucket_cap_mb": 0.0002}
    ours, theirs = DDP(_model(), **cap), torch_reference(_model(), **cap)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step)).requires_grad_()
        before = kernels.stats().get("unpack_calls", 0)
        for d in (ours, theirs):
            for p in d.parameters():
                p.grad = None
            last = d.module[-1].weight
            h = x.register_hook(lambda g, last=last: setattr(last, "grad", None)) if step == 3 else None
            d(x).pow(2).sum().backward()
            if h is not None:
                h.remove()
            x.grad = None
        equal = all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
        out.append((step, equal, ours.reducer.arming.chaining, kernels.stats().get("unpack_calls", 0) - before,
                    len(ours.reducer.buckets)))
    return out


def test_the_issue_chain_finishes_in_cpp_and_hands_a_missing_grad_to_python(world2):
    if OFF:
        pytest.skip("FASTDDP_NATIVE=0")
    for res in world2.run(_chain_finish_body):
        for step, equal, chaining, unpacks, nb in res:
            assert equal, f"step {step}: not bit-equal to torch's DDP"
            if step:
                assert chaining and nb > 1, (step, chaining, nb)
                # one unpack call a bucket (native, counted as the plain-torch path's); step 3: the
                # bucket with the missing grad is Python's per-parameter copy (not counted)
                assert unpacks == nb - (step == 3), (step, unpacks, nb)


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_the_steady_step_finishes_in_one_python_call_and_watches_its_outputs_in_cpp():
    """The chained steady state: the end-of-backward callback's one Python
    call is the inline bookkeeping (not take and _finalize), and leaves the
    reducer as _finalize does (nothing armed, hooks idle, the step counted);
    the outputs' watch (a second backward is reduced too) is a C++ pre hook
    that calls Python only once the step is reduced: not in a plain step,
    once in a second backward through the same outputs, which is reduced."""
    from fastddp import DistributedDataParallel as DDP, _native
    with single_rank_group():
        ddp = DDP(_model(), bucket_cap_mb=0.0002)
        r = ddp.reducer
        calls = {"watch": 0, "finalize": 0, "take": 0}
        watch, finalize, take = r.second._hook, r._finalize, r.arming.chain.take
        r.native.set_on_output(lambda g: (calls.__setitem__("watch", calls["watch"] + 1), watch(g))[1])
        r._finalize = lambda: (calls.__setitem__("finalize", calls["finalize"] + 1), finalize())[1]
        r.arming.chain.take = lambda *a: (calls.__setitem__("take", calls["take"] + 1), take(*a))[1]
        ddp(torch.randn(4, 8)).sum().backward()  # (learns the ready order: the Python path)
        for p in ddp.parameters():
            p.grad = None
        for k in calls:
            calls[k] = 0
        steps, exposed = r.steps_reduced, len(r.exposed_comm_s)
        ddp(torch.randn(4, 8)).sum().backward()
        assert r.arming.chaining and r.num_buckets > 1
        assert calls == {"watch": 0, "finalize": 0, "take": 0}, calls
        assert not r.ready.expect_hooks and r.native.mode() == _native.IDLE and not r.arming.fast
        assert (r.steps_reduced, len(r.exposed_comm_s)) == (steps + 1, min(exposed + 1, 32))
        assert ddp.stats()["collectives"] and ddp.stats()["bytes_on_wire"]  # (the counts: the W=2 chain tests)
        for p in ddp.parameters():
            p.grad = None
        out = ddp(torch.randn(4, 8)).sum()
        out.backward(retain_graph=True)
        first = [p.grad.clone() for p in ddp.parameters()]
        out.backward()  # a second backward: re-armed by the watch's one Python call, and reduced
        assert calls["watch"] == 1, calls
        assert r.steps_reduced == steps + 3
        assert all(torch.equal(p.grad, 2 * g) for p, g in zip(ddp.parameters(), first))
        from fastddp import kernels
        served = {k: kernels.stats()[k] for k in ("pack_calls", "unpack_calls", "reference_calls")}
        assert served["unpack_calls"] > 0  # (the chain's unpacks, counted in C++)
        del ddp, r, out, watch, finalize, take
        gc.collect()
        assert {k: kernels.stats()[k] for k in served} == served  # a reducer gone: its counts stay


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_the_issue_chain_is_off_where_python_does_more_per_bucket():
    """Profiler ranges, check_finite, a comm hook, a Python process group:
    the chain is not armed (each bucket goes through the Python path, which
    does those); a plain step arms it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from fastddp import DistributedDataParallel as DDP, profiling
    with single_rank_group():
        def chaining(ddp):  # (the first step records the ready order: never chained)
            for _ in range(1 if ddp.reducer.has_rebuilt_buckets else 2):
                ddp(torch.randn(2, 8)).sum().backward()
            return ddp.reducer.arming.chaining

        assert chaining(DDP(_model()))
        assert not chaining(DDP(_model(), check_finite=True))
        hooked = DDP(_model())
        hooked.register_comm_hook(None, default_hooks.allreduce_hook)
        assert not chaining(hooked)
        ranged = DDP(_model())
        profiling.enable()
        try:
            assert not chaining(ranged)
        finally:
            profiling.disable()
        with torch.profiler.profile():
            assert not chaining(ranged)
        assert chaining(ranged)


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_countdown_early_copy_into_views():
    """set_views + arm(scale): each fresh grad goes into its view as it
    arrives (times the scale, torch's mul_out), and .grad becomes the view;
    a grad already aliasing its view, or another dtype, is left to Python."""
    from fastddp import _native
    mod = _module()
    lin = nn.Linear(4, 3)
    ps = list(lin.parameters())
    flat = torch.zeros(15)
    views = [flat[:12].view(3, 4), flat[12:]]
    ev = []
    cd = mod.Countdown(ps, lambda b: ev.append((b, cd.filled(b))), lambda i, twice: None, [None, None])
    cd.set_buckets([0, 0])
    cd.set_views(views)
    x = torch.randn(2, 4)
    cd.arm(_native.FAST, [2], 0.5)
    lin(x).sum().backward()
    ref = nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    ref(x).sum().backward()
    assert ev == [(0, 2)] and cd.filled_marks() == b"\x01\x01"
    assert ps[0].grad is views[0] and ps[1].grad is views[1]
    assert torch.equal(views[0], ref.weight.grad * 0.5) and torch.equal(views[1], ref.bias.grad * 0.5)

    ev.clear()  # aliased grads accumulate into the views: not copied again
    cd.arm(_native.FAST, [2], 0.5)
    lin(x).sum().backward()
    assert ev == [(0, 0)] and cd.filled_marks() == b"\x00\x00" and ps[0].grad is views[0]

    ev.clear()  # ... with view_div (the default path's W): each divided in place as it arrives (torch's div_)
    before = [v.clone() for v in views]
    cd.arm(_native.FAST, [2], 0.5, view_div=2.0)
    lin(x).sum().backward()
    assert ev == [(0, 2)] and cd.filled_marks() == b"\x01\x01" and ps[0].grad is views[0]
    assert torch.equal(views[0], (before[0] + ref.weight.grad).div_(2.0))
    assert torch.equal(views[1], (before[1] + ref.bias.grad).div_(2.0))

    ev.clear()  # scale 0: a plain copy; -1: none
    for p in ps:
        p.grad = None
    cd.arm(_native.FAST, [2], 0.0)
    lin(x).sum().backward()
    assert ev == [(0, 2)] and torch.equal(views[1], ref.bias.grad)
    for p in ps:
        p.grad = None
    ev.clear()
    cd.arm(_native.FAST, [2], -1.0)
    lin(x).sum().backward()
    assert ev == [(0, 0)] and ps[1].grad is not views[1]

    ev.clear()  # divide (batched_grad_copy) and alias=False (not gradient_as_bucket_view)
    for p in ps:
        p.grad = None
    cd.arm(_native.FAST, [2], 0.0, 4.0, False)
    lin(x).sum().backward()
    assert ev == [(0, 2)] and ps[0].grad is not views[0]  # .grad stays the fresh gradient
    assert torch.equal(views[0], ref.weight.grad / 4) and torch.equal(ps[0].grad, ref.weight.grad)

    ev.clear()  # a view of another dtype (or None): never copied early
    cd.set_views([views[0].double(), None])
    for p in ps:
        p.grad = None
    cd.arm(_native.FAST, [2], 0.5)
    lin(x).sum().backward()
    assert ev == [(0, 0)]
    cd.remove()


@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_each_grad_is_copied_as_it_arrives():
    """On the CPU, buckets of large tensors: the native hooks copy each grad into its
    bucket slot as it arrives, as torch's reducer does (read while in cache, not by one
    pack after the last gradient); with gradient_as_bucket_view and fresh grads
    (zero_grad(set_to_none=True)) .grad becomes the view, so the fresh tensors are freed
    during backward.  Buckets of small tensors keep the one pack.  The reduced grads
    equal the Python hooks' (test above) and torch's (tests/test_parity.py)."""
    import fastddp.reducer
    from fastddp import DistributedDataParallel as DDP

    def wide():  # tensors of 64-256 KiB: above EARLY_COPY_MIN_NUMEL on average
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128))

    with single_rank_group():
        ddp = DDP(wide(), gradient_as_bucket_view=True)
        r = ddp.reducer
        for _ in range(3):
            for p in ddp.parameters():
                p.grad = None
            ddp(torch.randn(4, 256)).sum().backward()
        assert r.arming.early_any and r.native.filled_marks() == b"\x01" * len(r.params)
        views = [v for b in r.buckets for v in b.grad_views]
        assert all(any(p.grad is v for v in views) for p in ddp.parameters())
        small = DDP(_model(), gradient_as_bucket_view=True)  # tensors of < 1 KiB: the one pack
        for _ in range(2):
            small(torch.randn(4, 8)).sum().backward()
        assert not small.reducer.arming.early_any and set(small.reducer.native.filled_marks()) == {0}
        plain = DDP(wide())  # not view mode: copied early too, but .grad stays its own tensor
        for _ in range(3):
            plain(torch.randn(4, 256)).sum().backward()
        assert plain.reducer.arming.early_any and set(plain.reducer.native.filled_marks()) == {1}
        flats = [b.flat for b in plain.reducer.buckets]
        assert not any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                       for p in plain.parameters() for f in flats)
        assert fastddp.reducer.arming.EARLY_COPY_MIN_NUMEL == 16384
        del ddp, small, plain, r


# ------------------------------------------------------------ the fallback
def test_a_failed_build_falls_back_with_a_clear_warning(monkeypatch):
    from fastddp import DistributedDataParallel as DDP, _native

    def fail():
        raise RuntimeError("c++: command not found")
    ext = _native.EXTENSION
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_failed", None)
    monkeypatch.setattr(ext, "_import_built", lambda: None)
    monkeypatch.setattr(ext, "_build", fail)
    with _native_env(None), single_rank_group():
        with pytest.warns(RuntimeWarning, match="could not be built .*c\\+\\+: command not found.*Python hooks"):
            ddp = DDP(_model())
        assert ddp.reducer.native is None and len(ddp.reducer.arming.handles) == 6
        ddp(torch.randn(4, 8)).sum().backward()  # the Python hooks reduce
        assert all(p.grad is not None for p in ddp.parameters())
        with _native_env("require"), pytest.raises(RuntimeError, match="could not be built"):
            DDP(_model())
        del ddp


@pytest.mark.slow
@pytest.mark.skipif(OFF, reason="FASTDDP_NATIVE=0")
def test_build_without_ninja(tmp_path):
    """A machine with a compiler but no ninja (torch's JIT builder needs it)
    builds with the compiler directly, with torch's flags."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    import shutil
    for tool in ("c++", "g++", "cc", "gcc", "as", "ld"):
        path = shutil.which(tool)
        if path:
            os.symlink(path, bindir / tool)
    env = dict(os.environ, PATH=str(bindir), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), FASTDDP_NATIVE="require")
    code = ("import fastddp._native as n, torch\n"
            "from fastddp.kernels import _native_build\n"
            "assert not _native_build.has_ninja()\n"
            "m = n.countdown_module()\n"
            "lin = torch.nn.Linear(2, 2); ev = []\n"
            "cd = m.Countdown(list(lin.parameters()), ev.append, lambda i, t: None, [None, None])\n"
            "cd.set_buckets([0, 0]); cd.arm(n.FAST, [2]); lin(torch.ones(1, 2)).sum().backward()\n"
            "assert ev == [0], ev\n"
            "print('built', m.__file__)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "built" in res.stdout and str(tmp_path / "ext") in res.stdout


def test_off_by_environment():
    from fastddp import DistributedDataParallel as DDP
    with _native_env("0"), single_rank_group():
        ddp = DDP(_model())
        assert ddp.reducer.native is None and len(ddp.reducer.arming.handles) == 6
        ddp(torch.randn(4, 8)).sum().backward()
        del ddp


def test_mixed_precision_swap_keeps_the_hooks():
    """mixed_precision(param_dtype=fp16) swaps the parameters' data each
    forward (new AccumulateGrad nodes); the gradients still reduce."""
    from fastddp import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401 (torch present)
    try:
        from torch.nn.parallel.distributed import _MixedPrecision as MP
    except ImportError:
        pytest.skip("this torch has no DDP mixed precision config")
    with single_rank_group():
        m = _model()
        ref = copy.deepcopy(m)
        ddp = DDP(m, mixed_precision=MP(param_dtype=torch.float16, reduce_dtype=torch.float32))
        for _ in range(3):
            ddp(torch.randn(4, 8)).float().sum().backward()
            assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ddp.parameters())
            for p in ddp.parameters():
                p.grad = None
        del ddp, ref
