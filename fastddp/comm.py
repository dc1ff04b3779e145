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
    sees reduced gradients.  Gradients and buckets stay referenced by the
    reducer until that point, and nothing frees them on the compute stream
    before it waits, so no ``record_stream`` is needed.

CPU (gloo)::

    backward thread: --grad b2--|pack b2|issue b2|--grad b1--|pack b1|issue b1|--...--|wait b2|unpack b2|wait b1|...
    gloo thread:                         |== allreduce b2 ==|         |== allreduce b1 ==|

Kernels are only ever launched from the backward thread or the end-of-backward
callback, never from a Future callback (the Triton interpreter is not
thread-safe, and CUDA launches from foreign threads break stream semantics).

``FASTDDP_SIMULATE_BANDWIDTH_GBPS`` (read when the reducer is built) puts a
simulated serial wire of that many GB/s behind every collective: bucket ``i``
completes no earlier than ``max(issue_i, done_{i-1}) + bytes_i / bandwidth``;
waiting for it sleeps, consuming no compute.  It lets one machine show how
well backward hides communication as the network slows.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Comm", "Pending"]

_NULL = contextlib.nullcontext()


class Pending:
    """One bucket's collective in flight: a ``Work`` (plain all-reduce) or a
    ``Future`` (comm hook), plus the simulated-wire deadline."""

    __slots__ = ("work", "future", "deadline", "tensor")

    def __init__(self, work=None, future=None, deadline: float = 0.0, tensor=None):
        self.work = work
        self.future = future
        self.deadline = deadline
        self.tensor = tensor


def _sim_bandwidth_from_env() -> float | None:
    raw = os.environ.get("FASTDDP_SIMULATE_BANDWIDTH_GBPS")
    if raw in (None, ""):
        return None
    try:
        gbps = float(raw)
    except ValueError:
        raise ValueError(f"FASTDDP_SIMULATE_BANDWIDTH_GBPS={raw!r} is not a number of GB/s") from None
    if gbps <= 0:
        raise ValueError(f"FASTDDP_SIMULATE_BANDWIDTH_GBPS={raw!r} must be > 0 GB/s")
    return gbps


class Comm:
    """Issues and completes bucket collectives for one reducer."""

    def __init__(self, process_group, device: torch.device):
        self.pg = process_group
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.compute_stream = None  # the stream backward ran on (seen at the first pack)
        self.sim_gbps = _sim_bandwidth_from_env()
        self._wire_free_at = 0.0
        self.bytes_on_wire = 0  # cumulative payload bytes handed to collectives
        self.collectives = 0

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

    def hand_over(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor allocated on the comm stream that the compute stream will
        own (a new ``.grad``): tell the caching allocator, so its memory is
        not reused on the comm stream while compute-stream work still uses it."""
        if self.cuda and self.compute_stream is not None:
            t.record_stream(self.compute_stream)
        return t

    def join_compute_stream(self) -> None:
        """The compute stream waits for everything queued on the comm stream."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    # -- collectives -----------------------------------------------------
    def _deadline(self, nbytes: int) -> float:
        if self.sim_gbps is None:
            return 0.0
        start = max(time.perf_counter(), self._wire_free_at)
        self._wire_free_at = start + nbytes / (self.sim_gbps * 1e9)
        return self._wire_free_at

    def all_reduce(self, tensor: torch.Tensor) -> Pending:
        """SUM-all-reduce ``tensor`` in place, asynchronously."""
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_on_wire += nbytes
        self.collectives += 1
        work = dist.all_reduce(tensor, group=self.pg, async_op=True)
        return Pending(work=work, deadline=self._deadline(nbytes), tensor=tensor)

    def hook(self, future: Any, nbytes: int) -> Pending:
        """Track a comm hook's Future as this bucket's collective."""
        self.bytes_on_wire += nbytes
        self.collectives += 1
        return Pending(future=future, deadline=self._deadline(nbytes))

    def wait(self, pending: Pending):
        """Complete one collective; returns the hook's result (or None)."""
        result = None
        if pending.work is not None:
            pending.work.wait()
        elif pending.future is not None:
            pending.future.wait()
            result = pending.future.value()
        if pending.deadline:
            left = pending.deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return result

