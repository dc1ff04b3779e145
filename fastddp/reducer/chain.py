"""The native issue chain: bucket complete -> pack -> in-order issue in C++.

torch's reducer runs the chain from "a bucket's last gradient is in" to "its
all-reduce is issued" in C++.  fastddp's Python runs it otherwise: per bucket
about a dozen calls (the reducer's bucket bookkeeping, the mode's pack and
issue, ``dist.all_reduce``'s own Python), ~75-125 us a bucket inside a
backward whose caches are cold (world 1, the transformer:
reports/amd-epyc/2026-12-07-native-issue-chain.md).  Where the bucket mode
is the plain all-reduce, every bucket has native slots and the group is a
C++ gloo group, the native countdown (``csrc/countdown.cpp``,
``Countdown.chain``) packs each complete bucket and issues the packed ones
in bucket order itself, and Python is called once a step, when every
bucket is issued (the reducer's :meth:`~.core.Reducer._native_chain`).  The
same ATen ops and the same ``ProcessGroup.allreduce`` as the Python path,
so the same bits and the same collectives in the same order.

A bucket the native pack declines (a missing grad, a partial early copy,
another dtype: what :func:`~fastddp.reduction.datapath.fill_native` also
declines) hands the iteration to Python: :meth:`IssueChain.take` gives the
reducer what the chain packed and issued, and the Python path goes on from
there.  Anything the Python path does per bucket that the chain would skip
turns the chain off for the iteration: profiler ranges, check_finite,
in-place segments, a comm hook, a join whose divisor is pending, a GPU.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import groups, kernels, profiling
from ..comm import Pending
from ..reduction.plain import AllReduce

__all__ = ["IssueChain"]


def _plain_gloo(pg) -> bool:
    """A group the native module can call without Python: torch's own C++
    gloo group (not a Python subclass, not another backend)."""
    return (type(pg) is dist.ProcessGroup and groups.is_registered(pg)
            and groups.backend_name(pg) == "gloo")


class IssueChain:
    """The native issue chain of one reducer (``native``: its countdown)."""

    def __init__(self, native, pg, on_chain):
        self.native = native
        self.ok = bool(native is not None and _plain_gloo(pg) and native.set_group(pg, on_chain))
        self.kept = False  # every bucket issued by the chain, which keeps their Works for finish()

    def arm(self, buckets, mode, ctx, *, fast: bool, join_pending: bool) -> bool:
        """After the countdown's arm: chain this iteration where nothing the
        Python path does per bucket would be skipped.  Returns whether it does."""
        if not self.ok:
            return False
        self.kept = False
        on = (fast and type(mode) is AllReduce and not join_pending and ctx.native is not None
              and ctx.pre_unpack is None and not ctx.comm.cuda
              and not (profiling.enabled() or profiling._profiler_on())
              and not any(b.health is not None or b.sparse or mode.segments(ctx, b) for b in buckets))
        self.native.arm_chain(on, int(mode.scaling) if on else 0, float(ctx.divisor()) if on else 1.0)
        return on

    def off(self) -> None:
        if self.ok:
            self.native.arm_chain(False, 0, 1.0)

    def in_flight(self, buckets) -> tuple[int, int]:
        """(collectives, bytes) the chain issued that :meth:`take` has not
        counted yet: ``stats()`` read mid-backward sees them."""
        if not self.ok:
            return 0, 0
        taken, issued = self.native.chain_issued()
        return issued - taken, sum(b.flat.numel() * b.flat.element_size() for b in buckets[taken:issued])

    def take(self, buckets, comm, keep: bool) -> int:
        """Python takes the iteration over: the buckets the chain packed are
        complete, those it issued are counted as the Python path counts
        them and hold their Work, or with ``keep`` (every bucket issued) the
        chain keeps the Works for :meth:`finish`.  Returns the next bucket
        to issue."""
        issued, packed, works, packs = self.native.chain_state(keep)
        self.kept = keep
        for b, done in zip(buckets, packed):
            if done:
                b.pending, b.prefilled = 0, 0
        for b in buckets[:issued]:
            comm.bytes_on_wire += b.flat.numel() * b.flat.element_size()
            comm.collectives += 1
        for b, work in zip(buckets, works):
            b.work = Pending(work=work, tensor=b.flat)
        for _ in range(packs):
            kernels.count_served("pack")
        return issued

    def finish(self, buckets, view_mode: bool) -> None:
        """The finalize of an iteration whose Works the chain kept: every one
        waited for and each bucket unpacked in C++ (the GIL released while
        it waits); a bucket it could not unpack, and the ones after it, get
        a completed :class:`Pending` for the Python unpack.  Else nothing."""
        if not self.kept:
            return
        self.kept = False
        done = self.native.chain_finish(view_mode)
        for b in buckets[done:]:
            b.work = Pending()
        if not view_mode:
            for _ in range(done):
                kernels.count_served("unpack")
