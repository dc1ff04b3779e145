"""A model's rounds on one rank: every row built (:func:`_build`), tuners
stepped alone until they settle (:func:`_tune_alone`), warm-up and timed
rounds interleaved (:func:`_round`) until the stop rule or the fixed count
ends them, rows rebuilt in fresh allocations every few rounds
(:func:`_rebuild`), then one profiled step per row; a section is every
model under one wire (:func:`bench_section`)."""

from __future__ import annotations

import contextlib
import copy
import gc
import time

import torch
import torch.distributed as dist
from torch import nn

from . import report as R
from . import stats as S
from .models import ModelSpec, model_zoo
from .rank import RankContext, agree, agree_stop, all_gather
from .simwire import SimulatedWire
from .steps import Entry, GradClock, Memory, profile_step, timed_step, trace_steps
from .stoprule import POST_ROUNDS, Stopper
from .wrappers import WrapperOptions, build_wrapper, computed_wire_bytes, registry, wire_bytes_counter

__all__ = ["bench_section", "TUNE_ALONE_MAX", "TRACE_STEPS"]

TUNE_ALONE_MAX = 120
"""Steps at most that a wrapper tuning itself (``bucket_cap_mb="auto"``,
``auto_precision_hook``) runs alone, back to back, before the warm-up rounds
(``--quick`` too): as a training loop runs it, rather than one trial step
per rotated round after the other wrappers' steps.  (Measured: its steps
spread as much alone, 15-25% step to step, as inside the rounds.)"""
TRACE_STEPS = 3


def _batch(ctx: RankContext, spec: ModelSpec, index: int):
    gen = torch.Generator().manual_seed(ctx.cfg.seed * 1_000_003 + ctx.rank * 10_007 + index + 1_000)
    return spec.make_batch(gen, ctx.device)


def _build(ctx: RankContext, spec: ModelSpec, base: nn.Module, name: str, options: WrapperOptions,
           first_batch, measure: bool = True) -> tuple[Entry | None, R.Row]:
    """Copy ``base``, attach the gradient clock, wrap it as ``name`` and run
    its first step (rank 0 measures the memory this leaves resident, unless
    ``measure`` is False).  The ranks agree on failure; a failed wrapper
    comes back as ``(None, row)``."""
    ws = registry()[name]
    row = R.Row(spec.name, name, family=ws.family, baselines=list(ws.baselines))
    entry, error = None, None
    with (Memory(ctx).net() if measure else contextlib.nullcontext({"bytes": None})) as resident:
        try:
            model = copy.deepcopy(base)
            clock = GradClock(ctx.cuda)
            clock.attach(model)
            module, row.note = build_wrapper(name, model, options.wire, options)  # wire: None or the group
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            entry = Entry(name, module, opt, clock, row)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            error = exc
        if ctx.agree_any([error is not None])[0]:
            row.status = f"unavailable: {R.reason(error) if error else 'on another rank'}"
            return None, row
        try:
            timed_step(ctx, spec, entry, first_batch)
            entry.opt.zero_grad(set_to_none=True)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            error = exc
        if ctx.agree_any([error is not None])[0]:
            row.status = f"failed: {R.reason(error) if error else 'on another rank'}"
            return None, row
    entry.clock.pin_last()
    row.resident_bytes = resident["bytes"]
    row.wire_bytes, row.wire_source = computed_wire_bytes(ws, base.parameters()), "computed"
    try:
        entry.counter = wire_bytes_counter(ws, entry.module, options)
    except Exception:  # noqa: BLE001 - keep the computed figure
        entry.counter = None
    return entry, row


def _round(ctx: RankContext, spec: ModelSpec, entries: list[Entry], index: int, timed: bool) -> None:
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
            times[id(e)] = timed_step(ctx, spec, e, batch)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            errors[id(e)] = exc
        prev = e
    if ctx.meter is not None:
        ctx.barrier()
        link[id(prev)] = ctx.meter.lap()
    mine = torch.tensor([[*times.get(id(e), (0.0, -1.0, 0.0)), 1.0 if id(e) in errors else 0.0,
                          *link.get(id(e), (0, 0))] for e in live], dtype=torch.float64)
    mine[:, 1] = mine[:, 1].nan_to_num(-1.0)  # exposed not measured
    ranks = all_gather(ctx, mine)
    merged = S.merge_ranks([r[:, :3].tolist() for r in ranks])
    for i, (e, (ms, exposed, cpu)) in enumerate(zip(live, merged)):
        if any(r[i, 3] > 0 for r in ranks):
            exc = errors.get(id(e))
            e.row.status = f"failed: {R.reason(exc) if exc else 'on another rank'}"
        elif timed:
            e.row.step_ms.append(ms)
            e.row.cpu_ms.append(cpu)
            if exposed >= 0:
                e.row.exposed_ms.append(exposed)
            if ctx.meter is not None:  # one rank counts, the others add zeros
                e.row.link_out_bytes.append(int(sum(r[i, 4].item() for r in ranks)))
                e.row.link_in_bytes.append(int(sum(r[i, 5].item() for r in ranks)))


