"""The tuner a reducer owns: it measures steps and collectives, MAX-reduces
them over the ranks, feeds :class:`~fastddp.autotune.search.Search` and
installs its pick; the reducer is reached only through :class:`TunerHost`.

One tuning step, as the reducer calls in::

    boundary()        before a synchronising forward: close the last step,
                      decide (probe -> model -> trial -> settled), open the next
    on_ready(i)       each ready mark, while wants_ready_marks (the probe)
    on_all_issued()   the last bucket's collective is issued
    on_finalized()    every gradient is reduced
    freeze(why)       join(): stop now, without collectives
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import groups, planner
from .model import HOST_PER_BUCKET_S, Candidate, candidates, line_fit, predict
from .phase import Phase
from .search import TRIAL_STEPS, Search

__all__ = ["MICROBENCH_BYTES", "MICROBENCH_REPS", "Tuner", "TunerHost"]

log = logging.getLogger("fastddp.autotune")

MICROBENCH_BYTES = (4096, 256 * 1024, 4 * 1024 * 1024)
"""Sizes of the timed all-reduces (capped at the model's size) that fit latency and bandwidth."""
MICROBENCH_REPS = 3

_WAIT, _PROBE, _TRIAL, _SETTLED = Phase.WAITING, Phase.PROBE, Phase.TRIAL, Phase.SETTLED


class TunerHost(Protocol):
    """What the tuner reads of its reducer, and the two things it may ask of it."""

    params: Sequence[torch.Tensor]
    pg: Any
    world: int
    rank: int
    device: torch.device
    base_config: planner.BucketConfig
    """The bucket config the module was built with (its flags carry into every layout)."""
    steps_reduced: int
    """Backwards reduced so far (a step that did not end in one reduction is not measured)."""
    has_rebuilt_buckets: bool
    """torch's one rebuild in the ready order has happened."""
    wire_itemsize: int | None
    """Element size of the dense buckets' wire (a fused 16-bit hook: 2); None: the params' own."""
    mode_measuring: bool
    """The dense buckets' mode is timing steps of its own (auto_precision_hook's
    trial): the tuner waits, so that each measures one change at a time."""
    mode_epoch: int
    """The mode's :attr:`~fastddp.reduction.Reduction.layout_epoch`: when it
    moves (another wire format), a settled tuner tunes again."""

    def plan_for(self, config: planner.BucketConfig) -> planner.BucketPlan:
        """The buckets torch's rebuild makes with ``config``."""

    def set_bucket_config(self, config: planner.BucketConfig) -> bool:
        """Install ``config``'s buckets between steps; False when the buckets stay the same."""


class Tuner:
    """Drives one reducer's bucket caps through the first steps (see :mod:`fastddp.autotune`)."""

    def __init__(self, host: TunerHost):
        self.host = host
        self.base = host.base_config
        self.pg, self.world, self.rank = host.pg, host.world, host.rank
        self.device = host.device
        self.cuda = self.device.type == "cuda"
        self.state = _WAIT
        self.steps = 0                 # synchronising steps seen
        self.settled_at = None
        self.reason = ""
        self.search: Search | None = None  # from the probe's model on
        self.current: Candidate | None = None
        self.model: dict = {}
        self._times: list = []
        self._local: list = []         # this rank's step times (s) of the current round
        self._local_exposed: list = []
        self._open = None              # (t0 or event, steps_reduced at start)
        self._issued = self._end = None
        self.tuned_for = host.mode_epoch  # the mode's wire the layout is tuned for
        self.retunes = 0

    @property
    def active(self) -> bool:
        return self.state != _SETTLED or self.host.mode_epoch != self.tuned_for

    @property
    def wants_ready_marks(self) -> bool:
        """Every parameter's ready time is wanted (the probe step): the
        reducer routes its ready marks to :meth:`on_ready`."""
        return self.state == _PROBE

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
        if self.state == _PROBE:  # a mark routed at arming may arrive after the probe ended
            self._times[index] = self._now()

    def on_all_issued(self) -> None:
        if self._open is not None:
            self._issued = self._now()

    def on_finalized(self) -> None:
        if self._open is not None:
            self._end = self._now()

    def _close_step(self):
        """The step opened at the last boundary: (duration, exposed) or None
        when it did not end in exactly one reduction (a forward without
        backward, an error)."""
        opened, self._open = self._open, None
        issued, end, self._issued, self._end = self._issued, self._end, None, None
        if opened is None or end is None or issued is None or self.host.steps_reduced != opened[1] + 1:
            return None
        return self._span(opened[0], end), self._span(issued, end)

    # -- the state machine ---------------------------------------------------
    def boundary(self) -> bool:
        """Before a synchronising forward, on every rank at the same step.
        Returns True when the buckets were changed."""
        if self.state == _SETTLED:
            if self.host.mode_epoch == self.tuned_for:
                return False
            self._again()
        self.steps += 1
        step = self._close_step()
        changed = False
        host = self.host
        if self.state == _WAIT:
            if ((host.has_rebuilt_buckets or not self.base.should_rebuild) and host.steps_reduced >= 1
                    and not host.mode_measuring):
                self._arm_probe()
        elif self.state == _PROBE:
            if step is not None and self._probe_complete():
                self._build_model()
                self.state = _TRIAL
                changed = self._start(self.search.default)
            else:
                self._arm_probe()  # not a full step: probe the next one
        elif self.state == _TRIAL:
            if step is not None:
                self._local.append(step[0])
                self._local_exposed.append(step[1])
            if len(self._local) >= TRIAL_STEPS:
                self._reduce()
                if not self.search.wants_more(self.current):
                    nxt = self.search.next()
                    changed = self._settle(self.search.final_best(), "") if nxt is None else self._start(nxt)
        if self.state != _SETTLED:
            self._open = (self._now(), host.steps_reduced)
        return changed

    def freeze(self, why: str) -> None:
        """Stop tuning now, without collectives (every rank calls it at the
        same step): the best layout measured so far, else the current one."""
        self.tuned_for = self.host.mode_epoch  # no tuning again either
        if self.state == _SETTLED:
            return
        self._open = None
        pick = None if self.search is None else self.search.best or self.current
        if pick is None:  # (a tuning again keeps the layout it had)
            self.state, self.settled_at = _SETTLED, self.steps
            self.reason = f"tuning stopped by {why} before any layout was measured: layout unchanged"
            self._log()
            return
        self._settle(pick, f"tuning stopped early by {why}; ")

    def _again(self) -> None:
        """The mode's wire changed (a re-measure chose another format): tune
        again from the start, for it (bounded by the mode's re-measures)."""
        self.tuned_for = self.host.mode_epoch
        self.retunes += 1
        self.state, self.settled_at, self.search, self.model = _WAIT, None, None, {}
        self._local, self._local_exposed, self._open = [], [], None
        if self.rank == 0:
            log.info("fastddp bucket_cap_mb='auto': the wire format changed; tuning the layout again")

    # -- probe and model -----------------------------------------------------
    def _arm_probe(self):
        self.state = _PROBE
        self._times = [None] * len(self.host.params)

    def _probe_complete(self) -> bool:
        return all(t is not None for t in self._times)

    def _build_model(self):
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
        alpha, beta = self._microbench()
        ready = self._max(ready)
        itemsize = self.host.wire_itemsize
        host_s = HOST_PER_BUCKET_S.get(self.device.type, HOST_PER_BUCKET_S["cpu"])
        self.model = {"alpha_us": round(alpha * 1e6, 2), "beta_gbps": round(1 / beta / 1e9, 3) if beta else None,
                      "backward_ms": round(float(ready.max()) * 1e3, 3), "host_per_bucket_us": host_s * 1e6,
                      "wire_itemsize": itemsize}
        ready = ready.tolist()
        layouts, default = candidates(self.base, self.host.plan_for,
                                      lambda plan: predict(plan, ready, alpha, beta, host_s, itemsize))
        self.search = Search(layouts, default, cpu=self.device.type == "cpu", link_gbps=self.model["beta_gbps"])

    def _microbench(self) -> tuple[float, float]:
        """Latency and time per byte of this group's all-reduce: each size
        timed MICROBENCH_REPS times after one warm-up, MAX over ranks, min
        over reps, a least-squares line through the sizes."""
        total = sum(p.numel() * p.element_size() for p in self.host.params)
        sizes = sorted({min(s, max(total, 4096)) for s in MICROBENCH_BYTES})
        buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=self.device)
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
        _, beta, _ = line_fit(sizes, times)
        beta = max(beta, 1e-13)
        alpha = max(sum(times) / n - beta * sum(sizes) / n, 0.0)
        return alpha, beta

    def _max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        d = t.to(self.device)
        groups.all_reduce(d, self.pg, op=dist.ReduceOp.MAX)
        return d.cpu()

    # -- trials --------------------------------------------------------------
    def _start(self, lay: Candidate) -> bool:
        self.current = lay
        self._local, self._local_exposed = [], []
        return self.host.set_bucket_config(lay.config)

    def _reduce(self):
        """The round's steps MAX-reduced over the ranks, into the search."""
        k = TRIAL_STEPS
        vals = torch.tensor(self._local[:k] + self._local_exposed[:k], dtype=torch.float64)
        vals = self._max(vals).tolist()
        self._local, self._local_exposed = [], []
        self.search.record(self.current, vals[:k], vals[k:])

    def _settle(self, pick: Candidate, why: str) -> bool:
        changed = pick is not self.current and self.host.set_bucket_config(pick.config)
        self.current = pick
        self.state, self.settled_at = _SETTLED, self.steps
        self._open = None
        self.reason = why + self._explain(pick)
        self._log()
        return changed

    def _explain(self, pick: Candidate) -> str:
        s = self.search
        d = s.default
        base = (f"; torch's default (first 1 / rest 25 MiB) {d.cost * 1e3:.2f} ms"
                if d.samples and pick is not d else "")
        noise = s.noise(pick) if pick.samples else float("nan")
        tail = (f"gain within noise, chosen by the link: {s.tie_rule}" if s.tie_rule and pick is not d else
                "gain within noise: kept torch's default layout" + (f" ({s.tie_rule})" if s.tie_rule else "")
                if pick is d and len(s.order) > 1 else
                "best measured")
        return (f"chose {pick.label()}: {pick.cost * 1e3:.2f} ms per step "
                f"(forward to gradients reduced, median of the faster half of "
                f"{len(pick.samples)}, max over ranks){base}; "
                f"noise +-{noise * 1e3:.2f} ms; {tail}; {len(s.order)} layouts in "
                f"{s.steps} steps; model: latency "
                f"{self.model.get('alpha_us')} us, {self.model.get('beta_gbps')} GB/s, backward "
                f"{self.model.get('backward_ms')} ms; equivalent fixed setting {pick.torch_args()}")

    def _log(self):
        if self.rank == 0:
            log.info("fastddp bucket_cap_mb='auto': %s", self.reason)

    def report(self) -> dict:
        chosen = self.current if self.state == _SETTLED else None
        s = self.search
        pending = self.state == _SETTLED and self.active  # tuning again from the next step
        state = _WAIT if pending else self.state
        return {"state": state.value, "measuring": state.measuring, "steps": self.steps,
                "settled_at_step": self.settled_at,
                "retunes": self.retunes,
                "chosen": chosen.report() if chosen is not None else None,
                "current": self.current.report() if self.current is not None else None,
                "tried": [l.report() for l in s.order] if s is not None else [],
                "candidates": len(s.layouts) if s is not None else 0,
                "model": dict(self.model), "reason": self.reason}
