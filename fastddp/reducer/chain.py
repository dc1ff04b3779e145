"""The native issue chain: bucket complete -> pack -> in-order issue, and
wait -> unpack, in C++.

torch's reducer runs the chain from "a bucket's last gradient is in" to "its
all-reduce is issued", and its finalize, in C++.  fastddp's Python runs them
otherwise: per bucket about a dozen calls on the way out (the reducer's
bucket bookkeeping, the mode's pack and issue, ``dist.all_reduce``'s own
Python) and five on the way back, inside a backward whose caches are cold
(reports/amd-epyc/2026-12-07-native-issue-chain.md).  Where the bucket mode
is the plain all-reduce, every bucket has native slots and the group is a
C++ gloo group, the native countdown (``csrc/countdown.cpp``) packs each
complete bucket and issues the packed ones in bucket order itself; with
the last issue it queues its own engine callback (torch's
finalize_backward), which waits for every bucket and unpacks it in C++,
then calls Python once a step (the reducer's
:meth:`~.core.Reducer._native_chain`: the bookkeeping and ``_finalize``,
with nothing left to wait for).  Nothing runs on the training thread
between the last issue and the wait, as in torch's, so on a busy host the
collective's threads get the cores.  The same ATen ops and the same
``ProcessGroup.allreduce`` as the Python path: the same bits and the same
collectives in the same order.

A bucket the native pack declines (a missing grad, a partial early copy,
another dtype: what :func:`~fastddp.reduction.datapath.fill_native` also
declines) hands the iteration to Python: :meth:`IssueChain.take` gives the
reducer what the chain packed and issued, and the Python path goes on from
there; a bucket the native unpack declines (a grad replaced or gone after
its pack) goes to the mode's unpack.  Anything the Python path does per
bucket that the chain would skip turns the chain off for the iteration:
profiler ranges, check_finite, in-place segments, a comm hook, a join
whose divisor is pending, mixed precision's pre-unpack, the bucket tuner
timing the step, a GPU, a measured choice still deciding (the CPU's
in-place choice; settled, it runs its candidate: ``AutoPrecision.steady``).

The chain counts what it issues, packs and unpacks in C++
(``Countdown.served``): ``stats()`` and the kernel counters add those
counts when read, so a step costs no Python call for them.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import groups, kernels, profiling
from ..comm import Pending
from ..reduction.autoprec import AutoPrecision
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
        self.issued_at = 0.0  # the last issue of a chained iteration (perf_counter's clock)
        if self.ok:
            kernels.add_served_source(self)
        self._plan, self._key, self._allows = None, None, False  # decide's bucket list, mode, and verdict

    def decide(self, buckets, mode, ctx, *, fast: bool, join_pending: bool) -> tuple[bool, int, float]:
        """Chain this iteration where nothing the Python path does per bucket
        would be skipped: ``(on, scaling, w)`` for ``Countdown.arm``."""
        if not (self.ok and fast) or join_pending or profiling.enabled() or profiling._profiler_on():
            return False, 0, 1.0
        if isinstance(mode, AutoPrecision):  # a settled choice (the CPU's in-place choice): its candidate
            mode = mode.steady(ctx)
        key = (mode, ctx.native, ctx.pre_unpack, ctx.view_mode, ctx.keeps_unused)
        if self._plan is not buckets or self._key != key:  # what the buckets and the mode allow, once a plan
            self._plan, self._key = buckets, key
            self._allows = (type(mode) is AllReduce and ctx.native is not None and ctx.pre_unpack is None
                            and not ctx.comm.cuda
                            and not any(b.health is not None or b.sparse or mode.segments(ctx, b) for b in buckets))
        if not self._allows:
            return False, 0, 1.0
        return True, int(mode.scaling), float(ctx.divisor())

    def __del__(self):
        try:
            if self.ok:
                kernels.retire_served_source(self)  # (its counts stay counted)
        except Exception:  # interpreter shutdown: nothing left to count for
            pass

    def counts(self) -> tuple[int, int]:
        """(collectives, bytes) the chain issued since it was made, those in
        flight included: ``stats()`` adds them to the Python path's."""
        return tuple(self.native.served()[:2]) if self.ok else (0, 0)

    def served_calls(self) -> tuple[int, int]:
        """(packs, unpacks) the native data path did for the chain since it
        was made: the kernel counters add them (:func:`kernels.add_served_source`)."""
        return tuple(self.native.served()[2:]) if self.ok else (0, 0)

    def take(self, buckets, done: int | None = None) -> int:
        """Python takes the iteration over: the buckets the chain packed are
        complete (the chain counted what it packed, issued and unpacked).
        ``done`` None: mid-iteration, the issued buckets hold their Work;
        else every bucket is reduced (the chain's end-of-backward callback
        waited for them) and the first ``done`` unpacked: the others get a
        completed :class:`Pending` for Python's unpack.  Returns the next
        bucket to issue."""
        issued, packed, works, self.issued_at = self.native.chain_state()
        for b, ready in zip(buckets, packed):
            if ready:
                b.pending, b.prefilled = 0, 0
        for b, work in zip(buckets, works):
            b.work = Pending(work=work, tensor=b.flat)
        if done is not None:
            for k, b in enumerate(buckets):
                b.work = None if k < done else Pending()
        return issued
