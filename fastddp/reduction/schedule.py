"""When a measured choice measures, and what it picks: the schedule part of
:class:`~fastddp.reduction.autoprec.AutoPrecision` (whose module docstring
describes the phases: waiting, trial, settled with its watch, frozen).

The mode holds one :class:`ChoiceSchedule` and asks it once per iteration,
at the forward boundary, which candidate the next iteration runs and whether
this one is timed; the mode does the switching, the packing and the timing.
Only here are the trial's rounds and the watch's windows MAX-reduced over the
ranks (on the decision group ``side``), at the same iteration on every rank.
"""

from __future__ import annotations

import logging
import math
import statistics

from ..autotune.phase import Phase
from ..autotune.precision import PrecisionSearch, Watch, rotation
from .stepclock import StepClock, max_over_ranks, max_over_ranks_later

__all__ = ["ChoiceSchedule"]

log = logging.getLogger("fastddp.autotune")

_WAIT, _TRIAL, _SETTLED, _FROZEN = Phase.WAITING, Phase.TRIAL, Phase.SETTLED, Phase.FROZEN


class ChoiceSchedule:
    """The phases of one measured choice between ``formats`` (most precise
    first).  ``state``: the hook state (rounds, watch); ``clock``: the mode's
    :class:`~.stepclock.StepClock`, whose windows it reads; ``differs``:
    whether a bucket would be reduced differently by the candidates (given,
    a plan where none is settles on the first without a trial)."""

    def __init__(self, state, formats: list, clock: StepClock, label: str, differs=None):
        self.state, self.formats, self.clock, self.label = state, formats, clock, label
        self._differs = differs
        self.looked, self._seen_differ = None, False  # the iteration whose packs tell whether a bucket differs
        single = len(formats) == 1
        self.phase = _SETTLED if single else _WAIT
        self.watch = Watch() if state.watch and not single else None
        self.search: PrecisionSearch | None = None
        self.samples: dict = {}      # iteration -> (format, s), read from the clock
        self._t0 = 0                 # first iteration of the trial
        self._reduced = 0            # trial rounds all-reduced so far
        self._win0 = self._wins = 0  # first watched iteration, windows all-reduced
        self._window = None          # the last window's MAX in flight: read at the next iteration
        self._watching = False       # settled and the layout still: windows are timed and read
        self._trigger = ""
        self._restart = False
        self._rank = 0
        self.decisions: list = []
        self.layout_epoch = 0
        self.settled_at = None if not single else 0
        self.trial_steps = 0
        self.side = self.decided_on = None  # the decision group (stepclock.decision_group), set by the builder

    def look(self, ctx, bucket) -> None:
        """A bucket's pack in iteration :attr:`looked` (one after the rebuild;
        the mode calls only then): does it tell the candidates apart?"""
        if self.phase == _WAIT and not self._seen_differ:
            self._seen_differ = self._differs(ctx, bucket)

    def rebuilt(self) -> None:
        """The buckets were rebuilt: a trial restarts, a watch takes a new baseline, the plan is looked at afresh."""
        self._restart = True
        self.looked, self._seen_differ = None, False

    # ----------------------------------------------------------- steps
    def enter(self, ctx, cur: str) -> tuple[str, bool]:
        """The boundary of iteration ``ctx.iteration``, running ``cur``: read
        finished windows and decide.  Returns the format of the next iteration
        and whether this one is timed."""
        it, nxt = ctx.iteration, cur
        self._rank = ctx.rank
        self.samples.update(self.clock.take(it, wait=self.phase == _TRIAL))
        if self._restart:
            self._restart = False
            self.samples.clear()
            if self.phase == _TRIAL:
                self._begin_trial(it + 1, self._trigger + "; restarted: the buckets were rebuilt")
            elif self.phase == _SETTLED and self.watch is not None:
                self._drop_window()
                self._watching = False  # a new baseline from here (or once the layout settles)
        if self.phase == _WAIT and ctx.rebuilt and self._differs is not None and self.looked is None:
            self.looked = it  # this iteration's packs (the final plan's) tell whether a trial can tell anything
        elif self.phase == _WAIT and ctx.rebuilt and self._differs is not None and not self._seen_differ:
            self.phase, self.settled_at = _SETTLED, it  # every bucket the same whichever: nothing to measure
            self.decisions.append({"step": it, "chosen": cur, "trigger": "first measurement",
                                   "rounds": 0, "reason": "no bucket is reduced differently by the candidates"})
        elif self.phase == _WAIT and ctx.rebuilt:
            self._begin_trial(it + 1, "first measurement")
        elif self.phase == _TRIAL:
            nxt = self._trial(ctx, it) or nxt
        elif self.phase == _SETTLED and self.watch is not None:
            self._watch_if_still(ctx, it)
        if self.phase == _TRIAL:
            nxt = self._scheduled(it + 1, cur)
        timed = self.phase == _TRIAL or (self.phase == _SETTLED and self._watching and not self.watch.exhausted)
        return nxt, timed

    def _watch_if_still(self, ctx, it: int) -> None:
        """The watch runs while the layout holds still: bucket_cap_mb="auto"
        tries layouts after the format is chosen, and its steps are not the
        link's.  It starts afresh (a new baseline) once the layout settles."""
        if not ctx.layout_settled:
            if self._watching:
                self._drop_window()
                self._watching = False
            return
        if not self._watching:
            self._watching = True
            self.samples.clear()
            self.watch.restart()
            self._win0, self._wins = it + 1, 0
        self._watch(ctx, it)

    def _scheduled(self, it: int, cur: str) -> str:
        """The trial's format for iteration ``it``: a warm-up round, then rotated rounds."""
        j, n = it - self._t0, len(self.formats)
        if j < 0:
            return cur
        if j < n:
            return self.formats[j]
        r, p = divmod(j - n, n)
        return rotation(self.formats, r)[p]

    def _begin_trial(self, t0: int, why: str) -> None:
        st = self.state
        self.search = PrecisionSearch(self.formats, min_rounds=st.min_rounds, max_rounds=st.max_rounds)
        self.phase, self._t0, self._reduced, self._trigger = _TRIAL, t0, 0, why
        self.samples.clear()

    def _trial(self, ctx, it: int) -> str | None:
        """The trial's complete rounds, MAX-reduced; the pick once it is done (else None)."""
        n = len(self.formats)
        while True:
            first = self._t0 + n + self._reduced * n
            if first + n - 1 > it - self.clock.lag:
                return None
            order = rotation(self.formats, self._reduced)
            vals = []
            for f in self.formats:
                got = self.samples.pop(first + order.index(f), None)
                vals.append(got[1] if got is not None and got[0] == f else math.inf)
            vals = max_over_ranks(ctx, self.side, vals)
            self.search.record(dict(zip(self.formats, vals)))
            self._reduced += 1
            # rounds dropped for missing steps do not count: bound the trial all the same
            if self.search.done or self._reduced >= 2 * self.search.limit:
                return self._settle(it)

    def _settle(self, it: int) -> str:
        s = self.search
        pick, _, steps = s.walk()
        if self.decisions and pick != self.decisions[-1]["chosen"]:
            self.layout_epoch += 1  # another wire: a layout tuned for the old one is tuned again
        self.phase, self.settled_at = _SETTLED, it + 1
        self.trial_steps += it + 1 - self._t0
        self.decisions.append({"step": it + 1, "chosen": pick, "trigger": self._trigger, "rounds": s.rounds,
                               "trial_from_step": self._t0, "trial_steps": it + 1 - self._t0,
                               "dropped_rounds": s.dropped, "costs_ms": s.costs_ms(), "comparisons": steps,
                               "reason": s.explain()})
        self.samples.clear()
        if self.watch is not None:
            self.watch.restart()
            self._win0, self._wins, self._watching = it + 1, 0, True
        self._log(f"chose {s.explain()}; trial of {it + 1 - self._t0} steps ({self._trigger}); from step {it + 1}")
        return pick

    def _watch(self, ctx, it: int) -> None:
        if self._window is not None:  # the window MAX-reduced at the last read: complete by now
            v, self._window = self._window()[0], None
            base = self.watch.baseline
            if self.watch.feed(v):
                k = self.state.watch_steps
                self._begin_trial(it + 1, f"re-measure {self.watch.remeasures}: the step moved to "
                                          f"{v * 1e3:.2f} ms from {base * 1e3:.2f} ms for "
                                          f"{self.watch.sustain} windows of {k} steps")
                return
        if self.watch.exhausted:
            return
        k = self.state.watch_steps
        w0 = self._win0 + self._wins * k
        if w0 + k - 1 > it - self.clock.lag:
            return
        vals = [self.samples.pop(i)[1] for i in range(w0, w0 + k) if i in self.samples]
        for i in [i for i in self.samples if i < w0 + k]:
            del self.samples[i]
        self._window = max_over_ranks_later(ctx, self.side, [statistics.median(vals) if vals else math.inf])
        self._wins += 1

    def _drop_window(self) -> None:
        """A window in flight whose value no longer counts (the watch starts
        again): completed and dropped, on every rank alike."""
        if self._window is not None:
            self._window()
            self._window = None

    def freeze(self, why: str, it: int, nxt: str) -> str:
        """join() at iteration ``it``: the best format measured so far (else
        the most precise; ``nxt`` where already settled), from the next
        iteration on; no more collectives of its own.  Returns that format."""
        if self.phase == _FROZEN:
            return nxt
        self._drop_window()
        if self.phase in (_WAIT, _TRIAL):
            s = self.search
            nxt = s.pick() if s is not None and s.rounds else self.formats[0]
            self.decisions.append({"step": it + 1, "chosen": nxt, "trigger": f"{why} froze it",
                                   "rounds": s.rounds if s else 0, "reason": s.explain() if s and s.rounds
                                   else "nothing measured: the most precise format"})
            self._log(f"{why} froze the choice at {nxt}")
        self.phase = _FROZEN
        return nxt

    # ------------------------------------------------------------ report
    def _log(self, text: str) -> None:
        if self._rank == 0:
            log.info("fastddp %s: %s", self.label.replace("_", " "), text)

    def report(self) -> dict:
        """The schedule's part of the mode's ``stats()``."""
        s = self.search
        return {
            "state": self.phase.value, "measuring": self.phase.measuring,
            "settled_at_step": self.settled_at, "trial_steps": self.trial_steps,
            "decisions": list(self.decisions),
            "watch": self.watch.report() if self.watch is not None else None,
            "decided_on": self.decided_on,
            "trial": None if s is None else {"rounds": s.rounds, "costs_ms": s.costs_ms(),
                                             "comparisons": s.walk()[2]},
        }
