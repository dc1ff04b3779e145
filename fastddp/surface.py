"""The rest of torch DDP's class surface on fastddp's class.

``fastddp.DistributedDataParallel`` derives from torch's class (so that
``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` holds in
frameworks and in torch's own utilities) but never runs torch's constructor:
there is no C++ reducer, no ``self.logger``.  So every method of torch's class
is either

* defined again by fastddp (:class:`fastddp.ddp.DistributedDataParallel` or
  :class:`TorchSurface` below) on fastddp's reducer, or
* inherited on purpose, listed in :data:`INHERITED` with the reason it is
  correct without torch's constructor (each one is exercised by a test), or
* an internal of torch's C++ reducer that fastddp has no twin for: it raises
  :class:`NotImplementedError` naming the method and what to do instead
  (:data:`TORCH_INTERNALS`), never an ``AttributeError`` from deep inside.

``tests/test_torch_surface.py`` lists torch's class dictionary on the torch
under test and fails on any name that is in none of the three.
"""

from __future__ import annotations

import torch
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

import dataclasses
import warnings

import torch.distributed as dist

from . import groups, join

__all__ = ["INHERITED", "TORCH_INTERNALS", "TorchSurface"]

#: torch's methods fastddp inherits unchanged, and why that is correct.
INHERITED: dict[str, str] = {
    "_active_ddp_module": "dynamo's active-module slot; fastddp's metaclass keeps it on torch's class",
    "_get_active_ddp_module": "classmethod reading that slot",
    "_inside_ddp_forward": "context manager setting that slot (fastddp's forward uses compile.run_module)",
    "_set_params_and_buffers_to_ignore_for_model": "static: marks the module; fastddp's config reads "
                                                   "module._ddp_params_and_buffers_to_ignore",
    "_get_data_parallel_params": "static: the module's params without the _ddp_ignored mark",
    "_get_parameters": "pure generator over a module's parameters",
    "_build_debug_param_to_name_mapping": "reads self.module and self.parameters_to_ignore, both set",
    "_check_default_group": "reads self.process_group; raises through _log_and_throw",
    "_distributed_rank": "property: dist.get_rank(self.process_group)",
    "_passing_sync_batchnorm_handle": "refuses SyncBatchNorm on CPU modules (called by the constructor)",
    "_default_broadcast_coalesced": "broadcasts self.modules_buffers in self.broadcast_bucket_size chunks",
    "_distributed_broadcast_coalesced": "dist._broadcast_coalesced on self.process_group",
    "_register_fused_optim": "registers torch's allreduce hook + functional optimizer through "
                             "register_comm_hook, which fastddp runs like any Python hook",
    "train": "nn.Module.train returning self",
}

#: torch's C++-reducer internals with no fastddp twin: name -> what to do instead.
TORCH_INTERNALS: dict[str, str] = {
    "_ddp_init_helper": "construct a new fastddp.DistributedDataParallel instead",
    "_lazy_init": "fastddp has no lazy initialisation: the constructor does it all",
    "_setup_in_backward_optimizers": (
        "_apply_optimizer_in_backward is not supported by fastddp (the constructor refuses such "
        "parameters); step the optimizer after backward"),
    "_register_accum_grad_hook": "fastddp registers its own readiness hooks (fastddp.reducer)",
    "_fire_reducer_autograd_hook": "fastddp's readiness hooks fire by themselves",
    "_root_copy_hook": "mixed precision runs in fastddp.mixed_precision",
    "_module_wait_for_copy_hook": "mixed precision runs in fastddp.mixed_precision",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params runs in fastddp.delayed",
    "_register_delay_all_reduce_hook": "pass delay_all_reduce_named_params to the constructor",
    "_set_sparse_metadata": "fastddp all-reduces sparse gradients; it has no sparse all-gather metadata",
    "_update_process_group": "build a new fastddp.DistributedDataParallel on the new process group",
    "_register_buffer_comm_hook": (
        "fastddp broadcasts buffers from one rank (broadcast_buffers=True) or not at all; "
        "buffer comm hooks are not supported"),
}


