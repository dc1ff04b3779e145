"""The auto-precision mode's measuring side: each iteration's reduction
window, and the group its decisions are MAX-reduced on, without the host
ever waiting for the device once settled (see :mod:`.autoprec`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import groups

__all__ = ["StepClock", "decision_group"]


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


class StepClock:
    """Per iteration, its reduction window (first pack -> last unpack)."""

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

    def start(self, it: int, fmt: str) -> None:
        self.marks[it] = [self._now(fmt), None, fmt]

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
