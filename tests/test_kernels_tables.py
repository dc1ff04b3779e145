"""Pointer tables on an asynchronous device whose gradients are fresh every
step (``zero_grad(set_to_none=True)`` with bucket views): no table waits while
the GPU lags by less than the ring's size, no per-step allocation once the
ring covers the lag, no table rewritten while a launch that read it may still
run, and the same bits as the reference.

Interpreter session (``TRITON_INTERPRET=1``) on CPU tensors: the launcher
code is the CUDA path's, with the device's queue emulated (streams and
events of a GPU that runs the work of host step ``j`` once the host is at step
``j + lag + 1``, or when the host synchronizes on it).  The GPU checks are in
tests/test_kernels_layout.py and tests/test_gpu_cuda_path.py.
"""

from __future__ import annotations

import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import Layout, reference
from fastddp.kernels import _table_ring as TR
from tests._compare import assert_bits

from .test_kernels import BF16, FP32, INTERPRET, SPECIAL_VALUES, THIRD, make

pytestmark = [pytest.mark.interpret, SPECIAL_VALUES,
              pytest.mark.skipif(not INTERPRET, reason="emulates the device queue for CPU tensors")]

NUMELS = [33, 1, 70]


class _LaggingGpu:
    """The queue of an emulated GPU ``lag`` host steps behind the host."""

    class _Stream:
        cuda_stream = 1

        def wait_event(self, ev):
            pass  # one stream: its work runs in order anyway

    class _Event:
        def __init__(self, gpu):
            self.gpu, self.t = gpu, None

        def record(self, stream):
            self.t = self.gpu.step

        def query(self) -> bool:
            return self.t is None or self.t <= self.gpu.done()

        def synchronize(self):
            self.gpu.forced = max(self.gpu.forced, self.t)

    def __init__(self, lag: int):
        self.lag, self.step, self.forced = lag, 0, -1
        self.allocations = 0
        self.stream_ = self._Stream()

    def done(self) -> int:
        """The last host step whose work has completed."""
        return max(self.step - self.lag - 1, self.forced)

    def tables(self, rows, width, device):
        self.allocations += 1
        return torch.empty((rows, width), dtype=torch.int64), torch.empty((rows, width), dtype=torch.int64)

    def stream(self, device):
        return self.stream_

    def event(self):
        return self._Event(self)


def _run(monkeypatch, lag: int, steps: int, fresh):
    """``steps`` packs of one layout on a GPU ``lag`` steps behind; ``fresh(j)``
    gives step j's gradients.  Checks at each step that no slot still read by
    queued work was rewritten and that the bucket holds the reference's bits.
    Returns (counter deltas, allocations after each step, the ring)."""
    gpu = _LaggingGpu(lag)
    monkeypatch.setitem(TR.ASYNC_QUEUES, "cpu", gpu)
    lay = Layout([(n,) for n in NUMELS])
    flat = torch.empty(sum(NUMELS), dtype=BF16)
    last_read: dict[int, int] = {}  # slot -> the last host step whose launch read it
    allocations = []
    before = K.stats()
    for j in range(steps):
        gpu.step = j
        srcs = fresh(j)
        ring = next(iter(lay.cache.values())).ring if lay.cache else None
        held = {id(s): s.host_np.copy() for s in ring.slots} if ring else {}
        K.pack(srcs, flat, layout=lay, scale=THIRD)
        ring = next(iter(lay.cache.values())).ring
        for s in ring.slots:
            if id(s) in held and not (held[id(s)] == s.host_np).all():
                read = last_read.get(id(s), -1)  # -1: a new slot, never read
                assert read <= gpu.done(), f"step {j}: a table read at step {read} was rewritten before that launch ran"
        last_read[id(ring.cur)] = j
        assert (ring.cur.dev == ring.cur.host).all()
        want = torch.empty_like(flat)
        reference.pack(srcs, want, scale=THIRD)
        assert_bits(flat, want, f"step {j}")
        allocations.append(gpu.allocations)
    after = K.stats()
    return {k: after[k] - before[k] for k in before}, allocations, ring


def _cycling_grads(period: int):
    """Fresh values every step at addresses that come back every ``period``
    steps: the caching allocator hands a record_stream'ed block out again once
    the GPU ran the pack that read it, lag + 1 steps later."""
    pool = [make(FP32, NUMELS, seed=k) for k in range(period)]

    def fresh(j):
        srcs = pool[j % period]
        for s, v in zip(srcs, make(FP32, NUMELS, seed=100 + j)):
            s.copy_(v)
        return srcs
    return fresh


def _new_grads():
    """Fresh values at new addresses every step (kept alive: never reused)."""
    keep = []

    def fresh(j):
        keep.append(make(FP32, NUMELS, seed=100 + j))
        return keep[-1]
    return fresh


LAG = 6  # the host six steps ahead of the GPU: past a ring of four, within sixteen


def test_cycling_addresses_reuse_their_tables_without_a_copy_or_a_wait(monkeypatch):
    steps = 4 * (LAG + 1)
    d, allocations, ring = _run(monkeypatch, LAG, steps, _cycling_grads(LAG + 1))
    assert d["table_waits"] == 0, d
    assert d["table_uploads"] == LAG + 1, "one copy per address set, then none"
    assert d["launches"] == steps and d["pack_calls"] == steps
    assert allocations[LAG] == allocations[-1], "the ring stopped growing once it covered the lag"
    assert len(ring.slots) <= 2 * (LAG + 1)


def test_new_addresses_every_step_never_wait_within_the_ring(monkeypatch):
    steps = 4 * (LAG + 1)
    d, allocations, ring = _run(monkeypatch, LAG, steps, _new_grads())
    assert d["table_waits"] == 0, d
    assert d["table_uploads"] == steps
    assert allocations[LAG] == allocations[-1], "no allocation per step once the ring covers the lag"
    assert LAG + 1 <= len(ring.slots) <= 2 * (LAG + 1)


def test_a_lag_past_the_ring_waits_and_rewrites_only_finished_tables(monkeypatch):
    lag = TR.MAX_SLOTS + 2
    steps = lag + 8
    d, allocations, ring = _run(monkeypatch, lag, steps, _new_grads())
    assert len(ring.slots) == TR.MAX_SLOTS
    assert d["table_waits"] == steps - TR.MAX_SLOTS  # every step once all slots are in flight
    assert d["table_uploads"] == steps
