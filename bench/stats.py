"""The bench's statistics, in one place; pure (torch serves as a vectorised
math library for the bootstrap).

Two designs, one module:

* **paired rounds** (one run): every round ran each wrapper once on the same
  batch (order rotated); a round's time is the slowest rank's
  (:func:`merge_ranks`).  Two rows are compared *paired by round*::

      ratio  = exp(trimmed mean over rounds of log(a_i / b_i))
      diff   = trimmed mean over rounds of (a_i - b_i)          [ms]

  with a percentile-bootstrap 90% interval that resamples whole rounds
  (:class:`Resampler`): a slow round slows both and cancels.  The trimmed
  mean (the middle 60% of rounds) keeps a few disturbed rounds from moving
  the estimate, as a median would, but with a smooth bootstrap.  The
  verdict (:func:`decide`) reads the ratio's interval against a margin of
  ±X.  A ratio of two overheads over ``local`` is given only where the
  peer's overhead interval lies above zero, and never below 0.
* **repeated runs** (fresh processes): one ratio per run, the geometric mean
  and a Student t interval over the runs' log ratios
  (:func:`ratio_over_runs`); the t quantile is computed
  (:func:`t_quantile`), not looked up, so any number of runs is exact.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "Quantiles", "Comparison", "Resampler",
    "quantile", "summarize", "trimmed_mean", "merge_ranks", "interval", "paired", "compare", "decide",
    "verdict_text", "geo_mean", "t_quantile", "ratio_over_runs",
    "block_ids", "LEVEL", "BOOTSTRAP", "TRIM", "MIN_CI_ROUNDS", "MIN_BLOCKS", "DEFAULT_HALF_WIDTH",
]

#: Confidence level of every interval.
LEVEL = 0.90
#: Bootstrap resamples behind each interval (seeded: reports are reproducible).
BOOTSTRAP = 1000
#: Fraction of rounds cut from each end before averaging.
TRIM = 0.2
#: Below this many rounds no interval is given (the bootstrap of 4 rounds says nothing).
MIN_CI_ROUNDS = 5
#: Placements (builds of every row in fresh allocations) a model needs before
#: its intervals also cover the spread between placements (fewer: rounds only).
MIN_BLOCKS = 3
#: Default equality margin (and the bench's default precision goal): ±3% of the peer's step time.
DEFAULT_HALF_WIDTH = 0.03


# -- paired rounds ----------------------------------------------------------------

def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples`` with linear interpolation
    between closest ranks (numpy's default method); infinite samples are
    allowed (equal neighbours are returned as they are)."""
    if len(samples) == 0:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    xs = sorted(samples)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    if frac == 0 or xs[hi] == xs[lo]:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * frac


@dataclass
class Quantiles:
    """p20 / median / p80 of a set of samples (same unit as the samples)."""

    median: float
    p20: float
    p80: float


def summarize(samples: Sequence[float]) -> Quantiles | None:
    """Median, p20 and p80 of ``samples``; None when there are none."""
    if not samples:
        return None
    return Quantiles(quantile(samples, 0.5), quantile(samples, 0.2), quantile(samples, 0.8))


