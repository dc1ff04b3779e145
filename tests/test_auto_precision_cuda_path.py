"""``auto_precision_hook`` on CUDA never makes the host wait for the device
once it has settled (contract: nothing in a steady-state step syncs).

No GPU here, so the two CUDA-only pieces are driven with stand-ins: the
step clock with fake timing events that say whether they have completed
(and fail the test if waited for where they must not be), and the
decisions' group, whose gloo twin is made for a CUDA device on gloo ranks
(making it touches no device), with a ctx that names a CUDA device so any
device tensor would fail here.
"""

from __future__ import annotations

import types

import pytest
import torch

from fastddp.reduction.stepclock import StepClock
from tests._dist import STAND_IN, world2  # noqa: F401

pytestmark = [pytest.mark.timeout(300)]
ranks = pytest.mark.skipif(STAND_IN, reason="fastddp's auto precision")
CUDA = torch.device("cuda")


class FakeEvent:
    """A CUDA timing event: ``done`` says whether the device has reached it."""

    waits_allowed = True
    made: list = []

    def __init__(self):
        self.t, self.done, self.waited = None, True, False
        FakeEvent.made.append(self)

    def record(self):
        self.t = len(FakeEvent.made) * 1e-3  # ms: later records are later

    def query(self):
        return self.done

    def synchronize(self):
        assert FakeEvent.waits_allowed, "the host waited for the device in a steady-state step"
        self.waited, self.done = True, True

    def elapsed_time(self, other):
        assert self.done and other.done, "elapsed_time of an event that has not completed"
        return (other.t - self.t) * 1e3


def _clock_with_windows(n):
    FakeEvent.made = []
    c = StepClock(CUDA, None, event=FakeEvent)
    for it in range(n):
        c.start(it, "fp8")
        c.end(it)
    return c


def test_settled_reads_skip_windows_still_queued_and_never_wait():
    c = _clock_with_windows(4)
    assert c.lag == 2
    c.marks[1][1].done = False  # iteration 1's end is still queued on the device
    FakeEvent.waits_allowed = False
    try:
        got = c.take(4)  # iterations 0..2 are due
    finally:
        FakeEvent.waits_allowed = True
    assert sorted(got) == [0, 2] and c.not_ready == 1
    assert all(v[0] == "fp8" and v[1] > 0 for v in got.values())
    assert not any(e.waited for e in FakeEvent.made)
    assert list(c.marks) == [3]  # not due yet: kept


def test_the_trial_waits_for_its_windows():
    c = _clock_with_windows(3)
    c.marks[0][1].done = False
    got = c.take(3, wait=True)
    assert sorted(got) == [0, 1] and c.not_ready == 0
    assert list(c.marks) == [2] and FakeEvent.made[1].waited


def _decision_group(rank, world):
    import torch.distributed as dist

    from fastddp.reduction.stepclock import decision_group

    pg = dist.group.WORLD
    on_cpu, _ = decision_group(pg, torch.device("cpu"))
    side, where = decision_group(pg, CUDA)
    again, _ = decision_group(pg, CUDA)
    sub = dist.new_group([0])  # every rank calls new_group; rank 1 gets a placeholder
    sub_side = decision_group(sub, CUDA)[0] if rank == 0 else "n/a"
    t = torch.tensor([float(rank), 10.0 - rank], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=side)
    return (on_cpu, side is not None and side is not pg, again is side, dist.get_backend(side), where,
            sub_side, t.tolist())


@ranks
def test_cuda_decisions_go_over_a_gloo_twin_made_once(world2):
    got = world2.run(_decision_group)
    for on_cpu, twin, once, backend, where, _, maxed in got:
        assert on_cpu is None  # gloo groups reduce host tensors already
        assert twin and once and backend == "gloo" and "gloo" in where
        assert maxed == [1.0, 10.0]
    assert got[0][5] is None  # a sub-group of the world: no twin (new_group needs every rank)


def _max_on_the_twin(rank, world):
    import torch.distributed as dist

    import fastddp.hooks as fh
    from fastddp.reduction.autoprec import AutoPrecision
    from fastddp.reduction.stepclock import decision_group, max_over_ranks

    mode = AutoPrecision(fh.AutoPrecisionState(lowest="bf16"), {"fp32": None, "bf16": None}, CUDA)
    mode.side, mode.decided_on = decision_group(dist.group.WORLD, CUDA)
    # a ctx whose comm names the CUDA device: a device tensor would raise here (no CUDA)
    ctx = types.SimpleNamespace(world=world, comm=types.SimpleNamespace(device=CUDA, pg=dist.group.WORLD))
    return max_over_ranks(ctx, mode.side, [0.5 + rank, 2.0 - rank]), mode.stats()["auto_precision"]["decided_on"]


@ranks
def test_decisions_never_make_a_device_tensor_on_cuda(world2):
    for vals, where in world2.run(_max_on_the_twin):
        assert vals == [1.5, 2.0] and "gloo" in where


def _waits_by_phase(rank, world):
    import fastddp.hooks as fh
    from fastddp.reduction import stepclock
    from tests.test_auto_precision import SyntheticClock, _ddp, _train

    calls = []
    real = stepclock.StepClock.take

    def take(self, before, wait=False):
        calls.append((before, wait))
        return real(self, before, wait)

    stepclock.StepClock.take = take
    try:
        m = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
        _train(m, 40, rank)
    finally:
        stepclock.StepClock.take = real
    st = m.stats()["auto_precision"]
    trial = (st["decisions"][0]["step"] - st["trial_steps"], st["decisions"][0]["step"])
    return calls, trial, st["state"]


@ranks
def test_only_the_trial_reads_its_windows_waiting(world2):
    calls, (t0, settled), state = world2.run(_waits_by_phase)[0]
    assert state == "settled" and settled < 40
    after = [w for it, w in calls if it >= settled]
    assert after and not any(after), "a settled step read its window waiting for the device"
    assert all(w for it, w in calls if t0 < it < settled), "the trial's reads should wait (no round lost)"
