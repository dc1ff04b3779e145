"""The search over candidate layouts, fed with measured costs: pure.

Which layout to measure next, when one has been measured enough, when a
difference is noise, and which layout wins, from the samples given to
:meth:`Search.record` alone (the driver gives every rank the same MAX-reduced
samples, so every rank decides the same).  No clock, no process group: a test
feeds it synthetic timings."""

from __future__ import annotations

import math
import statistics

from .model import Candidate, line_fit

__all__ = ["COPY_SPEED_GBPS", "MAX_LAYOUTS", "MAX_TRIAL_STEPS", "MAX_TUNING_STEPS", "PRUNE", "REL_NOISE",
           "SPREAD_OK", "Search", "TRIAL_STEPS"]

TRIAL_STEPS = 3
"""Measured steps per layout at least (and per extension)."""
MAX_TRIAL_STEPS = 9
"""Measured steps per layout at most: a noisy layout is measured in rounds of
TRIAL_STEPS until its spread is under SPREAD_OK or it has this many."""
MAX_TUNING_STEPS = 30
"""Measured steps over all layouts at most (the probe and waits not counted):
tuning then settles on the best so far."""
SPREAD_OK = 0.02
"""Relative robust spread (1.4826 MAD / median) of a layout's steps under
which TRIAL_STEPS of them suffice.  On a shared 2-core machine a 70 ms step
was measured as 72 / 85 / 115 ms in one trial: a median of 3 then ranks
layouts by the machine's noise (auto measured 1.11x the best fixed cap)."""
MAX_LAYOUTS = 7
"""Layouts measured at most: probe + 7 x 3 steps settles by step ~25 on quiet steps."""
COPY_SPEED_GBPS = 0.5
"""An all-reduce microbenchmark at this rate or more (GB/s) means the link
moves bytes at copy speed (shared memory, loopback; a 1 Gbit/s wire measures
~0.12): there a CPU collective costs CPU time (:meth:`Search.by_link`)."""
REL_NOISE = 0.01
"""A layout must beat the best by more than 1% (or the measured spread) to replace it."""
PRUNE = 0.15
"""Never tried: a calibrated prediction more than 15% above the best measured cost."""


