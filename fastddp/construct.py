"""Building a DDP module's reducer from its resolved options: the bucket
config, the reducer's options, the collaborators the front hands it (mixed
precision, the module watch)."""

from __future__ import annotations

from . import groups, planner, settings
from .config import DDPConfig
from .reducer import Collaborators, Reducer, ReducerOptions
from .verify import ModuleWatch

__all__ = ["bucket_config", "build_reducer", "wire_hook"]

_REFUSE_WITH_PARAM_DTYPE = ("with mixed_precision(param_dtype=...): the first backward's end put the "
                            "full-precision parameters back and freed the low-precision copies its graph saved")


def bucket_config(cfg: DDPConfig, find_unused_parameters: bool, static_graph: bool) -> planner.BucketConfig:
    return planner.BucketConfig(bucket_cap_mb=cfg.bucket_cap_mb, bucket_cap_mb_list=cfg.bucket_cap_mb_list,
                                static_graph=static_graph, find_unused_parameters=find_unused_parameters,
                                set_last_bucket_as_small=settings.get().set_last_bucket_cap)


def build_reducer(ddp, parameters, names, sparse_params, mp, static_graph: bool):
    """``(module watch, reducer)`` for the DDP module ``ddp`` (its public,
    torch-named attributes: the options as they stand now); ``mp``: its
    :class:`~fastddp.mixed_precision.MixedPrecision` or None."""
    cfg = ddp.config
    opts = ReducerOptions(
        bucket=bucket_config(cfg, ddp.find_unused_parameters, static_graph),
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        batched_grad_copy=ddp.batched_grad_copy,
        find_unused_parameters=ddp.find_unused_parameters,
        static_graph=static_graph,
        skip_all_reduce_unused_params=ddp.skip_all_reduce_unused_params,
        reduce_dtype=mp.reduce_dtype if mp is not None else None,
        check_finite=cfg.check_finite,
        auto_bucket_cap=cfg.auto_bucket_cap,
        default_caps=cfg.bucket_cap_mb is None and cfg.bucket_cap_mb_list is None and not cfg.auto_bucket_cap,
        options=cfg.options,
    )
    sparse = sparse_params if len(sparse_params) == len(parameters) else None
    if sparse and any(sparse) and mp is not None:
        raise ValueError("fastddp: mixed_precision does not support modules with sparse gradients")
    watch = ModuleWatch(ddp.module, parameters, names, ddp.parameters_to_ignore,
                        groups.rank(ddp.process_group), check_dtype=mp is None)
    co = Collaborators(module_watch=watch)
    if mp is not None:
        refuse = (lambda: _REFUSE_WITH_PARAM_DTYPE) if mp.param_dtype is not None else None
        co = Collaborators(pre_unpack=mp.restore_bucket, after_finalize=mp.restore_all,
                           refuse_extra_backward=refuse, module_watch=watch)
    reducer = Reducer(parameters, names, ddp.process_group, opts, sparse=sparse,
                      debug=settings.get().debug_mode, collaborators=co)
    recipe = wire_hook(cfg.options)
    if recipe is not None and mp is None and not (sparse and any(sparse)):
        # Options.wire (constructor, configure(), FASTDDP_AUTO_PRECISION): as if the user
        # registered the hook (mixed precision and sparse modules keep their own reduction)
        reducer.register_comm_hook(*recipe, True)
    return watch, reducer


def wire_hook(options) -> tuple | None:
    """``(hook, state)`` of :class:`~fastddp.options.Options`' wire recipe and
    hierarchy (None: the exact flat all-reduce, no hook)."""
    from . import hooks
    from .options import WIRES

    cb, L = options.chunk_bytes, options.ranks_per_host
    if options.lowest is not None:
        return hooks.auto_precision_hook, hooks.AutoPrecisionState(lowest=options.lowest, chunk_bytes=cb,
                                                                   ranks_per_host=L)
    fmt = WIRES[options.wire or "exact"][2] or "fp32"  # the recipe's fixed format (exact: fp32)
    if options.hierarchical:
        return hooks.hierarchical_hook, hooks.HierarchicalState(wire=fmt, ranks_per_host=L, chunk_bytes=cb)
    if fmt == "bf16":
        return hooks.bf16_fp32acc_hook, hooks.CompressionState(error_feedback=True, chunk_bytes=cb)
    if fmt == "fp8":
        return hooks.fp8_compress_hook, hooks.FP8CompressionState(chunk_bytes=cb)
    return None
