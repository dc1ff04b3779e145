"""Which wire format to reduce in, from measured steps: pure.

:class:`PrecisionSearch` compares the formats a user allows, ordered most
precise first, from interleaved trial rounds (one step of every format per
round, the order rotated each round); :class:`Watch` tells, once settled,
when the step time moved for long enough that the formats should be
measured again.  No clock, no process group: the mode that drives them
(:mod:`fastddp.reduction.autoprec`) feeds every rank the same MAX-reduced
samples, so every rank decides the same; tests feed synthetic timings.

The rule, in one place:

* a round's samples are paired: format ``c`` against the incumbent ``b``
  gives one ratio ``log(t_c / t_b)`` per round (what else runs on the
  machine moves both steps of a round alike and cancels);
* the estimate is the 20%-trimmed mean of those log ratios, with a 90%
  Student-t interval from the winsorized variance (Tukey-McLaughlin: a few
  disturbed rounds move neither the estimate nor the interval much);
* walking the formats from the most precise, ``c`` replaces the incumbent
  only when the whole interval says it is faster by more than
  :data:`MARGIN` (``hi < log(1 - MARGIN)``): where the samples cannot tell,
  the more precise format stays;
* the search stops once every comparison of that walk is decided either way
  (``lo`` above the margin too) after :data:`MIN_ROUNDS`, or at
  :data:`MAX_ROUNDS` (then undecided comparisons keep the precise format),
  or at twice that where an undecided estimate promises a gain of 5% or
  more (:data:`PROMISING`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["MARGIN", "MAX_REMEASURES", "MAX_ROUNDS", "MIN_ROUNDS", "PROMISING", "REL_CHANGE", "SUSTAIN", "TRIM",
           "PrecisionSearch", "Watch", "paired_interval", "rotation"]

MARGIN = 0.01
"""A less precise format must be faster by more than 1% (its whole interval) to be chosen."""
MIN_ROUNDS = 4
"""Trial rounds at least (after one warm-up round that is not measured): at 3
a t interval on 2 degrees of freedom, checked after every round, switched to
a format 0.5% faster in 3 of 20 synthetic runs with 7% noise per step."""
MAX_ROUNDS = 8
"""Trial rounds at most: with 3 formats, 3 + 24 steps (twice that where a
gain looks large but the noise hides it: :data:`PROMISING`)."""
PROMISING = 0.95
"""At ``max_rounds``, a comparison still undecided whose estimate is below
this ratio (a 5%+ gain, hidden by noise) doubles the trial's rounds, once:
measured on the rig with the test suite on the same 2 cores, a drop to
0.5 Gbit/s left fp8 at 0.893 (0.666-1.197) of fp32 after 8 rounds, so fp32
stayed, and ran 1.40x slower than a fixed fp8 afterwards."""
TRIM = 0.2
"""Fraction of the log ratios trimmed at each end."""
REL_CHANGE = 0.15
"""Once settled: a window's median step this far from the baseline (or three
times the baseline windows' relative spread, if larger) counts as a change."""
SUSTAIN = 2
"""Consecutive changed windows that trigger a re-measure."""
MAX_REMEASURES = 4
"""Re-measures at most over a run (each also doubles the windows the next
baseline waits for): a link that keeps changing cannot keep the run in trials."""

# Student's t, 0.95 quantile (a two-sided 90% interval), by degrees of freedom
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
        1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
        1.699, 1.697)


def _t95(df: int) -> float:
    return _T95[min(df, len(_T95)) - 1] if df >= 1 else math.inf


def paired_interval(base: Sequence[float], other: Sequence[float], trim: float = TRIM):
    """``(estimate, lo, hi)`` of ``log(other / base)`` over paired rounds:
    the trimmed mean and its 90% interval.  Fewer than two pairs: ``hi`` and
    ``lo`` are infinite (nothing is decided)."""
    if len(base) != len(other):
        raise ValueError(f"paired_interval: {len(base)} base samples against {len(other)}; rounds are paired")
    r = sorted(math.log(o / b) for b, o in zip(base, other))
    n = len(r)
    if n == 0:
        return 0.0, -math.inf, math.inf
    g = int(trim * n)
    kept = r[g:n - g]
    est = sum(kept) / len(kept)
    if n < 2:
        return est, -math.inf, math.inf
    wins = [r[g]] * g + kept + [r[n - g - 1]] * g
    sw = statistics.stdev(wins)
    h = n - 2 * g
    se = sw / ((1 - 2 * g / n) * math.sqrt(n)) if h > 1 else math.inf
    half = _t95(h - 1) * se
    return est, est - half, est + half


