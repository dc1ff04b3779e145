"""The reducer: the bucket state machine, pack -> collective -> unpack, the
end-of-backward finalize, rebuilds.

It reproduces torch 2.13's C++ ``Reducer`` (``torch/csrc/distributed/c10d/
reducer.cpp``) rule for rule where the rules decide gradients, and replaces its
per-parameter work with one fused ``pack`` per bucket and one fused
``unpack`` per bucket (``fastddp.kernels``).  Which parameters count as ready
is :mod:`fastddp.readiness`'s business; how a bucket is packed, reduced and
unpacked is its mode's (:mod:`fastddp.reduction`).

Per step, as data flows (see also the timeline in :mod:`fastddp.comm`)::

    forward   prepare_for_backward(): arm hooks, reset countdowns, walk the graph
              for unused params (find_unused_parameters)
    backward  AccumulateGrad(p) -> post hook -> Readiness.on_hook(i) -> _mark_ready(i)
              bucket b's countdown hits 0 -> b.reduction.pack: ONE launch gathers
              the grads into b's flat buffer, scaled by torch's rule
              buckets are issued strictly in index order (every rank issues the
              same collectives in the same order) -> b.reduction.issue (async)
    end       engine callback _finalize(): wait(b) -> b.reduction.unpack: ONE
              launch writes the averaged grads back into .grad (none while
              the grads are views of the bucket)

Sparse gradients (``nn.Embedding(sparse=True)``) get a bucket of their own,
as in torch; complex parameters are reduced through their real view.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import _native, autotune, compile as _compile, groups, planner, profiling, reduction
from .buckets import Bucket
from .comm import Comm
from .health import HealthCheck
from .readiness import Readiness

__all__ = ["Reducer", "ReducerOptions"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


EARLY_COPY_MIN_NUMEL = 16384
"""On the CPU, a bucket whose tensors hold at least this many elements on
average (64 KiB of fp32) has each gradient copied into it as it arrives
(see :meth:`Reducer._early_scale`); smaller ones keep the one pack."""


@dataclass(frozen=True)
class ReducerOptions:
    """What the reducer does; resolved from the DDP constructor arguments."""

    bucket: planner.BucketConfig
    """Bucket sizing (caps, first-bucket rule, rebuild policy)."""
    gradient_as_bucket_view: bool = False
    """``.grad`` become views of the flat buckets (no copy in or out)."""
    batched_grad_copy: bool = False
    """torch's batched rule: divide by W (instead of multiplying by fp32(1/W))."""
    find_unused_parameters: bool = False
    """Walk the autograd graph from the outputs each step; unused params count as ready."""
    static_graph: bool = False
    """The set of used params is fixed: learnt in the first iteration."""
    skip_all_reduce_unused_params: bool = False
    """Do not reduce a bucket whose params were all unused on this rank."""
    reduce_dtype: torch.dtype | None = None
    """mixed_precision: the buckets' (wire) dtype; None: the params' dtype."""
    check_finite: str | None = None
    """``"raise"`` / ``"warn"``: gradient health flags set by the packs (:mod:`fastddp.health`)."""
    auto_bucket_cap: bool = False
    """``bucket_cap_mb="auto"``: :mod:`fastddp.autotune` changes ``bucket`` in the first steps."""


