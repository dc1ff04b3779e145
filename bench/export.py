"""The main job's files: the markdown report and where it and its charts
(:mod:`bench.charts`) go (``reports/<device>/<date>-<label>.md``, ``.json``, ``*.png``); pure but
for the files it writes.

:func:`write_report` derives each section, draws the per-model step and
ratio charts (and the step-against-bandwidth chart of a simulated sweep),
and writes :func:`to_markdown` (the one-screen summary of
:mod:`bench.advice` first) and :func:`bench.report.to_json` beside them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

from .advice import advice_text
from .charts import plot_bandwidth, plot_ratio, plot_step
from .report import (COMPARE_COLUMNS, FULL_RUN, ROW_COLUMNS, Report, Row, Section, comparison_table, derive, fmt_f,
                     fmt_size, left_out_text, model_names, row_cells, run_text, tally, to_json, too_few, too_few_text)

__all__ = ["to_markdown", "slugify", "write_report"]


# -- markdown -----------------------------------------------------------

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
    return [fmt_size(out / 1e6), fmt_size(into / 1e6), ratio]


_LINK_HEADS = ["link out MB", "link in MB", "out / wire"]


def _md_rows(section: Section) -> str:
    cols = [(k, h) for k, _, h in ROW_COLUMNS if h is not None]
    link = any(r.link_out_bytes for r in section.rows)  # a --link run: host 1's veth bytes per step
    extra = _LINK_HEADS if link else []
    out = [_md(["model", "wrapper"] + [h for _, h in cols] + extra + ["note"]),
           "|" + "|".join(["---", "---"] + ["---:"] * (len(cols) + len(extra)) + ["---"]) + "|"]
    for r in section.rows:
        if not r.ok:
            out.append(_md([r.model, r.wrapper] + ["-"] * (len(cols) + len(extra)) + [r.status]))
            continue
        cells = row_cells(r)
        out.append(_md([r.model, r.wrapper] + [cells[k] for k, _ in cols]
                       + (_link_cells(r) if link else []) + [r.note]))
    return "\n".join(out)


def _md_comparisons(section: Section) -> str:
    rows = comparison_table(section)
    if not rows:
        return "No fastddp row has a peer in this section (not run, unavailable or failed)."
    if all(too_few(c) for c in section.comparisons):  # no pair has an interval: no table of dashes
        text = too_few_text(min(c.rounds for c in section.comparisons))
        return (f"{text[0].upper()}{text[1:]}: no ratio is given. For figures: {FULL_RUN} (rounds until "
                f"every pair is within ±{section.goal * 100:g}%).")
    heads = [h.strip() for h, _ in COMPARE_COLUMNS]
    out = [_md(heads), "|" + "|".join(["---"] * 3 + ["---:"] * 6 + ["---"]) + "|"]
    out += [_md(r) for r in rows]
    return "\n".join(out)


def _md_runs(section: Section) -> str:
    out = ["| model | rounds | time s | budget s | stopped | widest pair ± |",
           "|---|---:|---:|---:|---|---:|"]
    for model in model_names(section.rows):
        info = section.runs.get(model) or {}
        hws = [c.half_width for c in section.comparisons if c.model == model and c.half_width is not None]
        widest = f"{max(hws) * 100:.1f}%" if hws else "-"
        stopped = run_text(model, info, section.goal).split("stopped: ", 1)[-1] if info else "-"
        budget = info.get("budget_s")
        out.append(_md([model, str(info.get("rounds", "-")), fmt_f(info.get("elapsed_s"), 0),
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
            out += ["**Smoke run (`--quick`): it checks that every row runs; no verdicts. For figures: "
                    "the full run, `fastddp-bench`.**", ""]
        left = left_out_text(section)
        if left:
            out += [left[0].upper() + left[1:] + ".", ""]
        out += [_md_runs(section), "", _md_rows(section), "", _LEGEND, ""]
        out += [f"### fastddp against its peers (±{section.half_width * 100:g}% margin)", "",
                _md_comparisons(section), ""]
        if not all(too_few(c) for c in section.comparisons):  # a table was printed: how to read it
            out += [_CMP_LEGEND + (" " + _VERDICT_LEGEND if section.verdicts else ""), ""]
        counted = tally(section)
        if counted:
            out += [counted, ""]
        for name in charts.get(section.tag, ()):
            out += [f"![{name}]({name})", ""]
    for name in charts.get("bandwidth", ()):
        out += ["## Step time against simulated bandwidth", "", f"![{name}]({name})", ""]
    return "\n".join(out)


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
        for what, plot in (("step", plot_step), ("ratio", plot_ratio)) if charts_on else ():
            path = folder / f"{stem}{section.tag}-{what}.png"
            if plot(section, path):
                charts.setdefault(section.tag, []).append(path.name)
                written.append(path)
    bw_path = folder / f"{stem}-bandwidth.png"
    if charts_on and plot_bandwidth(report, bw_path):
        charts["bandwidth"] = [bw_path.name]
        written.append(bw_path)
    md = folder / f"{stem}.md"
    md.write_text(to_markdown(report, charts))
    js = folder / f"{stem}.json"
    js.write_text(to_json(report))
    return {"md": md, "json": js, "charts": written}
