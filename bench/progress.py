"""Rank 0's progress bar over a whole run (:class:`Progress`)."""

from __future__ import annotations

import math
import sys

from .config import BenchConfig
from .models import model_zoo

__all__ = ["Progress", "eta_s"]


def eta_s(total_s: float, used_s: float, elapsed_s: float) -> float:
    """The most an adaptive run can still take: its total budget (models x
    sections x budget) less what the finished models used and ``elapsed_s``
    into the current one (each model ends by its share of the total)."""
    return max(0.0, total_s - used_s - elapsed_s)


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    """Rank 0's progress bar over the whole run (stderr, tqdm when installed;
    otherwise, or with ``enabled`` False, nothing).

    Adaptive rounds: the bar is time against the run's total budget (models
    x sections x budget: model i ends by (i + 1) x budget into the run, see
    :meth:`stoprule.StopRule.model_budget`) and says how long the run can
    still take at most (:func:`eta_s`), which holds across models whose
    rounds take different times.  ``--steps`` / ``--quick``: the bar counts
    rounds."""

    _FORMAT = "{desc} {percentage:3.0f}%|{bar}| "

    def __init__(self, enabled: bool, cfg: BenchConfig):
        self.cfg, self.label, self.text = cfg, "", ""
        zoo = model_zoo()
        models = list(cfg.models) * len(cfg.bandwidths)
        self.adaptive = cfg.mode == "adaptive"
        self.total_s = cfg.sections_budget_s
        self.used_s = 0.0
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if self.adaptive:
            self.bar = tqdm(total=round(self.total_s), file=sys.stderr, dynamic_ncols=True, leave=False,
                            bar_format=self._FORMAT)
        else:
            rounds = sum(cfg.warmup_steps() - 1 + cfg.rounds_for(zoo[m]) for m in models)
            self.bar = tqdm(total=rounds, unit="round", file=sys.stderr, dynamic_ncols=True, leave=False)

    def start(self, label: str) -> None:
        self.label = label
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            if self.adaptive:
                self.tick(0.0, 0, None)

    def tick(self, elapsed_s: float, rounds: int, widest: float | None) -> None:
        """After a round: ``elapsed_s`` into the current model, ``rounds``
        timed so far, the widest pair's half-width (None: not checked yet)."""
        if self.bar is None:
            return
        if not self.adaptive:
            self.bar.update(1)
            return
        goal = f"±{self.cfg.stop_rule().half_width * 100:g}%"
        state = "building, warming up" if rounds == 0 else (
            f"round {rounds}, widest pair " + ("-" if widest is None or math.isinf(widest) else f"±{widest:.1%}")
            + f" (goal {goal})")
        self.bar.n = min(round(self.used_s + elapsed_s), self.bar.total)
        # the text goes into the format itself: tqdm's postfix field would prefix ", "
        self.text = f"{state}, at most {_clock(eta_s(self.total_s, self.used_s, elapsed_s))} left"
        self.bar.bar_format = self._FORMAT + self.text.replace("{", "{{").replace("}", "}}")
        self.bar.refresh()

    def end(self, elapsed_s: float) -> None:
        """The current model took ``elapsed_s`` in all."""
        self.used_s += elapsed_s

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
