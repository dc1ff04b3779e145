"""The bucket layout and its changes, as an object the reducer holds: the
initial plan, torch's one rebuild in rank 0's ready order, and
``bucket_cap_mb="auto"``'s caps.  It is the bucket tuner's host
(:class:`fastddp.autotune.driver.TunerHost`: ``plan_for``,
``set_bucket_config``, ...): the tuner talks to it, not to the reducer."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import autotune, groups, planner
from ..buckets import Bucket

__all__ = ["BucketPlans"]


class BucketPlans:
    """A reducer's buckets: its plan, the buckets built from it, which bucket
    each parameter counts down, the one rebuild, the caps (``opts``: the
    reducer's options, replaced when the caps change) and the tuner.
    Installing a plan gives every bucket its mode and moves per-parameter
    state (error-feedback residuals, bucket views) into the new buckets.

    What it is handed, each explicit: the parameters and their sparsity, the
    group and device, the step context (``ctx``), the hooks (``arming``),
    readiness (``ready``: rank 0's ready order), the health flags, ``modes()``
    (the dense and sparse modes now), ``quiesce()`` (the reducer's
    ``ensure_prior_reduction_finished``) and ``steps()`` (steps reduced)."""

    def __init__(self, params, sparse, opts, pg, device, *, ctx, arming, ready, health,
                 modes: Callable[[], tuple], quiesce: Callable[[], None], steps: Callable[[], int]):
        self.params, self.sparse, self.opts, self.pg, self.device = params, sparse, opts, pg, device
        self.world, self.rank = groups.size(pg), groups.rank(pg)
        self.ctx, self.arming, self.ready, self.health = ctx, arming, ready, health
        self._modes, self._quiesce, self._steps = modes, quiesce, steps
        self.plan: planner.BucketPlan | None = None
        self.buckets: list[Bucket] = []
        self.bucket_of: list[Bucket] = []  # by parameter index
        self.rebuild_order: list[int] | None = None  # rank 0's ready order of the one rebuild
        self.has_rebuilt_buckets = False
        self.forward_syncs = False  # the forward before the next rebuild_buckets() synchronises
        self._install(planner.initial_plan(params, opts.bucket, sparse))
        self.tuner = autotune.Tuner(self) if opts.auto_bucket_cap else None

    # ------------------------------------------------- the tuner's host
    base_config = property(lambda self: self.opts.bucket, doc="The bucket caps now.")
    steps_reduced = property(lambda self: self._steps())
    mode_measuring = property(lambda self: self._modes()[0].measuring, doc="The mode times steps.")
    mode_epoch = property(lambda self: self._modes()[0].layout_epoch, doc="The mode's wire changed.")
    tuning_active = property(lambda self: self.tuner is not None and self.tuner.active,
                             doc='bucket_cap_mb="auto" is still trying layouts.')

    @property
    def wire_itemsize(self) -> int | None:
        """Bytes per element on the wire where the mode or mixed precision fixes it."""
        d = self._modes()[0]
        dtype = d.wire_dtype if d.fused and d.wire_dtype is not None else self.opts.reduce_dtype
        return None if dtype is None else dtype.itemsize

    def plan_for(self, config: planner.BucketConfig) -> planner.BucketPlan:
        """The plan torch's rebuild makes with ``config`` (the one ready order, else the initial plan)."""
        if self.rebuild_order is None:
            return planner.initial_plan(self.params, config, self.sparse)
        return planner.rebuilt_plan(self.params, self.rebuild_order, config, self.sparse)

    def set_bucket_config(self, config: planner.BucketConfig) -> bool:
        """New caps between steps (``bucket_cap_mb="auto"``): the buckets
        torch's rebuild makes with them; False when the buckets stay the same."""
        self._quiesce()
        if self.ready.expect_hooks and any(b.work is not None for b in self.buckets):
            raise RuntimeError("fastddp internal error: bucket caps changed while buckets are in flight")
        plan = self.plan_for(config)
        self.opts = dataclasses.replace(self.opts, bucket=config)
        if [b.param_indices for b in plan.buckets] == [b.param_indices for b in self.plan.buckets]:
            return False
        self._install(plan)
        return True

    # ------------------------------------------------------------ plans
    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameter indices, in bucket order."""
        return [list(b.param_indices) for b in self.plan.buckets]

    def bucket_sizes(self) -> list[int]:  # bytes of each bucket (sparse: of its last gradient)
        return [b.nbytes() for b in self.buckets]

    def error_feedback_residual(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s error-feedback residual (compressed modes), shaped like its bucket slot."""
        b, pos = self.plan.locate(index)
        res = self._modes()[0].residual_of(b)
        return None if res is None else self.buckets[b].layout.views(res)[pos]

    def give_modes(self) -> None:
        """The modes changed (a comm hook): every bucket gets its new one."""
        dense, sparse = self._modes()
        for b in self.buckets:
            b.reduction = sparse if b.sparse else dense

    def _install(self, plan: planner.BucketPlan) -> None:
        old, old_plan = self.buckets, self.plan
        self.plan = plan
        self.buckets = [Bucket(spec, self.params, None if spec.sparse else self.opts.reduce_dtype)
                        for spec in plan.buckets]
        self.give_modes()
        if self.health is not None:
            self.health.install(self.buckets)
        self.bucket_of = [self.buckets[plan.locate(i)[0]] for i in range(len(self.params))]
        self.ctx.num_buckets = len(self.buckets)
        self.ctx.native = self.arming.set_buckets([b.index for b in self.bucket_of], self.buckets)
        if not old:
            return
        old_locate = [(old[bi], pos) for bi, pos in map(old_plan.locate, range(len(self.params)))]
        self._modes()[0].carry_over(old, old_locate, self.buckets)
        if self.opts.gradient_as_bucket_view:
            for b in self.buckets:
                b.adopt_grads()

    def should_rebuild(self) -> bool:
        return self.opts.bucket.should_rebuild and not self.has_rebuilt_buckets

    def rebuild_buckets(self) -> bool:
        """Before a forward: rebuild once, in rank 0's ready order (torch's
        rule); with ``bucket_cap_mb="auto"``, the tuner's step boundary; then
        the mode's decisions (the step's one decision point)."""
        rebuilt = self._rebuild_once()
        syncs, self.forward_syncs = self.forward_syncs, False
        tuning = self.tuning_active
        if tuning and syncs:
            rebuilt = self.tuner.boundary() or rebuilt
            tuning = self.tuning_active
        ctx = self.ctx
        ctx.rebuilt = not self.should_rebuild()
        ctx.layout_settled = ctx.rebuilt and not tuning
        if syncs:
            self._modes()[0].boundary(ctx)  # after the tuner's
        return rebuilt

    def tune_for_mode(self) -> None:
        """A mode that tunes buckets (auto precision) turns bucket_cap_mb="auto"
        on where the caps are torch's default; a hook that replaces it (a user's
        hook over the configured auto precision) turns that off again."""
        opts = self.opts
        wants = self._modes()[0].tunes_buckets and opts.default_caps
        if wants and self.tuner is None:
            self.opts = dataclasses.replace(opts, auto_bucket_cap=True)
            self.tuner = autotune.Tuner(self)
        elif not wants and opts.default_caps and self.tuner is not None:
            self.opts = dataclasses.replace(opts, auto_bucket_cap=False)
            self.tuner = None

    def freeze_tuning(self, why: str) -> None:
        """End ``bucket_cap_mb="auto"``'s tuning and the mode's own measuring now (join): no collectives."""
        if self.tuner is not None:
            self.tuner.freeze(why)
        self._modes()[0].freeze(why)

    def _rebuild_once(self) -> bool:
        self._quiesce()
        if self.has_rebuilt_buckets or not self.ready.ready_order or not self.should_rebuild():
            return False
        order = self.ready.ready_order
        self.ready.ready_order = []
        if len(order) != len(self.params):
            return False  # an unfinished iteration (its error was caught): learn it again
        t = torch.tensor(order, dtype=torch.int64, device=self.device)
        groups.broadcast(t, self.pg, src=0)
        self.rebuild_order = t.tolist()
        self._install(planner.rebuilt_plan(self.params, self.rebuild_order, self.opts.bucket, self.sparse))
        self.has_rebuilt_buckets = True
        return True

    def push_all_rebuilt_params(self) -> None:
        """torch's _push_all_rebuilt_params: a joined rank takes part in the rebuild."""
        if self.should_rebuild() and not self.ready.ready_order:
            self.ready.ready_order = list(range(len(self.params)))
