"""The main job's one-screen summary: per wire and model, which fastddp
setting to use and what it gains over torch, with intervals; pure.

:func:`advice` picks, from one derived :class:`~bench.report.Section`,
fastddp's default unless another fastddp row is decidedly faster (auto
precision preferred among those, where it is not decidedly slower than the
fastest), and pairs the pick with torch's fastest row and torch's DDP;
:func:`advice_text` lays that out in at most :data:`~bench.report.SUMMARY_LINES`
lines.  No ratio from fewer rounds than an interval needs is printed ("too
few rounds to compare" instead), and a smoke run's summary ends with where
the figures come from.  The runner prints it last; :mod:`bench.export` puts
it at the top of the markdown report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .report import (FULL_RUN, SUMMARY_LINES, TOO_FEW, Report, Row, Section, clip, derive, left_out_text,
                     model_names, resampler, too_few, too_few_text)
from .stats import DEFAULT_HALF_WIDTH, MIN_CI_ROUNDS, Comparison, Resampler, compare, trimmed_mean, verdict_text

__all__ = ["Advice", "advice", "advice_text", "wire_line"]


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
    decided: bool = True
    """False where the model ran too few rounds for an interval: ``pick`` is
    then only the fastest fastddp row by its trimmed mean, not advice, and
    the summary prints no ratio for it."""
    rounds: int = 0
    """Timed rounds every measured row of the model has."""


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
    """``a`` against ``b``, paired by round, with the interval the report's
    own comparisons use (over rounds and the rows' placements)."""
    n = min(len(a.step_ms), len(b.step_ms))
    return compare(a.step_ms[:n], b.step_ms[:n], margin=section.half_width, verdict=section.verdicts,
                   resampler=resampler(section, a.model, n, rs), model=a.model, wrapper=a.wrapper, peer=b.wrapper)


def advice(section: Section) -> list[Advice]:
    """Per model of ``section``: the fastddp setting to use and its gains.

    The pick: fastddp's default, unless another fastddp row is decidedly
    faster than it (paired by round, its whole 90% interval below 1); of
    those the fastest, except that ``auto_precision_hook`` is preferred when
    it is among them and not decidedly slower than the fastest (it measures
    the formats on the user's own link and keeps fp32 where a smaller format
    does not pay).  Its gains: paired ratios against torch's fastest row in
    the section (lowest trimmed mean step) and against torch's DDP default.
    No verdicts (``--quick``): no pick beyond the default.  Fewer rounds
    than an interval needs: no pick either (``decided`` False; ``pick`` is
    the fastest fastddp row by its trimmed mean, which the summary does not
    print).  Every interval is the report's own
    (:func:`bench.report.resampler`: rounds and placements)."""
    out = []
    rs: dict[tuple[str, int], Resampler] = {}  # bench.report.resampler's cache: (model, rounds)
    for model in model_names(section.rows):
        rows = [r for r in section.rows if r.model == model and r.ok and r.step_ms]
        ours = [r for r in rows if r.family == "fastddp"]
        torch_rows = [r for r in rows if r.family == "torch"]
        name = _short_name(section)
        if not ours:
            out.append(Advice(name, model, None, why="no fastddp row was measured"))
            continue
        default = next((r for r in ours if r.wrapper == "fastddp"), ours[0])
        rounds = min(len(r.step_ms) for r in rows)
        if rounds < MIN_CI_ROUNDS:  # no interval, so nothing can be compared: say so
            pick = min(ours, key=lambda r: trimmed_mean(r.step_ms))
            how = ": raise --budget or --steps" if section.verdicts else ""  # a smoke run ends with where to look
            adv = Advice(name, model, pick.wrapper, _setting(pick), too_few_text(rounds, how), decided=False,
                         rounds=rounds)
            _gains(adv, pick, default, torch_rows, section, rs)
            out.append(adv)
            continue
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
        adv = Advice(name, model, pick.wrapper, _setting(pick), why, rounds=rounds)
        _gains(adv, pick, default, torch_rows, section, rs)
        out.append(adv)
    return out


def _gains(adv: Advice, pick: Row, default: Row, torch_rows: list, section: Section, rs: dict) -> None:
    """``adv``'s comparisons: ``pick`` against torch's fastest row and torch's
    DDP, and fastddp's default against torch's DDP where the pick is another."""
    if not torch_rows:
        return
    fastest = min(torch_rows, key=lambda r: trimmed_mean(r.step_ms))
    adv.gains.append(_cmp(pick, fastest, section, rs))
    plain = next((r for r in torch_rows if r.wrapper == "torch"), None)
    if plain is not None and plain is not fastest:
        adv.gains.append(_cmp(pick, plain, section, rs))
    if pick is not default and plain is not None:
        adv.default_vs_torch = _cmp(default, plain, section, rs)


def _gain(c: Comparison, margin: float, what: str = "") -> str:
    """``"0.757 (0.731-0.781) x torch's fp16 hook, torch's fastest: faster"``;
    ``"x torch DDP: too few rounds to compare"`` where there is no interval."""
    peer = f"x {_TORCH_NAMES.get(c.peer, c.peer)}{what}"
    if too_few(c):
        return f"{peer}: {TOO_FEW}"
    text = f"{c.ratio:.3f} ({c.ratio_ci[0]:.3f}-{c.ratio_ci[1]:.3f}) {peer}"
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
    smoke = bool(report.sections) and not all(s.verdicts for s in report.sections)
    if smoke:
        lines = ["Smoke run (--quick): it checks that every row runs; no verdicts and no picks",
                 f"({TOO_FEW} where they carry no 90% interval; tables above, report below)"]
        # last, whatever the cut below: where the figures are
        tail = [clip(f"For figures: {FULL_RUN} (rounds until every pair is within ±{margin * 100:g}%).")]
    else:
        lines = [f"What to use, and what it gains: step time ratio, 90% interval, verdict at ±{margin * 100:g}%",
                 "(< 1: fastddp faster; paired by round; tables above, report below)"]
        tail = []
    for s in report.sections:
        if not s.comparisons:
            derive(s)
        lines.append(clip(_heading(s)))
        for a in advice(s):
            if a.pick is None:
                lines.append(clip(f"  {a.model}: {a.why}"))
                continue
            if not a.decided:  # no interval: no ratio, no pick
                lines.append(clip(f"  {a.model}: {a.why}"))
                continue
            use = "use " if s.verdicts else ""  # a smoke run picks nothing
            lines.append(clip(f"  {a.model}: {use}{a.pick} ({a.setting})"))
            for i, c in enumerate(a.gains):
                what = ", torch's fastest" if i == 0 and len(a.gains) > 1 else ""
                lines.append(clip(f"    {_gain(c, s.half_width, what)}"))
            if not a.gains:
                lines.append("    no torch row to compare with")
            if a.default_vs_torch is not None:
                lines.append(clip(f"    fastddp default: {_gain(a.default_vs_torch, s.half_width)}"))
        left = left_out_text(s)
        if left:
            lines.append(clip(f"  {left}"))
    room = SUMMARY_LINES - len(tail)
    if len(lines) > room:  # keep one screen: the rest is in the tables above
        lines = lines[:room - 1] + [f"... {len(lines) - room + 1} more lines in the report"]
    return "\n".join(lines + tail)
