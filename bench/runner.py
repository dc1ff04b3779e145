"""The end-to-end runner behind ``fastddp-bench``: rank workers and orchestration.

One run (:func:`run`)::

    parent: spawn W ranks (gloo on CPU; NCCL, one per GPU) -- or, under
            torchrun, every process is a rank already
    rank:   for each simulated bandwidth (section), for each model:
              build the model once (seeded), then for each wrapper:
                deepcopy -> last-grad hooks -> wrap -> SGD -> first step
                (rank 0 measures the memory this leaves resident)
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

A step, as timed (``time.perf_counter``; CUDA synchronised before and after)::

    zero_grad(set_to_none=True) -> forward -> loss -> backward -> optimizer.step()

Exposed communication of a step = ``t(backward returned) - t(last gradient
accumulated)``: a ``register_post_accumulate_grad_hook`` on every parameter
(registered before wrapping, so it runs before the wrappers' own hooks)
stamps the time; both DDPs wait for their all-reduces before backward
returns, so this is the communication backward failed to hide.  On CUDA the
same is measured between CUDA events (on the last parameter seen in the first
step, and after backward).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import gc
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import export, report as R
from . import stats as S
from .models import DEFAULT_MODELS, ModelSpec, model_zoo
from .simwire import SimulatedWire
from .wrappers import (CUDA_EXTRA_WRAPPERS, DEFAULT_WRAPPERS, WrapperOptions, build_wrapper,
                       computed_wire_bytes, registry, wire_bytes_counter)

__all__ = ["BenchConfig", "WirePlan", "plan_wire", "run", "worker", "under_torchrun",
           "WIRE_MODEL", "WIRE_WRAPPERS", "DEFAULT_WIRE_GBIT", "WIRE_BUDGET_S"]

DEFAULT_WARMUP = 3
QUICK_WARMUP = 1
TUNE_ALONE_MAX = 120
"""Steps at most that a wrapper tuning its buckets (``bucket_cap_mb="auto"``)
runs alone, back to back, before the warm-up rounds: as a training loop
runs it, rather than one trial step per rotated round after the other
wrappers' steps.  (Measured: its steps spread as much alone, 15-25% step
to step, as inside the rounds.)"""
TRACE_STEPS = 3
REBUILD_EVERY = 10
"""``--rebuild-every``'s default: every row is rebuilt in fresh
allocations after each 10 timed rounds (the row effect: rows running the
same program measured 1.6-4.2% apart for a whole run, and one pair's mean
ratio ranged 0.944-1.127 between 20-round placements of one run).  The
intervals resample placements as well as rounds (``stats.Resampler``) and
the stop rule waits for 3 of them, so a model stops at 21 rounds at the
earliest; a rebuild costs about two rounds (auto precision's trial again
at most)."""

# The main job's wire section (``BenchConfig.wire_gbit``): the wire-bound
# model over a slow link, with the rows a user on such a link chooses from.
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
    unused (:meth:`report.StopRule.model_budget`); None:
    :data:`report.DEFAULT_BUDGET_S`."""
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
    """The main job's wire section: after the sections above, :data:`WIRE_MODEL`
    with :data:`WIRE_WRAPPERS` over a link of this many Gbit/s (a real one,
    two network namespaces and tc tbf, where :func:`plan_wire` finds root,
    iproute2 and the clone's tools; else the simulated wire at this rate),
    one more section of the same report; None: no wire section."""

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
        ends by (i + 1) x budget, :meth:`report.StopRule.model_budget`)."""
        return self.stop_rule().budget_s * len(self.models) * len(self.bandwidths)

    def stop_rule(self) -> R.StopRule:
        return R.StopRule(self.precision if self.precision is not None else self.half_width,
                          self.budget_s if self.budget_s is not None else R.DEFAULT_BUDGET_S)

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


# -- per-rank machinery -----------------------------------------------------------

class _Ctx:
    """One rank's view of the run."""

    def __init__(self, cfg: BenchConfig, rank: int, world: int, local_rank: int, device: torch.device):
        self.cfg, self.rank, self.world, self.local_rank, self.device = cfg, rank, world, local_rank, device
        self.cuda = device.type == "cuda"
        self.lead = rank == 0
        self.elapsed: dict[str, float] = {}  # "<model><section tag>" -> seconds
        self.load_start = _load()
        self.models_done = 0   # models benchmarked so far, all sections
        self.used_s = 0.0      # their time, build to last profiled step (rank 0's decides)
        self.meter = None      # --link: host 1's veth counters (linkbytes.LinkMeter)

    def barrier(self) -> None:
        if self.cuda:
            dist.barrier(device_ids=[self.local_rank])
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def agree_any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over ranks."""
        t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64,
                         device=self.device if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]


class _GradClock:
    """Stamps the time of the last gradient accumulated in a backward."""

    def __init__(self, cuda: bool):
        self.t = 0.0
        self.last = -1
        self.event_idx = -1  # CUDA: the parameter whose grad came last in the first step
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.bwd_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.handles = []

    def attach(self, module: nn.Module) -> None:
        for i, p in enumerate(p for p in module.parameters() if p.requires_grad):
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(_p):
            self.t = time.perf_counter()
            self.last = i
            if i == self.event_idx:
                self.event.record()
        return hook

    def pin_last(self) -> None:
        """CUDA: remember which parameter's grad came last (after a step)."""
        if self.event is not None:
            self.event_idx = self.last


