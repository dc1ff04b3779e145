"""Large gradients all-reduced where they are (the CPU's plain all-reduce).

On the CPU, ``AllReduce`` reduces each gradient of at least
``FASTDDP_IN_PLACE_NUMEL`` elements in ``.grad`` itself, one collective per
segment of the bucket (:meth:`fastddp.buckets.Bucket.segments`), and the
runs of smaller gradients from the flat bucket.  Checked here: the segments
(pure), torch's DDP side by side bit for bit at W=2 (default and
``batched_grad_copy``, accumulation, ``no_sync``, a channels_last weight that
must go through its slot), within a tolerance at W=3 (gloo's sum order
depends on an element's position in the buffer), join's shadow collectives,
and the options that keep one collective per bucket.  The rank workers set a
small threshold so that small models exercise it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests._dist import STAND_IN, setting, world2, world3  # noqa: F401
from tests._parity import side_by_side
from tests.test_auto_precision import SyntheticClock

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(STAND_IN, reason="fastddp's own reduction path")]

#: the workers' threshold: the models' weights (16384, 65536 and 36864
#: elements) are reduced in place, biases and the small head from the bucket
LEAST = 10_000


def _least(value):
    """FASTDDP_IN_PLACE_NUMEL=value in this worker while the wrappers are built."""
    return setting("FASTDDP_IN_PLACE_NUMEL", value)


class _Net(nn.Module):
    """Two large weights around small tensors; ``conv``: a channels_last
    convolution weight of 36864 elements whose gradient is not contiguous."""

    def __init__(self, conv: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 256)
        self.head = nn.Linear(256, 8)
        self.conv = nn.Conv2d(64, 64, 3, padding=1).to(memory_format=torch.channels_last) if conv else None

    def forward(self, x):
        if self.conv is not None:
            x = self.conv(x.reshape(-1, 64, 1, 1).expand(-1, 64, 2, 2).contiguous(
                memory_format=torch.channels_last)).mean((2, 3))
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)


# --------------------------------------------------------------------- pure

def test_segments_cut_large_slots_and_merge_the_runs_between():
    from fastddp import planner
    from fastddp.buckets import Bucket

    shapes = [(3,), (100,), (5, 4), (2,), (7,), (50,)]
    params = [torch.zeros(s) for s in shapes]
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:k]) for k in range(len(numels))]
    spec = planner.BucketSpec(0, tuple(range(len(params))), tuple(offsets), sum(numels), torch.float32,
                          torch.device("cpu"), 1 << 30)
    b = Bucket(spec, params)
    # slots: [0,3) [3,103) [103,123) [123,125) [125,132) [132,182)
    assert b.segments(50) == ((0, 3, -1), (3, 103, 1), (103, 132, -1), (132, 182, 5))
    assert b.segments(20) == ((0, 3, -1), (3, 103, 1), (103, 123, 2), (123, 132, -1), (132, 182, 5))
    assert b.segments(101) == ()  # nothing that large: one collective of the flat bucket
    assert b.segments(1) == tuple((o, o + n, k) for k, (o, n) in enumerate(zip(offsets, numels)))
    # the segments tile the bucket, so the collectives cover every element once
    segs = b.segments(20)
    assert segs[0][0] == 0 and segs[-1][1] == spec.numel
    assert all(a[1] == c[0] for a, c in zip(segs, segs[1:]))


def test_the_threshold_is_one_setting_with_a_clear_error(monkeypatch):
    from fastddp import reduction, settings

    try:
        for unset in (None, "auto", " AUTO "):  # unset or auto: the plain all-reduce measures whether it pays
            if unset is None:
                monkeypatch.delenv("FASTDDP_IN_PLACE_NUMEL", raising=False)
            else:
                monkeypatch.setenv("FASTDDP_IN_PLACE_NUMEL", unset)
            assert settings.reload().in_place_numel is None
            mode = reduction.choose(None, None, False, True)[0]
            assert mode.label == "in_place" and mode.formats == ["flat", "in-place"]
            assert mode.kind is reduction.Kind.ALLREDUCE and not mode.fused  # the default path, not a hook
            assert [m.in_place_min for m in mode.modes.values()] == [None, reduction.IN_PLACE_MIN_NUMEL]
            assert reduction.IN_PLACE_MIN_NUMEL == 1 << 20
            assert reduction.choose(None, None, False, True, torch.device("cuda"))[0].in_place_min is None
            assert reduction.choose(None, None, False, True, trial=False)[0].in_place_min is None
        monkeypatch.setenv("FASTDDP_IN_PLACE_NUMEL", "0")
        assert settings.reload().in_place_numel == 0
        assert reduction.choose(None, None, True, True)[0].in_place_min is None
        monkeypatch.setenv("FASTDDP_IN_PLACE_NUMEL", "4096")  # a number: always, no trial
        assert settings.reload().in_place_numel == 4096
        assert reduction.choose(None, None, True, True)[0].in_place_min == 4096
        monkeypatch.setenv("FASTDDP_IN_PLACE_NUMEL", "lots")
        with pytest.raises(ValueError, match="FASTDDP_IN_PLACE_NUMEL='lots' is not a whole number >= 0 or auto"):
            settings.reload()
    finally:
        monkeypatch.undo()
        settings.reload()


# ------------------------------------------------------------- side by side

def _collectives_and_slots(ddp):
    """What one synced step issued, and whether the in-place slots of the flat
    bucket were ever written (they must not be: the grads are reduced where
    they are)."""
    r = ddp.reducer
    expected = 0
    untouched = True
    for b in r.buckets:
        segs = r.mode.segments(r.ctx, b)
        expected += len(segs) or 1
        for start, stop, pos in segs:
            if pos >= 0:
                untouched = untouched and not bool(b.flat[start:stop].any())
    return expected, untouched


def _parity(rank, world, opts, set_to_none, micro, least, tol):
    with _least(least):
        before = {}

        def step_fn(ddp, x, y, step, is_ref):
            if not is_ref:
                before["n"] = ddp.stats()["collectives"]  # (the native chain counts its own)
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            return loss

        out = side_by_side(rank, world, _Net, kwargs=opts, steps=3, no_sync_micro=micro,
                           batch=_batch, step_fn=step_fn, set_to_none=set_to_none, tol=tol)
    r = out.test.reducer
    issued = out.test.stats()["collectives"] - before["n"]
    expected, untouched = _collectives_and_slots(out.test)
    return issued, expected, untouched, len(r.buckets)


@pytest.mark.parametrize("opts, set_to_none, micro", [
    ({}, True, 0),
    ({}, False, 2),
    ({"batched_grad_copy": True}, True, 0),
    ({"batched_grad_copy": True}, False, 2),
    ({"bucket_cap_mb": 0.05}, True, 1),
], ids=["default", "default-accumulate-no_sync", "batched", "batched-accumulate-no_sync", "small-buckets"])
def test_in_place_equals_torch_bit_for_bit_at_w2(world2, opts, set_to_none, micro):
    for issued, expected, untouched, buckets in world2.run(_parity, opts, set_to_none, micro, LEAST, None):
        assert issued == expected > buckets  # a collective per segment: some grads went in place
        assert untouched  # and never through their slot of the flat bucket


def test_in_place_off_by_zero_keeps_one_collective_per_bucket(world2):
    for issued, expected, _, buckets in world2.run(_parity, {}, True, 0, 0, None):
        assert issued == expected == buckets


def test_in_place_at_w3_within_the_sum_order_tolerance(world3):
    for issued, expected, untouched, buckets in world3.run(_parity, {}, True, 1, LEAST,
                                                           dict(rtol=1e-6, atol=1e-7)):
        assert issued == expected > buckets and untouched


def _channels_last(rank, world):
    with _least(LEAST):
        out = side_by_side(rank, world, lambda: _Net(conv=True), steps=3, batch=_batch)
    r = out.test.reducer
    b = r.buckets[-1] if r.buckets[-1].params[0] is out.test.module.conv.weight else \
        next(b for b in r.buckets if any(p is out.test.module.conv.weight for p in b.params))
    pos = next(k for k, p in enumerate(b.params) if p is out.test.module.conv.weight)
    start, stop = next((s, e) for s, e, k in r.mode.segments(r.ctx, b) if k == pos)
    # not contiguous: reduced from its slot (which now holds the last step's average)
    return bool(b.flat[start:stop].any()), out.test.module.conv.weight.grad.is_contiguous()


def test_a_grad_that_cannot_go_in_place_goes_through_its_slot(world2):
    for slot_used, contiguous in world2.run(_channels_last):
        assert slot_used and not contiguous


def _join(rank, world, least):
    from fastddp import DistributedDataParallel as F
    from torch.nn.parallel import DistributedDataParallel as T

    finals = []
    with _least(least):
        for cls in (T, F):
            torch.manual_seed(3)
            m = cls(_Net())
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            with m.join():
                for i in range(2 + 2 * rank):  # uneven: the joined rank shadows the others' segments
                    x, y = _batch(rank, i)
                    opt.zero_grad(set_to_none=True)
                    ((m(x) - y) ** 2).mean().backward()
                    opt.step()
            finals.append([p.detach().clone() for p in m.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*finals))


def test_join_shadows_every_segment_and_equals_torch(world2):
    assert all(world2.run(_join, LEAST))


def _kept_whole(rank, world, opts):
    from torch.nn.parallel.distributed import _MixedPrecision

    from fastddp import DistributedDataParallel as F

    if opts == "mixed_precision":
        opts = {"mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    with _least(LEAST):
        m = F(_Net(), **opts)
    r = m.reducer
    return [len(r.mode.segments(r.ctx, b)) for b in r.buckets]


@pytest.mark.parametrize("opts", [{"gradient_as_bucket_view": True}, {"find_unused_parameters": True},
                                  {"static_graph": True}, {"check_finite": True}, "mixed_precision"],
                         ids=["bucket-view", "find-unused", "static-graph", "check-finite", "mixed-precision"])
def test_options_that_keep_one_collective_per_bucket(world2, opts):
    # bucket views are the bucket already; a globally unused .grad must stay
    # as it was (known only after the packs); check_finite flags the flat
    # bucket; mixed precision puts the full-precision grads back at the unpack
    for counts in world2.run(_kept_whole, opts):
        assert counts and all(c == 0 for c in counts)


def _find_unused_parity(rank, world):
    with _least(LEAST):
        out = side_by_side(rank, world, _Net, kwargs={"find_unused_parameters": True}, steps=2,
                           batch=_batch, set_to_none=False)
    return out.checks


def test_find_unused_with_kept_grads_equals_torch(world2):
    assert all(n > 0 for n in world2.run(_find_unused_parity))


# ----------------------------------------------------- auto: the paired trial

def _auto(rank, world, costs, least, steps=24):
    """The default path with FASTDDP_IN_PLACE_NUMEL unset (auto) and the
    candidates' threshold at ``least``, side by side with torch's DDP for
    ``steps`` steps (the trial's included), each rank's trial timed by a
    synthetic clock of ``costs[rank]``.  Returns the choice, the trial's
    length and the collectives of each step."""
    from fastddp import reduction

    seen = []

    def make_test(module, **opts):
        from fastddp import DistributedDataParallel as F

        ddp = F(module, **opts)
        if costs is not None:
            ddp.reducer.mode.clock.synthetic = SyntheticClock(costs[rank])
        return ddp

    def step_fn(ddp, x, y, step, is_ref):
        n = None if is_ref else ddp.stats()["collectives"]
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        if n is not None:
            seen.append(ddp.stats()["collectives"] - n)
        return loss

    saved = reduction.IN_PLACE_MIN_NUMEL
    reduction.IN_PLACE_MIN_NUMEL = least
    try:
        with _least("auto"):
            out = side_by_side(rank, world, _Net, steps=steps, batch=_batch, step_fn=step_fn, make_test=make_test)
    finally:
        reduction.IN_PLACE_MIN_NUMEL = saved
    r = out.test.reducer
    if costs is None:  # no choice was built: the mode itself, and what it did
        return r.mode, r.stats(), seen, len(r.buckets), out.checks
    got = r.stats()["in_place"]
    whole = len(r.buckets)
    split = sum(len(r.mode.candidate("in-place").segments(r.ctx, b)) or 1 for b in r.buckets)
    # the last step's chain (the native issue chain serves a settled flat choice)
    chain = None if r.arming.chain is None or not r.arming.chain.ok else r.arming.chaining
    return got["chosen"], got["trial_steps"], seen, whole, split, out.checks, chain


def test_auto_takes_in_place_where_the_trial_measures_it_faster_bit_for_bit(world2):
    # rank 1 measures in place barely faster, rank 0 clearly: the MAX over the ranks decides, alike
    costs = [{"flat": 1.0, "in-place": 0.5}, {"flat": 1.0, "in-place": 0.9}]
    for chosen, trial, seen, whole, split, checks, chain in world2.run(_auto, costs, LEAST):
        assert chosen == "in-place" and trial > 0 and checks > 0  # torch's bits at every step, the trial's too
        assert split > whole and seen[-1] == split  # settled: a collective per segment
        assert not chain  # (segments: the Python path)
        assert set(seen) == {whole, split}  # the trial alternated the two


def native_countdown():
    from fastddp import _native
    return _native.countdown_module()


def test_auto_keeps_one_collective_per_bucket_where_the_trial_cannot_tell(world2):
    # equal on rank 0, in place slower on rank 1: the MAX is not faster by the margin, so flat stays
    costs = [{"flat": 1.0, "in-place": 1.0}, {"flat": 1.0, "in-place": 1.2}]
    for chosen, trial, seen, whole, split, checks, chain in world2.run(_auto, costs, LEAST):
        assert chosen == "flat" and trial > 0 and checks > 0
        assert seen[-1] == whole < split
        # settled flat: the native issue chain runs its candidate (None: no native module here)
        assert chain is True or (chain is None and native_countdown() is None), chain


def test_auto_builds_no_choice_where_no_gradient_is_large(world2):
    # every tensor below the threshold: no plan can cut a bucket, so the reducer
    # runs the flat all-reduce itself (no trial, no choice to delegate through)
    for mode, stats, seen, whole, checks in world2.run(_auto, None, 10 ** 9):
        assert type(mode).__name__ == "AllReduce" and mode.in_place_min is None, mode
        assert "in_place" not in stats and checks > 0  # torch's bits at every step
        assert set(seen) == {whole}  # one collective per bucket


def test_the_choice_is_dropped_only_where_no_dense_parameter_reaches_the_threshold():
    from fastddp import reduction
    from fastddp.reduction.choices import in_place_choice, without_idle_choice

    choice = in_place_choice(reduction.Scaling.MUL, False, 100)
    assert without_idle_choice(choice, 99) is choice.modes["flat"]
    assert without_idle_choice(choice, 100) is choice  # one parameter of 100 elements: a bucket may be cut
    plain = reduction.AllReduce(reduction.Scaling.MUL)
    assert without_idle_choice(plain, 0) is plain  # any other mode stays
