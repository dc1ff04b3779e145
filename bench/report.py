"""Report writing for the end-to-end runner; pure.

Nothing here starts processes or touches torch.distributed: the runner
hands over per-round samples and per-wrapper measurements, and this module
turns them, with :mod:`bench.stats` (the paired comparison, its bootstrap
intervals and verdicts), into the rows' derived figures (:func:`derive`),
the rule that ends a model's rounds (:class:`StopRule`, :class:`Stopper`),
the terminal text (:func:`summary_text`), and the files under
``reports/<device>/`` (:func:`write_report`: ``<date>-<label>.md``,
``.json`` and PNG charts).

A fastddp row is compared with each of its peers paired by round
(:func:`bench.stats.compare`); the overhead over ``local`` is the same
paired statistic.

Data model: a :class:`Report` holds the run's metadata and one
:class:`Section` per simulated bandwidth (a single section with
``bandwidth_gbps=None`` when no bandwidth is simulated); a section holds one
:class:`Row` per (model, wrapper), how each model's rounds ended
(``runs``) and, once derived, its :class:`~bench.stats.Comparison` list.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from .stats import (DEFAULT_HALF_WIDTH, MIN_CI_ROUNDS, Comparison, Quantiles, Resampler, compare, interval,
                    paired, summarize, trimmed_mean, verdict_text)

__all__ = [
    "Row", "Section", "Report", "StopRule", "Stopper", "pairs", "derive",
    "comparison_table", "format_table", "summary_text", "run_text", "clip_span",
    "to_markdown", "to_json", "from_json", "slugify", "write_report",
    "advice", "advice_text", "Advice", "wire_line",
    "MIN_ROUNDS", "DEFAULT_BUDGET_S", "TERMINAL_WIDTH", "SUMMARY_LINES",
]

#: Rounds before the precision goal may stop a model: a bootstrap interval
#: of a dozen rounds is too narrow too often to stop on.
MIN_ROUNDS = 20
#: Default time per model (build, warm-up, rounds, profiled step): the 4
#: default models then take at most 7 minutes on 2 cores, and the main job
#: with its wire section (``runner.WIRE_BUDGET_S``) about 10.
DEFAULT_BUDGET_S = 105.0
#: Time kept back at the end of a model's budget, in rounds' time, for the
#: profiled step of every wrapper that follows the rounds (a step under the
#: memory profiler takes 2-4x a plain one on the 600-tensor model).
POST_ROUNDS = 3.0
#: Rounds a model runs at least, even when its budget is already spent.
MIN_TIMED_ROUNDS = 3
#: Every line the terminal summary prints fits this.
TERMINAL_WIDTH = 100
#: The one-screen summary (:func:`advice_text`) is at most this many lines.
SUMMARY_LINES = 25

MiB = 1 << 20


# -- data model ----------------------------------------------------------------

@dataclass
class Row:
    """One (model, wrapper) result."""

    model: str
    wrapper: str
    status: str = "ok"
    """``ok``, ``unavailable: <reason>`` (could not be built) or
    ``failed: <reason>`` (raised while running)."""
    note: str = ""
    family: str = ""
    """``local``, ``floor``, ``torch``, ``fastddp`` (or another wrapper family)."""
    baselines: list[str] = field(default_factory=list)
    """The peers a fastddp row is compared with: every one present and ok."""
    step_ms: list[float] = field(default_factory=list)
    """Per-round wall time of this wrapper's step, max over ranks, ms."""
    exposed_ms: list[float] = field(default_factory=list)
    """Per-round exposed communication, max over ranks, ms."""
    cpu_ms: list[float] = field(default_factory=list)
    """Per-round host CPU time of a rank (all its threads: Python, autograd,
    gloo), mean over ranks, ms.  Far less noisy than wall time on a shared
    machine: it measures the work a wrapper adds, not the waiting."""
    ops_per_step: int | None = None
    ops_kind: str = ""
    """``aten ops`` (CPU: top-level aten ops) or ``kernel launches`` (CUDA)."""
    wire_bytes: int | None = None
    wire_source: str = ""
    """``measured`` (read from a counter) or ``computed`` (from the params)."""
    resident_bytes: int | None = None
    """Net memory allocated by building the wrapper and running one step."""
    step_peak_bytes: int | None = None
    """Peak memory above the step's start during a steady-state step."""
    autotune: dict | None = None
    """``bucket_cap_mb="auto"`` rows: the tuner's report after the timed
    rounds (``stats()["autotune"]``: layouts tried with their step times,
    the one chosen, when it settled)."""
    link_out_bytes: list[int] = field(default_factory=list)
    """``--link`` runs: per timed round, the bytes out of host 1 in this
    wrapper's step, from the veth's kernel counters (TCP/IP headers and one
    barrier included; ``fastddp.bench.linkbytes``)."""
    link_in_bytes: list[int] = field(default_factory=list)
    """The same, into host 1."""
    buckets: list[list[int]] | None = None
    """fastddp rows: the parameter indices of each bucket after the timed
    rounds.  Rows with equal lists ran the same buckets (the bucket sweep
    pools them: ``bucket_cap_mb`` 1, 5 and 10 can give one layout)."""
    autoprec: dict | None = None
    """``auto_precision_hook`` rows: what it chose after the timed rounds
    (``chosen``, ``state``, ``candidates``, ``settled_at_step``,
    ``trial_steps``, ``tuned_alone_steps``; from its ``stats()``)."""
    # derived by derive()
    step: Quantiles | None = None
    exposed: Quantiles | None = None
    overhead_ms: float | None = None
    """Trimmed mean over rounds of (this step - ``local``'s step), ms."""
    overhead_ci: tuple[float, float] | None = None
    cpu_overhead_ms: float | None = None
    """The same for host CPU time."""
    ratio: float | None = None
    """fastddp rows: step time / the best peer's (see :class:`Comparison`)."""
    ratio_ci: tuple[float, float] | None = None
    ratio_baseline: str | None = None
    """The best peer (lowest step time of the peers present)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak_bytes(self) -> int | None:
        if self.resident_bytes is None or self.step_peak_bytes is None:
            return None
        return self.resident_bytes + self.step_peak_bytes


@dataclass
class Section:
    """All rows measured under one simulated bandwidth (None: the real one)."""

    bandwidth_gbps: float | None
    rows: list[Row] = field(default_factory=list)
    half_width: float = DEFAULT_HALF_WIDTH
    """The margin of an ``equal`` verdict, and the precision goal unless ``precision`` is set."""
    precision: float | None = None
    """The stop rule's precision goal where it is finer than the margin (``--precision``)."""
    verdicts: bool = True
    """False for ``--quick``: a smoke run decides nothing."""
    runs: dict[str, dict] = field(default_factory=dict)
    """Per model: ``rounds``, ``stopped`` (``precision``, ``budget``,
    ``fixed`` or ``quick``), ``elapsed_s`` and ``budget_s``."""
    comparisons: list[Comparison] = field(default_factory=list)
    """Derived by :func:`derive`."""
    wire: dict | None = None
    """What carried this section's gradients, when the run says
    (``kind``: ``loopback``, ``netns`` or ``simulated``; ``gbit``: the rate
    in Gbit/s; ``netns``: ``what``, ``measured_gbit``, ``probe``; a
    simulated wire standing in for a real link: ``why``).  None: a section
    of a run with a single wire (the report's ``meta`` says which)."""

    @property
    def goal(self) -> float:
        """The precision goal the rounds ran to."""
        return self.precision if self.precision is not None else self.half_width

    @property
    def kind(self) -> str:
        """``loopback``, ``netns`` or ``simulated``."""
        if self.wire and self.wire.get("kind"):
            return self.wire["kind"]
        return "loopback" if self.bandwidth_gbps is None else "simulated"

    @property
    def gbit(self) -> float | None:
        """The wire's rate in Gbit/s (None: loopback, or an unshaped link)."""
        if self.wire and self.wire.get("gbit") is not None:
            return self.wire["gbit"]
        return None if self.bandwidth_gbps is None else self.bandwidth_gbps * 8

    @property
    def title(self) -> str:
        if self.kind == "netns":
            rate = "unshaped" if self.gbit is None else f"{self.gbit:g} Gbit/s"
            return f"Real link: {rate}"
        if self.bandwidth_gbps is not None:
            return f"Simulated interconnect: {self.bandwidth_gbps:g} GB/s ({self.bandwidth_gbps * 8:g} Gbit/s)"
        return "Loopback: no slow wire" if self.wire else "Results"

    @property
    def tag(self) -> str:
        if self.kind == "netns":
            return "-link" if self.gbit is None else f"-link{self.gbit:g}"
        return "" if self.bandwidth_gbps is None else f"-bw{self.bandwidth_gbps:g}"

    @property
    def description(self) -> str:
        """One line: what carried the gradients (and why, for a simulated
        wire standing in for a real link)."""
        w = self.wire or {}
        if self.kind == "netns":
            text = ("real link: 2 ranks in two network namespaces over a veth pair "
                    + ("unshaped" if self.gbit is None else f"shaped to {self.gbit:g} Gbit/s by tc tbf"))
            if w.get("measured_gbit") is not None:
                text += f"; measured {w['measured_gbit']:g} Gbit/s"
                if w.get("probe"):
                    text += f" ({w['probe']})"
            return text
        if self.kind == "simulated":
            text = (f"simulated wire: every row but local behind a serial wire of {self.bandwidth_gbps:g} GB/s "
                    f"({self.bandwidth_gbps * 8:g} Gbit/s; bench/simwire.py)")
            return text + (f"; not a real link because {w['why']}" if w.get("why") else "")
        return "no slow wire: the ranks talk over loopback TCP on this machine's shared cores"