def _cut(n: int, trim: float = TRIM) -> int:
    """Samples cut from each end of ``n`` (at least one is kept)."""
    return min(int(trim * n), (n - 1) // 2)


def trimmed_mean(samples: Sequence[float], trim: float = TRIM) -> float:
    """Mean of ``samples`` without the lowest and highest ``trim`` fraction
    (``int(trim * n)`` from each end)."""
    if len(samples) == 0:
        raise ValueError("trimmed mean of no samples")
    xs = sorted(samples)
    k = _cut(len(xs), trim)
    kept = xs[k:len(xs) - k]
    return math.fsum(kept) / len(kept)


def merge_ranks(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[tuple[float, float, float]]:
    """One round's samples from every rank -> one sample per wrapper.

    ``per_rank[rank][wrapper] = (step ms, exposed ms, host CPU ms)``; a
    round's step time and exposed communication are the slowest rank's (it
    sets the pace of data parallel training), its host CPU time the mean
    over ranks (the work one rank does).  Exposed time < 0 means "not
    measured" on that rank and stays < 0 only when no rank measured it."""
    if not per_rank:
        raise ValueError("merge_ranks: no rank's samples")
    width = len(per_rank[0])
    if any(len(r) != width for r in per_rank):
        raise ValueError(f"merge_ranks: ranks report different numbers of wrappers "
                         f"{[len(r) for r in per_rank]}")
    out = []
    for w in range(width):
        col = [r[w] for r in per_rank]
        out.append((max(c[0] for c in col), max(c[1] for c in col),
                    math.fsum(c[2] for c in col) / len(col)))
    return out


def block_ids(n: int, starts: Sequence[int] | None) -> list[int] | None:
    """Per round (``n`` of them), the placement it ran in, from the timed
    rounds at which each placement began (``starts``, ascending, the first
    0); None where there is no such record."""
    if not starts:
        return None
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"placement starts must begin at round 0 and ascend, got {list(starts)}")
    ids, k = [], 0
    for i in range(n):
        while k + 1 < len(starts) and starts[k + 1] <= i:
            k += 1
        ids.append(k)
    return ids


class Resampler:
    """The paired bootstrap over ``n`` rounds: ``resamples`` draws of ``n``
    round indices with replacement (seeded), shared by every statistic of a
    model so that all its intervals resample the same rounds.

    ``blocks`` (per round, the placement it ran in: :func:`block_ids`) adds
    the bootstrap over placements: whole placements drawn with replacement.
    A row keeps the speed of where its memory landed for as long as it
    lives (the row effect: 1.6-4.2% between rows running the same program,
    and per 20-round placement the mean fastddp/torch ratio of one pair
    ranged 0.944-1.127 in one run), so rounds of one placement are not
    independent, and the bootstrap over rounds alone printed decided
    verdicts that the next run or a focused rerun contradicted.  With K
    placements the percentile interval over placements is widened about
    its point by ``t(K-1) / z * sqrt(K / (K-1))`` (Student's t for the few
    placements, the bootstrap's variance bias for a mean), and the interval
    is the union with the one over rounds, so it is never narrower than
    before.  Fewer than :data:`MIN_BLOCKS` placements: rounds only.

    A resample is kept as counts per round, so the trimmed mean of a
    resample is a weighted sum over the sorted sample: no sort per
    resample (1000 x 300 rounds in ~15 ms)."""

    def __init__(self, n: int, resamples: int = BOOTSTRAP, seed: int = 0, blocks: Sequence[int] | None = None):
        if n < 1:
            raise ValueError(f"Resampler needs at least one round, got {n}")
        if resamples < 10:
            raise ValueError(f"Resampler needs at least 10 resamples, got {resamples}")
        self.n, self.resamples = n, resamples
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, n, (resamples, n), generator=gen)
        self.counts = torch.zeros(resamples, n, dtype=torch.float64)
        self.counts.scatter_add_(1, idx, torch.ones(resamples, n, dtype=torch.float64))
        self.blocks = 0
        """Placements the intervals also resample (0: rounds only)."""
        self.block_counts: torch.Tensor | None = None
        self.widen = 1.0
        if blocks is not None:
            if len(blocks) != n:
                raise ValueError(f"Resampler over {n} rounds got placements for {len(blocks)}")
            bid = torch.as_tensor(list(blocks), dtype=torch.int64)
            k = int(bid.max()) + 1
            if k >= MIN_BLOCKS:
                draws = torch.randint(0, k, (resamples, k), generator=gen)
                per = torch.zeros(resamples, k, dtype=torch.float64)
                per.scatter_add_(1, draws, torch.ones(resamples, k, dtype=torch.float64))
                self.block_counts = per[:, bid]
                self.blocks = k
                z = statistics.NormalDist().inv_cdf((1 + LEVEL) / 2)  # Student's t over placements is scaled by t/z
                self.widen = t_quantile(LEVEL, k - 1) / z * math.sqrt(k / (k - 1))

    def trimmed_means(self, samples: Sequence[float], counts: torch.Tensor | None = None) -> torch.Tensor:
        """The trimmed mean of ``samples`` (one per round) in every resample
        (of rounds, or ``counts``: rows of weights per round)."""
        if len(samples) != self.n:
            raise ValueError(f"Resampler over {self.n} rounds got {len(samples)} samples")
        x = torch.as_tensor(samples, dtype=torch.float64)
        xs, order = x.sort()
        c = (self.counts if counts is None else counts)[:, order]
        upto = c.cumsum(1)
        total = upto[:, -1:]  # rounds in each resample (placements differ in length)
        k = torch.floor(TRIM * total).minimum(torch.floor((total - 1) / 2))
        # each sorted value's count that falls inside positions [k, total - k)
        w = (torch.minimum(upto, total - k) - torch.maximum(upto - c, k)).clamp(min=0)
        return (w @ xs) / (total - 2 * k).squeeze(1)

    def interval(self, samples: Sequence[float], point: float) -> tuple[float, float]:
        """The interval of the trimmed mean of ``samples`` (its value:
        ``point``): over rounds, and over placements where there are enough."""
        lo, hi = interval(self.trimmed_means(samples))
        if self.block_counts is not None:
            blo, bhi = interval(self.trimmed_means(samples, self.block_counts))
            lo = min(lo, point - self.widen * (point - blo))
            hi = max(hi, point + self.widen * (bhi - point))
        return lo, hi


