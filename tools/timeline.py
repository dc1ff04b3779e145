"""Where a two-phase step's time goes, thread by thread: the mode's pack,
issue and unpack, the engine's rounds (on the backward thread, the phase-2
thread or the end-of-backward callback) and its finish, each as a start and
an end on the host clock.  ``python -m tools.step_phases --timeline ROW``
prints the last timed step of ROW on rank 0 (docs/benchmarking.md).
On a netns link :class:`LinkTrace` samples the interface's sent-bytes
counter through that step, and :func:`link_use` says when its bytes left
and at what share of the link's rate.

The probe wraps the classes' methods for as long as it is entered (every
instance, every thread) and restores them on leaving; nothing in the
library knows of it.
"""

from __future__ import annotations

import contextlib
import threading
import time

__all__ = ["LINK_EVERY_S", "LinkTrace", "Timeline", "link_use", "sent_at"]

#: how often :class:`LinkTrace` reads the counter, seconds
LINK_EVERY_S = 0.0005


class Timeline(contextlib.AbstractContextManager):
    """``with Timeline() as t: ...`` records ``(seconds since t.mark(),
    thread name, what)`` into ``t.events``; ``t.mark()`` starts a new step
    (clears the events, resets the clock)."""

    def __init__(self):
        self.events: list[tuple[float, str, str]] = []
        self._t0 = time.perf_counter()
        self._undo: list = []
        self._lock = threading.Lock()

    def mark(self) -> None:
        with self._lock:
            self.events = []
            self._t0 = time.perf_counter()

    @property
    def t0(self) -> float:
        """The ``time.perf_counter()`` of the last :meth:`mark`."""
        return self._t0

    def note(self, what: str) -> None:
        with self._lock:
            self.events.append((time.perf_counter() - self._t0, threading.current_thread().name, what))

    def __enter__(self) -> "Timeline":
        from fastddp.reduction import fp8, fp32acc, hierarchical, twophase

        for cls in (fp8.BlockFp8, fp32acc.Fp32Accumulate, hierarchical.Hierarchical):
            for name in ("pack", "issue", "unpack"):  # (ctx, bucket, ...)
                self._wrap(cls, name, lambda obj, a, name=name: f"{name} of bucket {a[1].index}")
        self._wrap(twophase.ShardStep, "advance", lambda obj, a: f"round {len(obj.works)} of bucket {obj.bucket.index}")
        self._wrap(twophase.TwoPhaseEngine, "finish", lambda obj, a: f"finish of bucket {a[0].bucket.index}")
        return self

    def _wrap(self, cls, name: str, label) -> None:
        """``cls.name`` noted at its start and end, as ``label(obj, args)`` says."""
        orig = cls.__dict__[name]
        probe = self

        def wrapped(obj, *args, **kwargs):
            what = label(obj, args)
            probe.note(what + " start")
            try:
                return orig(obj, *args, **kwargs)
            finally:
                probe.note(what + " end")

        setattr(cls, name, wrapped)
        self._undo.append((cls, name, orig))

    def __exit__(self, *exc) -> None:
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)
        self._undo = []

    def format(self) -> str:
        """One line per event: milliseconds, thread, what."""
        return "\n".join(f"{t * 1e3:9.2f} ms  {th[:18]:<18} {what}" for t, th, what in self.events)



class LinkTrace:
    """A thread reading ``read()`` (bytes sent so far) every ``every``
    seconds from :meth:`start` to :meth:`stop`: ``samples`` is
    ``[(seconds since t0, bytes sent since start)]``, ``t0`` the clock the
    step's events use (:attr:`Timeline.t0`)."""

    def __init__(self, read, every: float = LINK_EVERY_S):
        self.read, self.every = read, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, t0: float) -> None:
        self.stop()
        self.samples, b0 = [], self.read()
        self._stop.clear()

        def run():
            while True:
                done = self._stop.is_set()  # one more sample after stop: the step's last bytes
                self.samples.append((time.perf_counter() - t0, self.read() - b0))
                if done:
                    return
                self._stop.wait(self.every)

        self._thread = threading.Thread(target=run, daemon=True, name="link-trace")
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def link_use(samples: list[tuple[float, int]], gbit: float, idle_s: float = 0.003) -> dict | None:
    """What a step's :class:`LinkTrace` says: when its first bytes left and
    when its last did (``first``/``last``, seconds; the first as the sample
    before the counter moved), ``sent`` bytes, the share of ``gbit`` they
    went at over that span (``span_share``) and over it less every stretch of
    at least ``idle_s`` with nothing sent (``busy_share``), and those
    stretches (``idle``: ``(start, end)`` seconds; ``idle_s`` too).  None:
    nothing sent."""
    if not samples or samples[-1][1] <= 0:
        return None
    total = samples[-1][1]
    i0 = next(i for i, (_, b) in enumerate(samples) if b > 0)
    i1 = next(i for i, (_, b) in enumerate(samples) if b == total)
    first, last = samples[max(i0 - 1, 0)][0], samples[i1][0]
    idle, run = [], max(i0 - 1, 0)  # run: the first sample of the current stretch with no bytes sent
    for k in range(run + 1, i1 + 1):
        if samples[k][1] != samples[run][1]:
            if samples[k - 1][0] - samples[run][0] >= idle_s:
                idle.append((samples[run][0], samples[k - 1][0]))
            run = k
    rate = gbit * 1e9 / 8
    span = last - first
    busy = span - sum(b - a for a, b in idle)
    return {"first": first, "last": last, "sent": total, "idle": idle, "idle_s": idle_s,
            "span_share": total / span / rate if span > 0 else None,
            "busy_share": total / busy / rate if busy > 0 else None}


def sent_at(samples: list[tuple[float, int]], t: float) -> int:
    """Bytes the trace had counted at ``t`` (its last sample at or before it)."""
    got = 0
    for ts, b in samples:
        if ts > t:
            break
        got = b
    return got
