"""Report writing for the end-to-end runner; pure.

Nothing here starts processes or touches torch.distributed: the runner
hands over per-round samples and per-wrapper measurements, and this module
turns them, with :mod:`bench.stats` (the paired comparison, its bootstrap
intervals and verdicts), into the rows' derived figures (:func:`derive`),
the terminal text (:func:`summary_text`) and the JSON form of a run
(:func:`to_json`, :func:`from_json`).  The one-screen "what to use" summary
is :mod:`bench.advice`; the rule that ends a model's rounds is
:mod:`bench.stoprule`; the markdown, the charts and the files under
``reports/<device>/`` are :mod:`bench.export`.

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
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .stats import (DEFAULT_HALF_WIDTH, MIN_CI_ROUNDS, Comparison, Quantiles, Resampler, block_ids, compare,
                    paired, summarize, trimmed_mean, verdict_text)

__all__ = [
    "Row", "Section", "Report", "pairs", "derive", "model_names", "resampler",
    "comparison_table", "format_table", "summary_text", "run_text", "tally", "clip", "row_cells", "reason",
    "fmt_f", "fmt_ms", "fmt_x", "fmt_size", "ROW_COLUMNS", "COMPARE_COLUMNS",
    "to_json", "from_json", "too_few", "too_few_text", "left_out_text",
    "TERMINAL_WIDTH", "SUMMARY_LINES", "TOO_FEW", "LEFT_OUT_WHY", "FULL_RUN",
]

#: Every line the terminal summary prints fits this.
TERMINAL_WIDTH = 100
#: The one-screen summary (:func:`bench.advice.advice_text`) is at most this many lines.
SUMMARY_LINES = 25
#: Said in place of a ratio from fewer rounds than an interval needs (:func:`too_few`).
TOO_FEW = "too few rounds to compare"
#: Why a section's ``left_out`` rows are not in it.
LEFT_OUT_WHY = "self-tuning: the full run steps it alone until it settles"
#: Where the figures a smoke run leaves out come from.
FULL_RUN = "the full run, fastddp-bench"

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
    left_out: list[str] = field(default_factory=list)
    """Rows this section's run left out although its job has them: the
    self-tuning rows of ``--quick`` (:data:`LEFT_OUT_WHY`)."""

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


def model_names(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r.model for r in rows))


def resampler(section: Section, model: str, n: int, cache: dict | None = None) -> Resampler | None:
    """The resampler of ``n`` rounds of ``model`` in ``section``: over rounds
    and, where the section records the model's placements (the rounds at
    which each build of the rows began), over placements too; None below
    :data:`MIN_CI_ROUNDS`.  Every interval of a model (its comparisons, the
    summary's) goes through here, so that all of them see the placements;
    ``cache`` shares one set of resamples between them."""
    if n < MIN_CI_ROUNDS:
        return None
    key = (model, n)
    if cache is not None and key in cache:
        return cache[key]
    starts = (section.runs.get(model) or {}).get("placements")
    rs = Resampler(n, blocks=block_ids(n, starts))
    if cache is not None:  # rounds of one model share its placements
        cache[key] = rs
    return rs


def derive(section: Section) -> Section:
    """Fill each row's quantiles and paired overhead over ``local`` (with its
    interval), and the section's comparisons: every fastddp row against
    every peer present, with verdicts unless ``section.verdicts`` is False;
    each fastddp row's ``ratio`` is the one against its best peer.  Returns
    ``section`` (modified in place)."""
    by = {(r.model, r.wrapper): r for r in section.rows}
    samplers: dict[tuple[str, int], Resampler] = {}

    def sampler(model: str, n: int) -> Resampler | None:
        return resampler(section, model, n, samplers)

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
            r.overhead_ms, r.overhead_ci = paired([x - y for x, y in zip(r.step_ms, local.step_ms)],
                                                  sampler(r.model, n))
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
            resampler=sampler(r.model, n), model=r.model, wrapper=r.wrapper, peer=peer.wrapper))
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


def reason(exc: BaseException) -> str:
    """The first line of ``exc`` as a row's status gives it (``failed: <reason>``), at most 160 characters."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


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

