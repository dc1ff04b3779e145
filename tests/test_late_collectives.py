"""Collectives that complete late: no gradient is read before its collective.

The patterns of accelerate's ``test_sync`` ("Gradients not in sync when
they should be"): no_sync steps, then a synchronising one; or three forwards
under no_sync whose last backward is forced to synchronise.  On a quiet
machine gloo finishes a 2-scalar all-reduce long before anything reads
it, so a read that comes too early (a missed wait, a Future callback that
runs after the value is used, a bucket reused while in flight) only shows
under load.  Here every collective is made late on purpose, with a random
delay, so such a read shows on every run instead of one in a hundred.

:class:`LatePG` is a Python process group (the shape of fault-tolerant
wrappers; DDP is handed it as ``process_group``) that forwards each
collective to a gloo group from ONE worker thread, in issue order (so the
ranks stay in lockstep), after a random delay of up to ``DELAY_S``; its
Work's ``wait()`` and Future complete only then.  Each scenario runs a few
optimizer steps of a small model and checks every ``.grad`` after every
backward against an oracle computed on a plain copy of the module from every
rank's batch: ``W`` ranks' local gradients, accumulated and averaged where
the pattern synchronises.  A control (:func:`test_the_harness_sees_a_read_before_the_wait`)
removes the reducer's wait and checks that the harness reports it.
"""

from __future__ import annotations

import copy
import os
import queue
import random
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fastddp import settings
from tests._dist import STAND_IN, backward_with_sync_triggered, ddp_class, fastddp_only, world2  # noqa: F401

SEEDS = int(os.environ.get("FASTDDP_LATE_SEEDS", "2"))
"""Runs of each scenario (each with its own random delays); raise it to stress."""
DELAY_S = 0.004
"""Largest random delay before a collective runs (uniform): longer than a
small backward's remaining hooks, so an early read sees the unreduced bucket."""


class _LateWork(dist._Work):
    def __init__(self, fut: torch.futures.Future, done: threading.Event):
        super().__init__()
        self.fut, self.done = fut, done

    def wait(self, timeout=None):
        self.done.wait()
        self.fut.wait()  # raises what the collective raised
        return True

    def is_completed(self):
        return self.done.is_set()

    def get_future(self):
        return self.fut

    def result(self):
        return self.fut.value()


