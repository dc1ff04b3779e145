"""The ``nn.Module`` front: torch 2.13's DistributedDataParallel signature and
semantics; all bucket logic lives in :mod:`fastddp.reducer`."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

import torch
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _exit, agree, compile as _compile, groups, join, profiling, settings
from ._torch_ddp import TorchDDP
from .config import DDPConfig, params_for_reducer
from .options import Options
from .surface import TorchSurface
from .buffers import ForwardBuffers
from .construct import build_reducer

__all__ = ["DistributedDataParallel"]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


class _Sink(torch.autograd.Function):
    """Outputs pass through it (torch's ``_DDPSink``): with
    find_unused_parameters, outputs left out of the loss still deliver
    (undefined) gradients, so their params are marked ready; with static_graph
    it queues the first iteration's delayed all-reduce."""

    @staticmethod
    def forward(ctx, ddp_ref, *inputs):
        ctx.set_materialize_grads(False)
        ctx.ddp_ref = ddp_ref
        ddp = ddp_ref()
        if ddp is not None and not ddp._ddp_sink_clone:  # _set_ddp_sink_clone(False)
            return inputs
        return tuple(t.clone() for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ddp = ctx.ddp_ref()
        if ddp is not None and ddp.static_graph and not ddp._static_graph_delay_allreduce_enqueued:
            torch.autograd.Variable._execution_engine.queue_callback(ddp.reducer.delay_all_reduce)
            ddp._static_graph_delay_allreduce_enqueued = True
        return (None, *grads)


class _DDPType(type(TorchDDP)):
    """fastddp's metaclass: dynamo's DDP protocol has ONE active-module slot,
    ``_active_ddp_module`` on torch's class.  torch's own code sets it through
    the module-level name ``DistributedDataParallel``, which a user may have
    swapped to fastddp's class; an assignment on fastddp's class would hide
    the slot from code that reads torch's.  Assignments go to torch's class."""

    def __setattr__(cls, name, value):
        if name == "_active_ddp_module":
            type.__setattr__(TorchDDP, name, value)
        else:
            super().__setattr__(name, value)


class DistributedDataParallel(TorchSurface, TorchDDP, metaclass=_DDPType):
    """Drop-in replacement for :class:`torch.nn.parallel.DistributedDataParallel`.

    Same constructor, same semantics, same gradients (bit for bit where the
    arithmetic allows: docs/architecture.md); the reducer packs each bucket's gradients
    in one fused launch, overlaps its all-reduce with the rest of backward
    and unpacks it in one fused launch.

    A subclass of torch's class, so ``isinstance(model,
    torch.nn.parallel.DistributedDataParallel)`` holds; torch's constructor
    never runs, and every method of torch's class is fastddp's own or proven
    correct without it (:mod:`fastddp.surface`).

    fastddp's own arguments are keyword-only: ``check_finite`` and
    ``options`` (a :class:`fastddp.Options`: the wire recipe, bucket
    auto-tuning, chunking, the in-place threshold, the hierarchy).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list=None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        check_finite: bool | str | None = None,
        options: Options | None = None,
    ):
        torch.nn.Module.__init__(self)  # NOT torch DDP's constructor: no C++ reducer
        Joinable.__init__(self)
        cfg = DDPConfig.resolve(
            module, device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, init_sync=init_sync, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
            device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list, batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers, check_finite=check_finite, options=options)
        self.config = cfg
        self.module = module
        self.process_group, self.device_mesh = cfg.process_group, cfg.device_mesh
        self.device_ids, self.output_device, self.dim = cfg.device_ids, cfg.output_device, cfg.dim
        self.device_type, self.device, self.is_multi_device_module = cfg.device_type, cfg.device, False
        self.parameters_to_ignore = set(cfg.parameters_to_ignore)
        self.forward_sync_buffers = cfg.forward_sync_buffers
        self.find_unused_parameters = cfg.find_unused_parameters
        self.gradient_as_bucket_view = cfg.gradient_as_bucket_view
        self.batched_grad_copy = cfg.batched_grad_copy
        self.skip_all_reduce_unused_params = cfg.skip_all_reduce_unused_params
        self.mixed_precision = cfg.mixed_precision
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = False
        self._static_graph_delay_allreduce_enqueued = False
        self._divide_by_initial_world_size = True
        self.broadcast_bucket_size = _BROADCAST_BUCKET_BYTES
        self.use_side_stream_for_tensor_copies = settings.get().use_side_stream
        self._ddp_sink_clone = True
        self._passing_sync_batchnorm_handle(module)
        # gloo's and NCCL's threads release finished work, and the Python
        # tensors it holds, after the waiter wakes: wait for them at exit (see _exit)
        _exit.install()
        self._comm_hooks: list[tuple[Callable, object]] = []
        self._mp = None
        self._delayed = None
        if cfg.delay_params:
            from .delayed import DelayedAllReduce

            self._delayed = DelayedAllReduce(cfg.delay_params, cfg.param_to_hook_all_reduce,
                                             self.process_group, self.broadcast_bucket_size)
            if cfg.all_params_delayed:
                self.reducer = None
                return

        parameters, names = self._build_params_for_reducer()
        if cfg.init_sync:
            from torch.distributed.utils import _sync_module_states

            from .verify import verify_across_ranks

            bufs = self.named_module_buffers if cfg.init_sync_buffers else {}
            verify_across_ranks(self.process_group, parameters, names, list(bufs.values()), list(bufs))
            agree.check(self)  # before the reducer's own collectives (the options' hook may make groups)
            _sync_module_states(module=self.module, process_group=self.process_group,
                                broadcast_bucket_size=self.broadcast_bucket_size, src=0,
                                params_and_buffers_to_ignore=self.parameters_to_ignore,
                                broadcast_buffers=cfg.init_sync_buffers)
        if cfg.mixed_precision is not None:
            from .mixed_precision import MixedPrecision

            self._mp = MixedPrecision(self, cfg.mixed_precision, parameters)
        self._build_reducer(parameters, names, cfg.static_graph)
        if cfg.static_graph:
            self._set_static_graph()

    # ---------------------------------------------------------- construction
    def _build_params_for_reducer(self):
        params, names, self._sparse_params = params_for_reducer(self.module, self.parameters_to_ignore)
        self.forward_buffers = ForwardBuffers(self.module, self.parameters_to_ignore, self.process_group,
                                              self.broadcast_bucket_size)
        return params, names

    def _assign_modules_buffers(self):
        self.forward_buffers.collect()

    modules_buffers = property(lambda self: self.forward_buffers.tensors, doc="torch's: the buffers broadcast.")
    named_module_buffers = property(lambda self: self.forward_buffers.named)

    def _build_reducer(self, parameters, names, static_graph: bool) -> None:
        self._watch, self.reducer = build_reducer(self, parameters, names, self._sparse_params, self._mp,
                                                  static_graph)

    # ----------------------------------------------------------------- forward
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def bucket_bytes_cap(self) -> int:
        """torch DDP's attribute: torch.compile splits the graph at this many bytes."""
        return _compile.bucket_bytes_cap(self)

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.forward_buffers.tensors) > 0

    def _sync_buffers(self) -> None:
        # Under join() rank 0 may have joined with stale buffers: agree on a source.
        src = (join.find_common_rank(self, groups.rank(self.process_group), True)
               if self._join_config.enable else 0)
        self.forward_buffers.broadcast(src)

    @_compile.eager  # never traced by torch.compile
    def _pre_forward(self, *inputs, **kwargs):
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.reducer.prepare_for_forward(grad_sync)
        if self.reducer.debug:
            self._watch.check()
        elif self._watch.frozen:
            self._watch.check_frozen()
        work = Join.notify_join_context(self)
        if work:
            self.reducer.set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if grad_sync or self._join_config.enable:  # (in join(), every forward is collective)
            agree.once(self)
        if torch.is_grad_enabled() and self.reducer.rebuild_buckets():
            self._watch.check()
        if self.will_sync_module_buffers():
            self._sync_buffers()
        if self._join_config.enable:
            join.global_requires_backward_grad_sync(self, is_joined_rank=False)
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs

            moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs,
                                                    torch.device(self.device_type, self.device_ids[0]),
                                                    self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved_inputs[0], moved_kwargs[0]
        if self._mp is not None:
            inputs, kwargs = self._mp.pre_forward(inputs, kwargs)
        return inputs, kwargs

    @_compile.eager  # never traced by torch.compile
    def _post_forward(self, output):
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if grad and not sync:
            # the graph just built holds each parameter's AccumulateGrad node:
            # the native hooks follow nodes torch replaced (mixed_precision's
            # swap; .half()/.float()/.to() after wrapping, e.g. around an eval);
            # a synced forward's prepare_for_backward does it in its arm
            self.reducer.refresh_hooks()
        if sync:
            if not self.require_forward_param_sync:  # (nn.Module's __setattr__ only where it changes)
                self.require_forward_param_sync = True
            walk = self.find_unused_parameters and not self.static_graph  # the outputs' graph
            outs = [output] if isinstance(output, torch.Tensor) else [
                t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            self.reducer.prepare_for_backward(outs if walk else [])
            self.reducer.watch_outputs(outs)  # a second backward through them is reduced too
        elif self.require_forward_param_sync:
            self.require_forward_param_sync = False
        if (self.find_unused_parameters and not self.static_graph) or (
                self.static_graph and not self._static_graph_delay_allreduce_enqueued):
            leaves, spec = tree_flatten(output)
            idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if idx and grad:
                passed = _Sink.apply(weakref.ref(self), *[leaves[i] for i in idx])
                for i, t in zip(idx, passed):
                    leaves[i] = t
                output = tree_unflatten(leaves, spec)
        return output

    @_compile.eager_frame  # torch.compile skips this frame (no graph break), compiles the module's
    def forward(self, *inputs, **kwargs):
        with profiling.range("fastddp/forward", self.device_type == "cuda"):
            if self.reducer is None:  # every parameter is delayed
                output = _compile.run_module(self, inputs, kwargs)
                self._delayed.clear_grad_buffer()
                return output
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            output = _compile.run_module(self, inputs, kwargs)
            output = self._post_forward(output)
            if self._delayed is not None:
                self._delayed.clear_grad_buffer()
            if self._mp is not None and not torch.is_grad_enabled():
                # no backward will follow to restore them: full precision now
                # (under no_sync() the local backward still needs the copies)
                self._mp.restore_all()
            return output

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the context
        reduces what was accumulated (the forward must be inside the context)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------- hooks
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Register ``hook(state, bucket) -> Future[Tensor]`` for every bucket
        (torch's contract: once, before the first backward)."""
        from . import hooks

        # a hook set by the options' wire recipe is not in _comm_hooks: a user's hook replaces it
        hooks.check_registration(hook, state, registered=bool(self._comm_hooks),
                                 mixed_precision=self._mp is not None,
                                 stepped=self.reducer.num_iterations > 0, sparse=any(self.reducer.sparse))
        group = hooks.state_group(state)
        self.reducer.register_comm_hook(hook, state, group is None or group is self.process_group)
        self._comm_hooks.append((hook, state))

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """What the reducer did: buckets (dtype, size, params), collectives and
        bytes handed to them, kernel counters, and the exposed communication
        (host time from the last bucket's issue to all grads reduced) of the
        last steps.  Plain data: print it, log it, json.dump it."""
        from . import kernels

        out = self.reducer.stats() if self.reducer is not None else {"buckets": []}
        out["kernels"] = kernels.stats()
        return out

    def _get_ddp_logging_data(self) -> dict:
        """A subset of torch's logging data with torch's key names."""
        return profiling.ddp_logging_data(self)

    # -------------------------------------------------------------------- join
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Uneven inputs (torch's ``join``): ranks out of data shadow the others' collectives;
        the average is over the initial world (or the ranks still training); the last joiner's
        model is synced to all."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """The :class:`~torch.distributed.algorithms.join.JoinHook` for a
        shared ``Join`` context (e.g. with ``ZeroRedundancyOptimizer``).
        Ends ``bucket_cap_mb="auto"``'s tuning (every rank builds the context
        at the same step; a joined rank's shadow collectives have no tuner's)."""
        if self.reducer is not None:
            self.reducer.plans.freeze_tuning("join()")
        return join.DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    join_device = property(lambda self: self.device)
    join_process_group = property(lambda self: self.process_group)