def rotation(formats: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: the formats rotated by it (no
    format always runs first, right after another's step)."""
    k = round_index % len(formats)
    return list(formats[k:]) + list(formats[:k])


class PrecisionSearch:
    """Trial rounds over ``formats`` (most precise first).  Drive it as::

        while not search.done:
            search.record({fmt: seconds, ...})   # one round, MAX over ranks
        pick = search.pick()
    """

    def __init__(self, formats: Sequence[str], *, min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                 margin: float = MARGIN):
        if not formats:
            raise ValueError("PrecisionSearch: no formats to choose from")
        if not 1 <= min_rounds <= max_rounds:
            raise ValueError(f"PrecisionSearch: need 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
        self.formats = list(formats)
        self.min_rounds, self.max_rounds, self.margin = min_rounds, max_rounds, margin
        self.samples: dict[str, list[float]] = {f: [] for f in self.formats}
        self.dropped = 0  # rounds with a missing or non-finite sample

    @property
    def rounds(self) -> int:
        return len(self.samples[self.formats[0]])

    def record(self, round_times: dict) -> bool:
        """One round: every format's step time (s).  A round with a missing,
        non-finite or non-positive time is dropped (returns False)."""
        vals = [round_times.get(f) for f in self.formats]
        if any(v is None or not math.isfinite(v) or v <= 0 for v in vals):
            self.dropped += 1
            return False
        for f, v in zip(self.formats, vals):
            self.samples[f].append(float(v))
        return True

    def walk(self) -> tuple[str, bool, list[dict]]:
        """``(pick, uncertain, comparisons)``: the walk from the most precise
        format (see the module docstring); ``uncertain``: some comparison's
        interval straddles the margin."""
        best, uncertain, steps = self.formats[0], False, []
        cut = math.log(1 - self.margin)
        for c in self.formats[1:]:
            est, lo, hi = paired_interval(self.samples[best], self.samples[c])
            faster = hi < cut
            undecided = not faster and lo < cut
            uncertain = uncertain or undecided
            steps.append({"format": c, "against": best, "ratio": _ratio(est), "lo": _ratio(lo),
                          "hi": _ratio(hi), "verdict": "faster" if faster else "undecided" if undecided
                          else "not faster"})
            if faster:
                best = c
        return best, uncertain, steps

    @property
    def limit(self) -> int:
        """The rounds this trial may take: ``max_rounds``, or twice it once
        an undecided comparison's estimate is below :data:`PROMISING` there."""
        if self.rounds < self.max_rounds:
            return self.max_rounds
        steps = self.walk()[2]
        promising = any(s["verdict"] == "undecided" and s["ratio"] < PROMISING for s in steps)
        return 2 * self.max_rounds if promising else self.max_rounds

    @property
    def done(self) -> bool:
        n = self.rounds
        return n >= self.limit or (n >= self.min_rounds and not self.walk()[1])

    def pick(self) -> str:
        return self.walk()[0]

    def costs_ms(self) -> dict:
        """Each format's trimmed mean step (ms) over the rounds recorded."""
        out = {}
        for f, s in self.samples.items():
            if s:
                r = sorted(s)
                g = int(TRIM * len(r))
                kept = r[g:len(r) - g]
                out[f] = round(sum(kept) / len(kept) * 1e3, 3)
        return out

    def explain(self) -> str:
        pick, _, steps = self.walk()
        costs = self.costs_ms()
        parts = ", ".join(f"{f} {ms:.2f} ms" for f, ms in costs.items())
        cmp = "; ".join(f"{s['format']}/{s['against']} {s['ratio']:.3f} ({s['lo']:.3f}-{s['hi']:.3f}) "
                        f"{s['verdict']}" for s in steps)
        return (f"{pick} after {self.rounds} paired rounds (trimmed mean step: {parts}; {cmp or 'one format'}; "
                f"a later candidate must be faster by > {self.margin:.0%} over its whole 90% interval)")


def _ratio(x: float) -> float:
    return math.exp(x) if math.isfinite(x) else (math.inf if x > 0 else 0.0)


class Watch:
    """After settling: is the step time still what it was?  Fed one value
    per window (a window's median step, MAX over ranks); the first
    ``baseline_windows`` make the baseline; :meth:`feed` returns True when
    :data:`SUSTAIN` windows in a row lie beyond the noise, at most
    ``max_remeasures`` times over its life."""

    def __init__(self, baseline_windows: int = 2, rel_change: float = REL_CHANGE, sustain: int = SUSTAIN,
                 max_remeasures: int = MAX_REMEASURES):
        if baseline_windows < 1 or sustain < 1 or max_remeasures < 0 or not rel_change > 0:
            raise ValueError("Watch: baseline_windows and sustain must be >= 1, max_remeasures >= 0, "
                             "rel_change > 0")
        self.first_baseline = baseline_windows
        self.rel_change, self.sustain, self.max_remeasures = rel_change, sustain, max_remeasures
        self.remeasures = 0
        self.restart()

    def restart(self) -> None:
        """A new baseline (after settling or a re-measure); each re-measure
        doubles the windows it waits for."""
        self.want = self.first_baseline * (2 ** self.remeasures)
        self.base_windows: list[float] = []
        self.baseline: float | None = None
        self.threshold = self.rel_change
        self.strikes = 0
        self.last: float | None = None

    @property
    def exhausted(self) -> bool:
        return self.remeasures >= self.max_remeasures

    def feed(self, value: float) -> bool:
        """One window's value (s).  True: re-measure now (counted)."""
        if value is None or not math.isfinite(value) or value <= 0:
            return False  # a window without a complete step: no evidence either way
        self.last = value
        if self.baseline is None:
            self.base_windows.append(value)
            if len(self.base_windows) >= self.want:
                self.baseline = statistics.median(self.base_windows)
                spread = (max(self.base_windows) - min(self.base_windows)) / self.baseline
                self.threshold = max(self.rel_change, 3 * spread)
            return False
        if abs(value / self.baseline - 1) > self.threshold:
            self.strikes += 1
        else:
            self.strikes = 0
        if self.strikes >= self.sustain and not self.exhausted:
            self.remeasures += 1
            self.restart()  # the next value belongs to a new baseline
            return True
        return False

    def report(self) -> dict:
        return {"baseline_ms": None if self.baseline is None else round(self.baseline * 1e3, 3),
                "threshold": round(self.threshold, 3), "last_window_ms": None if self.last is None
                else round(self.last * 1e3, 3), "strikes": self.strikes, "remeasures": self.remeasures,
                "exhausted": self.exhausted}
