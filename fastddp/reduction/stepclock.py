"""The auto-precision mode's measuring side: each iteration's reduction
window, and the group its decisions are MAX-reduced on, without the host
ever waiting for the device once settled (see :mod:`.autoprec`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import groups

__all__ = ["StepClock", "decision_group", "max_over_ranks", "max_over_ranks_later"]


_SIDE: dict = {}


def decision_group(pg, device) -> tuple:
    """``(group, where)``: the group the decisions' floats are MAX-reduced on.
    None (``pg`` itself) off CUDA: gloo already reduces host tensors.  On
    CUDA a gloo group of ``pg``'s ranks, made once per group (collectively:
    every rank of the world calls ``new_group``), so no decision copies a
    device tensor back to the host; None where one cannot be made."""
    if device is None or device.type != "cuda" or pg is None:
        return None, "the process group (host tensors)"
    if not (groups.is_registered(pg) and dist.is_gloo_available()) or groups.size(pg) != dist.get_world_size():
        return None, ("the process group, copied to the host once per round or window (no gloo twin: "
                      "the group is not the whole world, or gloo is missing)")
    got = _SIDE.get(id(pg))
    if got is None or got[0] is not pg:
        got = _SIDE[id(pg)] = (pg, dist.new_group(groups.global_ranks(pg), backend="gloo"))
    return got[1], "a gloo group of the same ranks (host memory; the device is never waited for)"


def max_over_ranks(ctx, side, vals: list) -> list:
    """``vals`` MAX-reduced over the ranks (every rank decides from the same
    numbers), on ``side`` (:func:`decision_group`'s) or the step's group."""
    if ctx.world == 1:
        return vals
    if side is not None:  # CUDA: the gloo twin, host memory only
        t = torch.tensor(vals, dtype=torch.float64)
        groups.all_reduce(t, side, op=dist.ReduceOp.MAX)
        return t.tolist()
    t = torch.tensor(vals, dtype=torch.float64, device=ctx.comm.device)
    groups.all_reduce(t, ctx.comm.pg, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()  # gloo: a host tensor; a CUDA group without a gloo twin: one wait


def max_over_ranks_later(ctx, side, vals: list):
    """:func:`max_over_ranks`, issued now and read at the next iteration (a
    callable that returns the list): the watch never waits for a round trip
    in the middle of a backward.  Every rank issues it and reads it at the
    same iterations.  By the next one it is complete: on the CPU the
    buckets' collectives, queued after it on the same group, have been
    waited for; the gloo twin of a CUDA group has had a whole step (the read
    waits if not).  A CUDA group without a gloo twin reduces a device
    tensor: as :func:`max_over_ranks`."""
    if ctx.world == 1 or (side is None and ctx.comm.device.type != "cpu"):
        got = max_over_ranks(ctx, side, vals)
        return lambda: got
    t = torch.tensor(vals, dtype=torch.float64)
    work = groups.all_reduce(t, side if side is not None else ctx.comm.pg, op=dist.ReduceOp.MAX, async_op=True)

    def read() -> list:
        groups.wait(work)
        return t.tolist()
    return read


class StepClock:
    """Per iteration, its reduction window (first pack -> last unpack), or
    from a start the caller gives (the host clock only: ``start(at=...)``)."""

    def __init__(self, device, synthetic, event=None):
        self.synthetic = synthetic
        self.cuda = synthetic is None and device is not None and device.type == "cuda"
        self.lag = 2 if self.cuda else 1  # iterations until a window is read
        self.marks: dict = {}  # iteration -> [start, end, format]
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.not_ready = 0  # CUDA windows left out: their events had not completed when read

    def _now(self, fmt: str):
        if self.synthetic is not None:
            return float(self.synthetic(fmt))
        if self.cuda:
            ev = self.event()
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, it: int, fmt: str, at: float | None = None) -> None:
        """Iteration ``it`` in format ``fmt`` starts now, or at host time
        ``at`` (``time.perf_counter``; the host clock, not synthetic)."""
        use_at = at is not None and self.synthetic is None and not self.cuda
        self.marks[it] = [at if use_at else self._now(fmt), None, fmt]

    def end(self, it: int) -> None:
        m = self.marks.get(it)
        if m is None:
            return
        if self.cuda:
            if m[1] is None:
                m[1] = self.event()
            m[1].record()  # re-recorded at each unpack: the last one counts
        else:
            m[1] = self._now(m[2])

    def take(self, before: int, wait: bool = False) -> dict:
        """Windows of the iterations up to ``before - lag``: ``{it: (format, s)}``
        (an iteration that never reached an unpack is left out).  CUDA: with
        ``wait`` (the trial) the host waits for the events; without, a window
        whose events have not completed is left out, never waited for."""
        out = {}
        for it in [k for k in self.marks if k <= before - self.lag]:
            start, end, fmt = self.marks.pop(it)
            if end is None:
                continue
            if self.cuda:
                if wait:
                    end.synchronize()  # recorded two iterations ago: complete in practice
                elif not (end.query() and start.query()):
                    self.not_ready += 1
                    continue
                out[it] = (fmt, start.elapsed_time(end) / 1e3)
            else:
                out[it] = (fmt, end - start)
        return out
