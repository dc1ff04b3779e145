"""The bench's one simulated network: a process group that puts every
collective on a serial wire of a given speed.

:class:`SimulatedWire` is a Python ``torch.distributed.ProcessGroup``
wrapping the real (gloo or NCCL) group.  Both DDPs get it as
``process_group=``, so torch's C++ reducer and fastddp issue their
collectives to it the way they would to any group, and neither side runs
code the other does not::

    issue i:  the real collective starts at once on the inner group
    done_i  = max(issue_i, done_{i-1}) + bytes_i / (gbps * 1e9),
              and never before the real collective has finished
    wire thread: |wait real 0|sleep to done_0|complete 0|wait real 1|sleep to done_1|...

A wire thread completes each returned Work in issue order.  It has to be a
thread: torch's reducer takes the Work's ``get_future()`` and waits on that
Future from the end-of-backward callback, so something else must complete
it.  ``Work.wait(timeout)`` blocks on the same Future.  The waiting is a
sleep, so it costs no compute: a DDP that overlaps communication with
backward hides the wire, one that does not pays it.

``bytes_i`` is the size of the collective's result on this rank (the
tensors of an all-reduce or broadcast, every output of an all-gather), or
for an all-to-all and an all-gather into one tensor the part of it that
came from the other ranks, (W - 1) / W;
:attr:`SimulatedWire.bytes_sent` adds them up.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

__all__ = ["SimulatedWire"]

_NO_TIMEOUT = datetime.timedelta(0)


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t.layout == torch.sparse_coo:
            t = t.coalesce() if not t.is_coalesced() else t
            total += _nbytes([t.indices(), t.values()])
        else:
            total += t.numel() * t.element_size()
    return total


class _WireWork(dist._Work):
    """The Work a :class:`SimulatedWire` collective returns: done once the
    wire thread has completed its Future."""

    def __init__(self, inner: dist.Work, future: torch.futures.Future):
        super().__init__()
        self._inner = inner
        self._future = future

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        self._future.wait()  # re-raises what the real collective raised
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self):
        return self._inner.result()


class SimulatedWire(dist.ProcessGroup):
    """``inner`` behind a serial wire of ``gbps`` GB/s (1e9 bytes/s).

    Use it as a context manager (the wire thread runs inside the block).
    ``allreduce``, ``broadcast``, ``allgather``, ``alltoall_base`` and
    ``_allgather_base`` (the two-phase reductions' all-to-all and
    all-gather: fp8, bf16 with an fp32 sum) go through the wire;
    ``barrier`` goes straight to ``inner``; anything else is not supported.
    """

    def __init__(self, inner: dist.ProcessGroup, gbps: float, device: torch.device):
        if not gbps > 0:
            raise ValueError(f"simulated bandwidth must be > 0 GB/s, got {gbps!r}")
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.gbps = float(gbps)
        self.device = torch.device(device)
        self.bytes_sent = 0
        self.collectives = 0
        self._free_at = 0.0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- lifetime ------------------------------------------------------------
    def __enter__(self) -> "SimulatedWire":
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fastddp-bench-wire", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Finish the queued collectives, then stop the wire thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # -- the wire ------------------------------------------------------------
    def _put(self, inner: dist.Work, nbytes: int) -> _WireWork:
        if self._thread is None:
            raise RuntimeError("SimulatedWire used outside its `with` block")
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = done = start + nbytes / (self.gbps * 1e9)
            self.bytes_sent += nbytes
            self.collectives += 1
        cuda = self.device.type == "cuda"
        fut = torch.futures.Future(devices=[self.device]) if cuda else torch.futures.Future()
        self._queue.put((inner, done, fut))
        return _WireWork(inner, fut)

    def _serve(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            inner, done, fut = item
            try:
                inner.wait(_NO_TIMEOUT)  # raises if the real collective failed
                if cuda:  # NCCL's wait only makes this thread's stream wait: wait for the GPU
                    torch.cuda.current_stream(self.device).synchronize()
                delay = done - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                fut.set_result(inner.get_future().value())  # the output tensors
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)

    # -- collectives (the signatures torch's C++ ProcessGroup calls) ----------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        work = self.inner.allreduce(tensors, opts if opts is not None else dist.AllreduceOptions())
        return self._put(work, _nbytes(tensors))

    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        work = self.inner.broadcast(tensors, opts if opts is not None else dist.BroadcastOptions())
        return self._put(work, _nbytes(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        work = self.inner.allgather(output_tensors, input_tensors,
                                    opts if opts is not None else _c10d.AllgatherOptions())
        return self._put(work, _nbytes(t for outs in output_tensors for t in outs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        work = self.inner.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                        opts if opts is not None else dist.AllToAllOptions())
        return self._put(work, self._sent(output))

    def _allgather_base(self, output, input, opts=None):
        work = self.inner._allgather_base(output, input, opts if opts is not None else _c10d.AllgatherOptions())
        return self._put(work, self._sent(output))

    def _sent(self, output: torch.Tensor) -> int:
        """What this rank sends in an all-to-all or all-gather into ``output``:
        every slice but its own, (W - 1) / W of the result (a ring
        all-reduce sends 2 (W - 1) / W of its tensor: the result's size at W = 2)."""
        return _nbytes([output]) * (self.size() - 1) // max(1, self.size())

    def barrier(self, opts=None):
        return self.inner.barrier(opts if opts is not None else dist.BarrierOptions())

    def getBackendName(self) -> str:
        # not the inner group's name: torch's DDP logger looks a "gloo" or
        # "nccl" group's C++ backend up and finds none on a Python group
        return "simwire"

    def __repr__(self) -> str:
        return f"SimulatedWire({self.gbps:g} GB/s over {self.inner.name()})"
