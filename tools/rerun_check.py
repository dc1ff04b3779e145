"""Do main jobs run back to back agree, and do their intervals explain how far
apart they land?

    python -m tools.rerun_check reports/DEV/A.json reports/DEV/B.json [C.json ...]

Each ``fastddp-bench`` json is read back (``fastddp.bench.report.from_json``)
and derived as the report was; every pair (section, model, fastddp row,
peer) present in every run is compared:

* **verdicts**: decided alike in every run, undecided in every run, decided in
  some runs only (the others undecided), decided differently but compatibly
  (``faster`` and ``equal``, or ``slower`` and ``equal``: a ratio within the
  margin and below 1 makes both true), or **contradicted** (``faster`` in
  one run, ``slower`` in another: the failure the main job must not show);
  and pairs whose intervals in two runs do not overlap;
* **calibration**: how often one run's point estimate lies inside another
  run's 90% interval, and the run-to-run differences of the log ratios in
  units of their combined interval widths.  If the intervals account for
  everything that moves a run (rounds, placements, whatever lasts a whole
  process), about 76% of points fall inside (two independent estimates of
  one normal mean: P(|Z| < 1.645 / sqrt 2)) and the differences' standard
  deviation is about 1; well below 76% / above 1 means an effect the
  interval does not see.

Exit status 1 when a pair is contradicted, else 0.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys

from fastddp.bench.stats import LEVEL

#: the bench's intervals are two-sided at LEVEL (90%): their normal quantile
Z90 = statistics.NormalDist().inv_cdf((1 + LEVEL) / 2)
#: share of one run's points inside another's 90% interval when both are calibrated and independent
EXPECTED_INSIDE = 2 * statistics.NormalDist().cdf(Z90 / math.sqrt(2)) - 1


def table(report) -> dict:
    """``{(section, model, wrapper, peer): (ratio, (lo, hi) or None, verdict)}`` of one derived report."""
    from fastddp.bench import report as R

    out = {}
    for s in report.sections:
        R.derive(s)
        for c in s.comparisons:
            out[(s.tag, c.model, c.wrapper, c.peer)] = (c.ratio, tuple(c.ratio_ci) if c.ratio_ci else None,
                                                        c.verdict)
    return out


def verdicts(tables: list[dict]) -> dict:
    """Each pair present in every run, classified: ``alike``, ``undecided``,
    ``some``, ``compatible`` or ``contradicted``."""
    keys = [k for k in tables[0] if all(k in t for t in tables[1:])]
    out = {}
    for k in keys:
        decided = {t[k][2] for t in tables} - {"undecided"}
        if {"faster", "slower"} <= decided:
            out[k] = "contradicted"
        elif len(decided) > 1:
            out[k] = "compatible"
        elif not decided:
            out[k] = "undecided"
        else:
            out[k] = "alike" if all(t[k][2] != "undecided" for t in tables) else "some"
    return out


def disjoint(tables: list[dict]) -> list:
    """Pairs with two runs whose intervals do not overlap."""
    out = []
    for k in verdicts(tables):
        cis = [t[k][1] for t in tables if t[k][1]]
        if any(a[1] < b[0] or b[1] < a[0] for a, b in itertools.combinations(cis, 2)):
            out.append(k)
    return out


def calibration(tables: list[dict]) -> dict:
    """Coverage of each run's point by every other run's interval, and the
    spread of the pairwise log differences in units of their combined
    standard errors (from the 90% intervals' widths)."""
    keys = [k for k in tables[0] if all(k in t and t[k][1] for t in tables)]
    inside = n = 0
    z = []
    for k in keys:
        for i, j in itertools.permutations(range(len(tables)), 2):
            lo, hi = tables[j][k][1]
            inside += lo <= tables[i][k][0] <= hi
            n += 1
        for i, j in itertools.combinations(range(len(tables)), 2):
            (pi, (li, hi_), _), (pj, (lj, hj), _) = tables[i][k], tables[j][k]
            se = math.hypot(math.log(hi_ / li), math.log(hj / lj)) / (2 * Z90)
            if se > 0:
                z.append(math.log(pi / pj) / se)
    return {"pairs": len(keys), "points": n, "inside": inside / n if n else math.nan,
            "z_sd": math.sqrt(statistics.fmean(v * v for v in z)) if z else math.nan,
            "beyond": sum(abs(v) > Z90 for v in z) / len(z) if z else math.nan, "differences": len(z)}


def render(tables: list[dict], names: list[str]) -> str:
    cls, apart = verdicts(tables), disjoint(tables)
    lines = []
    for k, c in cls.items():
        cells = " | ".join(f"{t[k][0]:.3f}" + (f" ({t[k][1][0]:.3f}-{t[k][1][1]:.3f})" if t[k][1] else "")
                           + f" {t[k][2]}" for t in tables)
        mark = {"contradicted": "  CONTRADICTED", "some": "  (decided in some runs only)",
                "compatible": "  (decided differently, compatible)"}.get(c, "")
        if k in apart:
            mark += "  (intervals apart)"
        lines.append(f"{'/'.join(str(p) for p in k if p)}: {cells}{mark}")
    count = {c: sum(v == c for v in cls.values()) for c in ("alike", "undecided", "some", "compatible",
                                                            "contradicted")}
    cal = calibration(tables)
    lines += ["", f"runs: {', '.join(names)}",
              f"{len(cls)} pairs: {count['alike']} decided alike in every run, {count['undecided']} undecided in "
              f"every run, {count['some']} decided in some runs only, {count['compatible']} decided differently but "
              f"compatibly, {count['contradicted']} contradicted; {len(apart)} with intervals apart",
              f"calibration over {cal['pairs']} pairs: {cal['inside']:.0%} of points inside another run's 90% "
              f"interval (expected {EXPECTED_INSIDE:.0%}); run-to-run differences {cal['z_sd']:.2f} combined "
              f"standard errors rms (expected 1.00), {cal['beyond']:.0%} beyond 1.645 (expected 10%)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.rerun_check", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="fastddp-bench json reports of the same job")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two runs")
    from fastddp.bench import report as R

    tables = []
    for path in args.runs:
        try:
            with open(path) as f:
                tables.append(table(R.from_json(f.read())))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"{path}: not a fastddp-bench json report ({e})")
    if not verdicts(tables):
        p.error("the runs have no pair in common (different models or wrappers?)")
    print(render(tables, args.runs))
    return 1 if "contradicted" in verdicts(tables).values() else 0


if __name__ == "__main__":
    sys.exit(main())
