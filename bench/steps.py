"""One step of one row, as the rounds time it (:func:`timed_step`), as the
profiler counts it (:func:`profile_step`: ops or kernel launches, step peak
memory, bytes on the wire) and as ``--trace`` records it
(:func:`trace_steps`); the built row it steps (:class:`Entry`).

A step, as timed (``time.perf_counter``; CUDA synchronised before and after)::

    zero_grad(set_to_none=True) -> forward -> loss -> backward -> optimizer.step()

Exposed communication of a step = ``t(backward returned) - t(last gradient
accumulated)``: a ``register_post_accumulate_grad_hook`` on every parameter
(registered before wrapping, so it runs before the wrappers' own hooks)
stamps the time (:class:`GradClock`); both DDPs wait for their all-reduces
before backward returns, so this is the communication backward failed to
hide.  On CUDA the same is measured between CUDA events (on the last
parameter seen in the first step, and after backward).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import report as R
from .models import ModelSpec
from .rank import RankContext

__all__ = ["GradClock", "Entry", "Memory", "timed_step", "profile_step", "trace_steps"]


class GradClock:
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
class Entry:
    """A built wrapper on this rank and what it has measured so far."""

    name: str
    module: nn.Module
    opt: torch.optim.Optimizer
    clock: GradClock
    row: R.Row
    """Its samples: every rank appends the same merged sample per round."""
    counter: object = None
    tuned_alone: int = 0
    """Steps it ran alone to tune its buckets before the rounds (:func:`bench.rounds._tune_alone`)."""
    builds: int = 1
    """Times it was built: the first, and every :func:`bench.rounds._rebuild`."""
    chose: list = field(default_factory=list)
    """Auto precision's pick of each earlier build (a rebuild measures again)."""


def timed_step(ctx: RankContext, spec: ModelSpec, e: Entry, batch) -> tuple[float, float, float]:
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


def _step_body(spec: ModelSpec, e: Entry, batch) -> None:
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


class Memory:
    """Rank 0's memory probes (None elsewhere, or where the probe fails).

    * CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated``;
    * CPU: allocator events recorded by ``torch.profiler(profile_memory=True)``
      (only allocations made while the profiler runs, on threads it traces).
    """

    def __init__(self, ctx: RankContext):
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


def _activities(ctx: RankContext) -> list:
    """What torch.profiler records here: CPU ops, and CUDA kernels on a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def profile_step(ctx: RankContext, spec: ModelSpec, e: Entry, batch) -> None:
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


def trace_steps(ctx: RankContext, spec: ModelSpec, e: Entry, batches, tag: str) -> None:
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
