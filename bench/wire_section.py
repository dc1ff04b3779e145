"""The main job's wire section (``BenchConfig.wire_gbit``): the wire-bound
model over a slow link, with the rows a user on such a link chooses from,
run after the loopback sections as a launch of its own (a real link needs
its ranks inside the namespaces) and merged into the same report
(:func:`with_wire`)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

from . import report as R
from .config import BenchConfig
from .launcher import launch
from .wrappers import registry

__all__ = ["WirePlan", "plan_wire", "with_wire", "WIRE_MODEL", "WIRE_WRAPPERS", "DEFAULT_WIRE_GBIT",
           "WIRE_BUDGET_S"]

WIRE_MODEL = "mlp25m"
WIRE_WRAPPERS = ("torch", "torch-fp16", "fastddp", "fastddp-fp8", "fastddp-autoprec")
DEFAULT_WIRE_GBIT = 1.0
"""Gbit/s of the wire section's link: a common Ethernet rate, where the
25M-parameter model's fp32 all-reduce (~0.8 s a step) dwarfs its compute."""
WIRE_BUDGET_S = 150.0
"""The wire section's time (build, auto precision's trial, rounds, profile),
plus what the loopback models left of theirs: at 1 Gbit/s a round of the 5
rows takes ~4 s, so ~25 rounds after ~40 s of building and trials."""


@dataclass(frozen=True)
class WirePlan:
    """How the main job's wire section runs (:func:`plan_wire`)."""

    kind: str
    """``netns`` (a real link) or ``simulated``."""
    gbit: float
    why: str = ""
    """``simulated``: why not a real link (what was missing)."""

    def describe(self) -> str:
        if self.kind == "netns":
            return (f"{WIRE_MODEL} over a real {self.gbit:g} Gbit/s link (two network namespaces, "
                    f"a veth pair shaped by tc tbf)")
        return (f"{WIRE_MODEL} over the simulated wire at {self.gbit:g} Gbit/s ({self.gbit / 8:g} GB/s), "
                f"not a real link: {self.why}")


def plan_wire(gbit: float) -> WirePlan:
    """A real link where this process can build one (root, ``ip`` and ``tc``,
    the clone's tools/netlink.py), else the simulated wire at the same rate,
    saying what was missing."""
    from .clone import ToolsMissing, netlink

    try:
        N = netlink()
    except ToolsMissing:
        return WirePlan("simulated", gbit, "no clone of the repository here (the real link's tooling, "
                                           "tools/netlink.py, is not installed with the package)")
    try:
        N.check_requirements()
    except N.LinkError as e:  # "--link netns needs root (...). Without them use ...": the first part
        why = str(e).split(". Without them")[0].replace("--link netns needs", "a real link needs", 1)
        return WirePlan("simulated", gbit, why)
    return WirePlan("netns", gbit)


def _wire_rows(cfg: BenchConfig) -> tuple[tuple[str, ...], list[str]]:
    """The wire section's rows, and those it leaves out: ``--quick`` leaves
    out the rows that tune themselves (``WrapperSpec.tunes``: stepped alone
    until they settle, they would double the smoke run's time)."""
    if not cfg.quick:
        return WIRE_WRAPPERS, []
    reg = registry()
    return (tuple(w for w in WIRE_WRAPPERS if not reg[w].tunes),
            [w for w in WIRE_WRAPPERS if reg[w].tunes])


def _wire_cfg(cfg: BenchConfig, plan: WirePlan, budget_s: float | None) -> BenchConfig:
    """The wire section as a run of its own (the parent merges the reports)."""
    common = dict(models=(WIRE_MODEL,), wrappers=_wire_rows(cfg)[0], wire_gbit=None, budget_s=budget_s,
                  world=None)
    if plan.kind == "netns":
        return replace(cfg, link=f"netns:{plan.gbit:g}", bandwidths=(None,), **common)
    return replace(cfg, bandwidths=(plan.gbit / 8,), **common)


def _say(text: str) -> None:
    print(f"fastddp-bench: {text}", file=sys.stderr, flush=True)


def _wire_budget(cfg: BenchConfig, report: R.Report) -> float | None:
    """The wire section's budget: :data:`WIRE_BUDGET_S` plus what the
    loopback models left of their budget (--budget: the same per model);
    None outside the adaptive mode."""
    if cfg.mode != "adaptive":
        return None
    if cfg.budget_s is not None:
        return cfg.budget_s
    total = cfg.sections_budget_s
    used = sum((report.meta.get("elapsed_per_model_s") or {}).values())
    return WIRE_BUDGET_S + max(0.0, total - used)


def with_wire(cfg: BenchConfig, report: R.Report, t_start: float) -> R.Report:
    """Run the wire section (:func:`plan_wire`; a real link that fails to
    come up falls back to the simulated wire) and add it to ``report``."""
    plan = plan_wire(cfg.wire_gbit)
    budget = _wire_budget(cfg, report)
    _say(f"wire section: {plan.describe()}"
         + ("" if budget is None else f"; at most ~{budget:.0f} s"))
    try:
        wired = launch(_wire_cfg(cfg, plan, budget))
    except Exception as exc:  # noqa: BLE001 - a link that cannot come up: the simulated wire instead
        from .clone import netlink

        if plan.kind != "netns" or not isinstance(exc, netlink().LinkError):
            raise
        plan = WirePlan("simulated", plan.gbit, f"the link could not be set up: {R.reason(exc)}")
        _say(f"wire section: {plan.describe()}")
        wired = launch(_wire_cfg(cfg, plan, budget))
    for s in report.sections:
        s.wire = {"kind": "loopback"}
    rows, left_out = _wire_rows(cfg)
    for s in wired.sections:
        if plan.kind == "simulated":
            s.wire = {"kind": "simulated", "gbit": plan.gbit, "why": plan.why}
        s.left_out = list(left_out)
        report.sections.append(s)
    m, w = report.meta, wired.meta
    m["rounds"] = {**(m.get("rounds") or {}), **(w.get("rounds") or {})}
    m["elapsed_per_model_s"] = {**(m.get("elapsed_per_model_s") or {}), **(w.get("elapsed_per_model_s") or {})}
    m["model_descriptions"] = {**(m.get("model_descriptions") or {}), **(w.get("model_descriptions") or {})}
    m["wire"] = (f"{plan.describe()}; rows {', '.join(rows)}"
                 + (f" ({', '.join(left_out)} left out of --quick)" if left_out else "")
                 + ("" if budget is None else f"; budget {budget:.0f} s"))
    m["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if w.get("load"):
        m["load"] = f"{m.get('load')}; wire section: {w['load']}"
    return report