class Search:
    """Trials over ``layouts``, torch's ``default`` first.

    ``cpu``: the ranks run on the CPU (ties are then decided by the link);
    ``link_gbps``: the all-reduce microbenchmark's rate (None: no size
    dependence measured).  Drive it as::

        lay = search.default
        while lay is not None:
            search.record(lay, steps, exposed)   # TRIAL_STEPS samples each time
            if not search.wants_more(lay):
                lay = search.next()
        pick = search.final_best()
    """

    def __init__(self, layouts: list[Candidate], default: Candidate, *, cpu: bool, link_gbps: float | None):
        if not any(l is default for l in layouts):
            raise ValueError("fastddp autotune: torch's default layout must be one of the candidates")
        self.layouts, self.default = layouts, default
        self.cpu, self.link_gbps = cpu, link_gbps
        self.order: list[Candidate] = []  # measured, in trial order
        self.best: Candidate | None = None
        self.tie_rule = ""             # how final_best chose among layouts within noise

    @property
    def steps(self) -> int:
        """Steps measured over all layouts."""
        return sum(len(l.samples) for l in self.order)

    def record(self, lay: Candidate, steps: list, exposed: list) -> None:
        """One round of ``lay``'s steps (s, MAX over ranks): the step times
        and their exposed communication.  ``lay`` replaces the best only if
        faster by more than the noise; the best measured again may lose its place."""
        lay.samples += steps
        lay.exposed += exposed
        if lay not in self.order:
            self.order.append(lay)
        if self.best is lay:  # measured again: is it still the best?
            self.best = min(self.order, key=lambda l: l.cost)
        elif self.best is None or lay.cost < self.best.cost - self.noise(self.best, lay):
            self.best = lay

    def wants_more(self, lay: Candidate) -> bool:
        """Measure ``lay`` TRIAL_STEPS more steps?"""
        return len(lay.samples) < MAX_TRIAL_STEPS and lay.spread > SPREAD_OK and not self.spent()

    def spent(self) -> bool:
        return self.steps >= MAX_TUNING_STEPS

    def final_best(self) -> Candidate:
        """The best once every trial is in: the fastest layout measured, if
        it beats the incumbent by the noise as known now (the spread pooled
        over all trials, each layout's own step count).  Else the trials
        could not separate the incumbent from the layouts measured within its
        noise, and on the CPU the link decides among those ties
        (:meth:`by_link`); on CUDA the incumbent stays."""
        self.tie_rule = ""
        low = min(self.order, key=lambda l: l.cost)
        if low is not self.best and low.cost < self.best.cost - self.noise(self.best, low):
            self.best = low
            return self.best
        if self.cpu:
            ties = [l for l in self.order if l is self.best or l.cost < self.best.cost + self.noise(self.best, l)]
            self.best = self.by_link(ties)
        return self.best

    def copy_speed(self) -> bool:
        """CPU ranks on a link at copy speed (the microbenchmark at
        COPY_SPEED_GBPS or more; None: no size dependence measured, a tiny
        model): a collective costs CPU time there, and the model, which
        assumes communication overlaps backward, favours too many buckets,
        so the fewest-buckets layout is tried third, after torch's default
        and the model's best (unless the calibrated model prunes it)."""
        gbps = self.link_gbps
        return self.cpu and (gbps is None or gbps >= COPY_SPEED_GBPS)

    def by_link(self, ties: list) -> Candidate:
        """Among layouts the steps cannot tell apart (CPU ranks: steps spread
        15-25% step to step on a 2-core VM, so 30 tuning steps cannot resolve
        3-7%), what the link says: at copy speed (the all-reduce microbenchmark
        at COPY_SPEED_GBPS or more: shared memory, loopback) a collective costs
        CPU time that ranks sharing the cores cannot overlap, so the fewest
        buckets (measured: one bucket 3-5% faster than torch's default on
        ``small`` and the transformer locally); on a slower wire, overlap pays
        and the model's pick (``small`` at 1 Gbit/s: 0.5-1 MiB buckets 7%
        faster than the default), its price corrected by the per-bucket cost
        the trials show (:meth:`per_bucket_s`), unless the gain so predicted
        over the incumbent is within the trials' noise, where it is within the
        model's own error (the transformer with fp8 at 0.2 Gbit/s: ~10 ms
        predicted against ±20-40 ms of noise, measured 1-4% slower than
        torch's default)."""
        gbps = self.link_gbps
        rate = "unmeasured" if gbps is None else f"{gbps:g} GB/s"
        if self.copy_speed():
            pick = min(ties, key=lambda l: (l.buckets, l.cost))
            rule = f"the link runs at copy speed ({rate}): the fewest buckets"
        else:
            per = self.per_bucket_s()

            def price(lay: Candidate) -> float:  # the model, corrected per bucket by the trials
                return lay.predicted_s + per * lay.buckets
            pick, inc = min(ties, key=lambda l: (price(l), l.cost)), self.best
            gain = price(inc) - price(pick)
            fit = f", with {per * 1e3:.2f} ms a bucket fitted to the trials" if per > 0 else ""
            rule = f"the link is a wire ({rate}): the model's pick{fit}"
            if pick is not inc and not gain > self.noise(inc, pick):
                # a gain the trials' noise would hide is within the model's own error
                pick = inc
                rule = (f"the link is a wire ({rate}), but the model's gain ({gain * 1e3:.1f} ms{fit}) is within "
                        "the noise: kept the incumbent")
        if len(ties) > 1:
            self.tie_rule = f"{len(ties)} layouts within noise of each other; {rule}"
        return pick

    def per_bucket_s(self) -> float:
        """What one more bucket costs beyond the model, as the trials show it:
        the slope of (measured cost - prediction) over the bucket count, a
        least-squares line weighted by each layout's steps; 0 where it is not
        above twice its standard error (the steps' pooled robust spread), is
        negative, or fewer than two bucket counts were measured.  The model
        prices a bucket as one collective plus HOST_PER_BUCKET_S; a two-phase
        mode (fp8, bf16 with fp32 sum) runs two collectives and a
        quantization per bucket, and gloo over TCP a few round trips per
        collective.  Measured: the transformer with fp8 at 0.2 Gbit/s, 2.1-2.6
        ms a bucket (3-4 standard errors) the model did not see, so its
        19-bucket pick ran 5-7% slower than torch's default."""
        fit = [l for l in self.order if l.samples and math.isfinite(l.predicted_s)]
        if len({l.buckets for l in fit}) < 2:
            return 0.0
        _, slope, sxx = line_fit([l.buckets for l in fit], [l.cost - l.predicted_s for l in fit],
                                 [len(l.samples) for l in fit])
        return slope if slope > 2 * self.pooled_spread() / math.sqrt(sxx) else 0.0

    def pooled_spread(self) -> float:
        """The steps' robust spread (s) pooled over every trial: 1.4826 x
        the median absolute deviation from each layout's own cost."""
        dev = [abs(s - l.cost) for l in self.order for s in l.samples]
        return 1.4826 * statistics.median(dev) if dev else 0.0

    def noise(self, ref: Candidate, other: Candidate | None = None) -> float:
        """What a difference of the costs of ``ref`` and ``other`` must exceed:
        1% of ``ref``'s cost, or twice the pooled robust spread of the steps
        times sqrt(1/n_ref + 1/n_other), the samples each was measured on
        (TRIAL_STEPS for a layout not given).  A layout measured longer
        because its steps spread (up to MAX_TRIAL_STEPS) is known better: with
        the count fixed at TRIAL_STEPS a 10% gain measured on 9 steps each was
        kept out as noise (``small`` at 1 Gbit/s, 1.067x the best cap)."""
        spread = self.pooled_spread()
        n_ref = max(len(ref.samples), 1)
        n_other = max(len(other.samples), 1) if other is not None else TRIAL_STEPS
        return max(REL_NOISE * ref.cost, 2 * spread * math.sqrt(1 / n_ref + 1 / n_other))

    def calibrated(self, lay: Candidate) -> float:
        """The model's prediction on the measured scale, optimistically: +
        the smallest (measured - predicted) seen.  It only prunes, so it errs
        towards trying: with the median, one layout the model misjudged badly
        (predicted fastest, measured 25% slower) pulled every prediction up
        and pruned the true best unseen."""
        base = min(l.cost - l.predicted_s for l in self.order)
        return base + lay.predicted_s

    def next(self) -> Candidate | None:
        """The layout to measure next; None: the search is over."""
        measured = {id(l) for l in self.order}
        if len(self.order) >= MAX_LAYOUTS or self.spent():
            return None
        if len(self.order) <= 2:  # after torch's default: the model's best, then (copy speed) the fewest buckets
            early = [min(self.layouts, key=lambda l: l.predicted_s)]
            if self.copy_speed() and len(self.order) == 2:  # unless the calibrated model knows it to be bad
                fewest = min(self.layouts, key=lambda l: (l.buckets, l.predicted_s))
                if self.calibrated(fewest) <= self.best.cost * (1 + PRUNE):
                    early.append(fewest)
            for lay in early:
                if id(lay) not in measured:
                    return lay
        best = self.best
        limit = best.cost * (1 + PRUNE)
        # neighbours of the best: the next rest caps either side (the model's
        # best first cap for each), and the best rest cap's other first caps
        rests = sorted({l.rest_mb for l in self.layouts})
        k = rests.index(best.rest_mb) if best.rest_mb in rests else 0
        near = [l for l in self.layouts if l.rest_mb == best.rest_mb]
        for j in (k - 1, k + 1):
            if 0 <= j < len(rests):
                same = [l for l in self.layouts if l.rest_mb == rests[j]]
                near.append(min(same, key=lambda l: l.predicted_s))
        todo = [l for l in near if id(l) not in measured and self.calibrated(l) <= limit]
        # a direction already measured worse than the best: do not walk on
        for l in self.order:
            if l is not best and l.cost >= best.cost:
                todo = [t for t in todo if not _beyond(t, l, best)]
        return min(todo, key=self.calibrated) if todo else None


def _beyond(t: Candidate, worse: Candidate, best: Candidate) -> bool:
    """``t`` lies past ``worse`` as seen from ``best`` on the rest-cap axis."""
    if worse.rest_mb == best.rest_mb:
        return False
    if worse.rest_mb > best.rest_mb:
        return t.rest_mb > worse.rest_mb
    return t.rest_mb < worse.rest_mb
