"""``bucket_cap_mb="auto"``: bucket caps tuned online, in the first steps,
from measured overlap.

What is tuned: the first bucket's cap and the cap of the rest, i.e. torch's
``bucket_cap_mb_list=[first, rest]`` (``bucket_cap_mb=rest`` when equal).
Every layout tried is one torch's rebuild would make with those caps, from
the same ready order, so the gradients are those of that fixed setting.

How, step by step (a step = a forward that synchronises and its backward;
``no_sync`` forwards are not steps here)::

    wait    until torch's one bucket rebuild has happened (static_graph: after
            the second backward), torch's default layout (1 / 25 MiB) meanwhile
    probe   one step with torch's default layout: each parameter's ready
            time (host clock; CUDA events on CUDA)
    model   timeline MAX-reduced over ranks; a few all-reduces of 4 KiB ..
            4 MiB timed once (latency alpha, time per byte beta, MAX over
            ranks); each grid layout's exposed communication predicted by a
            serial-wire replay of the timeline (:func:`predict`)
    trials  torch's default first, then the model's best, then (CPU ranks on
            a copy-speed link, unless pruned) the fewest buckets, then hill-climbing
            on the rest cap (and the first cap) around the best measured:
            TRIAL_STEPS steps each, TRIAL_STEPS more (up to MAX_TRIAL_STEPS)
            while a layout's steps spread by more than SPREAD_OK; cost = the
            median of the faster half of the per-step MAX over ranks of
            forward start -> all gradients reduced (a step is only ever made
            slower by what else runs on the machine); a layout whose
            calibrated prediction is far above the best measured is never
            tried (calibrated by the smallest measured - predicted gap, so
            the pruning errs towards trying); a layout replaces the best only
            if it is faster by more than the noise
    settled the best; where no layout beat the incumbent by the noise, on
            the CPU the link picks among those within it (copy speed: the
            fewest buckets; a wire: the model's pick); installed at a step
            boundary; a log line on rank 0

Every decision is taken from values all-reduced (MAX) over the group, by the
same deterministic code on every rank: the ranks change buckets at the same
step, so their collectives stay in lockstep.  Buckets change only between
steps, through the reducer's rebuild path.

Cost: one all-reduce of ``TRIAL_STEPS`` floats per layout tried, one of a
float per parameter and ~12 small timed all-reduces once, a device sync per
tuning step on CUDA; nothing once settled.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import groups, planner

__all__ = ["Tuner", "parse_cap", "predict", "resolve_cap"]

log = logging.getLogger("fastddp.autotune")

TRIAL_STEPS = 3
"""Measured steps per layout at least (and per extension)."""
MAX_TRIAL_STEPS = 9
"""Measured steps per layout at most: a noisy layout is measured in rounds of
TRIAL_STEPS until its spread is under SPREAD_OK or it has this many."""
MAX_TUNING_STEPS = 30
"""Measured steps over all layouts at most (the probe and waits not counted):
tuning then settles on the best so far."""
SPREAD_OK = 0.02
"""Relative robust spread (1.4826 MAD / median) of a layout's steps under
which TRIAL_STEPS of them suffice.  On a shared 2-core machine a 70 ms step
was measured as 72 / 85 / 115 ms in one trial: a median of 3 then ranks
layouts by the machine's noise (issue: auto 1.11x the best fixed cap)."""
MAX_LAYOUTS = 7
"""Layouts measured at most: probe + 7 x 3 steps settles by step ~25 on quiet steps."""
REST_CAPS_MB = (0.5, 1, 2, 5, 10, 25, 50, 100)
"""The rest-cap grid (MiB); torch's default is 25."""
FIRST_CAPS_MB = (0.25, 1)
"""First-cap candidates besides ``first == rest`` (torch's default first bucket is 1 MiB)."""
COPY_SPEED_GBPS = 0.5
"""An all-reduce microbenchmark at this rate or more (GB/s) means the link
moves bytes at copy speed (shared memory, loopback; a 1 Gbit/s wire measures
~0.12): there a CPU collective costs CPU time (:meth:`Tuner._by_link`)."""
REL_NOISE = 0.01
"""A layout must beat the best by more than 1% (or the measured spread) to replace it."""
PRUNE = 0.15
"""Never tried: a calibrated prediction more than 15% above the best measured cost."""
HOST_PER_BUCKET_S = {"cpu": 30e-6, "cuda": 10e-6}
"""Host cost of one more bucket on the backward thread (pack + issue), for the model."""
MICROBENCH_BYTES = (4096, 256 * 1024, 4 * 1024 * 1024)
MICROBENCH_REPS = 3


