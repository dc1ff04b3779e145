"""The reducer's core: in-order issue, finalize, abort; the buckets and their
plan are the :class:`~.plans.BucketPlans` object it holds.

It reproduces torch 2.13's C++ ``Reducer`` (``torch/csrc/distributed/c10d/
reducer.cpp``) rule for rule where the rules decide gradients, and replaces its
per-parameter work with one fused ``pack`` and one fused ``unpack`` per bucket.
Which parameters count as ready is :mod:`fastddp.reducer.readiness`'s business, which
hooks run :mod:`.arming`'s, how a bucket is packed, reduced and unpacked its
mode's (:mod:`fastddp.reduction`, which sees the step's
:class:`~fastddp.reduction.StepContext`, never this class).  Per step::

    forward   prepare_for_backward(): arm the hooks, reset countdowns, walk the
              graph for unused params (find_unused_parameters)
    backward  hook(p) -> mark_ready(i) -> bucket b's countdown hits 0 ->
              mode.pack (ONE launch) -> buckets issued strictly in index order
              (every rank issues the same collectives in the same order) ->
              mode.issue (async)
    end       engine callback finalize(): wait(b) -> mode.unpack (ONE launch
              into .grad; none while the grads are views of the bucket)
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from .. import compile as _compile, groups, profiling, reduction
from ..buckets import Bucket
from ..comm import Comm
from ..health import HealthCheck
from .readiness import Readiness
from . import atonce
from .arming import Arming
from .divisor import Divisor
from .options import Collaborators, ReducerOptions
from .plans import BucketPlans
from .rearm import SecondBackward

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Reducer:
    """Bucketed, overlapped gradient averaging for one DDP module (``debug``: docs/options.md)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], process_group,
                 options: ReducerOptions, sparse: Sequence[bool] | None = None, debug: bool = False,
                 collaborators: Collaborators = Collaborators()):
        if not params:
            raise RuntimeError("fastddp: the reducer needs at least one parameter that requires grad")
        self.params, self.names, self.pg = list(params), list(names), process_group
        self.view_mode, self._skip_unused = options.gradient_as_bucket_view, options.skip_all_reduce_unused_params
        self.world, self.rank = groups.size(process_group), groups.rank(process_group)
        self.device = self.params[0].device
        self.sparse = tuple(bool(x) for x in sparse) if sparse else (False,) * len(self.params)
        self.debug, self.co = bool(debug), collaborators
        self.comm = Comm(process_group, self.device)
        self._lock = threading.Lock()
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self.comm_hook, self.comm_hook_state = None, None  # register_comm_hook's (a callable, its state)
        self._largest = max((p.numel() for p, s in zip(self.params, self.sparse) if not s), default=0)
        self._dense, self._sparse_mode = reduction.choose(None, None, options.batched_grad_copy, True, self.device,
                                                          options=options.options, largest=self._largest)
        self.ready = Readiness(self.names, process_group, self.device, static=options.static_graph,
                               find_unused=options.find_unused_parameters,
                               should_rebuild=lambda: self.plans.should_rebuild(),
                               on_first_hook=(lambda: _queue_callback(lambda: atonce.debug_check(self))) if debug else None)
        self.num_iterations = self.steps_reduced = 0
        self.exposed_comm_s: collections.deque = collections.deque(maxlen=32)
        self._next_bucket, self._t_all_issued, self._probe = 0, 0.0, None
        self.divisor = Divisor(self.world)
        self.health = HealthCheck(options.check_finite, self.device) if options.check_finite else None
        me = weakref.ref(self)  # the hooks hold these: no cycle back to the reducer
        self.arming = Arming(self.params, lambda i: me()._hook_body(i), lambda b: me()._native_bucket_ready(b),
                             lambda i: me()._native_marked_twice(i))
        self.ctx = reduction.StepContext.of(self.comm, self.world, self.rank, options.gradient_as_bucket_view,
                                            self.names, self._index_of, self.divisor.get,
                                            self.ready.globally_unused, self.arming.early_filled,
                                            collaborators.pre_unpack, options.static_graph or options.find_unused_parameters)
        self.plans = BucketPlans(self.params, self.sparse, options, process_group, self.device, ctx=self.ctx,
                                 arming=self.arming, ready=self.ready, health=self.health,
                                 modes=lambda: (self._dense, self._sparse_mode),
                                 quiesce=self.ensure_prior_reduction_finished, steps=lambda: self.steps_reduced)
        self.second = SecondBackward(self)
        self.arming.attach_chain(process_group, lambda b, at: me()._native_chain(b, at))
        self.arming.finished(idle=not (options.static_graph or options.find_unused_parameters or debug))

    # ------------------------------------------------------- public surface
    # the buckets and their plan are the plans object's (the bucket tuner's host)
    opts = property(lambda self: self.plans.opts, doc="The options now (the caps change with bucket_cap_mb='auto').")
    plan, buckets = property(lambda self: self.plans.plan), property(lambda self: tuple(self.plans.buckets))
    num_buckets = property(lambda self: len(self.plans.buckets))
    tuner, tuning_active = property(lambda self: self.plans.tuner), property(lambda self: self.plans.tuning_active)
    rebuild_order, has_rebuilt_buckets = (property(lambda self: self.plans.rebuild_order),
                                          property(lambda self: self.plans.has_rebuilt_buckets))
    comm_stream = property(lambda self: self.comm.stream, doc="The CUDA side stream of packs and collectives.")
    has_comm_hook = property(lambda self: self.comm_hook is not None)
    native = property(lambda self: self.arming.native, doc="The native countdown (None: Python hooks).")
    mode = property(lambda self: self._dense, doc="The dense buckets' mode (fastddp.reduction).")
    fused_path = property(lambda self: (self._dense.kind.value, self._dense.wire_dtype) if self._dense.fused else None,
                          doc="(kind, wire dtype) of a fastddp hook run as its fused path, else None.")

    def register_comm_hook(self, hook: Callable, state: Any, group_ok: bool) -> None:
        """Install a comm hook; fastddp's tagged hooks run as fused paths."""
        self._dense, self._sparse_mode = reduction.choose(hook, state, self.opts.batched_grad_copy, group_ok,
                                                          self.device, self.comm.pg, options=self.opts.options,
                                                          largest=self._largest)
        self.arming.forget_views()  # the bucket mode changed: found again at the next arm
        self.comm_hook, self.comm_hook_state = hook, state
        self.plans.give_modes()
        self.plans.tune_for_mode()

    def error_feedback_residual(self, index: int) -> torch.Tensor | None:
        return self.plans.error_feedback_residual(index)

    def stats(self) -> dict:
        return profiling.reducer_stats(self)

    # ----------------------------------------------------------- iteration
    def prepare_for_forward(self, sync: bool = True) -> None:
        """Every forward of the module; ``sync``: its backward will be reduced."""
        self.plans.forward_syncs = sync
        if sync:
            self.num_iterations += 1
            self.ctx.iteration = self.num_iterations
            self.ctx.forward_at = time.perf_counter()
            self.divisor.set_work(None)

    def set_forward_pass_work_handle(self, work, use_static_world_size: bool) -> None:
        """join(): the count of ranks still training; the divisor unless ``use_static_world_size``."""
        self.divisor.set_work(work, use_static_world_size)

    def divide_factor(self) -> int:
        """torch's div_factor_: W, or the ranks not joined (join(divide_by_initial_world_size=False))."""
        return self.divisor.get()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the hooks for the backward of a forward that synchronises."""
        self.ensure_prior_reduction_finished()
        self._reset_countdowns()
        self.ready.reset(outputs, self._index_of)
        r = self.ready
        if r.foreign and self.co.module_watch is not None:
            foreign, r.foreign = r.foreign, []
            try:
                self.co.module_watch.check_leaves(foreign)
            except RuntimeError:
                self.abort_iteration()
                raise
        tuner = self.plans.tuner
        self._probe = tuner.on_ready if self.plans.tuning_active and tuner.wants_ready_marks else None
        self.arming.arm(r, self.plans.buckets, self._dense, self.ctx, debug=self.debug, probe=self._probe is not None,
                        join_pending=self.divisor.pending, world=self.world, view_mode=self.view_mode,
                        timed=self.plans.tuning_active)

    def watch_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """After prepare_for_backward: later backwards through these outputs are reduced too."""
        self.second.watch(outputs)

    def rearm(self, unused) -> None:
        """Reduce another backward over an already reduced forward (:class:`SecondBackward`)."""
        with self._lock:
            self._reset_countdowns()
            self.ready.rearm(unused)
            self.arming.every_hook()

    def _reset_countdowns(self) -> None:
        self._next_bucket = 0
        for b in self.plans.buckets:
            b.reset()

    def refresh_hooks(self) -> int:
        """After each forward: the native hooks follow replaced AccumulateGrad nodes (:class:`Arming`)."""
        return self.arming.refresh()

    # ------------------------------------------------------------ readiness
    def _hook_body(self, index: int) -> None:
        if self.arming.fast:  # armed, nothing to track: no lock (one autograd thread)
            self.mark_ready(index)
        else:
            with self._lock:
                for i in self.ready.on_hook(index, self.params[index].grad is not None):
                    self.mark_ready(i)

    def _native_bucket_ready(self, b: int) -> None:
        """The native countdown: bucket ``b``'s last parameter is ready (marks stay in C++)."""
        bucket = self.plans.buckets[b]
        bucket.pending = 0
        bucket.prefilled = self.arming.filled(b)
        self._bucket_complete(bucket)

    def _native_chain(self, b: int, at: float) -> None:
        """The native issue chain hands over (:mod:`.chain`): bucket ``b`` to pack (>= 0), an error (-2), or
        from its end-of-backward callback every bucket reduced (the last issued at ``at``), the first ``-3 - b``
        unpacked."""
        if b == -3 - len(self.plans.buckets) and self.co.after_finalize is None:
            return self._chain_finished(-3 - b, at)
        done = -3 - b if b <= -3 else None
        self._next_bucket = self.arming.chain.take(self.plans.buckets, done)
        if b == -2:
            self.abort_iteration()
        elif b >= 0:
            self._native_bucket_ready(b)
        else:
            self._all_buckets_issued(self.arming.chain.issued_at)
            self._finalize()

    def _chain_finished(self, n: int, at: float) -> None:
        """The chain reduced every bucket into .grad and set the hooks idle: _finalize's bookkeeping inline
        (right after the waits each Python call runs cold: ~150 us a step through _finalize, here ~30)."""
        self._t_all_issued, self._next_bucket, self.arming.fast, self.ready.expect_hooks = at, n, False, False
        self.divisor.forget()  # join may change the divisor
        self.exposed_comm_s.append(time.perf_counter() - self._t_all_issued)
        self.steps_reduced += 1
        self.ready.finish()

    def _native_marked_twice(self, index: int) -> None:
        self._sync_native_marks()
        self.ready.mark(index)  # raises torch's error, naming the parameter
        raise RuntimeError(f"fastddp internal error: parameter {index} marked twice went unnoticed")

    def _sync_native_marks(self) -> None:
        """``ready.marked`` from the native countdown, before anything reads them."""
        if self.arming.counting():
            self.ready.marked = self.arming.marks()

    def mark_ready(self, index: int) -> None:
        self.ready.mark(index)
        if self._probe is not None:
            self._probe(index)
        bucket = self.plans.bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._bucket_complete(bucket)

    def _bucket_complete(self, bucket: Bucket) -> None:
        try:
            self._pack(bucket)
            if self.debug:
                return  # issued by atonce.debug_check after the cross-rank check
            self._launch_ready()
        except BaseException:
            self.abort_iteration()  # e.g. a hook's error: the next iteration starts clean
            raise
        if self._next_bucket == len(self.plans.buckets):
            self._all_buckets_issued()
            # compiled autograd's engine runs no queued callbacks (every grad is in by now)
            self._finalize() if _compile.in_compiled_autograd() else _queue_callback(self._finalize)

    def _all_buckets_issued(self, at: float | None = None) -> None:
        self._t_all_issued = time.perf_counter() if at is None else at
        self.comm.mark_all_issued()
        if self.plans.tuning_active:
            self.plans.tuner.on_all_issued()
        if self.ready.dynamic_find_unused:
            self.ready.all_reduce_used_map()

    # ---------------------------------------------------------- pack, issue
    def _pack(self, bucket: Bucket) -> None:
        with profiling.range(f"fastddp/pack[{bucket.index}]", self.comm.cuda), \
                self.comm.pack_context(bucket.ready_event), torch.no_grad():
            mode = bucket.reduction
            if not mode.pack_native(self.ctx, bucket):
                mode.pack(self.ctx, bucket, [p.grad for p in bucket.params])

    def _launch_ready(self) -> None:
        """Issue collectives strictly in bucket order (same order on every rank)."""
        buckets = self.plans.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            if self._skip_unused and set(b.indices) <= set(self.ready.unused):
                b.work = None
            else:
                with profiling.range(f"fastddp/allreduce[{b.index}]", self.comm.cuda), self.comm.comm_context():
                    b.work = b.reduction.issue(self.ctx, b)
            self._next_bucket += 1

    # -------------------------------------------------------------- finalize
    def delay_all_reduce(self) -> None:  # static_graph's first backward: learn the unused, reduce all
        atonce.delay_all_reduce(self)

    def _finalize(self) -> None:
        with profiling.range("fastddp/finalize", self.comm.cuda):
            if not self.ready.expect_hooks or self._next_bucket != len(self.plans.buckets):
                raise RuntimeError(f"fastddp internal error: finalize with {self._next_bucket} of "
                                   f"{len(self.plans.buckets)} buckets issued (armed: {self.ready.expect_hooks})")
            self.divisor.forget()  # join may change the divisor
            self.arming.finished(idle=not (self.ready.static or self.ready.dynamic_find_unused or self.debug))
            track = self.ready.static or self.opts.find_unused_parameters
            self.ready.expect_hooks = False
            live, check = [b for b in self.plans.buckets if b.work is not None], self.health is not None  # (not issued: no wait)
            with self.comm.comm_context(), torch.no_grad():
                try:
                    results = [self.comm.wait_bucket(b, check) for b in live] if check else None
                    if check:
                        self.health.check(self)  # before any reduced value reaches .grad
                    for k, b in enumerate(live):
                        result = results[k] if check else self.comm.wait_bucket(b, False)
                        with profiling.range(f"fastddp/unpack[{b.index}]", self.comm.cuda):
                            b.reduction.unpack(self.ctx, b, result, track)
                except BaseException:
                    self.abort_iteration()  # a hook's bad result, check_finite: the next one starts clean
                    raise
            self.comm.join_compute_stream()
            if self.co.after_finalize is not None:
                self.co.after_finalize()
            # host view of the exposed comm: last bucket issued -> all reduced (CUDA: events too)
            self.exposed_comm_s.append(time.perf_counter() - self._t_all_issued)
            if self.plans.tuning_active:
                self.plans.tuner.on_finalized()
            self.steps_reduced += 1
            self.ready.finish()

    # ------------------------------------------------------------ join, errors
    def abort_iteration(self) -> None:
        """An error is raised in this iteration: the next one starts clean.
        First the stream backward ran on waits for the comm stream (no host
        sync): queued packs read grads the user may free after catching it."""
        self.comm.join_compute_stream(self.comm.compute_stream)
        self._sync_native_marks()
        self.ready.abort()
        self.arming.every_hook()
        self._reset_countdowns()

    def ensure_prior_reduction_finished(self) -> None:
        if self.ready.expect_hooks:  # (else nothing is armed: no marks to read)
            self._sync_native_marks()
            if self.ready.require_finalize:
                err = self.ready.unfinished_error()
                self.abort_iteration()  # so the error is not raised forever after a user catches it
                raise err

    # torch's private names, which frameworks (Lightning) call on ddp.reducer
    def rebuild_buckets(self) -> bool:
        return self.plans.rebuild_buckets()

    _rebuild_buckets = rebuild_buckets
    _delay_all_reduce = delay_all_reduce

    def remove_hooks(self) -> None:
        self.arming.remove()
