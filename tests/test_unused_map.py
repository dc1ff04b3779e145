"""The used-parameter map of ``find_unused_parameters=True`` (and of
static_graph's first iteration): one map tensor for good, its reduced values
read back to the host only in a step where some parameter was unused on this
rank (torch's rule), and the gradients still torch's, bit for bit.

A read-back is counted as a ``Tensor.tolist`` called from fastddp's
readiness module (where the map lives); the map is the tensor that module
passes to ``all_reduce``.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch

from tests._compare import compare_grads
from tests._dist import ddp_class, fastddp_only, torch_reference, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model

pytestmark = [pytest.mark.timeout(300), fastddp_only]

STEPS = 5


@contextlib.contextmanager
def _watch_map():
    """Count the map's read-backs and collect the tensors all-reduced as the map."""
    import fastddp.groups as G
    import fastddp.reducer.readiness as R

    seen = {"reads": 0, "maps": []}
    real_tolist, real_all_reduce = torch.Tensor.tolist, G.all_reduce

    def from_readiness():
        return sys._getframe(2).f_code.co_filename == R.__file__

    def tolist(self):
        if from_readiness():
            seen["reads"] += 1
        return real_tolist(self)

    def all_reduce(tensor, *a, **k):
        if from_readiness():
            seen["maps"].append(tensor)
        return real_all_reduce(tensor, *a, **k)

    torch.Tensor.tolist, G.all_reduce = tolist, all_reduce
    try:
        yield seen
    finally:
        torch.Tensor.tolist, G.all_reduce = real_tolist, real_all_reduce


def _map_body(rank, world_size, schedule, kwargs):
    m_ref = make_model("branch_always", seed=3)
    m_ref.schedule = schedule
    m_test = copy.deepcopy(m_ref)
    ref = torch_reference(m_ref, **kwargs)
    test = ddp_class()(m_test, **kwargs)
    per_step = []
    for step in range(STEPS):
        x, y = make_batch("branch_always", rank, step)
        loss_fn(ref(x, step=step, rank=rank), y).backward()
        with _watch_map() as seen:
            loss_fn(test(x, step=step, rank=rank), y).backward()
        compare_grads(ref, test, f"rank {rank} step {step}")
        per_step.append((m_test.uses_branch(step, rank), seen["reads"], seen["maps"]))
        for p in [*m_ref.parameters(), *m_test.parameters()]:
            p.grad = None
    maps = [t for _, _, ts in per_step for t in ts]
    return [(used, reads, len(ts)) for used, reads, ts in per_step], all(t is maps[0] for t in maps)


@pytest.mark.parametrize("kwargs", [dict(find_unused_parameters=True),
                                    dict(find_unused_parameters=True, gradient_as_bucket_view=True),
                                    dict(find_unused_parameters=True, bucket_cap_mb=0.001)],
                         ids=["default", "view", "tiny_buckets"])
@pytest.mark.parametrize("schedule", ["always", "rank", "never"])
def test_map_read_back_only_when_a_param_is_unused_here(world2, schedule, kwargs):
    """Every param used here: no read-back (even where a peer left the branch
    unused); the branch unused here: one read-back, and its gradient (from the
    peer that used it, or none) is torch's."""
    for rank, (steps, same) in enumerate(world2.run(_map_body, schedule, kwargs)):
        for step, (used_here, reads, maps) in enumerate(steps):
            assert maps == 1, f"rank {rank} step {step}: {maps} map all-reduces, expected one"
            want = 0 if used_here else 1
            assert reads == want, (f"rank {rank} step {step} (branch {'used' if used_here else 'unused'} "
                                   f"here): {reads} read-backs of the map, expected {want}")
        assert same, f"rank {rank}: a new map tensor was all-reduced in some step (one for good expected)"


@pytest.mark.parametrize("schedule", ["always", "never"])
def test_static_graph_reads_the_first_map_only_if_a_param_is_unused(world2, schedule):
    """static_graph reduces the map once, in its first backward; it is read
    back then only if some param got no gradient here, and holds after."""
    for rank, (steps, _) in enumerate(world2.run(_map_body, schedule, dict(static_graph=True))):
        assert [maps for _, _, maps in steps] == [1] + [0] * (STEPS - 1), steps
        want = 0 if schedule == "always" else 1
        assert [reads for _, reads, _ in steps] == [want] + [0] * (STEPS - 1), f"rank {rank}: {steps}"


class _FakeEvent:
    """torch.cuda.Event's query/synchronize/record, scripted."""

    def __init__(self):
        self.done, self.calls = True, []

    def query(self):
        self.calls.append("query")
        return self.done

    def synchronize(self):
        self.calls.append("synchronize")
        self.done = True

    def record(self, stream):
        self.calls.append("record")
        self.done = False  # the upload just queued has not run yet


def test_pinned_staging_rewritten_only_when_the_marks_change():
    """The upload buffer is not rewritten while an earlier upload may read
    it: unchanged marks leave it alone (no query, no wait); changed marks wait
    for the last upload only if it has not run (the emulated event)."""
    from fastddp.reducer.readiness import PinnedStaging

    ev = _FakeEvent()
    st = PinnedStaging(4, pinned=False, event=ev)
    buf = st.buffer
    local = bytearray(4)
    u8 = torch.frombuffer(local, dtype=torch.uint8)
    dst = torch.full((4,), 7, dtype=torch.int32)

    local[:] = b"\x01\x01\x01\x01"
    st.upload(local, u8, dst, stream=None)  # first upload: nothing in flight
    assert ev.calls == ["query", "record"] and dst.tolist() == [1, 1, 1, 1]
    for _ in range(3):  # the same marks: the buffer is left alone, no query, no wait
        ev.calls.clear()
        dst.fill_(7)
        st.upload(local, u8, dst, stream=None)
        assert ev.calls == ["record"] and dst.tolist() == [1, 1, 1, 1]
    ev.calls.clear()
    local[2] = 0  # changed while the last upload has not run: wait for it first
    st.upload(local, u8, dst, stream=None)
    assert ev.calls == ["query", "synchronize", "record"] and dst.tolist() == [1, 1, 0, 1]
    ev.calls.clear()
    ev.done = True  # changed back after that upload ran (a read-back completed it): no wait
    local[2] = 1
    st.upload(local, u8, dst, stream=None)
    assert ev.calls == ["query", "record"] and dst.tolist() == [1, 1, 1, 1]
    assert st.buffer is buf, "the staging buffer must be allocated once"