@dataclass
class _Entry:
    """A built wrapper on this rank and what it has measured so far."""

    name: str
    module: nn.Module
    opt: torch.optim.Optimizer
    clock: _GradClock
    row: R.Row
    """Its samples: every rank appends the same merged sample per round."""
    counter: object = None
    tuned_alone: int = 0
    """Steps it ran alone to tune its buckets before the rounds (:func:`_tune_alone`)."""
    builds: int = 1
    """Times it was built: the first, and every :func:`_rebuild`."""
    chose: list = field(default_factory=list)
    """Auto precision's pick of each earlier build (a rebuild measures again)."""


def _step(ctx: _Ctx, spec: ModelSpec, e: _Entry, batch) -> tuple[float, float, float]:
    """One training step; returns (step ms, exposed communication ms, host
    CPU ms of this process, all threads)."""
    x, y = batch
    ctx.sync()
    # NaN unless a clock hook fires: replicate swaps the params for DTensors,
    # so hooks attached before wrapping never run and there is no reading
    e.clock.t = float("nan")
    c0 = time.process_time()
    t0 = time.perf_counter()
    e.opt.zero_grad(set_to_none=True)
    loss = spec.loss(e.module(x), y)
    loss.backward()
    t_bwd = time.perf_counter()
    if ctx.cuda:
        e.clock.bwd_event.record()
    e.opt.step()
    ctx.sync()
    t1 = time.perf_counter()
    cpu = (time.process_time() - c0) * 1e3
    if ctx.cuda:
        exposed = e.clock.event.elapsed_time(e.clock.bwd_event) if e.clock.event_idx >= 0 else float("nan")
    else:
        exposed = (t_bwd - e.clock.t) * 1e3
    return (t1 - t0) * 1e3, exposed, cpu


def _step_body(spec: ModelSpec, e: _Entry, batch) -> None:
    x, y = batch
    with torch.profiler.record_function("bench/forward"):
        loss = spec.loss(e.module(x), y)
    with torch.profiler.record_function("bench/backward"):
        loss.backward()
    with torch.profiler.record_function("bench/optimizer"):
        e.opt.step()


@contextlib.contextmanager
def _muted_stderr():
    """File descriptor 2 to /dev/null inside (C++ writes there directly)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def _profiler(**kwargs):
    """``torch.profiler.profile(**kwargs)``, started and stopped with stderr
    muted: kineto prints a ``USDT: ... profiler_start`` / ``profiler_stop``
    line each time at any ``KINETO_LOG_LEVEL``, and the runner starts it up
    to twice per wrapper.  What the profiled code prints is kept."""
    prof = torch.profiler.profile(**kwargs)
    with _muted_stderr():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _muted_stderr():
            prof.__exit__(None, None, None)


def _cpu_memory_events(prof) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every CPU allocator event in ``prof``."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.name() == "[memory]" and ev.device_type() == torch.autograd.DeviceType.CPU:
            out.append((ev.start_ns(), ev.nbytes()))
    out.sort()
    return out


class _Memory:
    """Rank 0's memory probes (None elsewhere, or where the probe fails).

    * CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated``;
    * CPU: allocator events recorded by ``torch.profiler(profile_memory=True)``
      (only allocations made while the profiler runs, on threads it traces).
    """

    def __init__(self, ctx: _Ctx):
        self.ctx = ctx

    @contextlib.contextmanager
    def net(self):
        """Yields a dict; afterwards ``["bytes"]`` = net bytes allocated inside."""
        out: dict = {"bytes": None}
        if not self.ctx.lead:
            yield out
            return
        if self.ctx.cuda:
            self.ctx.sync()
            before = torch.cuda.memory_allocated(self.ctx.device)
            yield out
            self.ctx.sync()
            out["bytes"] = torch.cuda.memory_allocated(self.ctx.device) - before
            return
        with _profiler(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            yield out
        try:
            out["bytes"] = sum(b for _, b in _cpu_memory_events(prof))
        except Exception:  # noqa: BLE001 - private profiler API: report n/a
            out["bytes"] = None


def _count_ops(prof, cuda: bool) -> int:
    """CPU: aten ops with no aten op around them (same thread); CUDA: kernels
    (Memcpy/Memset excluded).  Reads the raw kineto events: ``prof.events()``
    builds a Python object per event, slow on a big model's trace."""
    events = prof.profiler.kineto_results.events()
    if cuda:
        return sum(1 for ev in events if ev.device_type() == torch.autograd.DeviceType.CUDA
                   and not ev.name().startswith(("Memcpy", "Memset", "[memory]")))
    spans = sorted((ev.start_thread_id(), ev.start_ns(), -ev.duration_ns()) for ev in events
                   if ev.device_type() == torch.autograd.DeviceType.CPU and ev.name().startswith("aten::"))
    count, thread, busy_until = 0, None, -1
    for tid, start, neg_duration in spans:
        if tid != thread:
            thread, busy_until = tid, -1
        if start >= busy_until:  # not inside the previous top-level op
            count += 1
            busy_until = start - neg_duration
    return count


