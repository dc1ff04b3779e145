"""The reducer: readiness hooks, the bucket state machine, pack -> collective
-> unpack, end-of-backward finalize, unused parameters, rebuilds.

It reproduces torch 2.13's C++ ``Reducer`` (``torch/csrc/distributed/c10d/
reducer.cpp``) rule for rule where the rules decide gradients, and replaces its
per-parameter work with one fused ``pack`` per bucket and one fused
``unpack`` per bucket (``fastddp.kernels``).

Per step, as data flows (see also the timeline in :mod:`fastddp.comm`)::

    forward   prepare_for_backward(): arm hooks, reset countdowns, walk the graph
              for unused params (find_unused_parameters)
    backward  AccumulateGrad(p) -> post hook -> _autograd_hook(i) -> _mark_ready(i)
              bucket b's countdown hits 0 -> PACK(b): ONE launch gathers the
              grads into b's flat buffer, scaled by torch's rule
              buckets are issued strictly in index order (every rank issues the
              same collectives in the same order) -> async all-reduce(b)
    end       engine callback _finalize(): wait(b) -> UNPACK(b): ONE launch
              writes the averaged grads back into .grad (skipped while the
              grads are views of the bucket)

Scaling, exactly as torch (bit for bit):

* default path: ``grad * fp32(1/W)`` while packing (torch's ``mul_out``);
* ``batched_grad_copy``: ``grad / W`` (torch's foreach copy + flat ``div_``);
* grads already aliasing the bucket (``gradient_as_bucket_view``): ``div_(W)``;
* a registered comm hook: no scaling at all (the hook divides).

Sparse gradients (``nn.Embedding(sparse=True)``) get a bucket of their own,
as in torch: the sparse ``.grad`` itself is divided by W (unless a hook
runs), all-reduced (or handed to the hook) and replaced by the result.
Complex parameters are reduced through their real view
(``torch.view_as_real``): the bucket holds two real elements per complex one.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import groups, kernels, planner, profiling
from .comm import Comm, Pending

__all__ = ["Reducer", "ReducerOptions"]


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


_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64,
            torch.complex32: torch.float16}


class _Bucket:
    """Runtime state of one bucket of the plan.

    ``flat`` is real: a complex bucket holds the real view of its params'
    gradients (``layout`` / ``views`` over real elements), while
    ``grad_views`` are what ``.grad`` aliases with ``gradient_as_bucket_view``
    (the complex views of ``flat`` for complex params, else ``views``).  A
    sparse bucket (one parameter) has no flat buffer: ``sparse_grad`` is the
    gradient in flight."""

    __slots__ = ("index", "spec", "params", "indices", "layout", "flat", "views",
                 "size", "pending", "work", "ready_event", "flat_layout", "wire", "residual",
                 "complex", "grad_views", "hook_layout", "sparse", "sparse_grad")

    def __init__(self, spec: planner.Bucket, params: Sequence[torch.Tensor], dtype: torch.dtype | None = None):
        self.index = spec.index
        self.spec = spec
        self.indices = list(spec.param_indices)
        self.params = [params[i] for i in self.indices]
        self.size = len(self.params)
        self.sparse = spec.sparse
        self.sparse_grad = None
        self.work: Pending | None = None
        self.pending = self.size
        self.wire: torch.Tensor | None = None       # fused compression: the 16-bit wire buffer
        self.residual: torch.Tensor | None = None   # fused compression: error-feedback residual
        self.ready_event = torch.cuda.Event() if spec.device.type == "cuda" else None
        dtype = dtype or spec.dtype
        self.complex = dtype.is_complex
        if self.sparse:
            self.flat = self.layout = self.flat_layout = self.hook_layout = None
            self.views = self.grad_views = [None]
            return
        if self.complex:
            real = _REAL_OF[dtype]
            self.layout = kernels.Layout([(*p.shape, 2) for p in self.params],
                                         [2 * o for o in spec.offsets])
            self.flat = torch.zeros(2 * spec.numel, dtype=real, device=spec.device)
            self.views = self.layout.views(self.flat)
            self.grad_views = [torch.view_as_complex(v) for v in self.views]
            self.hook_layout = kernels.Layout([p.shape for p in self.params], spec.offsets)
        else:
            self.layout = kernels.Layout([p.shape for p in self.params], spec.offsets)
            self.flat = torch.zeros(spec.numel, dtype=dtype, device=spec.device)
            self.views = self.layout.views(self.flat)
            self.grad_views = self.views
            self.hook_layout = self.layout
        self.flat_layout = kernels.Layout([self.flat.shape])  # the flat bucket as one tensor

    def kernel_grads(self, grads):
        """The grads as the kernels see them (real views of complex grads)."""
        if not self.complex:
            return grads
        return [None if g is None else torch.view_as_real(g) for g in grads]

    def hook_buffer(self) -> torch.Tensor:
        """The flat buffer a comm hook receives (complex for a complex bucket, as torch)."""
        if self.sparse:
            return self.sparse_grad
        return torch.view_as_complex(self.flat.view(-1, 2)) if self.complex else self.flat

    def nbytes(self) -> int:
        if self.sparse:
            g = self.sparse_grad
            if g is None:
                return 0
            g = g.coalesce() if not g.is_coalesced() else g
            return g.values().numel() * g.element_size() + g.indices().numel() * 8
        return self.flat.numel() * self.flat.element_size()


class Reducer:
    """Bucketed, overlapped gradient averaging for one DDP module."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 process_group, options: ReducerOptions, sparse: Sequence[bool] | None = None,
                 debug: bool = False):
        if not params:
            raise RuntimeError("fastddp: the reducer needs at least one parameter that requires grad")
        self.params = list(params)
        self.names = list(names)
        self.opts = options
        self.pg = process_group
        self.world = groups.size(process_group)
        self.rank = groups.rank(process_group)
        self.device = self.params[0].device
        self.sparse = tuple(bool(x) for x in sparse) if sparse else (False,) * len(self.params)
        # debug mode (FASTDDP_DEBUG=1): every rank checks, before any bucket
        # is reduced, that all ranks marked the same params ready (a mismatch
        # would leave one rank blocked in a collective); buckets are then all
        # issued at the end of backward (no overlap) -- see README.
        self.debug = bool(debug)
        self._comm = Comm(process_group, self.device)
        self._lock = threading.Lock()
        self._single_device = len({p.device for p in self.params}) == 1

        n = len(self.params)
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self.comm_hook: Callable | None = None
        self.comm_hook_state: Any = None
        self._fused_hook = None  # set by fastddp.hooks for the fused compression paths
        self.mixed_precision_hook: Callable | None = None  # set by the front (mixed_precision)
        self.after_finalize: Callable | None = None         # ditto: frozen params back to fp

        # Iteration state (torch's names where they exist).
        self.num_iterations = 0
        self.num_bwd_calls = 0                 # torch's num_bwd_calls_: backwards that fired a hook
        self._first_hook_called = False        # ... in the current backward
        self._reduced_since_forward = False    # a backward was reduced since the last forward
        self._warned_extra_backward = False
        self._expect_hooks = False
        self._next_bucket = 0
        self._marked = bytearray(n)
        self._marked_unused = False
        self._unused: list[int] = []
        self._static = options.static_graph
        self._dynamic_find_unused = options.find_unused_parameters and not options.static_graph
        self._local_used = bytearray(n)
        self._global_used: list[int] | None = None
        self._used_work = None
        self._used_tensor: torch.Tensor | None = None
        self._hook_counts = [0] * n          # static graph: hooks per param in iteration 1
        self._per_iter_counts: list[int] = []
        self._ready_order: list[int] = []
        self._has_rebuilt = False
        self._div_factor: int | None = None    # torch's div_factor_ (join may lower it)
        self._t_all_issued = 0.0
        self.exposed_comm_s: collections.deque = collections.deque(maxlen=32)
        self.steps_reduced = 0
        self._fwd_work = None                  # join: all-reduce counting non-joined ranks
        self._fwd_use_static_world = True
        self._fast_hooks = False       # see _make_hook
        self._collect_order = False

        self.plan = planner.initial_plan(self.params, options.bucket, self.sparse)
        self._install_plan(self.plan)

        # Readiness: a post-accumulate-grad hook per parameter: it fires once
        # per accumulation, after it, also when AccumulateGrad ran with an
        # undefined gradient (an output left out of the loss) — the same
        # firings as the post hook torch's reducer puts on the AccumulateGrad
        # node, without building tuples of grads for Python.  A no-op Python
        # hook costs ~0.6 us per parameter on the 2.8 GHz dev VM, the locked
        # path ~2 us; the lock-free path of _make_hook is in between.
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                              for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ plan
    def _install_plan(self, plan: planner.BucketPlan) -> None:
        old_buckets = getattr(self, "_buckets", None)
        old_locate = getattr(self, "_locate", None)
        self.plan = plan
        self._buckets = [_Bucket(spec, self.params, None if spec.sparse else self.opts.reduce_dtype)
                         for spec in plan.buckets]
        self._locate = [None] * len(self.params)
        for b in self._buckets:
            for pos, i in enumerate(b.indices):
                self._locate[i] = (b, pos)
        self._bucket_of = [loc[0] for loc in self._locate]
        if old_buckets is not None and any(b.residual is not None for b in old_buckets):
            # Error-feedback residuals belong to parameters: carry them over.
            for b in (b for b in self._buckets if not b.sparse):
                b.residual = torch.zeros(b.flat.numel(), dtype=torch.float32, device=b.flat.device)
                new_views = b.layout.views(b.residual)
                for pos, i in enumerate(b.indices):
                    ob, opos = old_locate[i]
                    if ob.residual is not None:
                        new_views[pos].copy_(ob.layout.views(ob.residual)[opos])
        if self.opts.gradient_as_bucket_view and old_buckets is not None:
            # As torch's initialize_bucket_views: live grads move into the new
            # buckets and become views of them.
            with torch.no_grad():
                for b in self._buckets:
                    if b.sparse:
                        continue
                    for p, v in zip(b.params, b.grad_views):
                        if p.grad is not None and p.grad is not v:
                            v.copy_(p.grad)
                            p.grad = v

    def _should_rebuild(self) -> bool:
        return self.opts.bucket.should_rebuild and not self._has_rebuilt

    def rebuild_buckets(self) -> bool:
        """Called by the front before forward: rebuild the buckets once, in the
        order gradients became ready (rank 0's order, broadcast), as torch."""
        self.ensure_prior_reduction_finished()
        if not self._should_rebuild() or not self._ready_order:
            return False
        n = len(self.params)
        if len(self._ready_order) != n:
            # an iteration that did not finish (its error was caught): learn
            # the order again from the next complete backward
            self._ready_order = []
            return False
        order = torch.tensor(self._ready_order, dtype=torch.int64, device=self.device)
        groups.broadcast(order, self.pg, src=0)
        plan = planner.rebuilt_plan(self.params, order.tolist(), self.opts.bucket, self.sparse)
        self._install_plan(plan)
        self._has_rebuilt = True
        self._ready_order = []
        return True

    # ----------------------------------------------------------- iteration
    def prepare_for_forward(self, sync: bool = True) -> None:
        """Every forward of the module; ``sync``: its backward will be reduced."""
        self._reduced_since_forward = False
        if sync:
            self.num_iterations += 1
            self._fwd_work = None

    def set_forward_pass_work_handle(self, work, use_static_world_size: bool) -> None:
        """join(): the forward's all-reduce of ones counts the ranks still
        training; unless ``use_static_world_size`` it becomes the divisor."""
        self._fwd_work = work
        self._fwd_use_static_world = use_static_world_size

    def divide_factor(self) -> int:
        """What gradients are averaged over this iteration (torch's
        set_divide_factor): the world size, or under join(divide_by_initial_
        world_size=False) the number of ranks that have not joined."""
        if self._div_factor is None:
            d = self.world
            if self._fwd_work is not None and not self._fwd_use_static_world:
                groups.wait(self._fwd_work)
                d = int(self._fwd_work.result()[0].item())
            self._div_factor = d
        return self._div_factor

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the hooks for the coming backward (the front calls it after a
        forward that should synchronise)."""
        self.ensure_prior_reduction_finished()
        self._expect_hooks = True
        self._first_hook_called = False
        self._next_bucket = 0
        for b in self._buckets:
            b.pending = b.size
            b.work = None
        self._marked = bytearray(len(self.params))
        self._marked_unused = False
        if self._dynamic_find_unused:
            self._global_used = None
        if self._static:
            self._per_iter_counts = list(self._hook_counts)
        if self._dynamic_find_unused:
            self._unused = self._search_unused(outputs)
        self._collect_order = self._should_rebuild()
        self._fast_hooks = self._single_device and not (
            self._track_used or self._static or self._unused or self._collect_order or self.debug)

    def _search_unused(self, outputs: Sequence[torch.Tensor]) -> list[int]:
        """Params whose AccumulateGrad node is not reachable from the outputs."""
        seen = set()
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        reached = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                i = self._index_of.get(id(var))
                if i is not None:
                    reached.add(i)
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)
        return [i for i in range(len(self.params)) if i not in reached]

    @property
    def _static_first_iteration(self) -> bool:
        # torch counts backward passes (num_bwd_calls_), not forwards: a
        # forward re-run inside backward (non-reentrant checkpoint around the
        # whole module) must not end the first iteration early.
        return self._static and self.num_bwd_calls <= 1

    @property
    def _static_after_first_iteration(self) -> bool:
        return self._static and self.num_bwd_calls > 1

    @property
    def _track_used(self) -> bool:
        return self._dynamic_find_unused or self._static_first_iteration

    # ------------------------------------------------------------ readiness
    def _make_hook(self, index: int):
        reducer = self

        def hook(_param):
            if reducer._fast_hooks:
                # The common case (single device, hooks armed, no unused-param
                # tracking, no static-graph counting, order already known):
                # straight to the countdown, without the lock, because all of
                # one device's hooks run on one autograd thread.
                reducer._mark_ready(index)
            else:
                reducer._autograd_hook(index)
        return hook

    def _autograd_hook(self, index: int) -> None:
        # Hooks of params on several devices run on several autograd threads.
        with self._lock:
            if not self._first_hook_called:
                self._first_hook_called = True
                self.num_bwd_calls += 1
                if self.debug and self._expect_hooks:
                    torch.autograd.Variable._execution_engine.queue_callback(self._debug_end_of_backward)
            if self._track_used and self.params[index].grad is not None:
                self._local_used[index] = 1
            if self._static_first_iteration:
                self._hook_counts[index] += 1
                return
            if not self._expect_hooks:
                if self._reduced_since_forward and not self._warned_extra_backward:
                    # Not an error: calling ``ddp.module`` directly for a local
                    # step is a known pattern; retain_graph twice is the usual bug.
                    self._warned_extra_backward = True
                    warnings.warn(
                        f"fastddp: parameter {self.names[index]!r} got a gradient from a backward "
                        "that no DDP forward prepared, after this iteration's gradients were "
                        "already averaged (e.g. backward(retain_graph=True) twice over one "
                        "forward, or a forward through ddp.module). Those gradients are LOCAL, "
                        "not synchronised across ranks, and are added to the averaged ones. Run a "
                        "new forward through the DDP module for every backward, or accumulate "
                        "inside no_sync() and reduce with the last backward. (Warned once.)",
                        RuntimeWarning, stacklevel=2)
                return  # no_sync(), eval, or a backward that DDP did not prepare
            if not self._marked_unused:
                self._marked_unused = True
                for u in self._unused:
                    self._mark_ready(u)
            if self._static:
                left = self._per_iter_counts[index]
                if left <= 0:
                    self._abort_iteration()
                    raise RuntimeError(
                        "Your training graph has changed in this iteration, e.g., one parameter is "
                        "unused in first iteration, but then got used in the second iteration. this "
                        "is not compatible with static_graph set to True. "
                        f"fastddp: parameter {self.names[index]!r} (index {index}) produced more "
                        "gradients in this backward than in the first iteration. Pass "
                        "static_graph=False (with find_unused_parameters=True if some parameters "
                        "are unused in some iterations).")
                self._per_iter_counts[index] = left - 1
                if left > 1:
                    return
            if self._should_rebuild():
                self._ready_order.append(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._marked[index]:
            self._abort_iteration()
            raise RuntimeError(
                "Expected to mark a variable ready only once. "
                f"fastddp: parameter {self.names[index]!r} (index {index}) was marked ready twice in "
                "one iteration: several autograd hooks fired for it. This happens when a parameter "
                "is used outside forward(), when parameters are shared across concurrent "
                "forward/backward passes, or when reentrant backward passes (checkpoint with "
                "use_reentrant=True) reuse it. If your graph does not change between iterations, "
                "pass static_graph=True.")
        self._marked[index] = 1
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._bucket_complete(bucket)

    def _bucket_complete(self, bucket: _Bucket) -> None:
        try:
            self._pack(bucket)
            if self.debug:
                return  # issued by _debug_end_of_backward, after the cross-rank check
            self._launch_ready()
        except BaseException:
            self._abort_iteration()  # a hook's error: the next iteration starts clean
            raise
        if self._next_bucket == len(self._buckets):
            self._all_buckets_issued()

    @property
    def _require_finalize(self) -> bool:
        """torch's require_finalize_: this backward marked some parameter
        ready and its end-of-backward finalize has not run."""
        return self._expect_hooks and any(self._marked)

    def _all_buckets_issued(self) -> None:
        self._t_all_issued = time.perf_counter()
        self._comm.mark_all_issued()
        if self._dynamic_find_unused:
            self._all_reduce_used_map()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _all_reduce_used_map(self) -> None:
        self._used_tensor = torch.tensor(list(self._local_used), dtype=torch.int32, device=self.device)
        self._used_work = groups.all_reduce(self._used_tensor, self.pg, async_op=True)

    # ------------------------------------------------------------- debug
    def _debug_end_of_backward(self) -> None:
        """Debug mode, end of every prepared backward: all ranks compare which
        params were marked ready before any bucket is reduced, so a rank whose
        graph differs raises here instead of leaving its peers blocked in a
        collective; then the buckets are issued."""
        if not self._expect_hooks or self._static_first_iteration:
            return
        marked = torch.tensor(list(self._marked), dtype=torch.uint8, device=self.device)
        if self.world > 1:
            if groups.is_registered(self.pg) and groups.backend_name(self.pg) == "gloo":
                dist.monitored_barrier(group=self.pg, wait_all_ranks=True)
            every = [torch.empty_like(marked) for _ in range(self.world)]
            groups.all_gather(every, marked, self.pg)
            every = [e.cpu() for e in every]
            for r in range(self.world):
                diff = (every[r] != every[0]).nonzero().flatten().tolist()
                if diff:
                    self._abort_iteration()
                    desc = ", ".join(
                        f"{self.names[i]!r} ({'ready' if every[0][i] else 'no gradient'} on rank 0, "
                        f"{'ready' if every[r][i] else 'no gradient'} on rank {r})" for i in diff[:10])
                    raise RuntimeError(
                        f"fastddp (debug mode): the ranks disagree on which parameters received a "
                        f"gradient in this backward: {desc}. Without find_unused_parameters=True "
                        "every rank must use the same parameters each iteration (otherwise a rank "
                        "waits forever in a bucket's all-reduce). Pass "
                        "find_unused_parameters=True, or make the graphs agree.")
        if all(b.pending == 0 for b in self._buckets):
            self._launch_ready()
            self._t_all_issued = time.perf_counter()
            self._comm.mark_all_issued()
            if self._dynamic_find_unused:
                self._all_reduce_used_map()
            self._finalize()

    # ------------------------------------------------------------------ pack
    def _pack(self, bucket: _Bucket) -> None:
        """Fill the bucket's flat buffer (or a fused hook's wire buffer) from its
        params' grads: torch's mark_variable_ready_dense + flush_deferred_copies
        in one launch."""
        if bucket.sparse:
            self._pack_sparse(bucket)
            return
        grads = [p.grad for p in bucket.params]
        with profiling.range(f"fastddp/pack[{bucket.index}]", self._comm.cuda), \
                self._comm.pack_context(bucket.ready_event), torch.no_grad():
            if self._fused_hook is not None:
                self._fused_hook.pack(self, bucket, grads)
            elif self.comm_hook is not None:
                self.fill_flat(bucket, grads, None)
            elif self.opts.batched_grad_copy:
                self.fill_flat(bucket, grads, "div")
            else:
                self.fill_flat(bucket, grads, "mul")

    def _pack_sparse(self, bucket: _Bucket) -> None:
        """torch's mark_variable_ready_sparse: the sparse grad itself is the
        bucket, divided by W unless a hook divides."""
        p, i = bucket.params[0], bucket.indices[0]
        g = p.grad
        if g is None or g.layout != torch.sparse_coo:
            self._abort_iteration()
            raise RuntimeError(
                ("Expected sparse gradient to be defined." if g is None else
                 "Expected variable to have sparse gradient.") +
                f" fastddp: parameter {self.names[i]!r} belongs to a module with sparse gradients "
                f"(sparse=True) but its .grad is {'None' if g is None else g.layout} on rank "
                f"{self.rank}. Sparse parameters must get a gradient in every iteration.")
        with profiling.range(f"fastddp/pack[{bucket.index}]", self._comm.cuda), \
                self._comm.pack_context(bucket.ready_event), torch.no_grad():
            if self.comm_hook is None:
                g.div_(self.divide_factor())
        bucket.sparse_grad = g

    def plain_grads(self, bucket: _Bucket, grads) -> bool:
        """True when every grad exists and none aliases the bucket yet: the
        case one fused pack serves directly from the separate grads."""
        if any(g is None for g in grads):
            return False
        if self.opts.gradient_as_bucket_view:
            return not any(g is v for g, v in zip(grads, bucket.grad_views))
        return True

    def alias_views(self, bucket: _Bucket, grads) -> None:
        """gradient_as_bucket_view: the grads become views of the bucket.  The
        grads they replace were just read by a pack queued on the comm stream:
        tell the allocator, or it hands their blocks to later backward kernels
        on the compute stream before the pack has read them."""
        if self.opts.gradient_as_bucket_view:
            release = self._comm.release
            for p, g, v in zip(bucket.params, grads, bucket.grad_views):
                if g is not None and g is not v:
                    release(g)
                p.grad = v

    def fill_flat(self, bucket: _Bucket, grads, scaling: str | None) -> None:
        """Write grads into ``bucket.flat``; ``scaling`` is ``"mul"`` (torch's
        default: * fp32(1/W)), ``"div"`` (batched_grad_copy: / W) or None (a
        comm hook divides itself)."""
        W = self.divide_factor()
        if self.plain_grads(bucket, grads):
            src = bucket.kernel_grads(grads)
            if scaling == "mul":
                kernels.pack(src, bucket.flat, layout=bucket.layout, scale=1.0 / W)
            elif scaling == "div":
                kernels.pack(src, bucket.flat, layout=bucket.layout, divide=W)
            else:
                kernels.pack(src, bucket.flat, layout=bucket.layout)
            self.alias_views(bucket, grads)
            return
        if self.opts.gradient_as_bucket_view and all(g is v for g, v in zip(grads, bucket.grad_views)):
            if scaling is not None:
                bucket.flat.div_(W)  # torch: per-view div_ (aliased) / flat div_ (batched)
            return
        self._fill_flat_mixed(bucket, grads, scaling, W)

    def _fill_flat_mixed(self, bucket: _Bucket, grads, scaling: str | None, W: int) -> None:
        """Some grads missing or already aliased: torch's per-parameter rules."""
        view_mode = self.opts.gradient_as_bucket_view
        batched = scaling == "div"
        release = self._comm.release
        deferred_src, deferred_dst, deferred_params = [], [], []
        for p, g, v, gv in zip(bucket.params, grads, bucket.views, bucket.grad_views):
            if g is None:
                v.zero_()
            elif g is gv:
                if scaling == "mul":
                    v.div_(W)
            else:
                if g.layout != torch.strided:
                    raise RuntimeError(
                        f"fastddp: parameter {self.names[self._index_of[id(p)]]!r} has a "
                        f"{g.layout} gradient but its module does not declare sparse gradients "
                        "(nn.Embedding/EmbeddingBag(sparse=True) do); fastddp reduces it only "
                        "when the module declares it.")
                src = torch.view_as_real(g) if bucket.complex else g
                if batched and not g.requires_grad:
                    deferred_src.append(src)
                    deferred_dst.append(v)
                    deferred_params.append((p, g, gv))
                    continue
                if scaling is None:
                    v.copy_(src)
                else:
                    torch.mul(src, 1.0 / W, out=v)
                if view_mode:
                    release(g)
                    p.grad = gv
        if batched:
            if deferred_src:
                torch._foreach_copy_(deferred_dst, deferred_src)
                if view_mode:
                    for p, g, gv in deferred_params:
                        release(g)
                        p.grad = gv
            bucket.flat.div_(W)

    # ---------------------------------------------------------------- launch
    def _launch_ready(self) -> None:
        """Issue collectives strictly in bucket order (same order on every rank)."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(buckets[self._next_bucket])
            self._next_bucket += 1

    def _is_unused_bucket(self, bucket: _Bucket) -> bool:
        unused = set(self._unused)
        return all(i in unused for i in bucket.indices)

    def _launch(self, bucket: _Bucket) -> None:
        if self.opts.skip_all_reduce_unused_params and self._is_unused_bucket(bucket):
            bucket.work = None
            return
        with profiling.range(f"fastddp/allreduce[{bucket.index}]", self._comm.cuda), \
                self._comm.comm_context():
            if self._fused_hook is not None and not bucket.sparse:
                bucket.work = self._fused_hook.launch(self, bucket)
            elif self.comm_hook is not None:
                bucket.work = self._run_hook(bucket, bucket.hook_buffer())
            elif bucket.sparse:
                bucket.work = self._comm.all_reduce(bucket.sparse_grad, nbytes=bucket.nbytes())
            else:
                bucket.work = self._comm.all_reduce(bucket.flat)

    def _run_hook(self, bucket: _Bucket, buffer: torch.Tensor) -> Pending:
        from .hooks import GradBucket

        layout = None if bucket.sparse else bucket.hook_layout
        gb = GradBucket(bucket.index, len(self._buckets), buffer, bucket.params, None, layout)
        fut = self.comm_hook(self.comm_hook_state, gb)
        if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
            raise TypeError(
                f"fastddp: the comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} "
                f"returned {type(fut).__name__} for bucket {bucket.index}; it must return a "
                "torch.futures.Future whose value is the reduced bucket tensor")
        nbytes = bucket.nbytes() if bucket.sparse else buffer.numel() * buffer.element_size()
        return self._comm.hook(fut, nbytes)

    # -------------------------------------------------------------- finalize
    def delay_all_reduce(self) -> None:
        """static_graph, first iteration: nothing was reduced during backward;
        learn the unused params, then reduce every bucket now (torch's
        ``_delay_all_reduce``)."""
        with self._lock:
            self._all_reduce_used_map()
            self._unused = [i for i, c in enumerate(self._hook_counts) if c == 0]
            for b in self._buckets:
                self._pack(b)
                self._launch(b)
            self._next_bucket = len(self._buckets)
            self._t_all_issued = time.perf_counter()
            self._comm.mark_all_issued()
            self._expect_hooks = True
        self._finalize()

    def _global_unused(self, index: int) -> bool:
        """torch's lazy rule: a param used locally is used globally; otherwise
        wait for the all-reduced used-map (once) and look there.  With
        static_graph the map of the first iteration holds for good."""
        if self._local_used[index]:
            return False
        if self._global_used is None:
            if self._used_work is None:
                return False  # no map was reduced: nothing is known to be unused
            groups.wait(self._used_work)
            self._used_work = None
            self._global_used = self._used_tensor.tolist()
        return self._global_used[index] == 0

    def _finalize(self) -> None:
        with profiling.range("fastddp/finalize", self._comm.cuda):
            if not self._expect_hooks:
                raise RuntimeError("fastddp internal error: finalize ran without a prepared backward")
            if self._next_bucket != len(self._buckets):
                raise RuntimeError(
                    f"fastddp internal error: finalize before all buckets were issued "
                    f"({self._next_bucket} of {len(self._buckets)})")
            self._expect_hooks = False
            self._fast_hooks = False
            self._first_hook_called = False
            self._div_factor = None  # join may change it by the next iteration
            track = self._static or self.opts.find_unused_parameters
            with self._comm.comm_context(), torch.no_grad():
                for bucket in self._buckets:
                    if bucket.work is None:
                        continue  # skipped (skip_all_reduce_unused_params)
                    with profiling.range(f"fastddp/wait[{bucket.index}]", self._comm.cuda):
                        result = self._comm.wait(bucket.work)
                    bucket.work = None
                    with profiling.range(f"fastddp/unpack[{bucket.index}]", self._comm.cuda):
                        if bucket.sparse:
                            self._unpack_sparse(bucket, result)
                        elif self._fused_hook is not None:
                            self._fused_hook.unpack(self, bucket, track)
                        else:
                            src = bucket.flat if self.comm_hook is None else self._hook_result(bucket, result)
                            self._unpack(bucket, src, track)
            self._comm.join_compute_stream()
            if self.after_finalize is not None:
                self.after_finalize()
            if self._t_all_issued:
                # Host view of what backward failed to hide: from the last
                # bucket's issue (~ the last gradient) to all buckets reduced.
                # On CUDA, Comm times the same span with events (stats()).
                self.exposed_comm_s.append(time.perf_counter() - self._t_all_issued)
                self._t_all_issued = 0.0
            self.steps_reduced += 1
            self._reduced_since_forward = True
            if self._used_work is not None:
                # Never let the next iteration's map race this one.
                groups.wait(self._used_work)
                self._used_work = None
                self._global_used = self._used_tensor.tolist()
            if self._dynamic_find_unused:
                self._local_used = bytearray(len(self.params))
                self._global_used = None
            if self._static_after_first_iteration and self._should_rebuild():
                for u in self._unused:
                    self._ready_order.append(u)

    def _hook_result(self, bucket: _Bucket, result) -> torch.Tensor:
        if isinstance(result, (list, tuple)):
            result = result[0] if result else None
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"fastddp: the comm hook's Future for bucket {bucket.index} resolved to "
                f"{type(result).__name__}; it must hold one tensor (the reduced bucket)")
        expected = bucket.flat.numel() // 2 if bucket.complex else bucket.flat.numel()
        if bucket.complex and not result.is_complex() and result.numel() == bucket.flat.numel():
            return result.reshape(-1)  # c10d reduced the complex buffer as its real view
        if result.numel() != expected:
            raise ValueError(
                f"fastddp: the comm hook returned {result.numel()} elements for bucket "
                f"{bucket.index}, which holds {expected}; a hook must return a tensor "
                "with the bucket's numel")
        if result.is_complex():
            return torch.view_as_real(result.reshape(-1)).reshape(-1)
        return result.reshape(-1)

    def _unpack_sparse(self, bucket: _Bucket, result) -> None:
        """The reduced sparse gradient replaces .grad (torch copies it into the
        bucket's gradient, which is the .grad tensor)."""
        p, g = bucket.params[0], bucket.sparse_grad
        bucket.sparse_grad = None
        if self.comm_hook is not None:
            if isinstance(result, (list, tuple)):
                result = result[0] if result else None
            if not isinstance(result, torch.Tensor):
                raise TypeError(
                    f"fastddp: the comm hook's Future for (sparse) bucket {bucket.index} resolved "
                    f"to {type(result).__name__}; it must hold one tensor")
        elif isinstance(result, (list, tuple)) and result:
            result = result[0]
        if isinstance(result, torch.Tensor) and result is not g:
            g.copy_(result)
        if p.grad is not g:
            p.grad = g

    def _unpack(self, bucket: _Bucket, src: torch.Tensor, track_unused: bool) -> None:
        """Write the reduced bucket back into .grad (torch's finalize_bucket_dense)."""
        if self.mixed_precision_hook is not None:
            self.mixed_precision_hook(bucket, self._comm)  # full-precision params and grads back first
        if self.opts.gradient_as_bucket_view:
            if src is not bucket.flat:
                kernels.unpack(src, [bucket.flat], layout=bucket.flat_layout)  # one launch, casts back
            for i, p, v in zip(bucket.indices, bucket.params, bucket.grad_views):
                if track_unused and self._global_unused(i):
                    continue
                g = p.grad
                if g is None:
                    p.grad = v
                elif g is not v:
                    raise RuntimeError(
                        f"fastddp: the gradient of {self.names[i]!r} is not the expected bucket view "
                        "with gradient_as_bucket_view=True (was .grad replaced during backward?)")
            return
        grads = [p.grad for p in bucket.params]
        unused = any(self._global_unused(i) for i in bucket.indices) if track_unused else False
        if not unused and all(g is not None for g in grads):
            kernels.unpack(src, bucket.kernel_grads(grads), layout=bucket.layout)
            return
        views = bucket.layout.views(src)
        for i, p, g, v in zip(bucket.indices, bucket.params, grads, views):
            if track_unused and self._global_unused(i):
                continue  # globally unused: .grad untouched, as torch
            if bucket.complex:
                v = torch.view_as_complex(v)
            if g is None:
                p.grad = self._comm.hand_over(torch.empty_like(p, memory_format=torch.preserve_format).copy_(v))
            else:
                g.copy_(v)

    # ------------------------------------------------------------------ join
    def shadow_backward(self) -> None:
        """A joined rank mirrors one backward of the ranks still training:
        the same collectives, bucket by bucket in order, on zeros."""
        with self._comm.comm_context(), torch.no_grad():
            pending = []
            for bucket in self._buckets:
                pending.append(self._shadow_bucket(bucket))
            for p in pending:
                self._comm.wait(p)

    def _shadow_bucket(self, bucket: _Bucket) -> Pending:
        if bucket.sparse:
            p = bucket.params[0]
            zeros = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                            torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                            p.shape)
            if self.comm_hook is not None:
                bucket.sparse_grad = zeros
                try:
                    return self._run_hook(bucket, zeros)
                finally:
                    bucket.sparse_grad = None
            return self._comm.all_reduce(zeros, nbytes=0)
        if self._fused_hook is not None:
            return self._fused_hook.shadow(self, bucket)
        if self.comm_hook is not None:
            zeros = torch.zeros_like(bucket.hook_buffer())
            return self._run_hook(bucket, zeros)
        return self._comm.all_reduce(torch.zeros_like(bucket.flat))

    def shadow_used_map(self) -> None:
        """A joined rank's part of the find_unused_parameters used-map all-reduce."""
        groups.all_reduce(torch.zeros(len(self.params), dtype=torch.int32, device=self.device), self.pg)

    def push_all_rebuilt_params(self) -> None:
        """A joined rank that never ran a backward still takes part in the one
        bucket rebuild (torch's _push_all_rebuilt_params)."""
        if self._should_rebuild() and not self._ready_order:
            self._ready_order = list(range(len(self.params)))

    # ---------------------------------------------------------------- errors
    def _abort_iteration(self) -> None:
        """An error is being raised in this iteration: drop its state so the
        next well-formed iteration trains normally (nothing of the failed one
        may leak into it: partial ready order, marks, armed hooks)."""
        self._expect_hooks = False
        self._fast_hooks = False
        self._first_hook_called = False
        self._next_bucket = 0
        self._ready_order = []
        for b in self._buckets:
            b.work = None
            b.sparse_grad = None
            b.pending = b.size

    def ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
            return
        missing = [i for i in range(len(self.params)) if not self._marked[i]]
        names = ", ".join(f"{self.names[i]!r} (index {i})" for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        # Reset so the error is not raised forever after a user catches it.
        self._abort_iteration()
        if self._static:
            hint = ("With static_graph=True the set of parameters used must be the same in every "
                    "iteration as in the first one: your graph has changed (a parameter used in "
                    "the first iteration is unused now). Pass static_graph=False with "
                    "find_unused_parameters=True if the graph changes between iterations.")
        else:
            hint = ("You can enable unused parameter detection by passing the keyword argument "
                    "`find_unused_parameters=True` to `fastddp.DistributedDataParallel` (as with "
                    "torch's DDP), and by making sure all `forward` function outputs participate "
                    "in calculating loss.")
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. "
            "This error indicates that your module has parameters that were not used in producing "
            f"loss. {hint} Parameters that did not receive a gradient on rank {self.rank}: "
            f"{names}{more}.")

    # ----------------------------------------------------------------- stats
    @property
    def comm_stream(self):
        """The CUDA side stream the buckets are packed, reduced and unpacked on
        (None on CPU)."""
        return self._comm.comm_stream

    def register_comm_hook(self, hook: Callable, state: Any, fused) -> None:
        """Install a comm hook (``fused``: its fused execution, or None)."""
        self.comm_hook = hook
        self.comm_hook_state = state
        self._fused_hook = fused

    @property
    def has_comm_hook(self) -> bool:
        return self.comm_hook is not None

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket (sparse: of its last gradient)."""
        return [b.nbytes() for b in self._buckets]

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._has_rebuilt

    def stats(self) -> dict:
        fused = self._fused_hook
        hook = self.comm_hook
        return {
            "world_size": self.world,
            "iterations": self.num_iterations,
            "steps_reduced": self.steps_reduced,
            "has_rebuilt_buckets": self._has_rebuilt,
            "kernel_backend": kernels.backend(self.device),
            "comm_hook": None if hook is None else getattr(hook, "__name__", repr(hook)),
            "fused_path": None if fused is None else (fused.kind, str(fused.dtype) if fused.dtype else None),
            "collectives": self._comm.collectives,
            "bytes_on_wire": self._comm.bytes_on_wire,
            "exposed_comm_ms_last": [round(t * 1e3, 3) for t in self.exposed_comm_s],
            "exposed_comm_source": "host",
            **self._comm.exposed_stats(),
            "debug": self.debug,
            "buckets": [
                {"index": b.index,
                 "dtype": str(b.params[0].dtype if b.sparse or b.complex else b.flat.dtype),
                 "device": str(b.params[0].device),
                 "numel": b.spec.numel, "bytes": b.nbytes(), "sparse": b.sparse,
                 "params": [self.names[i] for i in b.indices]}
                for b in self._buckets
            ],
        }

    # torch's private names, which frameworks (Lightning) call on ddp.reducer
    def _rebuild_buckets(self) -> bool:
        return self.rebuild_buckets()

    def _delay_all_reduce(self) -> None:
        self.delay_all_reduce()

    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
