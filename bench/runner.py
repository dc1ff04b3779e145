"""The end-to-end runner behind ``fastddp-bench``: one run, start to report (:func:`run`).

One run (:func:`run`)::

    parent: spawn W ranks (gloo on CPU; NCCL, one per GPU) -- or, under
            torchrun, every process is a rank already
    rank:   for each simulated bandwidth (section), for each model:
              build the model once (seeded), then for each wrapper:
                deepcopy -> last-grad hooks -> wrap -> SGD -> first step
                (rank 0 measures the memory this leaves resident)
              a row that tunes itself: its steps alone until it settles
              warm-up rounds, then timed rounds, interleaved:
                round r: same batch for every wrapper, order rotated by r,
                         a barrier before each step (not timed); then one
                         all_gather of every rank's times -> the round's
                         sample per wrapper (slowest rank: stats.merge_ranks)
                after each round rank 0 applies the stop rule (every
                compared pair's ratio interval within +-X, or the model's
                time budget spent; --steps / --quick: a fixed count) and
                broadcasts go on / stop
              per wrapper: one profiled step (ops/launches, step peak
                memory, bytes on the wire); --trace: a Chrome trace
    rank 0: the results -> parent: terminal summary + reports/<device>/...

Where each part lives: :mod:`bench.config` (what a run measures),
:mod:`bench.launcher` (starting the ranks, one rank's whole run),
:mod:`bench.rounds` (a model's rounds), :mod:`bench.steps` (one step:
timed, profiled, traced), :mod:`bench.rank` (what the ranks agree on),
:mod:`bench.stoprule` (when the rounds end), :mod:`bench.wire_section`
(the main job's slow-link section), :mod:`bench.meta` and
:mod:`bench.progress`; the report is :mod:`bench.report`,
:mod:`bench.advice` and :mod:`bench.export`.
"""

from __future__ import annotations

import time

from . import export, report as R
from .config import BenchConfig
from .launcher import launch
from .wire_section import with_wire

__all__ = ["run"]


def run(cfg: BenchConfig) -> tuple[R.Report, dict] | None:
    """Run the benchmark and write the report; returns ``(report, paths)`` on
    the process that holds rank 0's results (None on other torchrun ranks).
    With ``wire_gbit`` the wire section runs after the others, as a second
    launch (a real link needs its ranks inside the namespaces), into the
    same report."""
    cfg.validate()
    t_start = time.perf_counter()
    report = launch(cfg)
    if report is None:
        return None
    if cfg.wire_gbit is not None:
        report = with_wire(cfg, report, t_start)
    paths = export.write_report(report, cfg.out, charts_on=cfg.charts)
    return report, paths
