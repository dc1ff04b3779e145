"""What one ``fastddp-bench`` run measures and how (:class:`BenchConfig`),
built by ``__main__`` from the command line and checked before any rank
starts (:meth:`BenchConfig.validate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import stats as S
from .models import DEFAULT_MODELS, ModelSpec, model_zoo
from .stoprule import DEFAULT_BUDGET_S, StopRule
from .wrappers import CUDA_EXTRA_WRAPPERS, DEFAULT_WRAPPERS, registry

__all__ = ["BenchConfig", "DEFAULT_WARMUP", "QUICK_WARMUP", "REBUILD_EVERY"]

DEFAULT_WARMUP = 3
QUICK_WARMUP = 1
REBUILD_EVERY = 10
"""``--rebuild-every``'s default: every row is rebuilt in fresh
allocations after each 10 timed rounds (the row effect: rows running the
same program measured 1.6-4.2% apart for a whole run, and one pair's mean
ratio ranged 0.944-1.127 between 20-round placements of one run).  The
intervals resample placements as well as rounds (``stats.Resampler``) and
the stop rule waits for 3 of them, so a model stops at 21 rounds at the
earliest; a rebuild costs about two rounds (auto precision's trial again
at most)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run needs; built by ``__main__`` from the command line."""

    models: tuple[str, ...] = DEFAULT_MODELS
    wrappers: tuple[str, ...] | None = None
    """None: :data:`DEFAULT_WRAPPERS` (+ torch-bf16 on CUDA)."""
    world: int | None = None
    """None: 2 on CPU, every visible GPU on CUDA; ignored under torchrun."""
    steps: int | None = None
    """A fixed number of timed rounds per model (no stop rule); None: rounds
    until the stop rule says so (``quick``: the model's ``quick_steps``)."""
    warmup: int | None = None
    """Warm-up rounds per model (>= 1); None: 3, or 1 with ``quick``."""
    half_width: float = S.DEFAULT_HALF_WIDTH
    """Precision goal: rounds go on until every compared pair's 90% interval
    of the step-time ratio is within this half-width (0.03: ±3%); also the
    margin of an ``equal`` verdict."""
    precision: float | None = None
    """The stop rule's half-width goal when it should differ from the verdict
    margin (``half_width``): e.g. 0.015 with a ±3% margin, so that a pair
    within ~1.5% of its peer ends "equal ±3%" rather than undecided (or,
    one run in twenty, decided slower by a few tenths of a percent).  None:
    ``half_width``."""
    budget_s: float | None = None
    """Seconds per model and section (build to last profiled step) before the
    rounds stop whatever the precision, plus what the models before it left
    unused (:meth:`stoprule.StopRule.model_budget`); None:
    :data:`stoprule.DEFAULT_BUDGET_S`."""
    bucket_cap_mb: float | None = None
    out: str = "reports"
    label: str | None = None
    quick: bool = False
    trace_dir: str | None = None
    bandwidths: tuple[float | None, ...] = (None,)
    """One section per entry; None: no simulated interconnect."""
    threads: int = 1
    """torch.set_num_threads per rank."""
    cpu: bool = False
    """Force gloo on the CPU even when CUDA is available."""
    seed: int = 0
    timeout_s: float = 900.0
    progress: bool = True
    charts: bool = True
    """Write the PNG charts (matplotlib) next to the report."""
    command: str = ""
    link: str | None = None
    """``netns:RATE``: two hosts (network namespaces) over a real veth link
    of RATE Gbit/s (tools/netlink.py, from a clone only; root, gloo on the
    CPU); None: loopback."""
    ranks_per_host: int | None = None
    """``--link`` only: ranks in each namespace (None: 1); the world is twice it."""
    rebuild_every: int = REBUILD_EVERY
    """Rebuild every row (model, wrapper, optimizer, buckets: fresh
    allocations) after each this many timed rounds, so that a row's speed
    from where its memory landed is resampled during the run; 0: never
    (:data:`REBUILD_EVERY`)."""
    wire_gbit: float | None = None
    """The main job's wire section (:mod:`bench.wire_section`): after the
    sections above, its model and rows over a link of this many Gbit/s (a
    real one, two network namespaces and tc tbf, where
    :func:`~bench.wire_section.plan_wire` finds root, iproute2 and the
    clone's tools; else the simulated wire at this rate), one more section
    of the same report; None: no wire section."""

    def resolved_label(self) -> str:
        if self.label:
            return self.label
        return "quick" if self.quick else "full"

    @property
    def mode(self) -> str:
        """``quick`` (a smoke run: few rounds, no verdicts), ``fixed``
        (``--steps`` rounds) or ``adaptive`` (the stop rule)."""
        return "quick" if self.quick else "fixed" if self.steps is not None else "adaptive"

    def rounds_for(self, spec: ModelSpec) -> int | None:
        """Timed rounds of ``spec``; None: as many as the stop rule wants."""
        if self.steps is not None:
            return self.steps
        return spec.quick_steps if self.quick else None

    @property
    def sections_budget_s(self) -> float:
        """The adaptive run's total time (models x sections x budget: model i
        ends by (i + 1) x budget, :meth:`stoprule.StopRule.model_budget`)."""
        return self.stop_rule().budget_s * len(self.models) * len(self.bandwidths)

    def stop_rule(self) -> StopRule:
        return StopRule(self.precision if self.precision is not None else self.half_width,
                          self.budget_s if self.budget_s is not None else DEFAULT_BUDGET_S)

    def warmup_steps(self) -> int:
        w = self.warmup if self.warmup is not None else (QUICK_WARMUP if self.quick else DEFAULT_WARMUP)
        return max(1, w)

    def wrapper_names(self, cuda: bool) -> tuple[str, ...]:
        if self.wrappers is not None:
            return self.wrappers
        return DEFAULT_WRAPPERS + (CUDA_EXTRA_WRAPPERS if cuda else ())

    def validate(self) -> None:
        zoo, reg = model_zoo(), registry()
        bad = [m for m in self.models if m not in zoo]
        if bad:
            raise ValueError(f"unknown model(s) {', '.join(bad)}; known: {', '.join(zoo)}")
        bad = [w for w in (self.wrappers or ()) if w not in reg]
        if bad:
            raise ValueError(f"unknown wrapper(s) {', '.join(bad)}; known: {', '.join(reg)}")
        for what, names in (("model", self.models), ("wrapper", self.wrappers or ())):
            if len(set(names)) != len(names):
                raise ValueError(f"a {what} is listed twice: {', '.join(names)}")
        if not self.models:
            raise ValueError("no model to run")
        if self.steps is not None and self.steps < 1:
            raise ValueError("--steps must be >= 1")
        if isinstance(self.rebuild_every, bool) or not isinstance(self.rebuild_every, int) or self.rebuild_every < 0:
            raise ValueError(f"--rebuild-every must be an integer >= 0 (0: never), got {self.rebuild_every!r}")
        if not 0.0 < self.half_width < 1.0:
            raise ValueError(f"--half-width must be a percentage between 0 and 100 (exclusive), "
                             f"got {self.half_width * 100:g}")
        if self.precision is not None and not 0.0 < self.precision < 1.0:
            raise ValueError(f"--precision must be a percentage between 0 and 100 (exclusive), "
                             f"got {self.precision * 100:g}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"--budget must be > 0 seconds per model, got {self.budget_s:g}")
        if self.world is not None and self.world < 1:
            raise ValueError("--world must be >= 1")
        for bw in self.bandwidths:
            if bw is not None and not bw > 0:
                raise ValueError(f"--simulate-bandwidth values must be > 0 GB/s, got {bw}")
        if self.link is not None:
            from .clone import netlink

            netlink().parse_link(self.link)  # the tooling is in the clone's tools/: say so early if absent
            L = 1 if self.ranks_per_host is None else self.ranks_per_host
            if isinstance(L, bool) or not isinstance(L, int) or L < 1:
                raise ValueError(f"--ranks-per-host must be an integer >= 1, got {self.ranks_per_host!r}")
            if self.world not in (None, 2 * L):
                raise ValueError(f"--link runs {L} rank(s) in each of two namespaces: --world must be "
                                 f"{2 * L} (2 x --ranks-per-host), got {self.world}")
            if any(bw is not None for bw in self.bandwidths):
                raise ValueError("--link and --simulate-bandwidth are two different wires: use one "
                                 "(run twice to compare them)")
        elif self.ranks_per_host is not None:
            raise ValueError("--ranks-per-host places ranks on the two hosts of --link netns:RATE; "
                             "without --link there are no hosts (use --world)")
        if self.wire_gbit is not None:
            if not (isinstance(self.wire_gbit, (int, float)) and 0 < self.wire_gbit < math.inf):
                raise ValueError(f"--wire-rate must be a positive number of Gbit/s, got {self.wire_gbit!r}")
            if self.link is not None or any(bw is not None for bw in self.bandwidths):
                raise ValueError("the wire section is the main job's: with --link or --simulate-bandwidth "
                                 "the whole run is on that wire already")
            if self.world not in (None, 2):
                raise ValueError(f"the wire section runs 2 ranks; --world {self.world} has no wire section "
                                 "(add --no-wire)")