@dataclass
class Report:
    meta: dict
    sections: list[Section] = field(default_factory=list)


def pairs(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """(fastddp row, peer row) for every fastddp row and every peer of it
    (``baselines``) present in ``rows``, both ok and measured."""
    by = {(r.model, r.wrapper): r for r in rows}
    out = []
    for r in rows:
        if r.family != "fastddp" or not r.ok or not r.step_ms:
            continue
        for name in r.baselines:
            peer = by.get((r.model, name))
            if peer is not None and peer.ok and peer.step_ms:
                out.append((r, peer))
    return out


def _models(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r.model for r in rows))


def derive(section: Section) -> Section:
    """Fill each row's quantiles and paired overhead over ``local`` (with its
    interval), and the section's comparisons: every fastddp row against
    every peer present, with verdicts unless ``section.verdicts`` is False;
    each fastddp row's ``ratio`` is the one against its best peer.  Returns
    ``section`` (modified in place)."""
    by = {(r.model, r.wrapper): r for r in section.rows}
    samplers: dict[int, Resampler] = {}

    def sampler(n: int) -> Resampler | None:
        if n < MIN_CI_ROUNDS:
            return None
        if n not in samplers:
            samplers[n] = Resampler(n)
        return samplers[n]

    for r in section.rows:
        r.step = summarize(r.step_ms) if r.ok else None
        r.exposed = summarize(r.exposed_ms) if r.ok else None
        r.overhead_ms = r.overhead_ci = r.cpu_overhead_ms = None
        r.ratio = r.ratio_ci = r.ratio_baseline = None
        local = by.get((r.model, "local"))
        if r.step is None or local is None or local.step is None:
            continue
        if r is local:
            r.overhead_ms = 0.0
        else:
            n = min(len(r.step_ms), len(local.step_ms))
            r.overhead_ms, r.overhead_ci = paired([x - y for x, y in zip(r.step_ms, local.step_ms)], sampler(n))
        n = min(len(r.cpu_ms), len(local.cpu_ms))
        if n:
            r.cpu_overhead_ms = trimmed_mean([x - y for x, y in zip(r.cpu_ms, local.cpu_ms)])

    section.comparisons = []
    for r, peer in pairs(section.rows):
        local = by.get((r.model, "local"))
        loc = local.step_ms if local is not None and local.ok and local.step_ms else None
        n = min(len(r.step_ms), len(peer.step_ms), len(loc) if loc else len(r.step_ms))
        section.comparisons.append(compare(
            r.step_ms, peer.step_ms, loc, margin=section.half_width, verdict=section.verdicts,
            resampler=sampler(n), model=r.model, wrapper=r.wrapper, peer=peer.wrapper))
    for r in section.rows:
        mine = [c for c in section.comparisons if (c.model, c.wrapper) == (r.model, r.wrapper)]
        if not mine:
            continue
        best = max(mine, key=lambda c: c.ratio)  # the same fastddp samples: highest ratio = fastest peer
        best.best = True
        r.ratio, r.ratio_ci, r.ratio_baseline = best.ratio, best.ratio_ci, best.peer
    # best peer first, in the rows' order
    order = {(r.model, r.wrapper): i for i, r in enumerate(section.rows)}
    section.comparisons.sort(key=lambda c: (order[(c.model, c.wrapper)], not c.best))
    return section