def _reducer(e: Entry):
    """The wrapper's fastddp reducer (its public ``reducer``, also through
    ``torch.compile``'s wrapper), else None (torch's DDP has a C++ one; other
    wrappers none)."""
    from fastddp.reducer import Reducer

    r = getattr(e.module, "reducer", None)
    return r if isinstance(r, Reducer) else None


def _tuning(e: Entry) -> bool:
    """The wrapper is fastddp with ``bucket_cap_mb="auto"`` still tuning
    (asked for, or turned on by ``auto_precision_hook`` after its choice),
    or with its bucket mode still measuring its candidates (``auto_precision_hook``'s
    formats, the CPU's in-place rule, ``bf16_fp32acc_hook``'s two-rank run:
    the mode's stats entry says ``measuring``)."""
    r = _reducer(e)
    if r is None:
        return False
    return r.tuning_active or r.plans.mode_measuring


def in_place_note(stats: dict) -> str | None:
    """What the CPU's in-place rule decided after a trial (``stats()["in_place"]``), for the
    row's note; None where it measured nothing (no gradient large enough) or is not there."""
    ip = stats.get("in_place")
    if ip is None or not ip.get("chosen") or not any(d.get("rounds") for d in ip.get("decisions", [])):
        return None
    return ("large grads reduced in place" if ip["chosen"] == "in-place" else
            "buckets whole (in place not faster)") + " after its trial"


def _buckets(e: Entry) -> list[list[int]] | None:
    """The wrapper's buckets as parameter indices (fastddp's reducer), else None."""
    r = _reducer(e)
    return None if r is None else r.plans.bucket_indices()


def _tune_alone(ctx: RankContext, spec: ModelSpec, e: Entry) -> None:
    """A wrapper that tunes its buckets: its steps back to back, alone
    (untimed), until the tuner settles (every rank at the same step: its
    decisions come from values reduced over the ranks) or TUNE_ALONE_MAX."""
    steps = 0
    while _tuning(e) and e.row.ok and steps < TUNE_ALONE_MAX:
        _round(ctx, spec, [e], steps, timed=False)
        steps += 1
    e.tuned_alone = steps


def _rebuild(ctx: RankContext, spec: ModelSpec, base: nn.Module, entries: list[Entry], options: WrapperOptions,
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


def _bench_model(ctx: RankContext, spec: ModelSpec, names: tuple[str, ...], options: WrapperOptions,
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
    stopper = Stopper(rule, budget) if ctx.lead and fixed is None else None
    for e in entries:  # --quick too: its few rounds are of the settled row, or of none
        _tune_alone(ctx, spec, e)
    for i in range(warmup - 1):
        _round(ctx, spec, entries, i, timed=False)
        progress.tick(time.perf_counter() - t0, 0, None)
    rounds, stopped, round_s, rebuilds = 0, None, 0.0, 0
    every = ctx.cfg.rebuild_every
    placements = [0] if every else None  # the timed round at which each build of the rows began
    while stopped is None:
        if every and rounds and rounds % every == 0 and any(e.row.ok for e in entries) and agree(
                ctx, fixed is not None or stopper is None
                or time.perf_counter() - t0 + round_s * (3.0 + POST_ROUNDS) <= stopper.budget_s):
            # fresh allocations for every row, then what its first rounds had: tuning alone, one
            # untimed round (torch's bucket rebuild after its first step, caches)
            _rebuild(ctx, spec, base, entries, options, rounds // every)
            rebuilds += 1
            placements.append(rounds)
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
            stopped = agree_stop(ctx, reason)
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
        what = in_place_note(stats)
        if what:
            e.row.note = f"{e.row.note}, {what}" if e.row.note else what
        e.row.buckets = _buckets(e)
    t_post = time.perf_counter()
    for e in entries:
        if e.row.ok:
            profile_step(ctx, spec, e, _batch(ctx, spec, -2))
    t_post = time.perf_counter() - t_post
    if ctx.cfg.trace_dir:
        batches = [_batch(ctx, spec, -3 - i) for i in range(TRACE_STEPS)]
        for e in entries:
            if e.row.ok:
                trace_steps(ctx, spec, e, batches, tag)

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


def bench_section(ctx: RankContext, bw: float | None, names: tuple[str, ...], bar,
                  wire: dict | None = None) -> R.Section:
    """Every model of the run with the wrappers ``names``, under a simulated
    wire of ``bw`` GB/s (None: none); ``wire`` says what carried the
    gradients (:attr:`report.Section.wire`), ``bar`` is rank 0's progress."""
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
