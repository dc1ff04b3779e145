"""The bucket layout and its changes: the initial plan, torch's one rebuild
in rank 0's ready order, and ``bucket_cap_mb="auto"``'s caps (the bucket
tuner's host interface: ``plan_for``, ``set_bucket_config``, ...)."""

from __future__ import annotations

import dataclasses

import torch

from .. import autotune, groups, planner
from ..buckets import Bucket

__all__ = ["BucketPlans"]


class BucketPlans:
    """The :class:`~fastddp.reducer.Reducer`'s buckets: its plan, the buckets
    built from it, which bucket each parameter counts down, the one rebuild.
    Installing a plan gives every bucket its mode and moves per-parameter
    state (error-feedback residuals, bucket views) into the new buckets."""

    plan: planner.BucketPlan
    rebuild_order: list[int] | None = None  # rank 0's ready order of the one rebuild
    _has_rebuilt = False

    num_buckets = property(lambda self: len(self._buckets))
    buckets = property(lambda self: tuple(self._buckets))
    has_rebuilt_buckets = property(lambda self: self._has_rebuilt)
    tuning_active = property(lambda self: self.tuner is not None and self.tuner.active,
                             doc='bucket_cap_mb="auto" is still trying layouts.')
    base_config = property(lambda self: self.opts.bucket, doc="The bucket caps now (the tuner's host).")
    mode_measuring = property(lambda self: self._dense.measuring, doc="The tuner's host: the mode times steps.")
    mode_epoch = property(lambda self: self._dense.layout_epoch, doc="The tuner's host: the mode's wire changed.")

    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameter indices, in bucket order."""
        return [list(b.param_indices) for b in self.plan.buckets]

    def bucket_sizes(self) -> list[int]:  # bytes of each bucket (sparse: of its last gradient)
        return [b.nbytes() for b in self._buckets]

    # ------------------------------------------------------------------ plan
    def _install_plan(self, plan: planner.BucketPlan) -> None:
        old, old_plan = self._buckets, getattr(self, "plan", None)
        self.plan = plan
        self._buckets = [Bucket(spec, self.params, None if spec.sparse else self.opts.reduce_dtype)
                         for spec in plan.buckets]
        for b in self._buckets:
            b.reduction = self._sparse_mode if b.sparse else self._dense
        if self.health is not None:
            self.health.install(self._buckets)
        self._bucket_of = [self._buckets[plan.locate(i)[0]] for i in range(len(self.params))]
        self.ctx.num_buckets = len(self._buckets)
        self.ctx.native = self.arming.set_buckets([b.index for b in self._bucket_of], self._buckets)
        if not old:
            return
        old_locate = [(old[bi], pos) for bi, pos in map(old_plan.locate, range(len(self.params)))]
        self._dense.carry_over(old, old_locate, self._buckets)
        if self.opts.gradient_as_bucket_view:
            for b in self._buckets:
                b.adopt_grads()

    def _should_rebuild(self) -> bool:
        return self.opts.bucket.should_rebuild and not self._has_rebuilt

    def rebuild_buckets(self) -> bool:
        """Before a forward: rebuild once, in rank 0's ready order (torch's
        rule); with ``bucket_cap_mb="auto"``, the tuner's step boundary."""
        rebuilt = self._rebuild_once()
        syncs, self._forward_syncs = self._forward_syncs, False
        if self.tuning_active and syncs:
            rebuilt = self.tuner.boundary() or rebuilt
        self.ctx.rebuilt = not self._should_rebuild()
        self.ctx.layout_settled = self.ctx.rebuilt and not self.tuning_active
        if syncs:
            self._dense.boundary(self.ctx)  # the mode's decisions, after the tuner's
        return rebuilt

    def plan_for(self, config: planner.BucketConfig) -> planner.BucketPlan:
        """The plan torch's rebuild makes with ``config`` (the one ready order, else the initial plan)."""
        if self.rebuild_order is None:
            return planner.initial_plan(self.params, config, self.sparse)
        return planner.rebuilt_plan(self.params, self.rebuild_order, config, self.sparse)

    def set_bucket_config(self, config: planner.BucketConfig) -> bool:
        """New caps between steps (``bucket_cap_mb="auto"``): the buckets
        torch's rebuild makes with them; False when the buckets stay the same."""
        self.ensure_prior_reduction_finished()
        if self.ready.expect_hooks and any(b.work is not None for b in self._buckets):
            raise RuntimeError("fastddp internal error: bucket caps changed while buckets are in flight")
        plan = self.plan_for(config)
        self.opts = dataclasses.replace(self.opts, bucket=config)
        if [b.param_indices for b in plan.buckets] == [b.param_indices for b in self.plan.buckets]:
            return False
        self._install_plan(plan)
        return True

    def _tune_for_mode(self) -> None:
        """A mode that tunes buckets (auto precision) turns bucket_cap_mb="auto"
        on where the caps are torch's default; a hook that replaces it (a user's
        hook over the configured auto precision) turns that off again."""
        opts = self.opts
        wants = self._dense.tunes_buckets and opts.default_caps
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
        self._dense.freeze(why)

    def _rebuild_once(self) -> bool:
        self.ensure_prior_reduction_finished()
        order = self.ready.ready_order
        if not self._should_rebuild() or not order:
            return False
        self.ready.ready_order = []
        if len(order) != len(self.params):
            return False  # an unfinished iteration (its error was caught): learn it again
        t = torch.tensor(order, dtype=torch.int64, device=self.device)
        groups.broadcast(t, self.pg, src=0)
        self.rebuild_order = t.tolist()
        self._install_plan(planner.rebuilt_plan(self.params, self.rebuild_order, self.opts.bucket, self.sparse))
        self._has_rebuilt = True
        return True

    def push_all_rebuilt_params(self) -> None:
        """torch's _push_all_rebuilt_params: a joined rank takes part in the rebuild."""
        if self._should_rebuild() and not self.ready.ready_order:
            self.ready.ready_order = list(range(len(self.params)))

