"""The overlap engine: where each bucket's collective runs and how the end of
backward waits for it.

CUDA (NCCL)::

    compute stream: --grad b2--grad b1--|rec ev1|--grad b0--|rec ev0|-...-|wait(comm)|--optimizer
    comm stream:                 |wait ev1|pack b1|AR b1 ....|wait ev0|pack b0|AR b0|..|unpack b1 b0|
    NCCL stream:                              |== allreduce b1 ==|      |== allreduce b0 ==|

  * a bucket's pack is queued on the comm stream behind an event recorded on
    the compute stream when its last gradient was produced, so the pack reads
    finished gradients and backward never waits for it;
  * ``dist.all_reduce(async_op=True)`` issued while the comm stream is current
    makes NCCL's stream wait for the pack; ``work.wait()`` at the end of
    backward makes the comm stream wait for NCCL; the unpacks run there;
  * the compute stream then waits on the comm stream once, so the optimizer
    sees reduced gradients.  Buckets and wire buffers live as long as the
    reducer.  A tensor allocated on the compute stream that the comm stream
    reads and whose last reference goes before that wait MUST be
    ``record_stream``ed (:meth:`Comm.release`), or the caching allocator hands
    its block to the next backward kernel while the queued pack may not have
    read it yet: that is every ``.grad`` replaced by its bucket view right
    after its pack was queued (``gradient_as_bucket_view``).  Tensors made on
    the comm stream for the compute stream (a new ``.grad``) are
    ``record_stream``ed the other way (:meth:`Comm.hand_over`).
  * exposed communication is timed with CUDA events (``enable_timing``):
    from the compute stream's point where the last bucket was issued to the
    point where it has waited for the comm stream; read without a host sync
    (``query()``) when stats are asked for.

CPU (gloo)::

    backward thread: --grad b2--|pack b2|issue b2|--grad b1--|pack b1|issue b1|--...--|wait b2|unpack b2|wait b1|...
    gloo thread:                         |== allreduce b2 ==|         |== allreduce b1 ==|

Kernels are only ever launched from the backward thread or the end-of-backward
callback, never from a Future callback (the Triton interpreter is not
thread-safe, and CUDA launches from foreign threads break stream semantics).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch

from . import groups, profiling

__all__ = ["Comm", "Pending"]

_NULL = contextlib.nullcontext()


class Pending:
    """One bucket's collective in flight: a ``Work`` (plain all-reduce), a
    list of them (:meth:`Comm.all_reduce_each`) or a ``Future`` (comm hook)."""

    __slots__ = ("work", "future", "tensor")

    def __init__(self, work=None, future=None, tensor=None):
        self.work = work
        self.future = future
        self.tensor = tensor


class Comm:
    """Issues and completes bucket collectives for one reducer."""

    def __init__(self, process_group, device: torch.device):
        self.pg = process_group
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None  # packs, collectives, unpacks (CUDA)
        # the second phase of the two-phase reductions, queued at issue (CUDA)
        self.phase2 = torch.cuda.Stream(device=device) if self.cuda else None
        # persistent events for the joins (Stream.wait_stream makes a new one per call)
        self._joined = torch.cuda.Event() if self.cuda else None
        self._phase2_done = torch.cuda.Event() if self.cuda else None
        self.compute_stream = None  # the stream backward ran on (seen at the first pack)
        self.bytes_on_wire = 0  # cumulative payload bytes handed to collectives
        self.collectives = 0
        # CUDA: (issued, joined) event pairs, reused round-robin (no per-step allocation)
        self._ev_pairs: list[tuple[Any, Any]] = []
        self._ev_next = 0
        self._ev_open: list[bool] = []
        self._ev_current = -1
        self.exposed_cuda_ms: collections.deque = collections.deque(maxlen=32)

    # -- stream plumbing -------------------------------------------------
    def pack_context(self, ready_event: "torch.cuda.Event | None"):
        """Context in which a bucket is packed and its collective issued: on
        CUDA, the comm stream made to wait for ``ready_event`` (recorded on
        the compute stream by the caller)."""
        if not self.cuda:
            return _NULL
        self.compute_stream = torch.cuda.current_stream(self.device)
        ready_event.record(self.compute_stream)
        self.stream.wait_event(ready_event)
        return torch.cuda.stream(self.stream)

    def comm_context(self):
        """Context in which collectives are issued and waited for and buckets
        unpacked: the comm stream on CUDA."""
        if not self.cuda:
            return _NULL
        return torch.cuda.stream(self.stream)

    def phase2_context(self):
        """Context in which a two-phase reduction's second phase (wait for
        its all-to-all, the shard sum, the all-gather) is queued as soon as
        the bucket is issued: on CUDA its own side stream, so the next
        bucket's pack on the comm stream does not queue behind this bucket's
        all-to-all.  Only tensors the mode owns for its life are used there."""
        if not self.cuda:
            return _NULL
        return torch.cuda.stream(self.phase2)

    def phase2_mark(self, event: "torch.cuda.Event") -> None:
        """Record ``event`` on the second-phase stream: what a bucket's rounds
        queued there so far (:meth:`phase2_context`)."""
        event.record(self.phase2)

    def hand_over(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor allocated on the comm stream that the compute stream will
        own (a new ``.grad``): tell the caching allocator, so its memory is
        not reused on the comm stream while compute-stream work still uses it."""
        if self.cuda and self.compute_stream is not None:
            t.record_stream(self.compute_stream)
        return t

    def release(self, t: torch.Tensor) -> None:
        """``t`` (allocated on the compute stream) was read by work queued on
        the comm stream and is about to lose its last reference: its block
        must not be reused before that work has run."""
        if self.cuda:
            t.record_stream(self.stream)

    def join_compute_stream(self, compute=None) -> None:
        """The compute stream (default: the current one) waits for everything
        queued on the comm stream (which first waits for the second-phase
        stream: after a caught error its work may not have been waited for).
        Stream waits only."""
        if self.cuda:
            compute = compute if compute is not None else torch.cuda.current_stream(self.device)
            self._phase2_done.record(self.phase2)
            self.stream.wait_event(self._phase2_done)
            self._joined.record(self.stream)
            compute.wait_event(self._joined)
            if self._ev_current >= 0:
                self._ev_pairs[self._ev_current][1].record(compute)
                self._ev_open[self._ev_current] = True
                self._ev_current = -1

    # -- exposed communication, timed on the device ----------------------
    def mark_all_issued(self) -> None:
        """The last bucket was just issued: on CUDA, record where the compute
        stream is (the end is recorded by :meth:`join_compute_stream`)."""
        if not self.cuda:
            return
        if len(self._ev_pairs) < 8:
            self._ev_pairs.append((torch.cuda.Event(enable_timing=True),
                                   torch.cuda.Event(enable_timing=True)))
            self._ev_open.append(False)
            k = len(self._ev_pairs) - 1
        else:
            k = self._ev_next
            self._ev_next = (k + 1) % len(self._ev_pairs)
            self._collect(k)
        self._ev_pairs[k][0].record(torch.cuda.current_stream(self.device))
        self._ev_current = k

    def _collect(self, k: int) -> None:
        if self._ev_open[k] and self._ev_pairs[k][1].query():  # query(): no host sync
            start, end = self._ev_pairs[k]
            self.exposed_cuda_ms.append(start.elapsed_time(end))
            self._ev_open[k] = False

    def exposed_stats(self) -> dict:
        """CUDA only: exposed communication of the last steps in ms, from CUDA
        events (pairs whose end has not run yet are left for a later call)."""
        if not self.cuda:
            return {}
        for k in range(len(self._ev_pairs)):
            self._collect(k)
        return {"exposed_comm_ms_cuda_last": [round(t, 4) for t in self.exposed_cuda_ms],
                "exposed_comm_cuda_source": "cuda_events: last bucket issued -> compute stream "
                                            "waited for the comm stream"}

    # -- collectives -----------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, nbytes: int | None = None, group=None) -> Pending:
        """SUM-all-reduce ``tensor`` in place, asynchronously, on the module's
        group (or ``group``, a sub-group of it)."""
        if nbytes is None:
            nbytes = tensor.numel() * tensor.element_size()
        self.bytes_on_wire += nbytes
        self.collectives += 1
        work = groups.all_reduce(tensor, self.pg if group is None else group, async_op=True)
        return Pending(work=work, tensor=tensor)

    def all_reduce_each(self, tensors) -> Pending:
        """SUM-all-reduce each of ``tensors`` in place, asynchronously, in
        order: one bucket's collectives (its large gradients reduced where
        they are, the rest from the flat bucket)."""
        return Pending(work=[self.all_reduce(t).work for t in tensors])

    def hook(self, future: Any, nbytes: int) -> Pending:
        """Track a comm hook's Future as this bucket's collective."""
        self.bytes_on_wire += nbytes
        self.collectives += 1
        return Pending(future=future)

    def wait_bucket(self, bucket, check: bool):
        """Complete ``bucket``'s collective (``check``: check_finite's check of the result)."""
        with profiling.range(f"fastddp/wait[{bucket.index}]", self.cuda):
            result, bucket.work = self.wait(bucket.work), None
        if check:
            bucket.reduction.check_result(bucket, result)
        return result

    def wait(self, pending: Pending):
        """Complete one collective; returns the hook's result (or None)."""
        result = None
        if isinstance(pending.work, list):
            for w in pending.work:
                groups.wait(w)
        elif pending.work is not None:
            groups.wait(pending.work)
            if pending.tensor is not None and pending.tensor.layout != torch.strided:
                result = pending.work.get_future().value()  # sparse: gloo returns the reduced tensor
        elif pending.future is not None:
            pending.future.wait()
            result = pending.future.value()
        return result