def _activities(ctx: _Ctx) -> list:
    """What torch.profiler records here: CPU ops, and CUDA kernels on a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _profile_step(ctx: _Ctx, spec: ModelSpec, e: _Entry, batch) -> None:
    """One untimed step, profiled on rank 0: ops (CPU) or kernel launches
    (CUDA), step peak memory, bytes on the wire."""
    e.opt.zero_grad(set_to_none=True)
    ctx.barrier()
    wire0 = e.counter() if e.counter is not None else None
    if not ctx.lead:
        _step_body(spec, e, batch)
        ctx.sync()
        return
    acts = _activities(ctx)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device)
    with _profiler(activities=acts, profile_memory=not ctx.cuda) as prof:
        _step_body(spec, e, batch)
        ctx.sync()
    e.row.ops_per_step = _count_ops(prof, ctx.cuda)
    e.row.ops_kind = "kernel launches" if ctx.cuda else "aten ops"
    if ctx.cuda:
        e.row.step_peak_bytes = torch.cuda.max_memory_allocated(ctx.device) - base
    else:
        try:
            run = peak = 0
            for _, b in _cpu_memory_events(prof):
                run += b
                peak = max(peak, run)
            e.row.step_peak_bytes = peak
        except Exception:  # noqa: BLE001 - private profiler API: report n/a
            e.row.step_peak_bytes = None
    if e.counter is not None:
        e.row.wire_bytes, e.row.wire_source = e.counter() - wire0, "measured"


def _trace(ctx: _Ctx, spec: ModelSpec, e: _Entry, batches, tag: str) -> None:
    """``--trace``: a Chrome trace of a few steps of one wrapper (rank 0)."""
    ctx.barrier()
    if not ctx.lead:
        for b in batches:
            e.opt.zero_grad(set_to_none=True)
            _step_body(spec, e, b)
        ctx.sync()
        return
    acts = _activities(ctx)
    with _profiler(activities=acts) as prof:
        for i, b in enumerate(batches):
            with torch.profiler.record_function(f"bench/step[{i}]"):
                e.opt.zero_grad(set_to_none=True)
                _step_body(spec, e, b)
        ctx.sync()
    folder = Path(ctx.cfg.trace_dir)
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"{spec.name}{tag}-{e.name}.json"))


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _batch(ctx: _Ctx, spec: ModelSpec, index: int):
    gen = torch.Generator().manual_seed(ctx.cfg.seed * 1_000_003 + ctx.rank * 10_007 + index + 1_000)
    return spec.make_batch(gen, ctx.device)


def _build(ctx: _Ctx, spec: ModelSpec, base: nn.Module, name: str, options: WrapperOptions,
           first_batch, measure: bool = True) -> tuple[_Entry | None, R.Row]:
    """Copy ``base``, attach the gradient clock, wrap it as ``name`` and run
    its first step (rank 0 measures the memory this leaves resident, unless
    ``measure`` is False).  The ranks agree on failure; a failed wrapper
    comes back as ``(None, row)``."""
    ws = registry()[name]
    row = R.Row(spec.name, name, family=ws.family, baselines=list(ws.baselines))
    entry, error = None, None
    with (_Memory(ctx).net() if measure else contextlib.nullcontext({"bytes": None})) as resident:
        try:
            model = copy.deepcopy(base)
            clock = _GradClock(ctx.cuda)
            clock.attach(model)
            module, row.note = build_wrapper(name, model, options.wire, options)  # wire: None or the group
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            entry = _Entry(name, module, opt, clock, row)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            error = exc
        if ctx.agree_any([error is not None])[0]:
            row.status = f"unavailable: {_reason(error) if error else 'on another rank'}"
            return None, row
        try:
            _step(ctx, spec, entry, first_batch)
            entry.opt.zero_grad(set_to_none=True)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            error = exc
        if ctx.agree_any([error is not None])[0]:
            row.status = f"failed: {_reason(error) if error else 'on another rank'}"
            return None, row
    entry.clock.pin_last()
    row.resident_bytes = resident["bytes"]
    row.wire_bytes, row.wire_source = computed_wire_bytes(ws, base.parameters()), "computed"
    try:
        entry.counter = wire_bytes_counter(ws, entry.module, options)
    except Exception:  # noqa: BLE001 - keep the computed figure
        entry.counter = None
    return entry, row


def _all_gather(ctx: _Ctx, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), on the CPU, in rank order."""
    if ctx.cuda:
        t = t.to(ctx.device)
    out = [torch.empty_like(t) for _ in range(ctx.world)]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


