"""One outer sync of cross-site training, started after an inner step and
applied a few steps later (:class:`OuterSync`).

At the start (main thread, after inner step ``t0``): the parameters are
copied into ``snap`` (fp32, the padded flat layout).  Then, on a thread of
its own (gloo's waits block the host; the backward and the inner steps go
on meanwhile), on groups no other thread uses:

1. agreement: one tiny MAX all-reduce over every rank of ``[t0, -t0,
   proposed delay]``: the ranks learn whether they all sync at the same
   step, and the delay they will apply it after (the largest proposed);
2. this rank's shard of the pseudo-gradient ``anchor - snap`` averaged over
   the hosts in the chosen format (:mod:`.wire`);
3. the outer optimizer's step on the shard (``torch.optim.SGD`` on the
   anchor shard, Nesterov by default: DiLoCo's outer step; lr 1, momentum
   0: plain averaging, torch's local SGD);
4. the new anchor's shards gathered inside the host; ``snap`` becomes the
   correction ``new anchor - snap``.

At step ``t0 + delay`` the main thread waits for it (usually long done) and
adds the correction to the parameters: the synced parameters plus the
inner progress made since ``t0``, kept (Streaming DiLoCo's overlap).
"""

from __future__ import annotations

import math
import threading
import time

import torch
import torch.distributed as dist

from .. import groups

__all__ = ["OuterSync", "Layout"]


class Layout:
    """The parameters in one padded fp32 vector, and this rank's shard of it."""

    def __init__(self, params, hosts: int, ranks_per_host: int, local_rank: int, block: int):
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        unit = ranks_per_host * hosts * block
        self.padded = max(unit, math.ceil(self.numel / unit) * unit)
        self.shard = self.padded // ranks_per_host
        self.lo = local_rank * self.shard
        offsets, off = [], 0
        for p in self.params:
            offsets.append(off)
            off += p.numel()
        self.offsets = offsets

    def views(self, flat: torch.Tensor) -> list:
        return [flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    def read(self, flat: torch.Tensor) -> None:
        """``flat`` <- the parameters (fp32)."""
        with torch.no_grad():
            torch._foreach_copy_(self.views(flat), [p.detach() for p in self.params])

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.lo:self.lo + self.shard]


class OuterSync:
    """One sync in flight (see the module docstring)."""

    def __init__(self, owner, step: int, proposal: int, threaded: bool):
        self.owner, self.step, self.proposal = owner, step, int(proposal)
        self.agreed = threading.Event()
        self.done = threading.Event()
        self.delay: int | None = None
        self.error: BaseException | None = None
        self.disagree: tuple[int, int] | None = None
        self.seconds = 0.0
        self.bytes = 0
        owner.layout.read(owner.snap)
        if threaded:
            self.thread = threading.Thread(target=self._run, name="fastddp-outer-sync", daemon=True)
            self.thread.start()
        else:  # the Triton interpreter is not thread-safe: the sync runs here, at once
            self.thread = None
            self._run()

    @classmethod
    def restored(cls, owner, saved: dict) -> "OuterSync":
        """A sync saved by ``state_dict`` after it finished (its correction is
        in ``owner.snap`` again)."""
        sync = cls.__new__(cls)
        sync.owner, sync.step, sync.proposal = owner, saved["step"], saved["delay"]
        sync.agreed, sync.done = threading.Event(), threading.Event()
        sync.agreed.set()
        sync.done.set()
        sync.delay, sync.error, sync.disagree, sync.thread = saved["delay"], None, None, None
        sync.seconds, sync.bytes = saved["seconds"], saved["bytes"]
        return sync

    def _run(self) -> None:
        o = self.owner
        t0 = time.perf_counter()
        try:
            sites = o.sites
            flag = torch.tensor([self.step, -self.step, self.proposal], dtype=torch.int64)
            groups.all_reduce(flag, sites.world_sync, op=dist.ReduceOp.MAX)
            hi, lo, delay = int(flag[0]), -int(flag[1]), int(flag[2])
            if hi != lo:
                self.disagree = (lo, hi)
                return
            self.delay = delay
            self.agreed.set()
            delta = torch.sub(o.anchor.detach(), o.layout.mine(o.snap))
            before = o.wire.bytes_sent
            o.anchor.grad = o.wire.average(delta)
            self.bytes = o.wire.bytes_sent - before
            o.outer.step()
            o.anchor.grad = None
            full = o.theta
            if sites.ranks_per_host > 1:
                groups.wait(groups.all_gather_into_tensor(full, o.anchor.detach(), sites.inside_sync))
            else:
                full.copy_(o.anchor.detach())
            torch.sub(full, o.snap, out=o.snap)  # the correction
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the wait
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self.agreed.set()
            self.done.set()

    def _raise(self) -> None:
        if self.disagree is not None:
            lo, hi = self.disagree
            raise RuntimeError(
                f"fastddp.CrossSite: the ranks started an outer sync at different steps (this rank "
                f"(rank {dist.get_rank()}) after step {self.step}, others between {lo} and {hi}): every "
                "rank must call step() the same number of times (a step skipped on one host, a "
                "different data length per host or a resumed checkpoint of another step)")
        if self.error is not None:
            raise RuntimeError(f"fastddp.CrossSite: the outer sync started after step {self.step} failed on "
                               f"rank {dist.get_rank()}: {self.error!r}") from self.error

    def _wait(self, event: threading.Event, timeout_s: float, what: str) -> None:
        if not event.wait(timeout_s):
            raise RuntimeError(
                f"fastddp.CrossSite: rank {dist.get_rank()} waited {timeout_s:g} s for {what} of the outer "
                f"sync started after step {self.step}: a rank stopped calling step() (unequal data per "
                "host, an exception on another host) or the link between hosts is down; raise "
                "sync_timeout_s for a link this slow")

    def wait_agreed(self, timeout_s: float) -> int:
        """The agreed delay (blocks until the agreement collective is done)."""
        self._wait(self.agreed, timeout_s, "the agreement")
        self._raise()
        return self.delay

    def finish(self, timeout_s: float) -> None:
        """Wait for the sync; its correction is then in ``owner.snap``."""
        self._wait(self.done, timeout_s, "the end")
        if self.thread is not None:
            self.thread.join()
        self._raise()