# -- when to stop ------------------------------------------------------------------

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

    def widest(self, rows: Sequence[Row]) -> float | None:
        """The widest half-width of the compared pairs' ratio intervals in
        ``rows`` (one model); None when nothing is compared, inf with too
        few rounds for an interval."""
        found = pairs(rows)
        if not found:
            return None
        n = min(min(len(a.step_ms), len(b.step_ms)) for a, b in found)
        if n < MIN_CI_ROUNDS:
            return math.inf
        rs = Resampler(n)
        worst = 0.0
        for a, b in found:
            lo, hi = interval(rs.trimmed_means([math.log(x / y) for x, y in zip(a.step_ms[:n], b.step_ms[:n])]))
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

    def update(self, rows: Sequence[Row], rounds: int, elapsed_s: float, round_s: float) -> str | None:
        """``"precision"``, ``"budget"`` or None (go on), after ``rounds``
        timed rounds, ``elapsed_s`` into the model's budget, the last round
        having taken ``round_s``."""
        if rounds >= self.next_check:
            self.widest = self.rule.widest(rows)
            self.next_check = rounds + max(1, rounds // 10)
            if self.widest is not None and self.widest <= self.rule.half_width:
                return "precision"
        if rounds >= MIN_TIMED_ROUNDS and elapsed_s + round_s * (1.0 + POST_ROUNDS) > self.budget_s:
            return "budget"
        return None


def run_text(model: str, info: Mapping | None, margin: float) -> str:
    """``"small: 212 rounds in 38 s, stopped: every pair within ±3%"``."""
    if not info:
        return model
    stopped = info.get("stopped")
    if stopped == "precision":
        how = f"every pair within ±{margin * 100:g}%"
    elif stopped == "budget":
        how = f"time budget of {info.get('budget_s') or 0:.0f} s spent"
    else:
        how = {"fixed": "fixed number of rounds (--steps)", "quick": "--quick smoke run, no verdicts",
               "failed": "every wrapper failed"}.get(stopped, str(stopped))
    rebuilt = info.get("rebuilds")
    rebuilt = f" ({rebuilt} rebuild{'s' if rebuilt > 1 else ''})" if rebuilt else ""
    return (f"{model}: {info.get('rounds', '?')} rounds{rebuilt} in {info.get('elapsed_s', 0):.0f} s, "
            f"stopped: {how}")


# -- cells -----------------------------------------------------------------------

def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    """Milliseconds with about 4 significant digits."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    return f"{x:.2f}" if a < 100 else f"{x:.1f}" if a < 1000 else f"{x:.0f}"


def _x(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def _iv(ci: tuple[float, float] | None, fmt=_ms) -> str:
    return "-" if ci is None else f"{fmt(ci[0])}..{fmt(ci[1])}"


def _size(x: float) -> str:
    """Sizes in MB / MiB: 3 significant digits below 1, one decimal above."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def _row_cells(r: Row) -> dict[str, str]:
    wire = "-" if r.wire_bytes is None else _size(r.wire_bytes / 1e6)
    if r.wire_bytes is not None and r.wire_source == "computed":
        wire += "*"
    return {
        "median": _ms(r.step.median if r.step else None),
        "p20": _ms(r.step.p20 if r.step else None),
        "p80": _ms(r.step.p80 if r.step else None),
        "p20..p80": "-" if r.step is None else f"{_ms(r.step.p20)}..{_ms(r.step.p80)}",
        "overhead": _ms(r.overhead_ms),
        "overhead ci": _iv(r.overhead_ci),
        "cpu": _ms(r.cpu_overhead_ms),
        "ops": "-" if r.ops_per_step is None else str(r.ops_per_step),
        "wire": wire,
        "peak": "n/a" if r.peak_bytes is None else _size(r.peak_bytes / MiB),
        "exposed": _ms(r.exposed.median if r.exposed else None),
    }


#: (key, terminal header, markdown header) of the per-wrapper table.
_ROW_COLUMNS = (
    ("median", "ms", "median ms"), ("p20", None, "p20"), ("p80", None, "p80"),
    ("p20..p80", "p20..p80", None), ("overhead", "+local", "+local ms"), ("overhead ci", None, "90%"),
    ("cpu", "cpu+", "cpu +ms"), ("ops", "ops/step", "ops/step"), ("wire", "wire MB", "wire MB"),
    ("peak", "peak MiB", "peak MiB"), ("exposed", "exposed", "exposed ms"),
)

#: The comparison list's columns: (header, shown in the terminal).
COMPARE_COLUMNS = (("model", False), ("wrapper", True), ("peer", True), ("x peer", True), ("90%", True),
                   ("diff ms", True), ("90% ", True), ("ovh x", True), ("90%  ", False), ("verdict", True))


def comparison_table(section: Section) -> list[list[str]]:
    """The comparison list, one row of cells per (fastddp row, peer) in
    :data:`COMPARE_COLUMNS` order: the terminal and the markdown both print
    these rows (the terminal without the columns it has no room for).
    ``*`` marks the best peer where a row has several."""
    count: dict[tuple[str, str], int] = {}
    for c in section.comparisons:
        count[c.model, c.wrapper] = count.get((c.model, c.wrapper), 0) + 1
    out = []
    for c in section.comparisons:
        star = "*" if c.best and count[c.model, c.wrapper] > 1 else ""
        out.append([c.model, c.wrapper, star + c.peer, _x(c.ratio), _iv(c.ratio_ci, _x),
                    _ms(c.diff_ms), _iv(c.diff_ci), _x(c.overhead_ratio, 2),
                    _iv(c.overhead_ratio_ci, lambda v: _x(v, 2)), verdict_text(c.verdict, section.half_width)])
    return out


def _fixed(rows: list[list[str]], right: set[int], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _clip(line: str, width: int = TERMINAL_WIDTH) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def format_table(section: Section, meta: Mapping | None = None) -> str:
    """The terminal text of one section (call :func:`derive` first): per
    model, how its rounds ended, the per-wrapper table and its comparisons;
    every line fits :data:`TERMINAL_WIDTH` columns (a long status or note
    is cut)."""
    descriptions = (meta or {}).get("model_descriptions") or {}
    cols = [(k, t) for k, t, _ in _ROW_COLUMNS if t is not None]
    cmp_cols = [i for i, (_, shown) in enumerate(COMPARE_COLUMNS) if shown]
    table = comparison_table(section)
    lines: list[str] = []
    for model in _models(section.rows):
        head = run_text(model, section.runs.get(model), section.goal)
        lines.append(_clip(head))
        if model in descriptions:
            lines.append(_clip(f"  ({descriptions[model]})"))
        rows = [r for r in section.rows if r.model == model]
        body = [["wrapper"] + [t for _, t in cols]]
        notes = []
        for r in rows:
            if not r.ok:
                continue
            cells = _row_cells(r)
            body.append([r.wrapper] + [cells[k] for k, _ in cols])
            if r.note:
                notes.append(f"{r.wrapper}: {r.note}")
        if len(body) > 1:
            lines += _fixed(body, right=set(range(1, len(body[0]))))
        for r in rows:
            if not r.ok:
                lines.append(_clip(f"  {r.wrapper}  {r.status}"))
        mine = [[row[i] for i in cmp_cols] for row in table if row[0] == model]
        if mine:
            header = [COMPARE_COLUMNS[i][0].strip() for i in cmp_cols]
            lines.append("  paired by round, fastddp / peer:")
            lines += [_clip(x) for x in _fixed([header] + mine, right={2, 3, 4, 5, 6})]
        lines += [_clip(f"  note: {n}") for n in notes]
        lines.append("")
    return "\n".join(lines).rstrip()


def _tally(section: Section) -> str | None:
    if not section.comparisons:
        return None
    if not section.verdicts:
        return "no verdicts: --quick is a smoke run (every wrapper ran; see the table)"
    counts: dict[str, int] = {}
    for c in section.comparisons:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    parts = [f"{counts[v]} {verdict_text(v, section.half_width)}"
             for v in ("faster", "equal", "slower", "undecided") if v in counts]
    return f"verdicts ({len(section.comparisons)} pairs, 90% intervals): " + ", ".join(parts)


def summary_text(report: Report) -> str:
    """The terminal version: per section its title, :func:`format_table` and
    a tally of the verdicts."""
    parts = []
    for s in report.sections:
        derive(s)
        parts += [f"== {s.title} ==", format_table(s, report.meta), ""]
        tally = _tally(s)
        if tally:
            parts += [_clip(tally), ""]
    return "\n".join(parts)


# -- the one-screen summary: what to use, and what it gains ------------------------

#: How a fastddp row is set, where its note does not say (bucket options).
_SETTING = {"fastddp": "the default", "fastddp-view": "gradient_as_bucket_view=True",
            "fastddp-batched": "batched_grad_copy=True"}


@dataclass
class Advice:
    """One (section, model): the fastddp setting to use and what it gains."""

    section: str
    """The section's short name: ``no slow wire (loopback)``, ``1 Gbit/s link (real)``..."""
    model: str
    pick: str | None
    """The fastddp wrapper to use; None when no fastddp row was measured."""
    setting: str = ""
    """How to get it (``gradient_as_bucket_view=True``, ``hooks.fp8_compress_hook``...)."""
    why: str = ""
    """Why this one: ``no other setting decidedly faster than the default``..."""
    gains: list[Comparison] = field(default_factory=list)
    """The pick against torch's fastest row here, then against torch's DDP
    default (``torch``) when that is another row."""
    default_vs_torch: Comparison | None = None
    """fastddp's default against torch's DDP, when the pick is another setting."""


def _short_name(section: Section) -> str:
    if section.kind == "netns":
        rate = "unshaped" if section.gbit is None else f"{section.gbit:g} Gbit/s"
        return f"{rate} link (real)"
    if section.kind == "simulated":
        return f"{section.gbit:g} Gbit/s link (simulated)"
    return "no slow wire (loopback)"


def _heading(section: Section) -> str:
    """The summary's line for a section: the wire, its rate and how it was made."""
    w = section.wire or {}
    if section.kind == "netns":
        rate = "an unshaped" if section.gbit is None else f"a {section.gbit:g} Gbit/s"
        measured = f", measured {w['measured_gbit']:.2f} Gbit/s" if w.get("measured_gbit") is not None else ""
        return f"on {rate} link (real: two network namespaces, veth + tc tbf{measured}):"
    if section.kind == "simulated":
        why = f"; not real: {w['why']}" if w.get("why") else ""
        return f"on a {section.gbit:g} Gbit/s link (simulated wire, {section.bandwidth_gbps:g} GB/s{why}):"
    return "no slow wire (loopback: 2 ranks on this machine's shared cores):"


#: The summary's names of torch's rows.
_TORCH_NAMES = {"torch": "torch DDP", "torch-fp16": "torch's fp16 hook", "torch-bf16": "torch's bf16 hook",
                "torch-batched": "torch batched_grad_copy", "torch-view": "torch bucket view"}


def _setting(r: Row) -> str:
    if r.wrapper in _SETTING:
        return _SETTING[r.wrapper]
    text = r.note or r.wrapper
    chosen = (r.autoprec or {}).get("chosen")
    if chosen and "chose" not in text:
        text += f", chose {chosen}"
    return text


def _cmp(a: Row, b: Row, section: Section, rs: dict) -> Comparison:
    n = min(len(a.step_ms), len(b.step_ms))
    if n >= MIN_CI_ROUNDS and n not in rs:
        rs[n] = Resampler(n)
    return compare(a.step_ms[:n], b.step_ms[:n], margin=section.half_width, verdict=section.verdicts,
                   resampler=rs.get(n), model=a.model, wrapper=a.wrapper, peer=b.wrapper)


def advice(section: Section) -> list[Advice]:
    """Per model of ``section``: the fastddp setting to use and its gains.

    The pick: fastddp's default, unless another fastddp row is decidedly
    faster than it (paired by round, its whole 90% interval below 1); of
    those the fastest, except that ``auto_precision_hook`` is preferred when
    it is among them and not decidedly slower than the fastest (it measures
    the formats on the user's own link and keeps fp32 where a smaller format
    does not pay).  Its gains: paired ratios against torch's fastest row in
    the section (lowest trimmed mean step) and against torch's DDP default.
    No verdicts (``--quick``): no pick beyond the default."""
    out = []
    rs: dict[int, Resampler] = {}
    for model in _models(section.rows):
        rows = [r for r in section.rows if r.model == model and r.ok and r.step_ms]
        ours = [r for r in rows if r.family == "fastddp"]
        torch_rows = [r for r in rows if r.family == "torch"]
        name = _short_name(section)
        if not ours:
            out.append(Advice(name, model, None, why="no fastddp row was measured"))
            continue
        default = next((r for r in ours if r.wrapper == "fastddp"), ours[0])
        faster = []
        for r in ours:
            if r is not default:
                c = _cmp(r, default, section, rs)
                if c.verdict == "faster":
                    faster.append((c.ratio, r))
        pick, why = default, ("no other setting decidedly faster than the default" if section.verdicts
                              else "--quick: no verdicts, so no other pick")
        if faster:
            best = min(faster, key=lambda x: x[0])[1]
            auto = next((r for _, r in faster if r.autoprec is not None or r.wrapper == "fastddp-autoprec"), None)
            if auto is not None and auto is not best and _cmp(auto, best, section, rs).verdict != "slower":
                best, why = auto, "decidedly faster than the default and not slower than the fastest row"
            else:
                why = "decidedly faster than the default" + (" and the fastest" if len(faster) > 1 else "")
            pick = best
        adv = Advice(name, model, pick.wrapper, _setting(pick), why)
        if torch_rows:
            fastest = min(torch_rows, key=lambda r: trimmed_mean(r.step_ms))
            adv.gains.append(_cmp(pick, fastest, section, rs))
            plain = next((r for r in torch_rows if r.wrapper == "torch"), None)
            if plain is not None and plain is not fastest:
                adv.gains.append(_cmp(pick, plain, section, rs))
            if pick is not default and plain is not None:
                adv.default_vs_torch = _cmp(default, plain, section, rs)
        out.append(adv)
    return out


def _gain(c: Comparison, margin: float, what: str = "") -> str:
    """``"0.757 (0.731-0.781) x torch's fp16 hook, torch's fastest: faster"``."""
    ci = "(no interval)" if c.ratio_ci is None else f"({c.ratio_ci[0]:.3f}-{c.ratio_ci[1]:.3f})"
    text = f"{c.ratio:.3f} {ci} x {_TORCH_NAMES.get(c.peer, c.peer)}{what}"
    return text if c.verdict is None else f"{text}: {verdict_text(c.verdict, margin)}"


def wire_line(section: Section) -> str:
    """``"1 Gbit/s link (real): real link: ... measured 0.94 Gbit/s"``: a section's one-line heading."""
    return f"{_short_name(section)}: {section.description}"


def advice_text(report: Report) -> str:
    """The one-screen summary (at most :data:`SUMMARY_LINES` lines of
    :data:`TERMINAL_WIDTH` columns): per section and model, which fastddp
    setting to use and its step time against torch's fastest row and
    torch's DDP default, with the 90% interval and the verdict."""
    margin = report.sections[0].half_width if report.sections else DEFAULT_HALF_WIDTH
    if report.sections and not all(s.verdicts for s in report.sections):
        lines = ["Smoke run (--quick): no verdicts and no picks; these ratios are not for decisions",
                 "(step time x torch's, paired by round, < 1: fastddp faster; tables above)"]
    else:
        lines = [f"What to use, and what it gains: step time ratio, 90% interval, verdict at ±{margin * 100:g}%",
                 "(< 1: fastddp faster; paired by round; tables above, report below)"]
    for s in report.sections:
        if not s.comparisons:
            derive(s)
        lines.append(_clip(_heading(s)))
        for a in advice(s):
            if a.pick is None:
                lines.append(_clip(f"  {a.model}: {a.why}"))
                continue
            use = "use " if s.verdicts else ""  # a smoke run picks nothing
            lines.append(_clip(f"  {a.model}: {use}{a.pick} ({a.setting})"))
            for i, c in enumerate(a.gains):
                what = ", torch's fastest" if i == 0 and len(a.gains) > 1 else ""
                lines.append(_clip(f"    {_gain(c, s.half_width, what)}"))
            if not a.gains:
                lines.append("    no torch row to compare with")
            if a.default_vs_torch is not None:
                lines.append(_clip(f"    fastddp default: {_gain(a.default_vs_torch, s.half_width)}"))
    if len(lines) > SUMMARY_LINES:  # keep one screen: the rest is in the tables above
        lines = lines[:SUMMARY_LINES - 1] + [f"... {len(lines) - SUMMARY_LINES + 1} more lines in the report"]
    return "\n".join(lines)


# -- markdown and JSON -----------------------------------------------------------

def _md(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _link_cells(r: Row) -> list[str]:
    """``--link`` columns: the median bytes per step out of and into host 1
    (kernel counters), MB, and out / the wrapper's own wire count."""
    from .linkbytes import median_bytes

    out, into = median_bytes(r.link_out_bytes), median_bytes(r.link_in_bytes)
    if out is None:
        return ["-", "-", "-"]
    ratio = f"{out / r.wire_bytes:.2f}" if r.wire_bytes else "-"
    return [_size(out / 1e6), _size(into / 1e6), ratio]


_LINK_HEADS = ["link out MB", "link in MB", "out / wire"]


def _md_rows(section: Section) -> str:
    cols = [(k, h) for k, _, h in _ROW_COLUMNS if h is not None]
    link = any(r.link_out_bytes for r in section.rows)  # a --link run: host 1's veth bytes per step
    extra = _LINK_HEADS if link else []
    out = [_md(["model", "wrapper"] + [h for _, h in cols] + extra + ["note"]),
           "|" + "|".join(["---", "---"] + ["---:"] * (len(cols) + len(extra)) + ["---"]) + "|"]
    for r in section.rows:
        if not r.ok:
            out.append(_md([r.model, r.wrapper] + ["-"] * (len(cols) + len(extra)) + [r.status]))
            continue
        cells = _row_cells(r)
        out.append(_md([r.model, r.wrapper] + [cells[k] for k, _ in cols]
                       + (_link_cells(r) if link else []) + [r.note]))
    return "\n".join(out)


def _md_comparisons(section: Section) -> str:
    rows = comparison_table(section)
    if not rows:
        return "No fastddp row has a peer in this section (not run, unavailable or failed)."
    heads = [h.strip() for h, _ in COMPARE_COLUMNS]
    out = [_md(heads), "|" + "|".join(["---"] * 3 + ["---:"] * 6 + ["---"]) + "|"]
    out += [_md(r) for r in rows]
    return "\n".join(out)


def _md_runs(section: Section) -> str:
    out = ["| model | rounds | time s | budget s | stopped | widest pair ± |",
           "|---|---:|---:|---:|---|---:|"]
    for model in _models(section.rows):
        info = section.runs.get(model) or {}
        hws = [c.half_width for c in section.comparisons if c.model == model and c.half_width is not None]
        widest = f"{max(hws) * 100:.1f}%" if hws else "-"
        stopped = run_text(model, info, section.goal).split("stopped: ", 1)[-1] if info else "-"
        budget = info.get("budget_s")
        out.append(_md([model, str(info.get("rounds", "-")), _f(info.get("elapsed_s"), 0),
                        "-" if budget is None else f"{budget:.0f}", stopped, widest]))
    return "\n".join(out)


_LEGEND = ("ms: wall time per step, the slowest rank's, per round. +local: trimmed mean over rounds of "
           "(step - local's step in the same round), 90% interval. cpu +ms: host CPU time per step over "
           "local's. wire MB `*`: computed from the parameters, else counted.")

_CMP_LEGEND = ("x peer: fastddp step time / the peer's, paired by round (exp of the trimmed mean of "
               "per-round log ratios), 90% bootstrap interval over rounds; diff ms: trimmed mean of "
               "fastddp - peer per round (< 0: fastddp faster). ovh x: fastddp's overhead over local / the "
               "peer's, only where the peer's overhead interval is above 0. `*`: the best of several peers, "
               "the row's headline.")
_VERDICT_LEGEND = ("Verdict from the x peer interval: equal when it lies within the margin, faster / slower "
                   "when it lies below / above 1, else undecided.")


def _meta_lines(meta: Mapping) -> list[str]:
    order = [
        ("date", "date"), ("device", "device"), ("cpu", "CPU"), ("cores", "cores"),
        ("gpus", "GPUs"), ("backend", "backend"), ("world_size", "world size"),
        ("threads_per_rank", "threads per rank"), ("torch", "torch"), ("triton", "triton"),
        ("nccl", "NCCL"), ("python", "python"), ("numpy", "numpy"), ("fastddp", "fastddp"),
        ("git", "git commit"), ("models", "models"), ("wrappers", "wrappers"),
        ("rounds", "rounds"), ("half_width", "verdict margin (±)"), ("precision", "precision goal (±)"), ("budget_s", "budget per model (s)"),
        ("warmup", "warm-up rounds"), ("bucket_cap_mb", "bucket_cap_mb"),
        ("simulate_bandwidth_gbps", "simulated bandwidth (GB/s)"), ("link", "link"),
        ("wire", "wire section"), ("quick", "quick"),
        ("load", "load average (1, 5, 15 min)"),
        ("command", "command"), ("elapsed_s", "run time (s)"), ("elapsed_per_model_s", "per model (s)"),
    ]
    lines = ["| | |", "|---|---|"]
    for key, label in order:
        if key in meta and meta[key] not in (None, "", []):
            v = meta[key]
            if isinstance(v, (list, tuple)):
                v = ", ".join(str(x) for x in v)
            elif isinstance(v, dict):
                v = ", ".join(f"{k}: {x}" for k, x in v.items())
            text = str(v).replace("|", "\\|")
            lines.append(f"| {label} | `{text}` |" if key in ("command", "git") else f"| {label} | {text} |")
    return lines


def to_markdown(report: Report, charts: Mapping[str, Sequence[str]] | None = None) -> str:
    """The report as markdown; ``charts`` maps a section tag ("" or "-bwX",
    or "bandwidth" for the cross-section chart) to image file names placed
    next to the markdown file."""
    charts = charts or {}
    m = report.meta
    out = [f"# fastddp-bench: {m.get('label', '')} on {m.get('device', '?')}", ""]
    out += ["How this report is produced and how to read it: [docs/benchmarking.md](../../docs/benchmarking.md).", ""]
    if report.sections:
        out += ["## Summary", "", "```text", advice_text(report), "```", ""]
    out += ["## Setup", ""] + _meta_lines(m) + [""]
    models = m.get("model_descriptions") or {}
    if models:
        out += ["Models:", ""] + [f"* `{k}`: {v}" for k, v in models.items()] + [""]
    for section in report.sections:
        out += [f"## {section.title}", ""]
        if section.wire or section.bandwidth_gbps is not None:
            out += [section.description[0].upper() + section.description[1:] + ".", ""]
        if not section.verdicts:
            out += ["**Smoke run (`--quick`): no verdicts; the figures below are not for decisions.**", ""]
        out += [_md_runs(section), "", _md_rows(section), "", _LEGEND, ""]
        out += [f"### fastddp against its peers (±{section.half_width * 100:g}% margin)", "",
                _md_comparisons(section), "", _CMP_LEGEND + (" " + _VERDICT_LEGEND if section.verdicts else ""), ""]
        tally = _tally(section)
        if tally:
            out += [tally, ""]
        for name in charts.get(section.tag, ()):
            out += [f"![{name}]({name})", ""]
    for name in charts.get("bandwidth", ()):
        out += ["## Step time against simulated bandwidth", "", f"![{name}]({name})", ""]
    return "\n".join(out)


def _row_json(r: Row) -> dict:
    d = dataclasses.asdict(r)
    d["peak_bytes"] = r.peak_bytes
    return d


def to_json(report: Report) -> str:
    doc = {"meta": report.meta,
           "sections": [{"bandwidth_gbps": s.bandwidth_gbps, "half_width": s.half_width, "precision": s.precision,
                         "verdicts": s.verdicts, "runs": s.runs, "wire": s.wire,
                         "rows": [_row_json(r) for r in s.rows],
                         "comparisons": [dataclasses.asdict(c) for c in s.comparisons]}
                        for s in report.sections]}
    return json.dumps(doc, indent=1, sort_keys=False)


_DERIVED = {"step", "exposed", "overhead_ms", "overhead_ci", "cpu_overhead_ms", "ratio", "ratio_ci",
            "ratio_baseline"}


def from_json(text: str) -> Report:
    """Inverse of :func:`to_json` (derived fields are recomputed; a report
    written before paired statistics reads with the defaults)."""
    doc = json.loads(text)
    names = {f.name for f in dataclasses.fields(Row)} - _DERIVED
    sections = []
    for s in doc["sections"]:
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in s["rows"]]
        sec = Section(s["bandwidth_gbps"], rows, half_width=s.get("half_width", DEFAULT_HALF_WIDTH),
                      verdicts=s.get("verdicts", True), runs=s.get("runs", {}), precision=s.get("precision"),
                      wire=s.get("wire"))
        sections.append(derive(sec))
    return Report(doc["meta"], sections)


# -- charts ----------------------------------------------------------------------

def clip_span(lo: float, hi: float, axis_lo: float, axis_hi: float,
              fmt=_ms) -> tuple[float, float, list[tuple[float, str]]]:
    """The part of the whisker ``[lo, hi]`` drawn inside ``[axis_lo,
    axis_hi]``, and a label ``(x, text)`` at each edge it was cut at, with
    the true value (``"> 123.4"`` / ``"< 0.51"``)."""
    if not axis_lo < axis_hi:
        raise ValueError(f"clip_span: empty axis [{axis_lo}, {axis_hi}]")
    labels = []
    if hi > axis_hi:
        labels.append((axis_hi, f"{fmt(hi)} >"))
    if lo < axis_lo:
        labels.append((axis_lo, f"< {fmt(lo)}"))
    return max(min(lo, axis_hi), axis_lo), min(max(hi, axis_lo), axis_hi), labels


def _colors(rows: Sequence[Row]) -> dict[str, str]:
    """One colour per wrapper, the same in every panel and chart."""
    from matplotlib import colormaps

    names = list(dict.fromkeys(r.wrapper for r in rows))
    if len(names) <= 10:
        palette = list(colormaps["tab10"].colors)
    else:  # tab20's saturated half first: the first 10 wrappers keep tab10's distinct hues
        tab20 = list(colormaps["tab20"].colors)
        palette = tab20[0::2] + tab20[1::2]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def _grid(plt, panels: int, tallest: int, width: float = 6.4):
    ncols = min(2, panels)
    nrows = math.ceil(panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, nrows * (0.32 * tallest + 1.5) + 1.2),
                             squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, axes


def _legend(fig, colors: Mapping[str, str], names: Sequence[str]) -> float:
    """A legend of ``names``' colours under the panels, as many per line as
    the figure's width takes; returns the fraction of the height it needs."""
    from matplotlib.patches import Patch

    width, height = fig.get_size_inches()
    ncol = max(1, min(len(names), int(width / 1.7)))
    handles = [Patch(color=colors[n], label=n) for n in names]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    return min(0.4, (0.25 * math.ceil(len(names) / ncol) + 0.15) / height)


def _panel_title(section: Section, model: str) -> str:
    """``"small: 212 rounds, within ±3%"``: short enough for a panel."""
    info = section.runs.get(model)
    if not info:
        return model
    how = {"precision": f"within ±{section.goal * 100:g}%", "budget": "budget spent",
           "fixed": "fixed count", "quick": "quick: no verdicts"}.get(info.get("stopped"), str(info.get("stopped")))
    return f"{model}: {info.get('rounds', '?')} rounds, {how}"


def _plot_step(section: Section, path: Path) -> bool:
    """Median step per wrapper, one panel per model; whiskers p20-p80 cut at
    1.3x the panel's slowest median (the true p80 printed where cut);
    dashed line: local's median."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = {m: [r for r in section.rows if r.model == m and r.ok and r.step is not None]
                 for m in _models(section.rows)}
    per_model = {m: rows for m, rows in per_model.items() if rows}
    if not per_model:
        return False
    colors = _colors(section.rows)
    fig, axes = _grid(plt, len(per_model), max(len(v) for v in per_model.values()))
    for ax, (model, rows) in zip(axes.flat, per_model.items()):
        ys = list(range(len(rows)))[::-1]
        right = 1.3 * max(r.step.median for r in rows)
        ax.barh(ys, [r.step.median for r in rows], color=[colors[r.wrapper] for r in rows], height=0.7)
        for y, r in zip(ys, rows):
            lo, hi, labels = clip_span(r.step.p20, r.step.p80, 0.0, right)
            ax.plot([lo, hi], [y, y], color="#222222", linewidth=1)
            for x, text in labels:
                ax.annotate(text, (x, y), xytext=(-2, 4), textcoords="offset points", ha="right",
                            va="bottom", fontsize=7)
        local = next((r for r in rows if r.family == "local"), None)
        if local is not None:
            ax.axvline(local.step.median, color="#444444", linestyle="--", linewidth=1)
        ax.set_xlim(0, right)
        ax.set_yticks(ys)
        ax.set_yticklabels([r.wrapper for r in rows], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("ms per step (median; whisker p20-p80; dashed: local)", fontsize=8)
        ax.set_title(_panel_title(section, model), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    bottom = _legend(fig, colors, list(colors))
    fig.suptitle(f"Step time, slowest rank per round - {section.title}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ratio_axis(comps: Sequence[Comparison], margin: float) -> tuple[float, float]:
    """x limits of a ratio panel: 1 ± 2 x margin, every point, and the
    intervals as far as 0.67-1.5 (wider ones are cut, their bound printed),
    padded, within [0.25, 4]."""
    points = [c.ratio for c in comps]
    bounds = [b for c in comps if c.ratio_ci is not None for b in c.ratio_ci]
    lo = min([1 - 2 * margin, min(points)] + [max(b, 2 / 3) for b in bounds])
    hi = max([1 + 2 * margin, max(points)] + [min(b, 1.5) for b in bounds])
    pad = 0.08 * (hi - lo)
    return max(0.25, lo - pad), min(4.0, hi + pad)


def _plot_ratio(section: Section, path: Path) -> bool:
    """Step-time ratio fastddp / peer with its 90% interval, one panel per
    model; the band is the ``equal`` margin; whiskers cut at the axis with
    the true bound printed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = {m: [c for c in section.comparisons if c.model == m] for m in _models(section.rows)}
    per_model = {m: cs for m, cs in per_model.items() if cs}
    if not per_model:
        return False
    colors = _colors(section.rows)
    fig, axes = _grid(plt, len(per_model), max(len(v) for v in per_model.values()))
    margin = section.half_width
    stars = {c.model + "/" + c.wrapper for c in section.comparisons if not c.best}  # rows with several peers
    for ax, (model, comps) in zip(axes.flat, per_model.items()):
        left, right = _ratio_axis(comps, margin)
        ys = list(range(len(comps)))[::-1]
        ax.axvspan(1 - margin, 1 + margin, color="#dddddd", zorder=0)
        ax.axvline(1.0, color="#444444", linewidth=1)
        for y, c in zip(ys, comps):
            color = colors[c.wrapper]
            if c.ratio_ci is not None:
                lo, hi, labels = clip_span(c.ratio_ci[0], c.ratio_ci[1], left, right, fmt=_x)
                ax.plot([lo, hi], [y, y], color=color, linewidth=2)
                for x, text in labels:
                    ax.annotate(text, (x, y), xytext=(0, -10), textcoords="offset points",
                                ha="right" if x == right else "left", fontsize=7)
            point = min(max(c.ratio, left), right)
            ax.plot([point], [y], marker="o", color=color, markersize=5)
            text = f"{c.ratio:.3f}" + ("" if c.verdict is None else f" {verdict_text(c.verdict, margin)}")
            ax.annotate(text, (point, y), xytext=(0, 5), textcoords="offset points", ha="center", fontsize=7)
        ax.set_xlim(left, right)
        ax.set_ylim(-0.8, len(comps) - 0.2)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{c.wrapper} / {'*' if c.best and f'{c.model}/{c.wrapper}' in stars else ''}{c.peer}"
                            for c in comps], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel(f"step time fastddp / peer, 90% interval (< 1: fastddp faster; band: ±{margin * 100:g}%)",
                      fontsize=8)
        ax.set_title(_panel_title(section, model), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    bottom = _legend(fig, colors, list(dict.fromkeys(c.wrapper for c in section.comparisons)))
    fig.suptitle(f"fastddp against its peers, paired by round - {section.title}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_bandwidth(report: Report, path: Path) -> bool:
    """Median step time (top) and overhead over local (bottom) against the
    simulated bandwidth, one column per model, one line per wrapper."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = [s for s in report.sections if s.bandwidth_gbps is not None]
    if len(sims) < 2:
        return False
    models = _models(sims[0].rows)
    colors = _colors(sims[0].rows)
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7.0), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in sims[0].rows if r.model == model]
        for top, value in ((True, lambda r: r.step.median if r.step else None),
                           (False, lambda r: r.overhead_ms)):
            ax = axes[0 if top else 1][col]
            for first in rows:
                if not top and first.family == "local":
                    continue
                pts = [(s.bandwidth_gbps, value(r)) for s in sims for r in s.rows
                       if r.model == model and r.wrapper == first.wrapper and value(r) is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=first.wrapper, color=colors[first.wrapper],
                            linestyle="--" if first.family == "torch" else "-")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
            if top:
                ax.set_title(model, fontsize=10)
                ax.set_ylabel("median step, ms", fontsize=8)
            else:
                ax.set_ylabel("overhead over local, ms", fontsize=8)
                ax.set_xlabel("simulated bandwidth, GB/s", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Step time against simulated bandwidth (torch dashed)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- files -------------------------------------------------------------------------

def slugify(name: str) -> str:
    """``"Intel(R) Xeon(R) Processor @ 2.80GHz"`` -> ``"intel-xeon-processor-2-80ghz"``."""
    s = re.sub(r"\((r|tm|c)\)", "", name.lower())
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown-device"


def write_report(report: Report, out_dir: str | Path, charts_on: bool = True) -> dict[str, Path]:
    """Write ``<out>/<device-slug>/<date>-<label>.md``, ``.json`` and (unless
    ``charts_on`` is False) the PNG charts; returns ``{"md": ..., "json": ...,
    "charts": [...]}``."""
    meta = report.meta
    folder = Path(out_dir) / slugify(meta.get("device", ""))
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{meta.get('date', 'undated')}-{slugify(meta.get('label', 'run'))}"
    charts: dict[str, list[str]] = {}
    written: list[Path] = []
    for section in report.sections:
        derive(section)
        for what, plot in (("step", _plot_step), ("ratio", _plot_ratio)) if charts_on else ():
            path = folder / f"{stem}{section.tag}-{what}.png"
            if plot(section, path):
                charts.setdefault(section.tag, []).append(path.name)
                written.append(path)
    bw_path = folder / f"{stem}-bandwidth.png"
    if charts_on and _plot_bandwidth(report, bw_path):
        charts["bandwidth"] = [bw_path.name]
        written.append(bw_path)
    md = folder / f"{stem}.md"
    md.write_text(to_markdown(report, charts))
    js = folder / f"{stem}.json"
    js.write_text(to_json(report))
    return {"md": md, "json": js, "charts": written}
