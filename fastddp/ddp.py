"""The ``nn.Module`` front: torch 2.13's DistributedDataParallel signature and
semantics; all bucket logic lives in :mod:`fastddp.reducer`."""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import groups, planner, profiling
from .reducer import Reducer, ReducerOptions

__all__ = ["DistributedDataParallel"]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


def _debug_enabled() -> bool:
    """FASTDDP_DEBUG=1, or torch's TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    import os

    return (os.environ.get("FASTDDP_DEBUG", "0") not in ("", "0")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


class _Sink(torch.autograd.Function):
    """Outputs pass through it (torch's ``_DDPSink``): with
    find_unused_parameters, outputs left out of the loss still deliver
    (undefined) gradients, so their params are marked ready; with static_graph
    it queues the first iteration's delayed all-reduce."""

    @staticmethod
    def forward(ctx, ddp_ref, *inputs):
        ctx.set_materialize_grads(False)
        ctx.ddp_ref = ddp_ref
        return tuple(t.clone() for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ddp = ctx.ddp_ref()
        if ddp is not None and ddp.static_graph and not ddp._static_graph_delay_allreduce_enqueued:
            torch.autograd.Variable._execution_engine.queue_callback(ddp.reducer.delay_all_reduce)
            ddp._static_graph_delay_allreduce_enqueued = True
        return (None, *grads)


class DistributedDataParallel(torch.nn.Module, Joinable):
    """Drop-in replacement for :class:`torch.nn.parallel.DistributedDataParallel`.

    Same constructor, same semantics, same gradients (bit for bit where the
    arithmetic allows: see README); the reducer packs each bucket's gradients
    in one fused launch, overlaps its all-reduce with the rest of backward
    and unpacks it in one fused launch.
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
        bucket_cap_mb: float | None = None,
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
    ):
        torch.nn.Module.__init__(self)
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True
        if process_group is None and device_mesh is None and (
                not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError(
                "fastddp.DistributedDataParallel: the default process group is not initialized. "
                "Call torch.distributed.init_process_group(backend=...) first (torchrun sets the "
                "environment it needs), then wrap the model.")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                             "need to be set at the same time.")
        if mixed_precision is not None and gradient_as_bucket_view:
            raise ValueError("mixed_precision with gradient_as_bucket_view=True is not supported: the "
                             "full-precision .grad cannot be a view of the reduced-precision bucket")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(
                    f"Only 1D device mesh is supported, but got {device_mesh} ({device_mesh.ndim}-D); "
                    "pass the data-parallel dimension, e.g. mesh['dp'].")
            if device_mesh._get_root_mesh() != device_mesh:
                raise NotImplementedError(
                    "fastddp.DistributedDataParallel: a device_mesh that is a slice of a larger mesh "
                    "(tensor-parallel DTensor modules) is not supported yet. Pass a 1-D mesh of its own, "
                    "or use torch.nn.parallel.DistributedDataParallel for this model.")
            self.device_mesh = device_mesh
            process_group = device_mesh.get_group(mesh_dim=0)
        if process_group is not None:
            groups.check_member(process_group)
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._delay_all_reduce_params: list[torch.nn.Parameter] = []
        if delay_all_reduce_named_params is not None:
            for name, param in delay_all_reduce_named_params:
                ignore.add(name)
                self._delay_all_reduce_params.append(param)
        self.parameters_to_ignore = ignore
        module_params = [p for n, p in module.named_parameters() if n not in ignore]
        if not any(p.requires_grad for p in module_params) and not self._delay_all_reduce_params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter "
                "that requires a gradient.")
        for n, p in module.named_parameters():
            if isinstance(p, torch.nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    f"Modules with uninitialized parameters can't be used with DistributedDataParallel "
                    f"(parameter {n!r}). Run a dummy forward pass to initialize the module first.")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        device_types = {p.device.type for p in module_params}
        if "meta" in device_types:
            name = next(n for n, p in module.named_parameters() if p.device.type == "meta")
            raise RuntimeError(
                f"fastddp.DistributedDataParallel: parameter {name!r} is on the meta device (no "
                "data). Materialize the module first, e.g. module.to_empty(device=...) and "
                "initialise its parameters (or load a checkpoint), then wrap it.")
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but "
                f"input module parameters locate in {device_types}.")
        self.device_type = next(iter(device_types))
        self.is_multi_device_module = len({p.device for p in module_params}) > 1
        if self.is_multi_device_module:
            raise NotImplementedError(
                "fastddp.DistributedDataParallel: the module's parameters span several devices "
                f"({sorted({str(p.device) for p in module_params})}); fastddp keeps one comm stream "
                "per module and supports single-device modules only. Put the module on one device "
                "per process (one process per GPU), or use torch.nn.parallel."
                "DistributedDataParallel for model-parallel modules.")
        if not device_ids or self.device_type == "cpu" or self.is_multi_device_module:
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters "
                    f"{ {p.device for p in module_params} }.")
            self.device_ids = None
            self.output_device = None
        else:
            from torch._utils import _get_device_index

            self.device_ids = [_get_device_index(x, True) for x in device_ids]
            self.output_device = _get_device_index(output_device if output_device is not None else device_ids[0], True)

        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        if broadcast_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided." if forward_sync_buffers is not None else
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers "
                "at init.", FutureWarning, stacklevel=2)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = bool(forward_sync_buffers)
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = self.forward_sync_buffers

        self.module = module
        self.dim = dim
        self.device = module_params[0].device
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.mixed_precision = mixed_precision
        self.device_mesh = getattr(self, "device_mesh", None)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = False
        self._static_graph_delay_allreduce_enqueued = False
        self.broadcast_bucket_size = _BROADCAST_BUCKET_BYTES
        self._bucket_args = (bucket_cap_mb, tuple(bucket_cap_mb_list) if bucket_cap_mb_list else None)
        self._comm_hooks: list[tuple[Callable, object]] = []

        self._delay_grad_buffer: torch.Tensor | None = None
        self._delay_grad_views: list[torch.Tensor] = []
        self._delay_work = None
        self._delay_all_reduce_all_params = False
        if self._delay_all_reduce_params:
            self._register_delay_all_reduce_hook(param_to_hook_all_reduce)
            if not any(p.requires_grad for p in module_params):
                self._delay_all_reduce_all_params = True
                self.reducer = None
                return

        parameters, names = self._build_params_for_reducer()
        if init_sync:
            from torch.distributed.utils import _sync_module_states

            from .verify import verify_across_ranks

            bufs = self.named_module_buffers if init_sync_buffers else {}
            verify_across_ranks(self.process_group, parameters, names, list(bufs.values()), list(bufs))

            _sync_module_states(module=self.module, process_group=self.process_group,
                                broadcast_bucket_size=self.broadcast_bucket_size, src=0,
                                params_and_buffers_to_ignore=self.parameters_to_ignore,
                                broadcast_buffers=init_sync_buffers)
        if mixed_precision is not None:
            from .mixed_precision import MixedPrecision

            self._mp = MixedPrecision(self, mixed_precision, parameters)
        else:
            self._mp = None
        self._build_reducer(parameters, names, static_graph)
        if static_graph:
            self._set_static_graph()

    # ---------------------------------------------------------- construction
    def _build_params_for_reducer(self):
        pairs = [
            (module, f"{mname}.{pname}" if mname else pname, p)
            for mname, module in self.module.named_modules()
            for pname, p in module.named_parameters(recurse=False)
            if p.requires_grad and (f"{mname}.{pname}" if mname else pname) not in self.parameters_to_ignore
        ]
        memo, params, names, sparse = set(), [], [], []
        for module, name, p in pairs:
            if p in memo:
                continue
            memo.add(p)
            params.append(p)
            names.append(name)
            # torch's _check_sparse: these modules produce sparse gradients
            sparse.append(isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse)
        self._sparse_params = sparse
        self._assign_modules_buffers()
        return params, names

    def _assign_modules_buffers(self):
        named = [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
        self.modules_buffers = [b for _, b in named]
        self.named_module_buffers = dict(named)

    def _check_new_parameters(self) -> None:
        """Parameters added to the module after it was wrapped are never
        reduced: say so (checked at the bucket rebuild, and at every forward
        in debug mode)."""
        known = {id(p) for p in self.reducer.params}
        new = [n for n, p in self.module.named_parameters()
               if p.requires_grad and n not in self.parameters_to_ignore and id(p) not in known]
        if new:
            raise RuntimeError(
                f"fastddp: parameter(s) {new[:10]} were added to the module (or set to "
                "requires_grad=True) after it was wrapped in DistributedDataParallel; their "
                "gradients would never be averaged across ranks. Create every parameter before "
                "wrapping the model (or wrap it again).")

    def _bucket_config(self, static_graph: bool) -> planner.BucketConfig:
        cap, cap_list = self._bucket_args
        return planner.BucketConfig(bucket_cap_mb=cap, bucket_cap_mb_list=cap_list,
                                    static_graph=static_graph,
                                    find_unused_parameters=self.find_unused_parameters)

    def _build_reducer(self, parameters, names, static_graph: bool) -> None:
        opts = ReducerOptions(
            bucket=self._bucket_config(static_graph),
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            batched_grad_copy=self.batched_grad_copy,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=static_graph,
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            reduce_dtype=self._mp.reduce_dtype if getattr(self, "_mp", None) is not None else None,
        )
        sparse = getattr(self, "_sparse_params", None)
        if sparse is not None and len(sparse) != len(parameters):
            sparse = None
        if sparse and any(sparse) and getattr(self, "_mp", None) is not None:
            raise ValueError("fastddp: mixed_precision does not support modules with sparse gradients")
        self.reducer = Reducer(parameters, names, self.process_group, opts, sparse=sparse,
                               debug=_debug_enabled())
        if getattr(self, "_mp", None) is not None:
            self.reducer.mixed_precision_hook = self._mp.restore_bucket
            self.reducer.after_finalize = self._mp.restore_all

    def _set_static_graph(self) -> None:
        """Declare the graph static (torch's private API, public in spirit)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self.reducer.num_iterations > 0:
            raise RuntimeError("fastddp: _set_static_graph() must be called before the first forward.")
        self.static_graph = True
        self._static_graph_delay_allreduce_enqueued = False
        if not self.reducer.opts.static_graph:
            params, names = self.reducer.params, self.reducer.names
            self.reducer.remove_hooks()
            self._build_reducer(params, names, True)
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not need "
                "to set find_unused_parameters=true, just be sure these unused parameters will not "
                "change during training loop while calling `_set_static_graph`.", stacklevel=2)

    # ---------------------------------------------------------------- pickling
    def __getstate__(self):
        attrs = dict(self.__dict__)
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise RuntimeError("fastddp: only a DDP model on the default process group can be pickled")
        for k in ("process_group", "reducer"):
            attrs.pop(k, None)
        return attrs

    def __setstate__(self, state):
        self.process_group = dist.distributed_c10d._get_default_group()
        super().__setstate__(state)
        params, names = self._build_params_for_reducer()
        self._build_reducer(params, names, self.static_graph)

    # ----------------------------------------------------------------- forward
    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0

    def _sync_buffers(self) -> None:
        # Under join() rank 0 may have joined with stale buffers: agree on a source.
        src = (self._find_common_rank(groups.rank(self.process_group), True)
               if self._join_config.enable else 0)
        self._broadcast_buffers(src)

    def _broadcast_buffers(self, src: int) -> None:
        # ``src`` is a rank of the group (c10d's broadcast_coalesced takes the
        # group rank as the root, as torch's DDP passes it)
        with torch.no_grad():
            self._assign_modules_buffers()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.modules_buffers)):
                dist._broadcast_coalesced(self.process_group, self.modules_buffers,
                                          self.broadcast_bucket_size, src)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        from .join import find_common_rank

        return find_common_rank(self, input_rank, rank_cond)

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        """join(): every rank learns whether this iteration's backward syncs."""
        flag = torch.ones(1, device=self.device) if (not is_joined_rank and self.require_backward_grad_sync) \
            else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if is_joined_rank:
            work.wait()
            return flag.item() != 0
        return None

    def _pre_forward(self, *inputs, **kwargs):
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.reducer.prepare_for_forward(grad_sync)
        if self.reducer.debug:
            self._check_new_parameters()
        work = Join.notify_join_context(self)
        if work:
            self.reducer.set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if torch.is_grad_enabled() and self.reducer.rebuild_buckets():
            self._check_new_parameters()
        if self.will_sync_module_buffers():
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            from torch.distributed.utils import _to_kwargs

            moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs,
                                                    torch.device(self.device_type, self.device_ids[0]), True)
            inputs, kwargs = moved_inputs[0], moved_kwargs[0]
        if self._mp is not None:
            inputs, kwargs = self._mp.pre_forward(inputs, kwargs)
        return inputs, kwargs

    def _post_forward(self, output):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            if self.find_unused_parameters and not self.static_graph:
                leaves, _ = tree_flatten(output)
                self.reducer.prepare_for_backward([t for t in leaves if isinstance(t, torch.Tensor)])
            else:
                self.reducer.prepare_for_backward([])
        else:
            self.require_forward_param_sync = False
        if (self.find_unused_parameters and not self.static_graph) or (
                self.static_graph and not self._static_graph_delay_allreduce_enqueued):
            leaves, spec = tree_flatten(output)
            idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if idx and torch.is_grad_enabled():
                passed = _Sink.apply(weakref.ref(self), *[leaves[i] for i in idx])
                for i, t in zip(idx, passed):
                    leaves[i] = t
                output = tree_unflatten(leaves, spec)
        return output

    def forward(self, *inputs, **kwargs):
        with profiling.range("fastddp/forward", self.device_type == "cuda"):
            if self._delay_all_reduce_all_params:
                output = self.module(*inputs, **kwargs)
                self._clear_grad_buffer()
                return output
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            output = self.module(*inputs, **kwargs)
            output = self._post_forward(output)
            self._clear_grad_buffer()
            if self._mp is not None and not torch.is_grad_enabled():
                # no backward will follow to restore them: full precision now
                # (under no_sync() the local backward still needs the copies)
                self._mp.restore_all()
            return output

    # ------------------------------------------------- delayed all-reduce
    def _register_delay_all_reduce_hook(self, param_to_hook_all_reduce) -> None:
        """torch's delay_all_reduce_named_params: those params leave the
        buckets; their grads live in one flat buffer that is averaged when
        ``param_to_hook_all_reduce``'s gradient is computed."""
        params = self._delay_all_reduce_params
        device = params[0].device
        self._delay_grad_buffer = torch.zeros(sum(p.numel() for p in params), device=device,
                                              dtype=params[0].dtype)
        dist._broadcast_coalesced(self.process_group, [p.detach() for p in params],
                                  self.broadcast_bucket_size, 0)
        param_to_hook_all_reduce.register_hook(self._delayed_all_reduce_hook)
        offset = 0
        for p in params:
            self._delay_grad_views.append(self._delay_grad_buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()

    def _delayed_all_reduce_hook(self, grad):
        self._delay_grad_buffer.div_(dist.get_world_size(self.process_group))
        self._delay_work = dist.all_reduce(self._delay_grad_buffer, group=self.process_group, async_op=True)
        # torch never waits for this work; fastddp waits at the end of backward,
        # so the optimizer can never read a half-reduced buffer.
        torch.autograd.Variable._execution_engine.queue_callback(self._wait_delayed_all_reduce)
        return grad

    def _wait_delayed_all_reduce(self) -> None:
        if self._delay_work is not None:
            self._delay_work.wait()
            self._delay_work = None

    def _clear_grad_buffer(self) -> None:
        if self._delay_grad_buffer is None:
            return
        all_none = all(p.grad is None for p in self._delay_all_reduce_params)
        for p, view in zip(self._delay_all_reduce_params, self._delay_grad_views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    p.grad.zero_()
        if all_none:
            self._delay_grad_buffer.zero_()

    def train(self, mode: bool = True):
        super().train(mode)
        return self

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
        self._check_comm_hook(hook)
        if self.reducer.has_comm_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._mp is not None:
            raise RuntimeError("fastddp: mixed_precision runs its own fused reduction; it cannot be "
                               "combined with register_comm_hook (torch refuses it too: its mixed "
                               "precision registers a comm hook)")
        if self.reducer.num_iterations > 0:
            raise RuntimeError("fastddp: register_comm_hook must be called before the first forward/backward.")
        from .hooks import FusedPath

        fused = FusedPath.for_hook(hook, state)
        if fused is not None and fused.group(self.reducer) is not self.process_group:
            if fused.error_feedback:
                raise ValueError("fastddp: CompressionState.process_group must be None or the DDP "
                                 "module's process group")
            fused = None  # another group: run the hook as an ordinary callback
        if fused is not None and fused.error_feedback and any(self.reducer.sparse):
            raise ValueError("fastddp: CompressionState(error_feedback=True) does not apply to "
                             "modules with sparse gradients")
        self._comm_hooks.append((hook, state))
        self.reducer.register_comm_hook(hook, state, fused)

    @staticmethod
    def _check_comm_hook(hook) -> None:
        """torch's checks (callable; a ``bucket`` annotation must be
        GradBucket; a return annotation must be Future[Tensor]) plus the arity."""
        if not callable(hook):
            raise TypeError(f"Communication hook must be callable, got {type(hook).__name__}.")
        import inspect

        try:
            sig = inspect.signature(hook, eval_str=True)
        except Exception:  # unresolvable string annotations: check what can be checked
            try:
                sig = inspect.signature(hook)
            except (TypeError, ValueError):
                return
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != 2 and not any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
            raise TypeError(
                f"Communication hook {getattr(hook, '__name__', hook)!r} must take exactly two "
                f"arguments (state, bucket), got {len(params)}: {sig}.")
        from .hooks import GradBucket

        name = getattr(hook, "__name__", hook)
        bucket_ann = params[1].annotation if len(params) == 2 else inspect.Parameter.empty
        if bucket_ann is not inspect.Parameter.empty and bucket_ann not in (dist.GradBucket, GradBucket):
            raise ValueError(
                "Communication hook: bucket annotation should be dist.GradBucket. "
                f"fastddp: hook {name!r} annotates its bucket argument as {bucket_ann!r}.")
        ret = sig.return_annotation
        if ret is not inspect.Signature.empty and ret != torch.futures.Future[torch.Tensor]:
            raise ValueError(
                "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
                f"fastddp: hook {name!r} is annotated to return {ret!r}.")

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            self.register_comm_hook(self.process_group, default_hooks.allreduce_hook)
        elif comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            self.register_comm_hook(self.process_group, default_hooks.fp16_compress_hook)
        else:
            raise ValueError(f"Unknown built-in DDP comm hook type {comm_hook_type}.")

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
        r = self.reducer
        return {
            "module_name": type(self.module).__name__,
            "world_size": groups.size(self.process_group),
            "rank": groups.rank(self.process_group),
            "backend_name": groups.backend_name(self.process_group),
            "bucket_cap_bytes": r.opts.bucket.bucket_bytes_cap if r else 0,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "can_set_static_graph": 0,
            "has_rebuilt_buckets": int(r.has_rebuilt_buckets) if r else 0,
            "bucket_sizes": r.bucket_sizes() if r else [],
            "comm_hook": "" if r is None or r.comm_hook is None else getattr(r.comm_hook, "__qualname__", ""),
        }

    # -------------------------------------------------------------------- join
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for uneven inputs (torch's ``DistributedDataParallel.join``):
        ranks that run out of data shadow the collectives of those still
        training; gradients are divided by the initial world size, or with
        ``divide_by_initial_world_size=False`` by the number of ranks still
        training; the final model is synced from the last rank to join."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """The :class:`~torch.distributed.algorithms.join.JoinHook` for a
        shared ``Join`` context (e.g. with ``ZeroRedundancyOptimizer``)."""
        from .join import DDPJoinHook

        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group
