"""The cost model and the candidates: pure (no process group, no clock).

A candidate :class:`Candidate` is the buckets torch's rebuild makes with one
pair of caps; :func:`predict` prices its exposed communication from a ready
timeline and a latency / bandwidth line; :func:`candidates` lists the grid."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import planner

__all__ = ["FIRST_CAPS_MB", "HOST_PER_BUCKET_S", "Candidate", "REST_CAPS_MB", "candidates", "line_fit", "predict",
           "wire_bytes"]

REST_CAPS_MB = (0.5, 1, 2, 5, 10, 25, 50, 100)
"""The rest-cap grid (MiB); torch's default is 25."""
FIRST_CAPS_MB = (0.25, 1)
"""First-cap candidates besides ``first == rest`` (torch's default first bucket is 1 MiB)."""
HOST_PER_BUCKET_S = {"cpu": 30e-6, "cuda": 10e-6}
"""Host cost of one more bucket on the backward thread (pack + issue), for the model."""


def wire_bytes(spec: planner.BucketSpec, itemsize: int | None) -> int:
    """Bytes bucket ``spec`` puts on the wire (``itemsize`` None: its params' element size)."""
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


def line_fit(xs, ys, weights=None) -> tuple[float, float, float]:
    """The least-squares line ``y = a + b x`` through the points, each with
    its weight (1 where None): ``(a, b, sxx)``, ``sxx`` the weighted sum of
    squared deviations of ``xs`` (what a slope's standard error divides by).
    Needs two distinct ``xs``.  The tuner fits the link's latency and time
    per byte with it, and the per-bucket cost the model misses."""
    w = [1] * len(xs) if weights is None else list(weights)
    n = sum(w)
    mx = sum(x * k for x, k in zip(xs, w)) / n
    my = sum(y * k for y, k in zip(ys, w)) / n
    sxx = sum(k * (x - mx) ** 2 for x, k in zip(xs, w))
    b = sum(k * (x - mx) * (y - my) for x, y, k in zip(xs, ys, w)) / sxx
    return my - b * mx, b, sxx


@dataclass
class Candidate:
    """One candidate: caps, its plan's shape, what the model and the steps said."""

    first_mb: float
    rest_mb: float
    config: planner.BucketConfig = field(repr=False)
    key: tuple = field(repr=False)
    buckets: int = 0
    predicted_s: float = float("nan")
    samples: list = field(default_factory=list)    # step times (s), MAX over ranks, per step
    exposed: list = field(default_factory=list)    # last bucket issued -> all reduced (s), ditto

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
                "predicted_exposed_ms": ms(self.predicted_s),
                "measured_ms": ms(self.cost) if self.samples else None,
                "step_ms": [ms(t) for t in self.samples],
                "exposed_ms": [ms(t) for t in self.exposed]}


def candidates(base: planner.BucketConfig, plan_for: Callable[[planner.BucketConfig], planner.BucketPlan],
               price: Callable[[planner.BucketPlan], float]) -> tuple[list[Candidate], Candidate]:
    """The grid's layouts, one per distinct set of buckets, and torch's default among them.

    Every (first, rest) pair of :data:`REST_CAPS_MB` x (``rest`` and the
    :data:`FIRST_CAPS_MB` below it), with ``base``'s flags (static_graph,
    find_unused_parameters, set_last_bucket_as_small); ``plan_for`` gives a
    config's buckets, ``price`` a plan's predicted exposed time.  Caps that
    give the same buckets are one layout, named by the first pair listed,
    except that torch's default (first 1 / rest 25 MiB) names the layout it
    falls on."""
    flags = dict(static_graph=base.static_graph, find_unused_parameters=base.find_unused_parameters,
                 set_last_bucket_as_small=base.set_last_bucket_as_small)
    seen: dict = {}
    layouts: list[Candidate] = []

    def add(first, rest, default=False) -> Candidate:
        if default:
            cfg = planner.BucketConfig(**flags)
        elif first == rest:
            cfg = planner.BucketConfig(bucket_cap_mb=rest, **flags)
        else:
            cfg = planner.BucketConfig(bucket_cap_mb_list=(first, rest), **flags)
        plan = plan_for(cfg)
        key = tuple(b.param_indices for b in plan.buckets)
        if key in seen:  # same buckets as a layout already listed (caps above the model's size)
            old = seen[key]
            if default and not old.is_default:  # torch's default names it
                old.first_mb, old.rest_mb, old.config = first, rest, cfg
            return old
        lay = Candidate(first, rest, cfg, key, len(plan.buckets), price(plan))
        seen[key] = lay
        layouts.append(lay)
        return lay

    for rest in REST_CAPS_MB:
        for first in sorted({rest, *(f for f in FIRST_CAPS_MB if f < rest)}):
            add(first, rest)
    default = add(1, planner.DEFAULT_BUCKET_CAP_MB, default=True)
    return layouts, default


def _mb(x: float) -> str:
    return f"{x:g}"


def ms(t: float | None) -> float | None:
    """Seconds -> milliseconds rounded for a report; None where not finite."""
    return None if t is None or not math.isfinite(t) else round(t * 1e3, 3)