def _internal(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"fastddp: DistributedDataParallel.{name}() is an internal of torch's C++ reducer, "
            f"which fastddp does not use: {TORCH_INTERNALS[name]}.")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not available in fastddp: {TORCH_INTERNALS[name]}."
    return method


class TorchSurface:
    """torch DDP's methods beyond the core API, on fastddp's reducer."""

    # ---------------------------------------------------------------- pickling
    def __getstate__(self):
        attrs = dict(self.__dict__)
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise RuntimeError("fastddp: only a DDP model on the default process group can be pickled")
        if self._delayed is not None:
            raise RuntimeError("fastddp: a DDP model with delay_all_reduce_named_params cannot be pickled")
        for k in ("process_group", "reducer", "forward_buffers"):  # (rebuilt by __setstate__)
            attrs.pop(k, None)
        attrs["config"] = dataclasses.replace(self.config, process_group=None, device_mesh=None)
        return attrs

    def __setstate__(self, state):
        self.process_group = dist.distributed_c10d._get_default_group()
        state["config"] = dataclasses.replace(state["config"], process_group=self.process_group)
        torch.nn.Module.__setstate__(self, state)  # not torch DDP's: it would build a C++ reducer
        params, names = self._build_params_for_reducer()
        self._build_reducer(params, names, self.static_graph)

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

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            self.register_comm_hook(self.process_group, default_hooks.allreduce_hook)
        elif comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            self.register_comm_hook(self.process_group, default_hooks.fp16_compress_hook)
        else:
            raise ValueError(f"Unknown built-in DDP comm hook type {comm_hook_type}.")

    # ------------------------------------------------- public, torch's behaviour
    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs, kwargs, device_id):
        from torch.distributed.utils import _to_kwargs

        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)

    # ----------------------------------------------------------- errors, hooks
    def _log_and_throw(self, err_type, err_msg):
        # torch also records the message in its C++ logger; fastddp has none
        raise err_type(err_msg)

    def _check_comm_hook(self, hook):
        from . import hooks

        hooks.check_hook(hook)

    def _check_reducer_finalized(self):
        """Raise torch's "Expected to have finished reduction..." error if the
        last backward left a reduction unfinished."""
        if self.reducer is not None:
            self.reducer.ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self):
        if self.reducer is not None:
            self.reducer.remove_hooks()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate):
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        # fastddp's stats() are kept for every iteration; the rate is recorded only
        self._ddp_runtime_logging_sample_rate = int(sample_rate)

    def _set_ddp_sink_clone(self, val: bool):
        """Whether outputs passing through the find_unused/static-graph sink are
        cloned (torch's default True: a loss modified in place stays legal)."""
        self._ddp_sink_clone = bool(val)

    # ---------------------------------------------------- forward and buffers
    def _run_ddp_forward(self, *inputs, **kwargs):
        from . import compile as _compile

        return _compile.run_module(self, inputs, kwargs)

    def _clear_grad_buffer(self):
        if self._delayed is not None:
            self._delayed.clear_grad_buffer()

    def _check_sync_bufs_pre_fwd(self):
        return self.will_sync_module_buffers()

    def _check_sync_bufs_post_fwd(self):
        return False  # no buffer comm hooks: buffers are broadcast before the forward

    def _sync_module_buffers(self, authoritative_rank):
        self.forward_buffers.broadcast(authoritative_rank)

    # ------------------------------------------------------------------- join
    def _find_common_rank(self, input_rank, rank_cond):
        return join.find_common_rank(self, input_rank, rank_cond)

    def _check_global_requires_backward_grad_sync(self, is_joined_rank):
        return join.global_requires_backward_grad_sync(self, is_joined_rank)

    def _check_and_sync_module_buffers(self):
        if self._check_sync_bufs_pre_fwd():
            self.forward_buffers.broadcast(self._find_common_rank(groups.rank(self.process_group), False))

    def _sync_final_model(self, is_last_joiner):
        join.sync_final_model(self, is_last_joiner)

    def _match_all_reduce_for_bwd_pass(self):
        join.shadow_backward(self.reducer)

    def _match_unused_params_allreduce(self):
        join.shadow_used_map(self)


for _name in TORCH_INTERNALS:
    setattr(TorchSurface, _name, _internal(_name))
del _name