def _round(ctx: _Ctx, spec: ModelSpec, entries: list[_Entry], index: int, timed: bool) -> None:
    """One step of every live wrapper on the same batch, order rotated by
    ``index``; a barrier (untimed) before each step.  Then one all_gather
    brings every rank's (step ms, exposed ms, CPU ms, failed) to every rank;
    :func:`stats.merge_ranks` makes the round's sample per wrapper (the
    slowest rank's step), appended to its row when ``timed``.  A wrapper
    that raised on any rank is marked failed on all."""
    batch = _batch(ctx, spec, index)
    live = [e for e in entries if e.row.ok]
    if not live:
        return
    k = index % len(live)
    times: dict[int, tuple[float, float, float]] = {}
    errors: dict[int, BaseException] = {}
    link: dict[int, tuple[int, int]] = {}  # --link: host 1's veth bytes per step (linkbytes' marks)
    prev = None
    for e in live[k:] + live[:k]:
        ctx.barrier()
        if ctx.meter is not None:
            link[id(prev)] = ctx.meter.lap()
        try:
            times[id(e)] = _step(ctx, spec, e, batch)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            errors[id(e)] = exc
        prev = e
    if ctx.meter is not None:
        ctx.barrier()
        link[id(prev)] = ctx.meter.lap()
    mine = torch.tensor([[*times.get(id(e), (0.0, -1.0, 0.0)), 1.0 if id(e) in errors else 0.0,
                          *link.get(id(e), (0, 0))] for e in live], dtype=torch.float64)
    mine[:, 1] = mine[:, 1].nan_to_num(-1.0)  # exposed not measured
    ranks = _all_gather(ctx, mine)
    merged = S.merge_ranks([r[:, :3].tolist() for r in ranks])
    for i, (e, (ms, exposed, cpu)) in enumerate(zip(live, merged)):
        if any(r[i, 3] > 0 for r in ranks):
            exc = errors.get(id(e))
            e.row.status = f"failed: {_reason(exc) if exc else 'on another rank'}"
        elif timed:
            e.row.step_ms.append(ms)
            e.row.cpu_ms.append(cpu)
            if exposed >= 0:
                e.row.exposed_ms.append(exposed)
            if ctx.meter is not None:  # one rank counts, the others add zeros
                e.row.link_out_bytes.append(int(sum(r[i, 4].item() for r in ranks)))
                e.row.link_in_bytes.append(int(sum(r[i, 5].item() for r in ranks)))


def _reducer(e: _Entry):
    """The wrapper's fastddp reducer (its public ``reducer``, also through
    ``torch.compile``'s wrapper), else None (torch's DDP has a C++ one; other
    wrappers none)."""
    from fastddp.reducer import Reducer

    r = getattr(e.module, "reducer", None)
    return r if isinstance(r, Reducer) else None


def _tuning(e: _Entry) -> bool:
    """The wrapper is fastddp with ``bucket_cap_mb="auto"`` still tuning
    (asked for, or turned on by ``auto_precision_hook`` after its choice), or
    with ``auto_precision_hook`` still measuring its formats."""
    r = _reducer(e)
    if r is None:
        return False
    return r.tuning_active or r.stats().get("auto_precision", {}).get("state") in ("waiting", "trial")


def _buckets(e: _Entry) -> list[list[int]] | None:
    """The wrapper's buckets as parameter indices (fastddp's reducer), else None."""
    r = _reducer(e)
    return None if r is None else r.bucket_indices()


def _tune_alone(ctx: _Ctx, spec: ModelSpec, e: _Entry) -> None:
    """A wrapper that tunes its buckets: its steps back to back, alone
    (untimed), until the tuner settles (every rank at the same step: its
    decisions come from values reduced over the ranks) or TUNE_ALONE_MAX."""
    steps = 0
    while _tuning(e) and e.row.ok and steps < TUNE_ALONE_MAX:
        _round(ctx, spec, [e], steps, timed=False)
        steps += 1
    e.tuned_alone = steps


def _rebuild(ctx: _Ctx, spec: ModelSpec, base: nn.Module, entries: list[_Entry], options: WrapperOptions,
             index: int) -> None:
    """Every live row's model, wrapper, optimizer and buckets built afresh
    (the row keeps its samples): the row effect (a row keeps one speed for
    the whole run, from where its memory happened to land) is resampled.
    Row by row, in an order rotated by ``index``: the new one is built while
    the old one still holds its memory (so it lands elsewhere), then the old
    one is freed (for the next row's new one to land in; one row's memory
    extra at most).  A row whose rebuild fails on any rank is marked failed."""
    live = [e for e in entries if e.row.ok]
    if not live:
        return
    k = index % len(live)
    for e in live[k:] + live[:k]:
        new, row = _build(ctx, spec, base, e.name, options, _batch(ctx, spec, -1), measure=False)
        if new is None:
            what, _, why = row.status.partition(":")
            e.row.status = f"{what}: on rebuild:{why}"
            continue
        for h in e.clock.handles:
            h.remove()
        r = _reducer(e)
        ap = None if r is None else r.stats().get("auto_precision")
        if ap is not None:
            e.chose.append(ap.get("chosen"))
        e.module, e.opt, e.clock, e.counter = new.module, new.opt, new.clock, new.counter
        e.builds += 1
        del new
        gc.collect()