def fmt_f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_ms(x: float | None) -> str:
    """Milliseconds with about 4 significant digits."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    return f"{x:.2f}" if a < 100 else f"{x:.1f}" if a < 1000 else f"{x:.0f}"


def fmt_x(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def _iv(ci: tuple[float, float] | None, fmt=fmt_ms) -> str:
    return "-" if ci is None else f"{fmt(ci[0])}..{fmt(ci[1])}"


def fmt_size(x: float) -> str:
    """Sizes in MB / MiB: 3 significant digits below 1, one decimal above."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def row_cells(r: Row) -> dict[str, str]:
    wire = "-" if r.wire_bytes is None else fmt_size(r.wire_bytes / 1e6)
    if r.wire_bytes is not None and r.wire_source == "computed":
        wire += "*"
    return {
        "median": fmt_ms(r.step.median if r.step else None),
        "p20": fmt_ms(r.step.p20 if r.step else None),
        "p80": fmt_ms(r.step.p80 if r.step else None),
        "p20..p80": "-" if r.step is None else f"{fmt_ms(r.step.p20)}..{fmt_ms(r.step.p80)}",
        "overhead": fmt_ms(r.overhead_ms),
        "overhead ci": _iv(r.overhead_ci),
        "cpu": fmt_ms(r.cpu_overhead_ms),
        "ops": "-" if r.ops_per_step is None else str(r.ops_per_step),
        "wire": wire,
        "peak": "n/a" if r.peak_bytes is None else fmt_size(r.peak_bytes / MiB),
        "exposed": fmt_ms(r.exposed.median if r.exposed else None),
    }


#: (key, terminal header, markdown header) of the per-wrapper table.
ROW_COLUMNS = (
    ("median", "ms", "median ms"), ("p20", None, "p20"), ("p80", None, "p80"),
    ("p20..p80", "p20..p80", None), ("overhead", "+local", "+local ms"), ("overhead ci", None, "90%"),
    ("cpu", "cpu+", "cpu +ms"), ("ops", "ops/step", "ops/step"), ("wire", "wire MB", "wire MB"),
    ("peak", "peak MiB", "peak MiB"), ("exposed", "exposed", "exposed ms"),
)

#: The comparison list's columns: (header, shown in the terminal).
COMPARE_COLUMNS = (("model", False), ("wrapper", True), ("peer", True), ("x peer", True), ("90%", True),
                   ("diff ms", True), ("90% ", True), ("ovh x", True), ("90%  ", False), ("verdict", True))


def too_few(c: Comparison) -> bool:
    """True where ``c`` rests on fewer rounds than an interval needs
    (:data:`~bench.stats.MIN_CI_ROUNDS`): its ratio is no comparison, and
    no text or chart prints it."""
    return c.ratio_ci is None


def too_few_text(rounds: int, what: str = "") -> str:
    """``"too few rounds to compare (3 rounds; an interval needs 5)"``; ``what``
    is added after the count (how to get more rounds)."""
    return (f"{TOO_FEW} ({rounds} round{'' if rounds == 1 else 's'}; an interval needs "
            f"{MIN_CI_ROUNDS}{what})")


def left_out_text(section: Section) -> str | None:
    """``"left out: fastddp-autoprec (self-tuning: ...)"``, or None."""
    if not section.left_out:
        return None
    return f"left out: {', '.join(section.left_out)} ({LEFT_OUT_WHY})"


def comparison_table(section: Section) -> list[list[str]]:
    """The comparison list, one row of cells per (fastddp row, peer) in
    :data:`COMPARE_COLUMNS` order: the terminal and the markdown both print
    these rows (the terminal without the columns it has no room for).
    ``*`` marks the best peer where a row has several.  A pair with too
    few rounds for an interval (:func:`too_few`) has no figures, only
    :data:`TOO_FEW` in the verdict column."""
    count: dict[tuple[str, str], int] = {}
    for c in section.comparisons:
        count[c.model, c.wrapper] = count.get((c.model, c.wrapper), 0) + 1
    out = []
    for c in section.comparisons:
        star = "*" if c.best and count[c.model, c.wrapper] > 1 else ""
        if too_few(c):
            out.append([c.model, c.wrapper, star + c.peer] + ["-"] * 6 + [TOO_FEW])
            continue
        out.append([c.model, c.wrapper, star + c.peer, fmt_x(c.ratio), _iv(c.ratio_ci, fmt_x),
                    fmt_ms(c.diff_ms), _iv(c.diff_ci), fmt_x(c.overhead_ratio, 2),
                    _iv(c.overhead_ratio_ci, lambda v: fmt_x(v, 2)), verdict_text(c.verdict, section.half_width)])
    return out


