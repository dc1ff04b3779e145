"""Statistics and report writing for the end-to-end runner; pure.

Nothing here starts processes or touches torch.distributed: the runner hands
over per-step samples and per-wrapper measurements, and this module turns
them into numbers (:func:`summarize`, :func:`derive`), a terminal table
(:func:`format_table`), and the files under ``reports/<device>/``
(:func:`write_report`: ``<date>-<label>.md``, ``.json`` and PNG charts).

Data model: a :class:`Report` holds the run's metadata and one
:class:`Section` per simulated bandwidth (a single section with
``bandwidth_gbps=None`` when no bandwidth is simulated); a section holds one
:class:`Row` per (model, wrapper).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

__all__ = [
    "Quantiles", "Row", "Section", "Report",
    "quantile", "summarize", "bootstrap_ratio", "derive", "format_table", "targets",
    "to_markdown", "to_json", "from_json", "slugify", "write_report", "summary_text", "verdict_lines",
    "TARGETS",
]

#: fastddp's overhead over local as a fraction of torch DDP's, per model
#: (other models: :data:`DEFAULT_TARGET`); reports/README.md says why.
TARGETS = {"small": 0.8}
DEFAULT_TARGET = 1.0

MiB = 1 << 20


# -- statistics ----------------------------------------------------------------

def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples`` with linear interpolation
    between closest ranks (numpy's default method)."""
    if not samples:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    xs = sorted(samples)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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
    """``local``, ``torch`` or ``fastddp``."""
    baselines: list[str] = field(default_factory=list)
    """Torch wrappers the overhead ratio may be taken against (first present)."""
    step_ms: list[float] = field(default_factory=list)
    """Per-step wall time, max over ranks, ms."""
    exposed_ms: list[float] = field(default_factory=list)
    """Per-step exposed communication, max over ranks, ms."""
    cpu_ms: list[float] = field(default_factory=list)
    """Per-step host CPU time of a rank (all its threads: Python, autograd,
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
    # derived by derive()
    step: Quantiles | None = None
    exposed: Quantiles | None = None
    overhead_ms: float | None = None
    ratio: float | None = None
    ratio_ci: tuple[float, float] | None = None
    """Bootstrap 90% interval of ``ratio`` (steps resampled in rounds)."""
    ratio_baseline: str | None = None
    cpu_overhead_ms: float | None = None
    """Median host CPU per step minus the local median."""
    cpu_ratio: float | None = None
    """``cpu_overhead_ms`` over the baseline's."""

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

    @property
    def title(self) -> str:
        if self.bandwidth_gbps is None:
            return "Results"
        return f"Simulated interconnect: {self.bandwidth_gbps:g} GB/s"

    @property
    def tag(self) -> str:
        return "" if self.bandwidth_gbps is None else f"-bw{self.bandwidth_gbps:g}"


@dataclass
class Report:
    meta: dict
    sections: list[Section] = field(default_factory=list)


def _median(xs: Sequence[float]) -> float:
    return quantile(xs, 0.5)


def _overhead_ratio(row: Sequence[float], base: Sequence[float], local: Sequence[float]) -> float | None:
    d = _median(base) - _median(local)
    return None if d <= 0 else (_median(row) - _median(local)) / d


#: Bootstrap resamples behind each ratio's interval (seeded: reports are reproducible).
BOOTSTRAP = 1000


