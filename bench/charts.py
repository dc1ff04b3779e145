"""The main job's PNG charts (matplotlib, Agg): per section the step time of
every row by round (:func:`plot_step`) and each fastddp row's paired ratio
to its peers with its interval (:func:`plot_ratio`), and across a simulated
sweep the step time against bandwidth (:func:`plot_bandwidth`).  Each
returns False, drawing nothing, where there is nothing to draw (or no
matplotlib).  :func:`clip_span` cuts a whisker to the axis and labels the cut.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from .report import Report, Row, Section, fmt_ms, fmt_x, model_names, too_few
from .stats import Comparison, verdict_text

__all__ = ["clip_span", "plot_step", "plot_ratio", "plot_bandwidth"]


def clip_span(lo: float, hi: float, axis_lo: float, axis_hi: float,
              fmt=fmt_ms) -> tuple[float, float, list[tuple[float, str]]]:
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


def plot_step(section: Section, path: Path) -> bool:
    """Median step per wrapper, one panel per model; whiskers p20-p80 cut at
    1.3x the panel's slowest median (the true p80 printed where cut);
    dashed line: local's median."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = {m: [r for r in section.rows if r.model == m and r.ok and r.step is not None]
                 for m in model_names(section.rows)}
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


def plot_ratio(section: Section, path: Path) -> bool:
    """Step-time ratio fastddp / peer with its 90% interval, one panel per
    model; the band is the ``equal`` margin; whiskers cut at the axis with
    the true bound printed.  Pairs with too few rounds for an interval are
    left out; False (no chart) where no pair has one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a pair with too few rounds for an interval has no ratio to show (report.too_few)
    per_model = {m: [c for c in section.comparisons if c.model == m and not too_few(c)]
                 for m in model_names(section.rows)}
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
                lo, hi, labels = clip_span(c.ratio_ci[0], c.ratio_ci[1], left, right, fmt=fmt_x)
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
    bottom = _legend(fig, colors, list(dict.fromkeys(c.wrapper for cs in per_model.values() for c in cs)))
    fig.suptitle(f"fastddp against its peers, paired by round - {section.title}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bandwidth(report: Report, path: Path) -> bool:
    """Median step time (top) and overhead over local (bottom) against the
    simulated bandwidth, one column per model, one line per wrapper."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = [s for s in report.sections if s.bandwidth_gbps is not None]
    if len(sims) < 2:
        return False
    models = model_names(sims[0].rows)
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