class Reducer:
    """Bucketed, overlapped gradient averaging for one DDP module (``debug``: see README)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 process_group, options: ReducerOptions, sparse: Sequence[bool] | None = None,
                 debug: bool = False):
        if not params:
            raise RuntimeError("fastddp: the reducer needs at least one parameter that requires grad")
        self.params, self.names, self.opts, self.pg = list(params), list(names), options, process_group
        self.world, self.rank = groups.size(process_group), groups.rank(process_group)
        self.device = self.params[0].device
        self.sparse = tuple(bool(x) for x in sparse) if sparse else (False,) * len(self.params)
        self.debug = bool(debug)
        self.comm = Comm(process_group, self.device)
        self._lock = threading.Lock()
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self.comm_hook: Callable | None = None
        self.comm_hook_state: Any = None
        self._dense, self._sparse_mode = reduction.choose(None, None, options.batched_grad_copy, True)
        self.mixed_precision_hook: Callable | None = None  # set by the front (mixed_precision)
        self.after_finalize: Callable | None = None         # ditto: frozen params back to fp
        self.refuse_extra_backward: Callable[[], str | None] | None = None  # ditto: why not (mixed_precision)
        self.module_watch = None  # ditto: verify.ModuleWatch, for what the find_unused walk meets
        self.ready = Readiness(self.names, process_group, self.device, static=options.static_graph,
                               find_unused=options.find_unused_parameters,
                               should_rebuild=self._should_rebuild,
                               on_first_hook=(lambda: _queue_callback(self._debug_check)) if debug else None)
        self.num_iterations = 0
        self.steps_reduced = 0
        self.exposed_comm_s: collections.deque = collections.deque(maxlen=32)
        self._next_bucket = 0
        self._has_rebuilt = False
        self._div_factor: int | None = None    # torch's div_factor_ (join may lower it)
        self._t_all_issued = 0.0
        self._fwd_work = None                  # join: all-reduce counting non-joined ranks
        self._fwd_use_static_world = True
        self._fast_hooks = False               # see _make_hook
        self._buckets: list[Bucket] = []
        self.health = HealthCheck(options.check_finite, self.device) if options.check_finite else None
        self._install_plan(planner.initial_plan(self.params, options.bucket, self.sparse))
        self.rebuild_order: list[int] | None = None  # rank 0's ready order of the one rebuild
        self._forward_syncs = False
        self.base_config = options.bucket  # the tuner's host interface (autotune.TunerHost)
        self._ready_observer: Callable[[int], None] | None = None  # set at arming: the tuner's probe
        self.tuner = autotune.Tuner(self) if options.auto_bucket_cap else None
        # post-accumulate-grad hooks fire as the post hook torch's reducer puts
        # on AccumulateGrad (also for undefined grads), without tuples of grads
        self._fwd_reduced_at, self._fwd_unused = 0, []   # see watch_outputs
        self._output_hook = self._make_output_hook()
        self._hook_handles, self.native = [], None
        self._attach_hooks()

    # ------------------------------------------------------- public surface
    view_mode = property(lambda self: self.opts.gradient_as_bucket_view)
    num_buckets = property(lambda self: len(self._buckets))
    buckets = property(lambda self: tuple(self._buckets))
    comm_stream = property(lambda self: self.comm.comm_stream, doc="The CUDA side stream of packs and collectives.")
    has_comm_hook = property(lambda self: self.comm_hook is not None)
    has_rebuilt_buckets = property(lambda self: self._has_rebuilt)

    def name(self, p) -> str:
        return self.names[self._index_of[id(p)]]

    def globally_unused(self, index: int) -> bool:
        return self.ready.globally_unused(index)

    def before_unpack(self, bucket: Bucket) -> None:
        if self.mixed_precision_hook is not None:
            self.mixed_precision_hook(bucket, self.comm)  # full-precision params and grads back first

    def register_comm_hook(self, hook: Callable, state: Any, group_ok: bool) -> None:
        """Install a comm hook; fastddp's tagged hooks run as fused paths."""
        self._dense, self._sparse_mode = reduction.choose(hook, state, self.opts.batched_grad_copy, group_ok)
        self._early_views, self._early_any = None, False  # the bucket mode changed: found again at the next arm
        self.comm_hook, self.comm_hook_state = hook, state
        for b in self._buckets:
            b.reduction = self._sparse_mode if b.sparse else self._dense

    fused_path = property(lambda self: self._dense.fused)

    @property
    def wire_itemsize(self) -> int | None:
        """Element size of the dense buckets' wire: a fused hook's dtype, else
        mixed_precision's reduce_dtype; None: the params' own."""
        fused = self.fused_path
        wire = fused[1] if fused and fused[1] is not None else self.opts.reduce_dtype
        return wire.itemsize if wire is not None else None

    def bucket_sizes(self) -> list[int]:  # bytes of each bucket (sparse: of its last gradient)
        return [b.nbytes() for b in self._buckets]

    def error_feedback_residual(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s error-feedback residual (fused compression), shaped like its bucket slot."""
        b, pos = self.plan.locate(index)
        res = getattr(self._dense, "residual", {}).get(b)
        return None if res is None else self._buckets[b].layout.views(res)[pos]

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
        self._early_views, self._early_any = None, False  # the native early copy's views: the buckets changed
        if getattr(self, "native", None) is not None:
            self.native.set_buckets([b.index for b in self._bucket_of])
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
        if self.tuner is not None and self.tuner.active and syncs:
            rebuilt = self.tuner.boundary() or rebuilt
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

    def freeze_tuning(self, why: str) -> None:
        """End ``bucket_cap_mb="auto"``'s tuning now (join): no collectives."""
        if self.tuner is not None:
            self.tuner.freeze(why)

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

    # ----------------------------------------------------------- iteration
    def prepare_for_forward(self, sync: bool = True) -> None:
        """Every forward of the module; ``sync``: its backward will be reduced."""
        self._forward_syncs = sync
        if sync:
            self.num_iterations += 1
            self._fwd_work = None

    def set_forward_pass_work_handle(self, work, use_static_world_size: bool) -> None:
        """join(): the count of ranks still training; the divisor unless ``use_static_world_size``."""
        self._fwd_work, self._fwd_use_static_world = work, use_static_world_size

    def divide_factor(self) -> int:
        """torch's div_factor_: W, or the ranks not joined (join(divide_by_initial_world_size=False))."""
        if self._div_factor is None:
            d = self.world
            if self._fwd_work is not None and not self._fwd_use_static_world:
                groups.wait(self._fwd_work)
                d = int(self._fwd_work.result()[0].item())
            self._div_factor = d
        return self._div_factor

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the hooks for the backward of a forward that synchronises."""
        self.ensure_prior_reduction_finished()
        self._next_bucket = 0
        for b in self._buckets:
            b.pending, b.work = b.size, None
        self.ready.reset(outputs, self._index_of)
        r = self.ready
        if r.foreign and self.module_watch is not None:
            foreign, r.foreign = r.foreign, []
            try:
                self.module_watch.check_leaves(foreign)
            except RuntimeError:
                self.abort_iteration()
                raise
        self._fast_hooks = not (r.track_used or r.static or r.unused or r.collect_order or self.debug)
        probe = self.tuner is not None and self.tuner.wants_ready_marks
        self._ready_observer = self.tuner.on_ready if probe else None
        if self.native is not None:
            fast = self._fast_hooks and not probe
            early, divide = self._early_scale() if fast else (-1.0, 0.0)
            self.native.arm(_native.FAST if fast else _native.PY, [b.size for b in self._buckets],
                            early, divide, self.view_mode)

    def _early_scale(self) -> tuple[float, float]:
        """The native hooks' early copy this iteration (on the CPU, plain
        all-reduce or a Python comm hook): each gradient goes into its bucket
        slot as it arrives, scaled as torch's reducer does (``mul_out`` by
        1/W; batched_grad_copy's copy-then-divide as one division, the same
        bits; a comm hook's plain copy), read while still in cache instead
        of by the bucket's one pack after the last gradient; with
        gradient_as_bucket_view the fresh gradient is then freed (``.grad``
        becomes the view), as torch's.  On a GPU the one fused pack launch
        is the point and nothing is copied early.  Returns ``(early,
        divide)`` for :meth:`Countdown.arm` (early -1: none, 0: a plain copy,
        else the scale 1/W; divide > 0: divide by it instead).
        Buckets of small tensors keep the one pack: there a copy per tensor
        costs more than it saves (world 1, ``small``, 600 tensors of 16 KiB:
        0.95-0.98x torch's view path with early copies, 0.89 without)."""
        if self._early_views is None:
            self._early_views = self._find_early_views()
            self._early_any = any(v is not None for v in self._early_views)
            self.native.set_views(self._early_views)
        if not self._early_any or self._fwd_work is not None:
            return -1.0, 0.0  # join's divisor is known only after its forward all-reduce
        d = self._dense
        if type(d) is reduction.AllReduce and d.scaling is reduction.Scaling.MUL:
            return 1.0 / self.world, 0.0
        if type(d) is reduction.AllReduce and d.scaling is reduction.Scaling.DIV:
            return 0.0, float(self.world)
        return 0.0, 0.0  # a comm hook: the bucket undivided

    def _find_early_views(self) -> list:
        d = self._dense
        if type(d) not in (reduction.AllReduce, reduction.PythonHook):
            return [None] * len(self.params)
        ok = {b.index for b in self._buckets
              if not b.sparse and not b.complex and b.flat.device.type == "cpu"
              and b.flat.numel() >= EARLY_COPY_MIN_NUMEL * b.size}
        views: list = [None] * len(self.params)
        for b in self._buckets:
            if b.index in ok:
                for i, p, v in zip(b.indices, b.params, b.views):  # (= grad_views: not complex)
                    views[i] = v if v.dtype == p.dtype else None
        return views

    def watch_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """After prepare_for_backward: every later backward through these
        outputs is reduced too (``retain_graph=True``, two losses through one
        forward), not just the first.  A backward that reaches no DDP output
        (a forward through ``ddp.module``) stays local, as in torch."""
        self._fwd_reduced_at, self._fwd_unused = self.steps_reduced, self.ready.unused
        seen = set()
        for t in outputs:
            fn = t.grad_fn  # a pre-hook on the node: a fifth of Tensor.register_hook's cost
            if fn is not None and fn not in seen:
                seen.add(fn)
                fn.register_prehook(self._output_hook)

    def _make_output_hook(self):
        reducer = self

        def output_hook(_grad_outputs):
            # An output's node runs before any parameter's AccumulateGrad of
            # the same backward: re-arming here is in time for all of them.
            if reducer.ready.expect_hooks or reducer.steps_reduced == reducer._fwd_reduced_at:
                return  # the forward's first backward (or one that failed) is still the one armed
            reducer._rearm(reducer._fwd_unused)
        # one object for the reducer's life (compiled autograd would recompile
        # for a new hook each step); called eagerly under compiled autograd
        return _compile.eager(output_hook)

    def _rearm(self, unused) -> None:
        """Reduce another backward over an already reduced forward.  The
        ``.grad`` hold avg(g) from the first reduction (the same on every rank)
        plus this backward's local increment d: reducing the total gives
        avg(avg(g) + d) = avg(g) + avg(d) = avg(g + d), the average of what both
        backwards accumulated locally (exactly where the arithmetic is exact).
        Every rank must run the same number of backwards, as it must run
        the same forwards."""
        why = None
        if self._fwd_work is not None:
            why = ("inside join(): the ranks that have joined shadow one backward per forward "
                   "and would not match this one's collectives")
        elif self.refuse_extra_backward is not None:
            why = self.refuse_extra_backward()
        if why is not None:
            raise RuntimeError(
                f"fastddp: a second backward through the outputs of one DDP forward "
                f"(backward(retain_graph=True) twice, or two losses of one forward) on rank "
                f"{self.rank} cannot be averaged {why}. Sum the losses and call backward once, or "
                "run a new forward for each backward.")
        with self._lock:
            self._next_bucket = 0
            for b in self._buckets:
                b.pending, b.work = b.size, None
            self.ready.rearm(list(unused))
            self._fast_hooks = False
            if self.native is not None:
                self.native.set_mode(_native.PY)

    # ------------------------------------------------------------ readiness
    def _attach_hooks(self) -> None:
        """One readiness hook per parameter: the native countdown
        (:mod:`fastddp._native`, a C++ post hook on each AccumulateGrad, as
        torch's reducer has) where it builds, else Python post-accumulate hooks."""
        mod = _native.countdown_module()
        if mod is None:
            self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                                  for i, p in enumerate(self.params)]
            return
        me = weakref.ref(self)  # the C++ side holds these: no cycle back to the reducer

        def on_bucket(b: int) -> None:
            r = me()
            if r is not None:
                r._native_bucket_ready(b)

        def on_hook(index: int, twice: bool) -> None:
            r = me()
            if r is not None:
                r._native_marked_twice(index) if twice else r._hook_body(index)

        def ca_hook(index: int):
            def hook(_grad_inputs, _grad_outputs):  # compiled autograd's node post hook
                r = me()
                if r is not None:
                    r._hook_body(index)
            return _compile.eager(hook)

        self.native = mod.Countdown(self.params, on_bucket, on_hook,
                                    [ca_hook(i) for i in range(len(self.params))])
        self.native.set_buckets([b.index for b in self._bucket_of])

    def refresh_hooks(self) -> int:
        """After each forward: the native hooks follow AccumulateGrad nodes
        that torch replaced (a parameter's data changed dtype or device);
        Python's post-accumulate hooks live on the tensor and need nothing.
        ~0.3 us per parameter (600: ~0.2 ms with a cold cache).  Returns how
        many moved."""
        return self.native.refresh() if self.native is not None else 0

    def _make_hook(self, index: int):
        reducer = self

        def hook(_param):
            reducer._hook_body(index)
        return _compile.eager(hook)  # compiled autograd: called eagerly, in place

    def _hook_body(self, index: int) -> None:
        if self._fast_hooks:  # armed, nothing to track: no lock (one autograd thread)
            self._mark_ready(index)
        else:
            with self._lock:
                for i in self.ready.on_hook(index, self.params[index].grad is not None):
                    self._mark_ready(i)

    def _native_bucket_ready(self, b: int) -> None:
        """The native countdown: bucket ``b``'s last parameter is ready.  The
        marks stay on the C++ side; :meth:`_sync_native_marks` copies them
        over where they are read (errors, an unfinished iteration)."""
        bucket = self._buckets[b]
        bucket.pending = 0
        bucket.prefilled = self.native.filled(b) if self._early_any else 0
        self._bucket_complete(bucket)

    def early_filled(self, bucket: Bucket) -> bytes:
        """Per position in ``bucket``: its grad was copied early this iteration."""
        marks = self.native.filled_marks()
        return bytes(marks[i] for i in bucket.indices)

    def _native_marked_twice(self, index: int) -> None:
        self._sync_native_marks()
        self.ready.mark(index)  # raises torch's error, naming the parameter
        raise RuntimeError(f"fastddp internal error: parameter {index} marked twice went unnoticed")

    def _sync_native_marks(self) -> None:
        """``ready.marked`` from the native countdown (it keeps them while it
        counts): before anything reads them in a counted iteration."""
        if self.native is not None and self.native.mode() == _native.FAST:
            self.ready.marked = bytearray(self.native.marked())

    def _mark_ready(self, index: int) -> None:
        self.ready.mark(index)
        if self._ready_observer is not None:
            self._ready_observer(index)
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._bucket_complete(bucket)

    def _bucket_complete(self, bucket: Bucket) -> None:
        try:
            self._pack(bucket)
            if self.debug:
                return  # issued by _debug_check after the cross-rank check
            self._launch_ready()
        except BaseException:
            self.abort_iteration()  # e.g. a hook's error: the next iteration starts clean
            raise
        if self._next_bucket == len(self._buckets):
            self._all_buckets_issued()
            # compiled autograd's engine runs no queued callbacks (every grad is in by now)
            self._finalize() if _compile.in_compiled_autograd() else _queue_callback(self._finalize)

    def _all_buckets_issued(self) -> None:
        self._t_all_issued = time.perf_counter()
        self.comm.mark_all_issued()
        if self.tuner is not None and self.tuner.active:
            self.tuner.on_all_issued()
        if self.ready.dynamic_find_unused:
            self.ready.all_reduce_used_map()

    def _debug_check(self) -> None:
        if not self.ready.expect_hooks or self.ready.static_first_iteration:
            return
        try:
            self.ready.check_agreement()
        except RuntimeError:
            self.abort_iteration()
            raise
        if all(b.pending == 0 for b in self._buckets):
            self._launch_ready()
            self._all_buckets_issued()
            self._finalize()

    # ---------------------------------------------------------- pack, issue
    def _pack(self, bucket: Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        with profiling.range(f"fastddp/pack[{bucket.index}]", self.comm.cuda), \
                self.comm.pack_context(bucket.ready_event), torch.no_grad():
            bucket.reduction.pack(self, bucket, grads)

    def _launch_ready(self) -> None:
        """Issue collectives strictly in bucket order (same order on every rank)."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            if self.opts.skip_all_reduce_unused_params and set(b.indices) <= set(self.ready.unused):
                b.work = None
            else:
                with profiling.range(f"fastddp/allreduce[{b.index}]", self.comm.cuda), \
                        self.comm.comm_context():
                    b.work = b.reduction.issue(self, b)
            self._next_bucket += 1

    # -------------------------------------------------------------- finalize
    def delay_all_reduce(self) -> None:
        """static_graph's first backward (torch's ``_delay_all_reduce``): learn the unused params, reduce all."""
        with self._lock:
            self.ready.learn_static_unused()
            for b in self._buckets:
                self._pack(b)
                b.pending = 0
            self._launch_ready()
            self._all_buckets_issued()
            self.ready.expect_hooks = True
        self._finalize()

    def _finalize(self) -> None:
        with profiling.range("fastddp/finalize", self.comm.cuda):
            if not self.ready.expect_hooks or self._next_bucket != len(self._buckets):
                raise RuntimeError(f"fastddp internal error: finalize with {self._next_bucket} of "
                                   f"{len(self._buckets)} buckets issued (armed: {self.ready.expect_hooks})")
            self._fast_hooks, self._div_factor = False, None  # join may change the divisor
            if self.native is not None:  # until the next armed forward: hooks that track nothing skip Python
                idle = not (self.ready.static or self.ready.dynamic_find_unused or self.debug)
                self.native.set_mode(_native.IDLE if idle else _native.PY)
            track = self.ready.static or self.opts.find_unused_parameters
            self.ready.expect_hooks = False
            live = [b for b in self._buckets if b.work is not None]  # else skipped (unused)
            with self.comm.comm_context(), torch.no_grad():
                try:
                    results = [self._wait(b) for b in live] if self.health is not None else None
                    if results is not None:
                        self.health.check(self)  # before any reduced value reaches .grad
                    for k, b in enumerate(live):
                        result = results[k] if results is not None else self._wait(b)
                        with profiling.range(f"fastddp/unpack[{b.index}]", self.comm.cuda):
                            b.reduction.unpack(self, b, result, track)
                except BaseException:
                    self.abort_iteration()  # a hook's bad result, check_finite: the next one starts clean
                    raise
            self.comm.join_compute_stream()
            if self.after_finalize is not None:
                self.after_finalize()
            # host view of the exposed comm: last bucket issued -> all reduced (CUDA: events too)
            self.exposed_comm_s.append(time.perf_counter() - self._t_all_issued)
            if self.tuner is not None and self.tuner.active:
                self.tuner.on_finalized()
            self.steps_reduced += 1
            self.ready.finish()

    def _wait(self, b: Bucket):
        with profiling.range(f"fastddp/wait[{b.index}]", self.comm.cuda):
            result, b.work = self.comm.wait(b.work), None
        if self.health is not None:
            b.reduction.check_result(b, result)
        return result

    # ------------------------------------------------------------------ join
    def push_all_rebuilt_params(self) -> None:
        """torch's _push_all_rebuilt_params: a joined rank takes part in the rebuild."""
        if self._should_rebuild() and not self.ready.ready_order:
            self.ready.ready_order = list(range(len(self.params)))

    # ---------------------------------------------------------------- errors
    def abort_iteration(self) -> None:
        """An error is raised in this iteration: the next well-formed one starts clean."""
        self._sync_native_marks()
        self.ready.abort()
        self._fast_hooks = False
        if self.native is not None:
            self.native.set_mode(_native.PY)
        self._next_bucket = 0
        for b in self._buckets:
            b.work, b.sparse_grad, b.pending = None, None, b.size

    def ensure_prior_reduction_finished(self) -> None:
        self._sync_native_marks()
        if self.ready.require_finalize:
            err = self.ready.unfinished_error()
            self.abort_iteration()  # so the error is not raised forever after a user catches it
            raise err

    def stats(self) -> dict:
        return profiling.reducer_stats(self)

    # torch's private names, which frameworks (Lightning) call on ddp.reducer
    _rebuild_buckets = rebuild_buckets
    _delay_all_reduce = delay_all_reduce

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        if self.native is not None:
            self.native.remove()
