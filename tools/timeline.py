"""Where a two-phase step's time goes, thread by thread: the mode's pack,
issue and unpack, the engine's rounds (on the backward thread, the phase-2
thread or the end-of-backward callback) and its finish, each as a start and
an end on the host clock.  ``python -m tools.step_phases --timeline ROW``
prints the last timed step of ROW on rank 0 (docs/benchmarking.md).

The probe wraps the classes' methods for as long as it is entered (every
instance, every thread) and restores them on leaving; nothing in the
library knows of it.
"""

from __future__ import annotations

import contextlib
import threading
import time

__all__ = ["Timeline"]


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