def bootstrap_ratio(row: Sequence[float], base: Sequence[float], local: Sequence[float],
                    resamples: int = BOOTSTRAP, level: float = 0.90,
                    seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval of the overhead ratio
    ``(median(row) - median(local)) / (median(base) - median(local))``.

    Step ``k`` of every wrapper ran in the same round (same batch, the
    wrappers interleaved), so rounds are resampled together: the interval
    keeps what pairing removes (a slow round slows every wrapper).  None
    with fewer than 5 rounds or when too many resamples have no positive
    baseline overhead."""
    n = min(len(row), len(base), len(local))
    if n < 5:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        r = _overhead_ratio([row[i] for i in idx], [base[i] for i in idx], [local[i] for i in idx])
        if r is not None:
            ratios.append(r)
    if len(ratios) < 0.9 * resamples:
        return None
    a = (1.0 - level) / 2
    return quantile(ratios, a), quantile(ratios, 1.0 - a)


def derive(section: Section) -> Section:
    """Fill each row's quantiles, overhead over ``local`` (median minus the
    local median of the same model), overhead ratio against its torch
    baseline with a bootstrap interval (None when either overhead is missing
    or the baseline's is <= 0, where a ratio means nothing), and the same
    for host CPU time.  Returns ``section`` (modified in place)."""
    by_key = {(r.model, r.wrapper): r for r in section.rows}
    for r in section.rows:
        r.step = summarize(r.step_ms) if r.ok else None
        r.exposed = summarize(r.exposed_ms) if r.ok else None
    for r in section.rows:
        r.overhead_ms = r.ratio = r.ratio_ci = r.ratio_baseline = None
        r.cpu_overhead_ms = r.cpu_ratio = None
        local = by_key.get((r.model, "local"))
        if r.step is None or local is None or local.step is None:
            continue
        r.overhead_ms = r.step.median - local.step.median
        if r.cpu_ms and local.cpu_ms:
            r.cpu_overhead_ms = _median(r.cpu_ms) - _median(local.cpu_ms)
    for r in section.rows:
        local = by_key.get((r.model, "local"))
        for b in r.baselines:
            base = by_key.get((r.model, b))
            if base is None or not base.ok:
                continue
            r.ratio_baseline = b
            if r.overhead_ms is not None and base.overhead_ms is not None and base.overhead_ms > 0:
                r.ratio = r.overhead_ms / base.overhead_ms
                r.ratio_ci = bootstrap_ratio(r.step_ms, base.step_ms, local.step_ms)
            if r.cpu_overhead_ms is not None and base.cpu_overhead_ms is not None \
                    and base.cpu_overhead_ms > 0:
                r.cpu_ratio = r.cpu_overhead_ms / base.cpu_overhead_ms
            break
    return section


def targets(section: Section) -> list[dict]:
    """The target check per (model, fastddp wrapper) that has a baseline:
    ratio, its 90% interval, target, and the verdict: ``met`` is whether the
    point estimate is within the target (None when the ratio is undefined,
    e.g. the torch overhead was <= 0); ``verdict`` is ``"met"`` when the
    whole interval is within the target, ``"missed"`` when all of it is
    above, ``"inconclusive"`` when the interval straddles it."""
    out = []
    for r in section.rows:
        if r.family != "fastddp" or r.ratio_baseline is None or r.overhead_ms is None:
            continue
        target = TARGETS.get(r.model, DEFAULT_TARGET)
        verdict = None
        if r.ratio_ci is not None:
            lo, hi = r.ratio_ci
            verdict = "met" if hi <= target else "missed" if lo > target else "inconclusive"
        out.append({"model": r.model, "wrapper": r.wrapper, "baseline": r.ratio_baseline,
                    "ratio": r.ratio, "ci": r.ratio_ci, "target": target,
                    "met": None if r.ratio is None else r.ratio <= target,
                    "verdict": verdict, "cpu_ratio": r.cpu_ratio})
    return out


# -- formatting ----------------------------------------------------------------

COLUMNS = ("model", "wrapper", "median ms", "p20", "p80", "overhead ms", "x torch",
           "cpu +ms", "cpu x torch", "ops/step", "wire MB", "peak MiB", "exposed ms", "note")


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _size(x: float) -> str:
    """Sizes in MB / MiB: 3 significant digits below 1, one decimal above."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def _cells(r: Row) -> list[str]:
    if not r.ok:
        return [r.model, r.wrapper] + ["-"] * (len(COLUMNS) - 3) + [r.status]
    ratio = "-"
    if r.ratio is not None:
        ratio = f"{r.ratio:.2f}"
    elif r.ratio_baseline is not None:
        ratio = "n/a"
    ops = "-" if r.ops_per_step is None else str(r.ops_per_step)
    wire = "-" if r.wire_bytes is None else _size(r.wire_bytes / 1e6)
    if r.wire_bytes is not None and r.wire_source == "computed":
        wire += "*"
    peak = "n/a" if r.peak_bytes is None else _size(r.peak_bytes / MiB)
    return [
        r.model, r.wrapper,
        _f(r.step.median if r.step else None, 2),
        _f(r.step.p20 if r.step else None, 2),
        _f(r.step.p80 if r.step else None, 2),
        _f(r.overhead_ms, 2),
        ratio,
        _f(r.cpu_overhead_ms, 2),
        _f(r.cpu_ratio, 2),
        ops, wire, peak,
        _f(r.exposed.median if r.exposed else None, 2),
        r.note,
    ]


def format_table(section: Section) -> str:
    """A fixed-width text table of ``section`` (call :func:`derive` first)."""
    rows = [list(COLUMNS)] + [_cells(r) for r in section.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = []
    for k, row in enumerate(rows):
        left = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        right = [row[i].rjust(widths[i]) for i in range(2, len(COLUMNS) - 1)]
        lines.append("  ".join(left + right + [row[-1]]).rstrip())
        if k == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _md_table(section: Section) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |",
           "|" + "|".join(["---", "---"] + ["---:"] * (len(COLUMNS) - 3) + ["---"]) + "|"]
    for r in section.rows:
        cells = [c.replace("|", "\\|") for c in _cells(r)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _md_targets(section: Section) -> str:
    checks = targets(section)
    if not any(c["ratio"] is not None for c in checks):
        return "No fastddp row has a ratio in this section (unavailable, or torch's overhead <= 0)."
    lines = ["| model | wrapper | vs | overhead ratio | 90% interval | target | met (median) "
             "| verdict (interval) | host CPU ratio |",
             "|---|---|---|---:|---:|---:|---|---|---:|"]
    for c in checks:
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        ci = "-" if c["ci"] is None else f"{c['ci'][0]:.2f} .. {c['ci'][1]:.2f}"
        met = "n/a (torch overhead <= 0)" if c["met"] is None else ("yes" if c["met"] else "NO")
        cpu = "-" if c["cpu_ratio"] is None else f"{c['cpu_ratio']:.2f}"
        lines.append(f"| {c['model']} | {c['wrapper']} | {c['baseline']} | {ratio} | {ci} | "
                     f"<= {c['target']:.1f} | {met} | {c['verdict'] or '-'} | {cpu} |")
    return "\n".join(lines)


_LEGEND = ("ms: wall time per step, max over ranks. overhead = median - local's median; x torch = "
           "overhead / the torch row's with the same option (90% interval below); cpu: host CPU "
           "time per step; wire MB `*`: computed from the parameters, else counted.")


def _meta_lines(meta: Mapping) -> list[str]:
    order = [
        ("date", "date"), ("device", "device"), ("cpu", "CPU"), ("cores", "cores"),
        ("gpus", "GPUs"), ("backend", "backend"), ("world_size", "world size"),
        ("threads_per_rank", "threads per rank"), ("torch", "torch"), ("triton", "triton"),
        ("nccl", "NCCL"), ("python", "python"), ("numpy", "numpy"), ("fastddp", "fastddp"),
        ("git", "git commit"), ("models", "models"), ("wrappers", "wrappers"),
        ("steps", "timed steps"), ("warmup", "warm-up steps"), ("bucket_cap_mb", "bucket_cap_mb"),
        ("simulate_bandwidth_gbps", "simulated bandwidth (GB/s)"), ("link", "link"), ("quick", "quick"),
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
    out += ["How this report is produced and what each column means: "
            "[reports/README.md](../README.md).", ""]
    out += ["## Setup", ""] + _meta_lines(m) + [""]
    models = m.get("model_descriptions") or {}
    if models:
        out += ["Models:", ""] + [f"* `{k}`: {v}" for k, v in models.items()] + [""]
    for section in report.sections:
        out += [f"## {section.title}", "", _md_table(section), ""]
        out += [_LEGEND, ""]
        for name in charts.get(section.tag, ()):
            out += [f"![{name}]({name})", ""]
        out += ["### Targets (fastddp overhead / torch overhead)", "", _md_targets(section), ""]
    for name in charts.get("bandwidth", ()):
        out += ["## Step time against simulated bandwidth", "", f"![{name}]({name})", ""]
    return "\n".join(out)


def _row_json(r: Row) -> dict:
    d = dataclasses.asdict(r)
    d["peak_bytes"] = r.peak_bytes
    return d


def to_json(report: Report) -> str:
    doc = {"meta": report.meta,
           "sections": [{"bandwidth_gbps": s.bandwidth_gbps, "rows": [_row_json(r) for r in s.rows]}
                        for s in report.sections]}
    return json.dumps(doc, indent=1, sort_keys=False)


_DERIVED = {"step", "exposed", "overhead_ms", "ratio", "ratio_ci", "ratio_baseline",
            "cpu_overhead_ms", "cpu_ratio"}


def from_json(text: str) -> Report:
    """Inverse of :func:`to_json` (derived fields are recomputed)."""
    doc = json.loads(text)
    names = {f.name for f in dataclasses.fields(Row)} - _DERIVED
    sections = []
    for s in doc["sections"]:
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in s["rows"]]
        sections.append(derive(Section(s["bandwidth_gbps"], rows)))
    return Report(doc["meta"], sections)


# -- charts ----------------------------------------------------------------------

_FAMILY_COLOR = {"local": "#888888", "floor": "#bbbbbb", "torch": "#4c72b0", "fastddp": "#dd8452"}


def _models(section: Section) -> list[str]:
    seen: list[str] = []
    for r in section.rows:
        if r.model not in seen:
            seen.append(r.model)
    return seen


def _chart_order(rows: list[Row]) -> list[Row]:
    """Table order, but each fastddp row right after the torch row it is
    compared with, so pairs sit side by side."""
    out = [r for r in rows if r.family != "fastddp"]
    for r in (r for r in rows if r.family == "fastddp"):
        anchor = next((i for i, x in enumerate(out) if x.wrapper == r.ratio_baseline), None)
        if anchor is None:
            out.append(r)
        else:
            while anchor + 1 < len(out) and out[anchor + 1].family == "fastddp":
                anchor += 1
            out.insert(anchor + 1, r)
    return out


def _ratio_whiskers(section: Section, rows: list[Row]) -> list[tuple[float, float] | None]:
    """Each row's ratio interval drawn on its overhead bar, as (ms below, ms
    above) the bar's end: the ratio is the bar over the baseline's overhead,
    so the interval in ms is ``ci x`` that overhead.  None: no interval."""
    base = {(r.model, r.wrapper): r for r in section.rows}
    out: list[tuple[float, float] | None] = []
    for r in rows:
        b = base.get((r.model, r.ratio_baseline))
        if r.ratio_ci is None or b is None or b.overhead_ms is None or r.overhead_ms is None:
            out.append(None)
            continue
        out.append((max(r.overhead_ms - r.ratio_ci[0] * b.overhead_ms, 0.0),
                    max(r.ratio_ci[1] * b.overhead_ms - r.overhead_ms, 0.0)))
    return out


def _plot_bars(section: Section, path: Path, what: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = {}
    for model in _models(section):
        rows = [r for r in section.rows if r.model == model and r.ok and r.step is not None]
        if what == "overhead":
            rows = [r for r in rows if r.family != "local" and r.overhead_ms is not None]
        if rows:
            per_model[model] = _chart_order(rows)
    if not per_model:
        return False
    ncols = min(2, len(per_model))
    nrows = math.ceil(len(per_model) / ncols)
    tallest = max(len(v) for v in per_model.values())
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, nrows * (0.3 * tallest + 1.3) + 0.5),
                             squeeze=False)
    for ax in axes.flat[len(per_model):]:
        ax.set_visible(False)
    for ax, (model, rows) in zip(axes.flat, per_model.items()):
        ys = list(range(len(rows)))[::-1]
        colors = [_FAMILY_COLOR.get(r.family, "#55a868") for r in rows]
        if what == "step":
            vals = [r.step.median for r in rows]
            err = [[r.step.median - r.step.p20 for r in rows], [r.step.p80 - r.step.median for r in rows]]
            ax.barh(ys, vals, xerr=err, color=colors, capsize=2, height=0.7)
            ax.set_xlabel("ms: median step, whiskers p20-p80", fontsize=8)
            local = next((r for r in rows if r.family == "local"), None)
            if local is not None:
                ax.axvline(local.step.median, color="#444444", linestyle="--", linewidth=1)
        else:
            vals = [r.overhead_ms for r in rows]
            ax.barh(ys, vals, color=colors, height=0.7)
            ax.axvline(0, color="#444444", linewidth=1)
            ax.set_xlabel("ms: median step - local median step; whiskers: 90% interval of x torch",
                          fontsize=8)
            for y, r, w in zip(ys, rows, _ratio_whiskers(section, rows)):
                if w is not None:
                    ax.errorbar(r.overhead_ms, y, xerr=[[w[0]], [w[1]]], fmt="none", ecolor="#222222",
                                capsize=2, linewidth=1)
                if r.ratio is not None:
                    ci = "" if r.ratio_ci is None else f" [{r.ratio_ci[0]:.2f}, {r.ratio_ci[1]:.2f}]"
                    end = r.overhead_ms + (w[1] if w is not None else 0.0)
                    ax.annotate(f" x{r.ratio:.2f}{ci}", (max(end, 0), y), va="center", fontsize=7)
            ax.margins(x=0.2)  # room for the labels right of the longest whisker
        ax.set_yticks(ys)
        ax.set_yticklabels([r.wrapper for r in rows], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(model, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    head = "Step time (max over ranks)" if what == "step" else "Overhead over local (x: vs torch, same option)"
    fig.suptitle(f"{head} - {section.title}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
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
    models = _models(sims[0])
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7.0), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in sims[0].rows if r.model == model]
        for top, value in ((True, lambda r: r.step.median if r.step else None),
                           (False, lambda r: r.overhead_ms)):
            ax = axes[0 if top else 1][col]
            for i, first in enumerate(rows):
                if not top and first.family == "local":
                    continue
                pts = [(s.bandwidth_gbps, value(r)) for s in sims for r in s.rows
                       if r.model == model and r.wrapper == first.wrapper and value(r) is not None]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=first.wrapper, color=f"C{i % 10}",
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
        for what in ("step", "overhead") if charts_on else ():
            path = folder / f"{stem}{section.tag}-{what}.png"
            if _plot_bars(section, path, what):
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


def verdict_lines(section: Section) -> list[str]:
    """One line per target of :func:`targets` (call :func:`derive` first)."""
    out = []
    for c in targets(section):
        head = f"{c['model']} {c['wrapper']} vs {c['baseline']}"
        if c["ratio"] is None:
            out.append(f"{head}: no ratio (torch overhead <= 0)")
            continue
        ci = "" if c["ci"] is None else f" [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]"
        verdict = c["verdict"] or (("median met" if c["met"] else "median missed") + ", too few rounds for an interval")
        out.append(f"{head}: x{c['ratio']:.2f}{ci}, target <= {c['target']:.1f}: {verdict}")
    return out


def summary_text(report: Report) -> str:
    """The terminal version: per section, the table and one verdict line per target."""
    parts = []
    for s in report.sections:
        derive(s)
        parts += [f"== {s.title} ==", format_table(s), ""]
        lines = verdict_lines(s)
        if lines:
            parts += ["targets (90% interval):"] + [f"  {x}" for x in lines] + [""]
    return "\n".join(parts)