def interval(boot: torch.Tensor | Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of bootstrap values (infinite values allowed)."""
    vals = boot.tolist() if isinstance(boot, torch.Tensor) else list(boot)
    a = (1.0 - level) / 2
    return quantile(vals, a), quantile(vals, 1.0 - a)


def decide(ci: tuple[float, float] | None, margin: float) -> str:
    """The verdict of a step-time ratio interval (fastddp / peer):

    * ``equal``: the whole interval lies within ``1 ± margin`` (any
      difference is smaller than the margin);
    * ``faster`` / ``slower``: the whole interval is below / above 1;
    * ``undecided``: anything else, or no interval."""
    if ci is None:
        return "undecided"
    lo, hi = ci
    if 1.0 - margin < lo and hi < 1.0 + margin:
        return "equal"
    if hi < 1.0:
        return "faster"
    if lo > 1.0:
        return "slower"
    return "undecided"


def verdict_text(verdict: str | None, margin: float) -> str:
    if verdict is None:
        return "-"
    return f"equal ±{margin * 100:g}%" if verdict == "equal" else verdict


@dataclass
class Comparison:
    """A fastddp row against one peer, paired by round."""

    model: str
    wrapper: str
    peer: str
    rounds: int
    ratio: float
    """Step time fastddp / peer: exp of the trimmed mean of the per-round log ratios."""
    ratio_ci: tuple[float, float] | None
    diff_ms: float
    """Trimmed mean of the per-round difference fastddp - peer, ms (< 0: fastddp faster)."""
    diff_ci: tuple[float, float] | None
    overhead_ratio: float | None = None
    """fastddp's overhead over ``local`` / the peer's; None unless the
    peer's overhead interval lies above 0; never below 0."""
    overhead_ratio_ci: tuple[float, float] | None = None
    verdict: str | None = None
    """``faster``, ``slower``, ``equal`` (within the margin) or
    ``undecided``; None where no verdict is given (``--quick``)."""
    best: bool = False
    """The peer with the lowest step time of this row's peers: the headline."""

    @property
    def half_width(self) -> float | None:
        """Half the width of the ratio's interval (a fraction of the peer's step time)."""
        return None if self.ratio_ci is None else (self.ratio_ci[1] - self.ratio_ci[0]) / 2


def paired(samples: Sequence[float], rs: Resampler | None) -> tuple[float, tuple[float, float] | None]:
    point = trimmed_mean(samples)
    if rs is None:
        return point, None
    return point, rs.interval(samples, point)


def compare(a: Sequence[float], b: Sequence[float], local: Sequence[float] | None = None, *,
            margin: float = DEFAULT_HALF_WIDTH, verdict: bool = True, resampler: Resampler | None = None,
            model: str = "", wrapper: str = "", peer: str = "") -> Comparison:
    """Compare step times ``a`` (fastddp) with ``b`` (its peer), round by
    round (``a[i]``, ``b[i]`` and ``local[i]`` ran in the same round).

    ``resampler`` (over the same number of rounds) lets every comparison of
    a model share one set of resamples; without it one is made.  Fewer than
    :data:`MIN_CI_ROUNDS` rounds: point estimates only, verdict
    ``undecided``."""
    n = min(len(a), len(b), len(local) if local is not None else len(a))
    if n < 1:
        raise ValueError(f"compare {wrapper or 'a'} with {peer or 'b'}: no rounds")
    a, b = list(a[:n]), list(b[:n])
    bad = [x for x in a + b if not x > 0]
    if bad:
        raise ValueError(f"compare {wrapper or 'a'} with {peer or 'b'}: step times must be > 0 ms, got {bad[0]}")
    rs = None
    if n >= MIN_CI_ROUNDS:
        rs = resampler if resampler is not None and resampler.n == n else Resampler(n)
    log_ratio, point_ci = paired([math.log(x / y) for x, y in zip(a, b)], rs)
    diff, diff_ci = paired([x - y for x, y in zip(a, b)], rs)
    cmp = Comparison(model, wrapper, peer, n, math.exp(log_ratio),
                     None if point_ci is None else (math.exp(point_ci[0]), math.exp(point_ci[1])),
                     diff, diff_ci)
    if local is not None and rs is not None:
        loc = list(local[:n])
        over_b = [y - z for y, z in zip(b, loc)]
        boot_b = rs.trimmed_means(over_b)
        if interval(boot_b)[0] > 0:  # the peer's overhead is clearly positive
            over_a = [x - z for x, z in zip(a, loc)]
            boot_a = rs.trimmed_means(over_a)
            ratios = torch.where(boot_b > 0, (boot_a / boot_b).clamp(min=0.0),
                                 torch.full_like(boot_b, math.inf))
            cmp.overhead_ratio = max(0.0, trimmed_mean(over_a) / trimmed_mean(over_b))
            cmp.overhead_ratio_ci = interval(ratios)
    if verdict:
        cmp.verdict = decide(cmp.ratio_ci, margin)
    return cmp



# -- repeated runs ------------------------------------------------------------------

def geo_mean(xs: Sequence[float]) -> float:
    """Geometric mean of positive ``xs``."""
    if len(xs) == 0:
        raise ValueError("geometric mean of no values")
    if any(not x > 0 for x in xs):
        raise ValueError(f"geometric mean needs values > 0, got {min(xs)}")
    return math.exp(math.fsum(math.log(x) for x in xs) / len(xs))


def _t_two_sided(t: float, dof: int) -> float:
    """P(|T| < t) for Student's t with ``dof`` degrees of freedom (t >= 0),
    by the finite series that exist for integer dof (Abramowitz & Stegun
    26.7.3 / 26.7.4), with theta = atan(t / sqrt(dof))."""
    theta = math.atan(t / math.sqrt(dof))
    s, c = math.sin(theta), math.cos(theta)
    if dof % 2 == 1:
        # (2 / pi) (theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...)), dof - 2 as the last power
        term, total = c, 0.0
        for k in range(1, (dof - 1) // 2 + 1):
            total += term
            term *= c * c * (2 * k) / (2 * k + 1)
        return (2 / math.pi) * (theta + s * total)
    # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), dof - 2 as the last power
    term, total = 1.0, 0.0
    for k in range(1, dof // 2 + 1):
        total += term
        term *= c * c * (2 * k - 1) / (2 * k)
    return s * total


def t_quantile(level: float, dof: int) -> float:
    """The two-sided ``level`` quantile of Student's t with ``dof`` degrees
    of freedom: the t with ``P(|T| < t) = level`` (0.90, 1 dof: 6.314)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"t_quantile: level must be in (0, 1), got {level}")
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"t_quantile: degrees of freedom must be an int >= 1, got {dof!r}")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, dof) < level:
        hi *= 2.0
    for _ in range(200):  # bisection: P(|T| < t) increases with t
        mid = (lo + hi) / 2
        if _t_two_sided(mid, dof) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def ratio_over_runs(ratios: Sequence[float], level: float = LEVEL) -> tuple[float, tuple[float, float] | None]:
    """Repeated runs, one ratio each: the geometric mean of ``ratios`` and
    its ``level`` Student t interval over the runs' log ratios (None for one
    run: no spread to measure)."""
    if len(ratios) == 0:
        raise ValueError("ratio_over_runs: no runs")
    logs = [math.log(geo_mean([q])) for q in ratios]  # geo_mean checks each ratio is > 0
    k, m = len(logs), math.fsum(logs) / len(logs)
    if k < 2:
        return math.exp(m), None
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in logs) / (k - 1))
    h = t_quantile(level, k - 1) * sd / math.sqrt(k)
    return math.exp(m), (math.exp(m - h), math.exp(m + h))