# ---------------------------------------------------------------- the option
def parse_cap(value, what: str = "bucket_cap_mb"):
    """``"auto"`` (any case), a number of MiB >= 0, or None; else a clear error."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number of MiB or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of MiB or 'auto', got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of MiB >= 0 or 'auto', got {value!r}")
    return value


def resolve_cap(bucket_cap_mb, bucket_cap_mb_list, configured=None) -> tuple:
    """The constructor's ``bucket_cap_mb`` -> ``(cap or None, auto)``.

    Explicit arguments win; with neither ``bucket_cap_mb`` nor
    ``bucket_cap_mb_list``, ``configured`` (``fastddp.configure``'s value),
    else ``FASTDDP_BUCKET_CAP_MB`` (``auto`` or MiB)."""
    value = parse_cap(bucket_cap_mb)
    if value == "auto" and bucket_cap_mb_list:
        raise ValueError("fastddp: bucket_cap_mb='auto' and bucket_cap_mb_list were both given; "
                         "'auto' tunes the caps itself: pass one or the other")
    if value is None and not bucket_cap_mb_list:
        value = configured
        if value is None:
            env = os.environ.get("FASTDDP_BUCKET_CAP_MB", "").strip()
            value = parse_cap(env, "FASTDDP_BUCKET_CAP_MB") if env else None
    if value == "auto":
        return None, True
    return value, False


# ------------------------------------------------------------------ the model
def wire_bytes(spec: planner.Bucket, itemsize: int | None) -> int:
    return 0 if spec.sparse else spec.numel * (itemsize or spec.element_size)


def predict(plan: planner.BucketPlan, ready_s, alpha: float, beta: float, host_s: float,
            itemsize: int | None = None) -> float:
    """Exposed communication (s) of ``plan``: a serial-wire replay.

    ``ready_s[i]``: when parameter ``i``'s gradient was ready (same clock
    for all).  Buckets are issued in index order as each completes, each one
    delays the backward thread by ``host_s``; the wire carries one
    collective at a time: ``alpha + beta * bytes``.  Returns the time the
    last collective ends after the last gradient (plus the added host time)."""
    t_end = max(ready_s)
    delay = done = 0.0
    for b in plan.buckets:
        ready = max(ready_s[i] for i in b.param_indices) + delay
        delay += host_s
        done = max(ready, done) + alpha + beta * wire_bytes(b, itemsize)
    return max(done, t_end + delay) - t_end


@dataclass
class Layout:
    """One candidate: caps, its plan's shape, what the model and the steps said."""

    first_mb: float
    rest_mb: float
    config: planner.BucketConfig = field(repr=False)
    key: tuple = field(repr=False)
    buckets: int = 0
    predicted_s: float = float("nan")
    local: list = field(default_factory=list)      # this rank's step times (s), this trial
    local_exposed: list = field(default_factory=list)
    samples: list = field(default_factory=list)    # MAX over ranks, per step (s)
    exposed: list = field(default_factory=list)

    @property
    def cost(self) -> float:
        """The median of the faster half of the steps (noise only adds time)."""
        if not self.samples:
            return float("inf")
        fast = sorted(self.samples)[:(len(self.samples) + 1) // 2]
        return statistics.median(fast)

    @property
    def spread(self) -> float:
        """Relative robust spread of the steps: 1.4826 * MAD / median."""
        if len(self.samples) < 2:
            return 0.0
        med = statistics.median(self.samples)
        return 1.4826 * statistics.median(abs(x - med) for x in self.samples) / med if med > 0 else 0.0

    @property
    def is_default(self) -> bool:
        return self.config.uses_default_cap

    def torch_args(self) -> dict:
        """The fixed setting that gives these buckets."""
        if self.is_default:
            return {"bucket_cap_mb": None}
        if self.first_mb == self.rest_mb:
            return {"bucket_cap_mb": self.rest_mb}
        return {"bucket_cap_mb_list": [self.first_mb, self.rest_mb]}

    def label(self) -> str:
        return (f"first {_mb(self.first_mb)} / rest {_mb(self.rest_mb)} MiB "
                f"({self.buckets} bucket{'' if self.buckets == 1 else 's'})")

    def report(self) -> dict:
        return {"first_mb": self.first_mb, "rest_mb": self.rest_mb, "buckets": self.buckets,
                "torch_args": self.torch_args(),
                "predicted_exposed_ms": _ms(self.predicted_s),
                "measured_ms": _ms(self.cost) if self.samples else None,
                "step_ms": [_ms(t) for t in self.samples],
                "exposed_ms": [_ms(t) for t in self.exposed]}


def _mb(x: float) -> str:
    return f"{x:g}"


def _ms(t: float) -> float | None:
    return None if t is None or not math.isfinite(t) else round(t * 1e3, 3)


# ------------------------------------------------------------------ the tuner
_WAIT, _PROBE, _TRIAL, _SETTLED = "wait", "probe", "trial", "settled"


class Tuner:
    """Drives one reducer's bucket caps through the first steps (see module doc).

    The reducer calls :meth:`boundary` before every forward that
    synchronises (after the previous step's reduction), :meth:`on_ready` for
    each parameter marked ready while a probe is armed, :meth:`on_all_issued`
    and :meth:`on_finalized` in each reduced backward, :meth:`freeze`
    (join)."""

    def __init__(self, r):
        self.base = r.opts.bucket
        self.pg, self.world, self.rank = r.pg, r.world, r.rank
        self.device = r.device
        self.cuda = self.device.type == "cuda"
        self.state = _WAIT
        self.steps = 0                 # synchronising steps seen
        self.settled_at = None
        self.reason = ""
        self.layouts: list[Layout] = []
        self.order: list[Layout] = []  # measured, in trial order
        self.current: Layout | None = None
        self.best: Layout | None = None
        self.default: Layout | None = None
        self.model: dict = {}
        self.probing = False
        self.tie_rule = ""             # how _final_best chose among layouts within noise
        self._times: list = []
        self._open = None              # (t0 or event, steps_reduced at start)
        self._issued = self._end = None

    @property
    def active(self) -> bool:
        return self.state != _SETTLED

    # -- timing ------------------------------------------------------------
    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _span(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def on_ready(self, index: int) -> None:
        self._times[index] = self._now()

    def on_all_issued(self) -> None:
        if self._open is not None:
            self._issued = self._now()

    def on_finalized(self) -> None:
        if self._open is not None:
            self._end = self._now()

    def _close_step(self, r):
        """The step opened at the last boundary: (duration, exposed) or None
        when it did not end in exactly one reduction (a forward without
        backward, an error)."""
        opened, self._open = self._open, None
        issued, end, self._issued, self._end = self._issued, self._end, None, None
        if opened is None or end is None or issued is None or r.steps_reduced != opened[1] + 1:
            return None
        return self._span(opened[0], end), self._span(issued, end)

    # -- the state machine ---------------------------------------------------
    def boundary(self, r) -> bool:
        """Before a synchronising forward, on every rank at the same step.
        Returns True when the buckets were changed."""
        if self.state == _SETTLED:
            return False
        self.steps += 1
        step = self._close_step(r)
        changed = False
        if self.state == _WAIT:
            if (r.has_rebuilt_buckets or not self.base.should_rebuild) and r.steps_reduced >= 1:
                self._arm_probe(r)
        elif self.state == _PROBE:
            r.ready_probe = None
            if step is not None and self._probe_complete():
                self._build_model(r)
                self.state = _TRIAL
                changed = self._start(r, self.default)
            else:
                self._arm_probe(r)  # not a full step: probe the next one
        elif self.state == _TRIAL:
            if step is not None:
                self.current.local.append(step[0])
                self.current.local_exposed.append(step[1])
            if len(self.current.local) >= TRIAL_STEPS:
                self._reduce(self.current)
                if not self._more(self.current):
                    nxt = self._next()
                    changed = self._settle(r, self._final_best(), "") if nxt is None else self._start(r, nxt)
        if self.state != _SETTLED:
            self._open = (self._now(), r.steps_reduced)
        return changed

    def freeze(self, r, why: str) -> None:
        """Stop tuning now, without collectives (every rank calls it at the
        same step): the best layout measured so far, else the current one."""
        if self.state == _SETTLED:
            return
        r.ready_probe = None
        self._open = None
        pick = self.best or self.current
        if pick is None:
            self.state, self.settled_at = _SETTLED, self.steps
            self.reason = f"tuning stopped by {why} before any layout was measured: layout unchanged"
            self._log()
            return
        self._settle(r, pick, f"tuning stopped early by {why}; ")

    # -- probe and model -----------------------------------------------------
    def _arm_probe(self, r):
        self.state = _PROBE
        self._times = [None] * len(r.params)
        r.ready_probe = self.on_ready

    def _probe_complete(self) -> bool:
        return all(t is not None for t in self._times)

    def _build_model(self, r):
        times = self._times
        self._times = []
        if self.cuda:
            for t in times:
                t.synchronize()
            rel = [times[0].elapsed_time(t) / 1e3 for t in times]  # any event is a reference
        else:
            rel = list(times)
        t0 = min(rel)
        ready = torch.tensor([t - t0 for t in rel], dtype=torch.float64)
        alpha, beta = self._microbench(r)
        ready = self._max(ready)
        fused = r.fused_path
        wire = fused[1] if fused and fused[1] is not None else r.opts.reduce_dtype
        itemsize = wire.itemsize if wire is not None else None
        host = HOST_PER_BUCKET_S.get(self.device.type, HOST_PER_BUCKET_S["cpu"])
        self.model = {"alpha_us": round(alpha * 1e6, 2), "beta_gbps": round(1 / beta / 1e9, 3) if beta else None,
                      "backward_ms": round(float(ready.max()) * 1e3, 3), "host_per_bucket_us": host * 1e6,
                      "wire_itemsize": itemsize}
        ready = ready.tolist()
        seen: dict = {}
        for rest in REST_CAPS_MB:
            for first in sorted({rest, *(f for f in FIRST_CAPS_MB if f < rest)}):
                self._add(r, seen, first, rest, ready, alpha, beta, host, itemsize)
        self.default = self._add(r, seen, 1, planner.DEFAULT_BUCKET_CAP_MB, ready, alpha, beta, host,
                                 itemsize, default=True)

    def _add(self, r, seen, first, rest, ready, alpha, beta, host, itemsize, default=False):
        flags = dict(static_graph=self.base.static_graph, find_unused_parameters=self.base.find_unused_parameters,
                     set_last_bucket_as_small=self.base.set_last_bucket_as_small)
        if default:
            cfg = planner.BucketConfig(**flags)
        elif first == rest:
            cfg = planner.BucketConfig(bucket_cap_mb=rest, **flags)
        else:
            cfg = planner.BucketConfig(bucket_cap_mb_list=(first, rest), **flags)
        plan = r.plan_for(cfg)
        key = tuple(b.param_indices for b in plan.buckets)
        if key in seen:  # same buckets as a layout already listed (caps above the model's size)
            old = seen[key]
            if default and not old.is_default:  # torch's default names it
                old.first_mb, old.rest_mb, old.config = first, rest, cfg
            return old
        lay = Layout(first, rest, cfg, key, len(plan.buckets), predict(plan, ready, alpha, beta, host, itemsize))
        seen[key] = lay
        self.layouts.append(lay)
        return lay

    def _microbench(self, r) -> tuple[float, float]:
        """Latency and time per byte of this group's all-reduce: each size
        timed MICROBENCH_REPS times after one warm-up, MAX over ranks, min
        over reps, a least-squares line through the sizes."""
        total = sum(p.numel() * p.element_size() for p in r.params)
        sizes = sorted({min(s, max(total, 4096)) for s in MICROBENCH_BYTES})
        dtype = torch.float32
        buf = torch.zeros(max(sizes) // 4, dtype=dtype, device=self.device)
        out = []
        for s in sizes:
            t = buf[: s // 4]
            groups.all_reduce(t, self.pg)
            reps = []
            for _ in range(MICROBENCH_REPS):
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                groups.all_reduce(t, self.pg)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                reps.append(time.perf_counter() - t0)
            out.append(reps)
        times = self._max(torch.tensor(out, dtype=torch.float64)).min(dim=1).values.tolist()
        n = len(sizes)
        if n == 1:
            return times[0], 0.0
        mx, my = sum(sizes) / n, sum(times) / n
        var = sum((x - mx) ** 2 for x in sizes)
        beta = max(sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / var, 1e-13)
        alpha = max(my - beta * mx, 0.0)
        return alpha, beta

    def _max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        d = t.to(self.device)
        groups.all_reduce(d, self.pg, op=dist.ReduceOp.MAX)
        return d.cpu()

    # -- trials --------------------------------------------------------------
    def _start(self, r, lay: Layout) -> bool:
        self.current = lay
        lay.local, lay.local_exposed = [], []
        return r.set_bucket_config(lay.config)

    def _reduce(self, lay: Layout):
        k = TRIAL_STEPS
        vals = torch.tensor(lay.local[:k] + lay.local_exposed[:k], dtype=torch.float64)
        vals = self._max(vals).tolist()
        lay.samples += vals[:k]
        lay.exposed += vals[k:]
        lay.local, lay.local_exposed = [], []
        if lay not in self.order:
            self.order.append(lay)
        if self.best is lay:  # measured again: is it still the best?
            self.best = min(self.order, key=lambda l: l.cost)
        elif self.best is None or lay.cost < self.best.cost - self.noise(self.best, lay):
            self.best = lay

    def _more(self, lay: Layout) -> bool:
        """Measure ``lay`` TRIAL_STEPS more steps?  From MAX-reduced samples
        only, so every rank decides the same."""
        return len(lay.samples) < MAX_TRIAL_STEPS and lay.spread > SPREAD_OK and not self._spent()

    def _spent(self) -> bool:
        return sum(len(l.samples) for l in self.order) >= MAX_TUNING_STEPS

    def _final_best(self) -> Layout:
        """The best once every trial is in: the fastest layout measured, if
        it beats the incumbent by the noise as known now (the spread pooled
        over all trials, each layout's own step count).  Else the trials
        could not separate the incumbent from the layouts measured within its
        noise, and on the CPU the link decides among those ties
        (:meth:`_by_link`); on CUDA the incumbent stays."""
        self.tie_rule = ""
        low = min(self.order, key=lambda l: l.cost)
        if low is not self.best and low.cost < self.best.cost - self.noise(self.best, low):
            self.best = low
            return self.best
        if self.device.type == "cpu":
            ties = [l for l in self.order if l is self.best or l.cost < self.best.cost + self.noise(self.best, l)]
            self.best = self._by_link(ties)
        return self.best

    def _copy_speed(self) -> bool:
        """CPU ranks on a link at copy speed (the microbenchmark at
        COPY_SPEED_GBPS or more; None: no size dependence measured, a tiny
        model): a collective costs CPU time there, and the model, which
        assumes communication overlaps backward, favours too many buckets,
        so the fewest-buckets layout is tried third, after torch's default
        and the model's best (unless the calibrated model prunes it)."""
        gbps = self.model.get("beta_gbps")
        return self.device.type == "cpu" and (gbps is None or gbps >= COPY_SPEED_GBPS)

    def _by_link(self, ties: list) -> Layout:
        """Among layouts the steps cannot tell apart (CPU ranks: steps spread
        15-25% step to step on a 2-core VM, so 30 tuning steps cannot resolve
        3-7%), what the link says: at copy speed (the all-reduce microbenchmark
        at COPY_SPEED_GBPS or more: shared memory, loopback) a collective costs
        CPU time that ranks sharing the cores cannot overlap, so the fewest
        buckets (measured: one bucket 3-5% faster than torch's default on
        ``small`` and the transformer locally); on a slower wire, overlap pays
        and the model's pick (``small`` at 1 Gbit/s: 0.5-1 MiB buckets 7%
        faster than the default)."""
        gbps = self.model.get("beta_gbps")
        rate = "unmeasured" if gbps is None else f"{gbps:g} GB/s"
        if self._copy_speed():
            pick = min(ties, key=lambda l: (l.buckets, l.cost))
            rule = f"the link runs at copy speed ({rate}): the fewest buckets"
        else:
            pick = min(ties, key=lambda l: (l.predicted_s, l.cost))
            rule = f"the link is a wire ({rate}): the model's pick"
        if len(ties) > 1:
            self.tie_rule = f"{len(ties)} layouts within noise of each other; {rule}"
        return pick

    def noise(self, ref: Layout, other: Layout | None = None) -> float:
        """What a difference of the costs of ``ref`` and ``other`` must exceed:
        1% of ``ref``'s cost, or twice the pooled robust spread of the steps
        times sqrt(1/n_ref + 1/n_other), the samples each was measured on
        (TRIAL_STEPS for a layout not given).  A layout measured longer
        because its steps spread (up to MAX_TRIAL_STEPS) is known better: with
        the count fixed at TRIAL_STEPS a 10% gain measured on 9 steps each was
        kept out as noise (``small`` at 1 Gbit/s, 1.067x the best cap)."""
        dev = [abs(s - l.cost) for l in self.order for s in l.samples]
        spread = 1.4826 * statistics.median(dev) if dev else 0.0
        n_ref = max(len(ref.samples), 1)
        n_other = max(len(other.samples), 1) if other is not None else TRIAL_STEPS
        return max(REL_NOISE * ref.cost, 2 * spread * math.sqrt(1 / n_ref + 1 / n_other))

    def _calibrated(self, lay: Layout) -> float:
        """The model's prediction on the measured scale, optimistically: +
        the smallest (measured - predicted) seen.  It only prunes, so it errs
        towards trying: with the median, one layout the model misjudged badly
        (predicted fastest, measured 25% slower) pulled every prediction up
        and pruned the true best unseen."""
        base = min(l.cost - l.predicted_s for l in self.order)
        return base + lay.predicted_s

    def _next(self) -> Layout | None:
        measured = {id(l) for l in self.order}
        if len(self.order) >= MAX_LAYOUTS or self._spent():
            return None
        if len(self.order) <= 2:  # after torch's default: the model's best, then (copy speed) the fewest buckets
            early = [min(self.layouts, key=lambda l: l.predicted_s)]
            if self._copy_speed() and len(self.order) == 2:  # unless the calibrated model knows it to be bad
                fewest = min(self.layouts, key=lambda l: (l.buckets, l.predicted_s))
                if self._calibrated(fewest) <= self.best.cost * (1 + PRUNE):
                    early.append(fewest)
            for lay in early:
                if id(lay) not in measured:
                    return lay
        best = self.best
        limit = best.cost * (1 + PRUNE)
        # neighbours of the best: the next rest caps either side (the model's
        # best first cap for each), and the best rest cap's other first caps
        rests = sorted({l.rest_mb for l in self.layouts})
        k = rests.index(best.rest_mb) if best.rest_mb in rests else 0
        near = [l for l in self.layouts if l.rest_mb == best.rest_mb]
        for j in (k - 1, k + 1):
            if 0 <= j < len(rests):
                same = [l for l in self.layouts if l.rest_mb == rests[j]]
                near.append(min(same, key=lambda l: l.predicted_s))
        todo = [l for l in near if id(l) not in measured and self._calibrated(l) <= limit]
        # a direction already measured worse than the best: do not walk on
        for l in self.order:
            if l is not best and l.cost >= best.cost:
                todo = [t for t in todo if not _beyond(t, l, best)]
        return min(todo, key=self._calibrated) if todo else None

    def _settle(self, r, pick: Layout, why: str) -> bool:
        changed = pick is not self.current and r.set_bucket_config(pick.config)
        self.current = pick
        self.state, self.settled_at = _SETTLED, self.steps
        r.ready_probe = None
        self._open = None
        d = self.default
        base = (f"; torch's default (first 1 / rest 25 MiB) {d.cost * 1e3:.2f} ms"
                if d is not None and d.samples and pick is not d else "")
        noise = self.noise(pick) if pick.samples else float("nan")
        tail = (f"gain within noise, chosen by the link: {self.tie_rule}" if self.tie_rule and pick is not d else
                "gain within noise: kept torch's default layout" if pick is d and len(self.order) > 1 else
                "best measured")
        self.reason = (f"{why}chose {pick.label()}: {pick.cost * 1e3:.2f} ms per step "
                       f"(forward to gradients reduced, median of the faster half of "
                       f"{len(pick.samples)}, max over ranks){base}; "
                       f"noise +-{noise * 1e3:.2f} ms; {tail}; {len(self.order)} layouts in "
                       f"{sum(len(l.samples) for l in self.order)} steps; model: latency "
                       f"{self.model.get('alpha_us')} us, {self.model.get('beta_gbps')} GB/s, backward "
                       f"{self.model.get('backward_ms')} ms; equivalent fixed setting {pick.torch_args()}")
        self._log()
        return changed

    def _log(self):
        if self.rank == 0:
            log.info("fastddp bucket_cap_mb='auto': %s", self.reason)

    def report(self) -> dict:
        chosen = self.current if self.state == _SETTLED else None
        return {"state": self.state, "steps": self.steps, "settled_at_step": self.settled_at,
                "chosen": chosen.report() if chosen is not None else None,
                "current": self.current.report() if self.current is not None else None,
                "tried": [l.report() for l in self.order],
                "candidates": len(self.layouts), "model": dict(self.model), "reason": self.reason}


def _beyond(t: Layout, worse: Layout, best: Layout) -> bool:
    """``t`` lies past ``worse`` as seen from ``best`` on the rest-cap axis."""
    if worse.rest_mb == best.rest_mb:
        return False
    if worse.rest_mb > best.rest_mb:
        return t.rest_mb > worse.rest_mb
    return t.rest_mb < worse.rest_mb
