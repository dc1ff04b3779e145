"""When a model's rounds end; pure.

Every compared pair's step-time ratio interval within ±X (after
:data:`MIN_ROUNDS`), or the model's time budget spent, whichever comes
first (:class:`StopRule`); rank 0 of the runner applies it round after
round (:class:`Stopper`) and broadcasts go on / stop.  The intervals are
:mod:`bench.stats`'s, over the rows of :mod:`bench.report`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .report import Row, pairs
from .stats import DEFAULT_HALF_WIDTH, MIN_BLOCKS, MIN_CI_ROUNDS, Resampler, block_ids, trimmed_mean

__all__ = ["StopRule", "Stopper", "MIN_ROUNDS", "DEFAULT_BUDGET_S", "POST_ROUNDS", "MIN_TIMED_ROUNDS"]


#: Rounds before the precision goal may stop a model: a bootstrap interval
#: of a dozen rounds is too narrow too often to stop on.
MIN_ROUNDS = 20
#: Default time per model (build, warm-up, rounds, profiled step): the 4
#: default models then take at most 7 minutes on 2 cores, and the main job
#: with its wire section (``wire_section.WIRE_BUDGET_S``) about 10.
DEFAULT_BUDGET_S = 105.0
#: Time kept back at the end of a model's budget, in rounds' time, for the
#: profiled step of every wrapper that follows the rounds (a step under the
#: memory profiler takes 2-4x a plain one on the 600-tensor model).
POST_ROUNDS = 3.0
#: Rounds a model runs at least, even when its budget is already spent.
MIN_TIMED_ROUNDS = 3


@dataclass(frozen=True)
class StopRule:
    """When a model's rounds end: every compared pair's step-time ratio
    interval within ±``half_width`` (after ``min_rounds``), or the time
    budget of the model spent, whichever comes first."""

    half_width: float = DEFAULT_HALF_WIDTH
    """Half-width goal of every pair's 90% ratio interval (0.03: ±3%)."""
    budget_s: float = DEFAULT_BUDGET_S
    """Seconds per model, from its build to its last profiled step; what a
    model leaves unused goes to the models after it (:meth:`model_budget`)."""
    min_rounds: int = MIN_ROUNDS
    """Rounds before the precision goal may stop the model."""

    def __post_init__(self):
        if not 0.0 < self.half_width < 1.0:
            raise ValueError(f"half-width must be a fraction in (0, 1) (0.03 = ±3%), got {self.half_width}")
        if not self.budget_s > 0:
            raise ValueError(f"the time budget per model must be > 0 s, got {self.budget_s}")
        if self.min_rounds < MIN_CI_ROUNDS:
            raise ValueError(f"min_rounds must be >= {MIN_CI_ROUNDS}, got {self.min_rounds}")

    def model_budget(self, index: int, used_s: float) -> float:
        """The budget of the run's model ``index`` (0-based, across sections)
        when the models before it took ``used_s`` in all: each model must
        end by ``(index + 1) x budget_s`` into the run, so time a model saves
        by reaching the precision early goes to the next ones (the slow
        models, last in the default order, need it most) and the run never
        takes more than ``models x budget_s``.  May be <= 0 after an overrun."""
        return (index + 1) * self.budget_s - used_s

    def widest(self, rows: Sequence[Row], placements: Sequence[int] | None = None) -> float | None:
        """The widest half-width of the compared pairs' ratio intervals in
        ``rows`` (one model); None when nothing is compared, inf with too
        few rounds for an interval, or, where the rows are rebuilt
        (``placements``: the rounds at which each build began), too few
        placements for the interval to cover the spread between them."""
        found = pairs(rows)
        if not found:
            return None
        n = min(min(len(a.step_ms), len(b.step_ms)) for a, b in found)
        if n < MIN_CI_ROUNDS:
            return math.inf
        rs = Resampler(n, blocks=block_ids(n, placements))
        if placements is not None and rs.blocks < MIN_BLOCKS:
            return math.inf
        worst = 0.0
        for a, b in found:
            logs = [math.log(x / y) for x, y in zip(a.step_ms[:n], b.step_ms[:n])]
            lo, hi = rs.interval(logs, trimmed_mean(logs))
            worst = max(worst, (math.exp(hi) - math.exp(lo)) / 2)
        return worst


class Stopper:
    """Applies a :class:`StopRule` round after round (rank 0 of the runner).

    The precision check bootstraps every pair, so it runs at ``min_rounds``
    and then each time the rounds have grown by a tenth; the budget is
    checked every round: the next round plus the work after the rounds
    (:data:`POST_ROUNDS` rounds' time) must fit."""

    def __init__(self, rule: StopRule, budget_s: float | None = None):
        self.rule = rule
        self.budget_s = rule.budget_s if budget_s is None else budget_s
        """This model's budget (:meth:`StopRule.model_budget`); default: the rule's."""
        self.next_check = rule.min_rounds
        self.widest: float | None = None

    def update(self, rows: Sequence[Row], rounds: int, elapsed_s: float, round_s: float,
               placements: Sequence[int] | None = None) -> str | None:
        """``"precision"``, ``"budget"`` or None (go on), after ``rounds``
        timed rounds, ``elapsed_s`` into the model's budget, the last round
        having taken ``round_s`` (``placements``: :meth:`StopRule.widest`)."""
        if rounds >= self.next_check:
            self.widest = self.rule.widest(rows, placements)
            self.next_check = rounds + max(1, rounds // 10)
            if self.widest is not None and self.widest <= self.rule.half_width:
                return "precision"
        if rounds >= MIN_TIMED_ROUNDS and elapsed_s + round_s * (1.0 + POST_ROUNDS) > self.budget_s:
            return "budget"
        return None