def _fixed(rows: list[list[str]], right: set[int], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def clip(line: str, width: int = TERMINAL_WIDTH) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def format_table(section: Section, meta: Mapping | None = None) -> str:
    """The terminal text of one section (call :func:`derive` first): per
    model, how its rounds ended, the per-wrapper table and its comparisons;
    every line fits :data:`TERMINAL_WIDTH` columns (a long status or note
    is cut)."""
    descriptions = (meta or {}).get("model_descriptions") or {}
    cols = [(k, t) for k, t, _ in ROW_COLUMNS if t is not None]
    cmp_cols = [i for i, (_, shown) in enumerate(COMPARE_COLUMNS) if shown]
    table = comparison_table(section)
    lines: list[str] = []
    for model in model_names(section.rows):
        head = run_text(model, section.runs.get(model), section.goal)
        lines.append(clip(head))
        if model in descriptions:
            lines.append(clip(f"  ({descriptions[model]})"))
        rows = [r for r in section.rows if r.model == model]
        body = [["wrapper"] + [t for _, t in cols]]
        notes = []
        for r in rows:
            if not r.ok:
                continue
            cells = row_cells(r)
            body.append([r.wrapper] + [cells[k] for k, _ in cols])
            if r.note:
                notes.append(f"{r.wrapper}: {r.note}")
        if len(body) > 1:
            lines += _fixed(body, right=set(range(1, len(body[0]))))
        for r in rows:
            if not r.ok:
                lines.append(clip(f"  {r.wrapper}  {r.status}"))
        mine = [[row[i] for i in cmp_cols] for row in table if row[0] == model]
        few = [c for c in section.comparisons if c.model == model and too_few(c)]
        if mine and len(few) == len(mine):  # no pair has an interval: no table of dashes
            lines.append(clip(f"  paired by round, fastddp / peer: {too_few_text(min(c.rounds for c in few))}"))
        elif mine:
            header = [COMPARE_COLUMNS[i][0].strip() for i in cmp_cols]
            lines.append("  paired by round, fastddp / peer:")
            lines += [clip(x) for x in _fixed([header] + mine, right={2, 3, 4, 5, 6})]
        lines += [clip(f"  note: {n}") for n in notes]
        lines.append("")
    left = left_out_text(section)
    if left:
        lines.append(clip(left))
    return "\n".join(lines).rstrip()


def tally(section: Section) -> str | None:
    if not section.comparisons:
        return None
    if not section.verdicts:
        return f"no verdicts: --quick checks that every row runs; figures come from {FULL_RUN}"
    counts: dict[str, int] = {}
    for c in section.comparisons:
        v = TOO_FEW if too_few(c) else c.verdict
        counts[v] = counts.get(v, 0) + 1
    parts = [f"{counts[v]} {v if v == TOO_FEW else verdict_text(v, section.half_width)}"
             for v in ("faster", "equal", "slower", "undecided", TOO_FEW) if v in counts]
    return f"verdicts ({len(section.comparisons)} pairs, 90% intervals): " + ", ".join(parts)


def summary_text(report: Report) -> str:
    """The terminal version: per section its title, :func:`format_table` and
    a tally of the verdicts."""
    parts = []
    for s in report.sections:
        derive(s)
        parts += [f"== {s.title} ==", format_table(s, report.meta), ""]
        counted = tally(s)
        if counted:
            parts += [clip(counted), ""]
    return "\n".join(parts)


# -- JSON ------------------------------------------------------------------------

def _row_json(r: Row) -> dict:
    d = dataclasses.asdict(r)
    d["peak_bytes"] = r.peak_bytes
    return d


def to_json(report: Report) -> str:
    doc = {"meta": report.meta,
           "sections": [{"bandwidth_gbps": s.bandwidth_gbps, "half_width": s.half_width, "precision": s.precision,
                         "verdicts": s.verdicts, "runs": s.runs, "wire": s.wire, "left_out": s.left_out,
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
                      wire=s.get("wire"), left_out=s.get("left_out", []))
        sections.append(derive(sec))
    return Report(doc["meta"], sections)