class LatePG(dist.ProcessGroup):
    """Forwards to ``inner`` (gloo) late, in order, from one thread."""

    def __init__(self, inner, seed: int, delay_s: float = DELAY_S):
        super().__init__(inner.rank(), inner.size())
        self.inner, self.delay_s = inner, delay_s
        self.rng = random.Random(seed)
        self.calls = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="late-pg", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._q.put, None)

    def _run(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            delay, op, fut, done, result = item
            time.sleep(delay)
            try:
                op().wait()
                fut.set_result(result)
            except Exception as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
            done.set()

    def _late(self, op, result):
        self.calls += 1
        fut, done = torch.futures.Future(), threading.Event()
        self._q.put((self.rng.uniform(0, self.delay_s), op, fut, done, result))
        return _LateWork(fut, done)

    def drain(self):
        """Wait until every collective issued so far has run."""
        w = self._late(lambda: _Done(), None)
        w.wait()

    def close(self):
        self._q.put(None)
        self._thread.join(timeout=10)

    # the collectives DDP (torch's and fastddp's) issue on a Python group
    def allreduce(self, tensors, opts):
        return self._late(lambda: self.inner.allreduce(tensors, opts), tensors)

    def broadcast(self, tensors, opts):
        return self._late(lambda: self.inner.broadcast(tensors, opts), tensors)

    def allgather(self, outputs, inputs, opts):
        return self._late(lambda: self.inner.allgather(outputs, inputs, opts), outputs)

    def _allgather_base(self, out, inp, opts):
        return self._late(lambda: self.inner._allgather_base(out, inp, opts), [out])

    def alltoall_base(self, out, inp, out_split, in_split, opts):
        return self._late(lambda: self.inner.alltoall_base(out, inp, out_split, in_split, opts), [out])

    def getBackendName(self):
        return "late-gloo"


class _Done:
    def wait(self):
        return True


# ------------------------------------------------------------------ the model
class _Net(nn.Module):
    """Several buckets at a tiny cap, an optional branch no rank uses."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.skip = nn.Linear(6, 2) if unused else None

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batch(rank: int, k: int):
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def _loss(model, rank, k):
    x, y = _batch(rank, k)
    return (model(x) - y).pow(2).mean()


class _Oracle:
    """Every rank's expected ``.grad`` (W of them, for a parameter list),
    from local gradients on a plain copy of the module."""

    def __init__(self, module: nn.Module, world: int):
        self.m, self.world = copy.deepcopy(module), world
        self.expect: list[list[torch.Tensor | None]] = [[None] * len(list(self.m.parameters()))
                                                         for _ in range(world)]

    def load(self, module: nn.Module):
        with torch.no_grad():
            for q, p in zip(self.m.parameters(), module.parameters()):
                q.copy_(p)

    def local(self, r: int, k: int) -> list[torch.Tensor | None]:
        self.m.zero_grad(set_to_none=True)
        _loss(self.m, r, k).backward()
        return [None if q.grad is None else q.grad.clone() for q in self.m.parameters()]

    def backward(self, k: int, sync: bool):
        """Micro-batch ``k`` on every rank; ``sync``: this backward is reduced."""
        for r in range(self.world):
            for i, g in enumerate(self.local(r, k)):
                if g is not None:
                    e = self.expect[r][i]
                    self.expect[r][i] = g if e is None else e + g
        if sync:
            for i in range(len(self.expect[0])):
                got = [self.expect[r][i] for r in range(self.world)]
                if all(g is None for g in got):
                    continue
                mean = sum(torch.zeros_like(next(g for g in got if g is not None)) if g is None else g
                           for g in got) / self.world
                for r in range(self.world):
                    self.expect[r][i] = mean.clone()

    def zero(self):
        self.expect = [[None] * len(self.expect[0]) for _ in range(self.world)]


def _check(ddp, oracle, rank, where, rtol):
    bad = []
    for i, (p, e) in enumerate(zip(ddp.module.parameters(), oracle.expect[rank])):
        if e is None:
            if p.grad is not None and p.grad.abs().max() > 0:
                bad.append(f"{where}: param {i} has a grad, none expected")
        elif p.grad is None:
            bad.append(f"{where}: param {i} has no grad")
        elif not torch.allclose(p.grad, e, rtol=rtol, atol=max(1e-7, rtol * float(e.abs().max()))):
            err = float((p.grad - e).abs().max())
            bad.append(f"{where}: param {i} off by {err:.3g} (|expected| max {float(e.abs().max()):.3g})")
    return bad


# -------------------------------------------------------------- the scenarios
SCENARIOS = {
    # name: (DDP kwargs, pattern, hook, fastddp only)
    # pattern: per optimizer step, the backwards' kinds: "s" synchronising,
    # "l" local (no_sync), "F" three forwards under no_sync, their last
    # backward forced to synchronise (accelerate's trigger_sync_in_backward),
    # "r" two losses through one forward (retain_graph): both reduced (fastddp)
    "plain": ({}, ["s"] * 4, None, False),
    "no_sync_then_sync": ({}, ["ls", "lls", "s", "ls"], None, False),
    "accelerate_distributed_sync": ({}, ["lsls"], None, False),
    "trigger_sync_in_backward": ({}, ["F", "F"], None, False),
    "tiny_buckets_view": (dict(bucket_cap_mb=0.0005, gradient_as_bucket_view=True), ["ls", "s", "lls"], None, False),
    "find_unused": (dict(find_unused_parameters=True, bucket_cap_mb=0.0005), ["s", "ls", "s"], None, False),
    "static_graph": (dict(static_graph=True, bucket_cap_mb=0.0005), ["s", "s", "ls", "s"], None, False),
    "batched_grad_copy": (dict(batched_grad_copy=True, bucket_cap_mb=0.0005), ["s", "ls", "s"], None, True),
    "python_hook_future": (dict(bucket_cap_mb=0.0005), ["s", "ls", "s"], "python", False),
    "fp16_hook": (dict(bucket_cap_mb=0.0005), ["s", "ls", "s"], "fp16", True),
    "second_backward": (dict(bucket_cap_mb=0.0005), ["r", "s", "r"], None, True),
    "auto_caps": (dict(bucket_cap_mb="auto"), ["s"] * 3 + ["ls", "s"] * 4, None, True),
}


def _python_hook(pg, bucket):
    """A user's comm hook: the group's own all-reduce, averaged in a Future callback."""
    buf = bucket.buffer()
    w = pg.size()
    return pg.allreduce([buf], dist.AllreduceOptions()).get_future().then(lambda f: f.value()[0].div_(w))


def _scenario_body(rank, world_size, name, native, seed):
    kwargs, pattern, hook, _ = SCENARIOS[name]
    os.environ["FASTDDP_NATIVE"] = native
    settings.reload()
    inner = dist.new_group(list(range(world_size)), backend="gloo")
    pg = LatePG(inner, seed=seed * 7919 + rank)
    try:
        torch.manual_seed(0)
        base = _Net(unused=kwargs.get("find_unused_parameters", False))
        ddp = ddp_class()(copy.deepcopy(base), process_group=pg, **kwargs)
        rtol = 1e-5
        if hook == "python":
            ddp.register_comm_hook(pg, _python_hook)
        elif hook == "fp16":
            from fastddp import hooks
            ddp.register_comm_hook(None, hooks.fp16_compress_hook)
            rtol = 2e-3
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        oracle = _Oracle(base, world_size)
        bad, k = [], 0
        for step, kinds in enumerate(pattern):
            oracle.load(ddp.module)
            for kind in kinds:
                where = f"step {step} backward {kind}{k}"
                if kind == "l":
                    with ddp.no_sync():
                        _loss(ddp, rank, k).backward()
                    oracle.backward(k, sync=False)
                elif kind == "s":
                    _loss(ddp, rank, k).backward()
                    oracle.backward(k, sync=True)
                elif kind == "r":  # two losses through one forward
                    x, y = _batch(rank, k)
                    out = ddp(x)
                    (out - y).pow(2).mean().backward(retain_graph=True)
                    oracle.backward(k, sync=True)
                    bad += _check(ddp, oracle, rank, where + " (first loss)", rtol)
                    (out - y).pow(2).mean().backward()
                    oracle.backward(k, sync=True)
                elif kind == "F":  # accelerate's test_distributed_sync_multiple_fwd
                    losses = []
                    for j in range(3):
                        with ddp.no_sync():
                            losses.append(_loss(ddp, rank, k + j))
                    for j, loss in enumerate(losses):
                        if j < 2:
                            loss.backward()
                            oracle.backward(k + j, sync=False)
                            bad += _check(ddp, oracle, rank, f"{where}.{j}", rtol)
                        else:
                            backward_with_sync_triggered(ddp, loss)
                            oracle.backward(k + j, sync=True)
                    k += 2
                bad += _check(ddp, oracle, rank, where, rtol)
                k += 1
            opt.step()
            opt.zero_grad(set_to_none=True)
            oracle.zero()
        pg.drain()
        return bad, pg.calls
    finally:
        os.environ.pop("FASTDDP_NATIVE", None)
        settings.reload()
        pg.drain()
        pg.close()
        dist.barrier()


@pytest.mark.parametrize("native", ["1", "0"], ids=["native_hooks", "python_hooks"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_late_collectives_give_the_averaged_gradients(world2, name, native):
    if SCENARIOS[name][3] and STAND_IN:
        pytest.skip("fastddp-only behaviour (FASTDDP_TEST_IMPL=torch stand-in)")
    for seed in range(SEEDS):
        res = world2.run(_scenario_body, name, native, seed, timeout=120)
        for rank, (bad, calls) in enumerate(res):
            assert calls > 0, "no collective went through the late group"
            assert not bad, f"rank {rank}, seed {seed}: grads differ from the ranks' average:\n" + "\n".join(bad)


# ---------------------------------------------------------------- the control
def _early_read_body(rank, world_size):
    """The reducer's wait for a bucket's collective removed: the harness must see it."""
    from fastddp import comm

    wait = comm.Comm.wait
    comm.Comm.wait = lambda self, pending: None
    try:
        return _scenario_body(rank, world_size, "no_sync_then_sync", "0", 0)[0]
    finally:
        comm.Comm.wait = wait


@fastddp_only
def test_the_harness_sees_a_read_before_the_wait(world2):
    res = world2.run(_early_read_body, timeout=120)
    assert all(res), f"a reducer that does not wait for its collectives passed the harness: {res}"