def _agree(ctx: _Ctx, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a rebuild only where its time fits rank 0's budget)."""
    return bool(_from_lead(ctx, int(flag)))


_STOPS = (None, "precision", "budget")


def _from_lead(ctx: _Ctx, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    if ctx.cuda:
        t = t.to(ctx.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _agree_stop(ctx: _Ctx, reason: str | None) -> str | None:
    """Rank 0's stop decision, on every rank (its clock and its rule decide)."""
    return _STOPS[_from_lead(ctx, _STOPS.index(reason))]


def _bench_model(ctx: _Ctx, spec: ModelSpec, names: tuple[str, ...], options: WrapperOptions,
                 tag: str, progress) -> tuple[list[R.Row], dict]:
    """Every wrapper on one model: build, warm up, timed rounds until the
    stop rule (or the fixed count) ends them, profile.  Returns the rows
    and how the rounds ended (``Section.runs``)."""
    t0 = time.perf_counter()
    torch.manual_seed(ctx.cfg.seed)
    base = spec.build().to(ctx.device)
    first = _batch(ctx, spec, -1)
    rows, entries = [], []
    for name in names:
        entry, row = _build(ctx, spec, base, name, options, first)
        rows.append(row)
        if entry is not None:
            entries.append(entry)

    warmup, fixed = ctx.cfg.warmup_steps(), ctx.cfg.rounds_for(spec)
    rule = ctx.cfg.stop_rule()
    budget = rule.model_budget(ctx.models_done, ctx.used_s)
    stopper = R.Stopper(rule, budget) if ctx.lead and fixed is None else None
    if not ctx.cfg.quick:  # a smoke run does not wait for tuners: their rounds include tuning steps
        for e in entries:
            _tune_alone(ctx, spec, e)
    for i in range(warmup - 1):
        _round(ctx, spec, entries, i, timed=False)
        progress.tick(time.perf_counter() - t0, 0, None)
    rounds, stopped, round_s, rebuilds = 0, None, 0.0, 0
    every = ctx.cfg.rebuild_every
    placements = [0] if every else None  # the timed round at which each build of the rows began
    while stopped is None:
        if every and rounds and rounds % every == 0 and any(e.row.ok for e in entries) and _agree(
                ctx, fixed is not None or stopper is None
                or time.perf_counter() - t0 + round_s * (3.0 + R.POST_ROUNDS) <= stopper.budget_s):
            # fresh allocations for every row, then what its first rounds had: tuning alone, one
            # untimed round (torch's bucket rebuild after its first step, caches)
            _rebuild(ctx, spec, base, entries, options, rounds // every)
            rebuilds += 1
            placements.append(rounds)
            if not ctx.cfg.quick:
                for e in entries:
                    _tune_alone(ctx, spec, e)
            _round(ctx, spec, entries, warmup + rounds, timed=False)
        t_round = time.perf_counter()
        _round(ctx, spec, entries, warmup + rounds, timed=True)
        rounds += 1
        now = time.perf_counter()
        round_s = now - t_round
        if not any(e.row.ok for e in entries):  # the same on every rank (statuses are agreed)
            stopped = "failed"
        elif fixed is not None:
            stopped = ctx.cfg.mode if rounds >= fixed else None
        else:
            reason = (stopper.update([e.row for e in entries], rounds, now - t0, round_s, placements)
                      if stopper else None)
            stopped = _agree_stop(ctx, reason)
        progress.tick(now - t0, rounds, stopper.widest if stopper else None)

    for e in entries:
        r = _reducer(e)
        stats = {} if r is None else r.stats()
        tune = stats.get("autotune")
        if tune is not None:
            e.row.autotune = {**tune, "tuned_alone_steps": e.tuned_alone}
        ap = stats.get("auto_precision")
        if ap is not None:
            e.row.autoprec = {k: ap.get(k) for k in ("chosen", "state", "candidates", "settled_at_step",
                                                     "trial_steps")}
            e.row.autoprec["tuned_alone_steps"] = e.tuned_alone
            e.row.autoprec["chosen_per_build"] = e.chose + [ap.get("chosen")]
            if ap.get("chosen"):
                picks = e.row.autoprec["chosen_per_build"]
                what = f"chose {ap['chosen']}" + ("" if len(set(picks)) == 1 else
                                                  f" (each build: {', '.join(str(c) for c in picks)})")
                e.row.note = f"{e.row.note}, {what}" if e.row.note else what
        e.row.buckets = _buckets(e)
    t_post = time.perf_counter()
    for e in entries:
        if e.row.ok:
            _profile_step(ctx, spec, e, _batch(ctx, spec, -2))
    t_post = time.perf_counter() - t_post
    if ctx.cfg.trace_dir:
        batches = [_batch(ctx, spec, -3 - i) for i in range(TRACE_STEPS)]
        for e in entries:
            if e.row.ok:
                _trace(ctx, spec, e, batches, tag)

    for e in entries:
        for h in e.clock.handles:
            h.remove()
    del entries, base
    gc.collect()
    elapsed = time.perf_counter() - t0
    ctx.models_done += 1
    ctx.used_s += elapsed
    info = {"rounds": rounds, "stopped": stopped, "elapsed_s": round(elapsed, 1),
            "budget_s": round(budget, 1) if fixed is None else None,
            "round_s": round(round_s, 3), "profile_s": round(t_post, 1), "rebuilds": rebuilds,
            "placements": placements}
    return rows, info


def _section(ctx: _Ctx, bw: float | None, names: tuple[str, ...], bar, wire: dict | None = None) -> R.Section:
    cfg = ctx.cfg
    zoo = model_zoo()
    section = R.Section(bw, half_width=cfg.half_width, verdicts=not cfg.quick,
                        precision=cfg.precision, wire=wire)
    with contextlib.ExitStack() as stack:
        wire = None
        if bw is not None:
            wire = stack.enter_context(SimulatedWire(dist.group.WORLD, bw, ctx.device))
        options = WrapperOptions(bucket_cap_mb=cfg.bucket_cap_mb,
                                 device_ids=[ctx.local_rank] if ctx.cuda else None, wire=wire)
        for m in cfg.models:
            bar.start(f"{m}{section.tag}")
            rows, section.runs[m] = _bench_model(ctx, zoo[m], names, options, section.tag, bar)
            section.rows += rows
            ctx.elapsed[f"{m}{section.tag}"] = section.runs[m]["elapsed_s"]
            bar.end(section.runs[m]["elapsed_s"])
    return section


# -- metadata -------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not sha:
        return None
    return sha + (" (uncommitted changes)" if dirty else "")


def _load() -> str | None:
    """The load average (1, 5, 15 min), or None where the OS has none."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def _meta(ctx: _Ctx, names: tuple[str, ...], elapsed: float, sections: list[R.Section]) -> dict:
    cfg = ctx.cfg
    zoo = model_zoo()
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001 - not installed / broken: recorded as such
        triton_v = None
    nccl = None
    if ctx.cuda:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            nccl = "unknown"
    try:
        import numpy
        numpy_v = numpy.__version__
    except ImportError:
        numpy_v = None
    try:
        import fastddp
        fastddp_v = getattr(fastddp, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        fastddp_v = f"unavailable ({_reason(exc)})"
    cpu = _cpu_model()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    now = _dt.datetime.now()
    meta = {
        "label": cfg.resolved_label(),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else cpu,
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {affinity} usable",
        "gpus": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                 if ctx.cuda else None),
        "backend": "nccl" if ctx.cuda else "gloo",
        "world_size": ctx.world,
        "threads_per_rank": cfg.threads,
        "torch": torch.__version__,
        "triton": triton_v,
        "nccl": nccl,
        "python": platform.python_version(),
        "numpy": numpy_v,
        "fastddp": fastddp_v,
        "git": _git(),
        "models": list(cfg.models),
        "model_descriptions": {m: zoo[m].description for m in cfg.models},
        "wrappers": list(names),
        "mode": cfg.mode,
        "rounds": {f"{m}{s.tag}": info["rounds"] for s in sections for m, info in s.runs.items()},
        "half_width": f"{cfg.half_width * 100:g}%",
        "precision": f"{cfg.stop_rule().half_width * 100:g}%",
        "budget_s": cfg.stop_rule().budget_s if cfg.mode == "adaptive" else None,
        "warmup": cfg.warmup_steps(),
        "bucket_cap_mb": cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else "default (25)",
        "simulate_bandwidth_gbps": [b for b in cfg.bandwidths if b is not None] or None,
        "quick": cfg.quick,
        "load": f"{ctx.load_start} at start, {_load()} at the end" if ctx.load_start else None,
        "command": cfg.command,
        "elapsed_s": round(elapsed, 1),
        "elapsed_per_model_s": dict(ctx.elapsed),
        "config": {k: v for k, v in asdict(cfg).items() if k != "command"},
    }
    return meta


# -- entry points -------------------------------------------------------------------------

def under_torchrun() -> bool:
    """True when launched by torchrun (or any env:// launcher setting these)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def worker(rank: int, world: int, local_rank: int, cfg: BenchConfig, init_method: str,
           result_path: str | None) -> R.Report | None:
    """One rank's whole run; rank 0 returns the report (and writes it as JSON
    to ``result_path`` when given), the others return None."""
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    cuda = torch.cuda.is_available() and not cfg.cpu
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=_dt.timedelta(seconds=cfg.timeout_s))
    try:
        ctx = _Ctx(cfg, rank, world, local_rank, device)
        link_probe = None
        if cfg.link is not None:  # the rate the link really carries, before the rounds
            from .clone import netlink
            from .linkbytes import LinkMeter, probe_between_hosts

            link_probe = probe_between_hosts(netlink().probe_link, cfg.ranks_per_host or 1)
            ctx.meter = LinkMeter.for_rank()
        names = cfg.wrapper_names(cuda)
        bar = _Progress(ctx.lead and cfg.progress, cfg)
        wire = None
        if link_probe is not None:  # the section says what carried it (the main job has several wires)
            spec = netlink().parse_link(cfg.link)
            wire = {"kind": "netns", "gbit": spec.gbit, "what": spec.describe(), **link_probe}
            link_meta = {"spec": cfg.link, "what": wire["what"], "ranks_per_host": cfg.ranks_per_host or 1,
                         **link_probe}
        try:
            sections = [_section(ctx, bw, names, bar, wire) for bw in cfg.bandwidths]
        finally:
            bar.close()
        if not ctx.lead:
            return None
        meta = _meta(ctx, names, time.perf_counter() - t_start, sections)
        if link_probe is not None:
            meta["link"] = link_meta
        report = R.Report(meta, sections)
        for s in report.sections:
            R.derive(s)
        if result_path:
            Path(result_path).write_text(R.to_json(report))
        return report
    finally:
        dist.destroy_process_group()


def eta_s(total_s: float, used_s: float, elapsed_s: float) -> float:
    """The most an adaptive run can still take: its total budget (models x
    sections x budget) less what the finished models used and ``elapsed_s``
    into the current one (each model ends by its share of the total)."""
    return max(0.0, total_s - used_s - elapsed_s)


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class _Progress:
    """Rank 0's progress bar over the whole run (stderr, tqdm when installed;
    otherwise, or with ``enabled`` False, nothing).

    Adaptive rounds: the bar is time against the run's total budget (models
    x sections x budget: model i ends by (i + 1) x budget into the run, see
    :meth:`report.StopRule.model_budget`) and says how long the run can
    still take at most (:func:`eta_s`), which holds across models whose
    rounds take different times.  ``--steps`` / ``--quick``: the bar counts
    rounds."""

    _FORMAT = "{desc} {percentage:3.0f}%|{bar}| "

    def __init__(self, enabled: bool, cfg: BenchConfig):
        self.cfg, self.label, self.text = cfg, "", ""
        zoo = model_zoo()
        models = list(cfg.models) * len(cfg.bandwidths)
        self.adaptive = cfg.mode == "adaptive"
        self.total_s = cfg.sections_budget_s
        self.used_s = 0.0
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if self.adaptive:
            self.bar = tqdm(total=round(self.total_s), file=sys.stderr, dynamic_ncols=True, leave=False,
                            bar_format=self._FORMAT)
        else:
            rounds = sum(cfg.warmup_steps() - 1 + cfg.rounds_for(zoo[m]) for m in models)
            self.bar = tqdm(total=rounds, unit="round", file=sys.stderr, dynamic_ncols=True, leave=False)

    def start(self, label: str) -> None:
        self.label = label
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            if self.adaptive:
                self.tick(0.0, 0, None)

    def tick(self, elapsed_s: float, rounds: int, widest: float | None) -> None:
        """After a round: ``elapsed_s`` into the current model, ``rounds``
        timed so far, the widest pair's half-width (None: not checked yet)."""
        if self.bar is None:
            return
        if not self.adaptive:
            self.bar.update(1)
            return
        goal = f"±{self.cfg.stop_rule().half_width * 100:g}%"
        state = "building, warming up" if rounds == 0 else (
            f"round {rounds}, widest pair " + ("-" if widest is None or math.isinf(widest) else f"±{widest:.1%}")
            + f" (goal {goal})")
        self.bar.n = min(round(self.used_s + elapsed_s), self.bar.total)
        # the text goes into the format itself: tqdm's postfix field would prefix ", "
        self.text = f"{state}, at most {_clock(eta_s(self.total_s, self.used_s, elapsed_s))} left"
        self.bar.bar_format = self._FORMAT + self.text.replace("{", "{{").replace("}", "}}")
        self.bar.refresh()

    def end(self, elapsed_s: float) -> None:
        """The current model took ``elapsed_s`` in all."""
        self.used_s += elapsed_s

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _spawn_entry(rank: int, world: int, cfg: BenchConfig, init_method: str, result_path: str) -> None:
    worker(rank, world, rank, cfg, init_method, result_path)


def resolve_world(cfg: BenchConfig) -> int:
    if cfg.world is not None:
        return cfg.world
    if torch.cuda.is_available() and not cfg.cpu:
        return max(1, torch.cuda.device_count())
    return 2


def link_rank(cfg_path: str, result_path: str) -> None:
    """A rank of a ``--link`` run, started inside its namespace by
    :func:`_run_linked` (RANK and the rest come from the environment)."""
    import pickle

    cfg = pickle.loads(Path(cfg_path).read_bytes())
    rank = int(os.environ["RANK"])
    worker(rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), cfg, "env://",
           result_path if rank == 0 else None)


def _run_linked(cfg: BenchConfig) -> R.Report:
    """``--ranks-per-host`` ranks (1 by default) in each of two network
    namespaces, over the ``--link`` veth pair."""
    import pickle

    from .clone import netlink

    N = netlink()
    L = cfg.ranks_per_host or 1
    cfg = replace(cfg, cpu=True, world=2 * L)
    with tempfile.TemporaryDirectory(prefix="fastddp-bench-") as tmp:
        cfg_path, result = Path(tmp, "cfg.pkl"), Path(tmp, "result.json")
        cfg_path.write_bytes(pickle.dumps(cfg))
        argv = [sys.executable, "-c", "import sys; from fastddp.bench.runner import link_rank; "
                "link_rank(sys.argv[1], sys.argv[2])", str(cfg_path), str(result)]
        with N.NetnsLink(N.parse_link(cfg.link), ranks_per_host=L) as link:
            link.run_ranks(argv)
        return R.from_json(result.read_text())


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


def _wire_cfg(cfg: BenchConfig, plan: WirePlan, budget_s: float | None) -> BenchConfig:
    """The wire section as a run of its own (the parent merges the reports)."""
    common = dict(models=(WIRE_MODEL,), wrappers=WIRE_WRAPPERS, wire_gbit=None, budget_s=budget_s, world=None)
    if plan.kind == "netns":
        return replace(cfg, link=f"netns:{plan.gbit:g}", bandwidths=(None,), **common)
    return replace(cfg, bandwidths=(plan.gbit / 8,), **common)


def _launch(cfg: BenchConfig) -> R.Report | None:
    """Run ``cfg``'s ranks; rank 0's report (None on other torchrun ranks)."""
    if cfg.link is not None:
        return _run_linked(cfg)
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return worker(rank, world, int(os.environ["LOCAL_RANK"]), cfg, "env://", None)
    import torch.multiprocessing as mp

    world = resolve_world(cfg)
    with tempfile.TemporaryDirectory(prefix="fastddp-bench-") as tmp:
        init = Path(tmp, "init").as_uri()
        result = Path(tmp, "result.json")
        mp.spawn(_spawn_entry, args=(world, cfg, init, str(result)), nprocs=world, join=True)
        return R.from_json(result.read_text())


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


def _with_wire(cfg: BenchConfig, report: R.Report, t_start: float) -> R.Report:
    """Run the wire section (:func:`plan_wire`; a real link that fails to
    come up falls back to the simulated wire) and add it to ``report``."""
    plan = plan_wire(cfg.wire_gbit)
    budget = _wire_budget(cfg, report)
    _say(f"wire section: {plan.describe()}"
         + ("" if budget is None else f"; at most ~{budget:.0f} s"))
    try:
        wired = _launch(_wire_cfg(cfg, plan, budget))
    except Exception as exc:  # noqa: BLE001 - a link that cannot come up: the simulated wire instead
        from .clone import netlink

        if plan.kind != "netns" or not isinstance(exc, netlink().LinkError):
            raise
        plan = WirePlan("simulated", plan.gbit, f"the link could not be set up: {_reason(exc)}")
        _say(f"wire section: {plan.describe()}")
        wired = _launch(_wire_cfg(cfg, plan, budget))
    for s in report.sections:
        s.wire = {"kind": "loopback"}
    for s in wired.sections:
        if plan.kind == "simulated":
            s.wire = {"kind": "simulated", "gbit": plan.gbit, "why": plan.why}
        report.sections.append(s)
    m, w = report.meta, wired.meta
    m["rounds"] = {**(m.get("rounds") or {}), **(w.get("rounds") or {})}
    m["elapsed_per_model_s"] = {**(m.get("elapsed_per_model_s") or {}), **(w.get("elapsed_per_model_s") or {})}
    m["model_descriptions"] = {**(m.get("model_descriptions") or {}), **(w.get("model_descriptions") or {})}
    m["wire"] = (f"{plan.describe()}; rows {', '.join(WIRE_WRAPPERS)}"
                 + ("" if budget is None else f"; budget {budget:.0f} s"))
    m["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if w.get("load"):
        m["load"] = f"{m.get('load')}; wire section: {w['load']}"
    return report


def run(cfg: BenchConfig) -> tuple[R.Report, dict] | None:
    """Run the benchmark and write the report; returns ``(report, paths)`` on
    the process that holds rank 0's results (None on other torchrun ranks).
    With ``wire_gbit`` the wire section runs after the others, as a second
    launch (a real link needs its ranks inside the namespaces), into the
    same report."""
    cfg.validate()
    t_start = time.perf_counter()
    report = _launch(cfg)
    if report is None:
        return None
    if cfg.wire_gbit is not None:
        report = _with_wire(cfg, report, t_start)
    paths = export.write_report(report, cfg.out, charts_on=cfg.charts)
    return report, paths
