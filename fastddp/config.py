"""The DDP constructor's arguments, checked once and resolved into one frozen
object.  What the user passed is never written back; everything derived
(the process group behind a device mesh, the buffer-sync rules, the devices)
is a field here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import groups, settings
from .options import Options
from .autotune import resolve_cap
from .health import resolve_mode

__all__ = ["DDPConfig", "params_for_reducer"]


def params_for_reducer(module: torch.nn.Module, ignore) -> tuple[list, list[str], list[bool]]:
    """torch's ``_build_params_for_reducer``: the trainable parameters not
    ignored, shared ones once, with their names and whether their module
    produces sparse gradients (torch's ``_check_sparse``)."""
    memo, params, names, sparse = set(), [], [], []
    for mname, sub in module.named_modules():
        for pname, p in sub.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if not p.requires_grad or name in ignore or p in memo:
                continue
            memo.add(p)
            params.append(p)
            names.append(name)
            sparse.append(isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse)
    return params, names, sparse


@dataclass(frozen=True)
class DDPConfig:
    """torch 2.13's DistributedDataParallel arguments, resolved."""

    process_group: Any
    """The group gradients are averaged over (from ``process_group``, ``device_mesh`` or the default group)."""
    device_mesh: Any
    """The 1-D mesh it came from, if any."""
    device_ids: list[int] | None
    """One CUDA device index for a single-device CUDA module, else None (torch's rule)."""
    output_device: int | None
    """Where outputs go (defaults to ``device_ids[0]``)."""
    dim: int
    """Kept for torch's API (DDP no longer scatters inputs)."""
    device_type: str
    """``"cuda"`` or ``"cpu"``: the type of every parameter's device."""
    device: torch.device
    """The module's (single) device."""
    parameters_to_ignore: frozenset
    """Names left out of DDP: ``module._ddp_params_and_buffers_to_ignore`` and the delayed params."""
    delay_params: tuple
    """``delay_all_reduce_named_params``' parameters (averaged by their own hook)."""
    param_to_hook_all_reduce: Any
    """The parameter whose gradient triggers the delayed all-reduce."""
    all_params_delayed: bool
    """Every trainable parameter is delayed: no reducer at all."""
    init_sync: bool
    """Verify the model across ranks and broadcast rank 0's state at construction."""
    init_sync_buffers: bool
    """Buffers are part of that broadcast."""
    forward_sync_buffers: bool
    """Buffers are broadcast before every forward (``broadcast_buffers`` of old)."""
    bucket_cap_mb: float | None
    bucket_cap_mb_list: tuple | None
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    mixed_precision: Any
    skip_all_reduce_unused_params: bool
    batched_grad_copy: bool
    check_finite: str | None = None
    """fastddp extension: ``"raise"`` / ``"warn"`` on a non-finite gradient (:mod:`fastddp.health`)."""
    auto_bucket_cap: bool = False
    """``bucket_cap_mb="auto"`` (argument, ``fastddp.configure`` or ``FASTDDP_BUCKET_CAP_MB``): the
    reducer tunes the caps in the first steps (:mod:`fastddp.autotune`); ``bucket_cap_mb`` is then None."""
    options: Options = Options()
    """fastddp's options for this module: the constructor's ``options`` where
    set, else ``fastddp.configure``'s, else the environment's
    (:func:`fastddp.settings.effective`)."""

    @classmethod
    def resolve(cls, module: torch.nn.Module, *, device_ids=None, output_device=None, dim=0,
                broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False,
                static_graph=False, delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                check_finite=None, options: Options | None = None) -> "DDPConfig":
        """Check every argument against the module (torch's errors, torch's
        sentences) and resolve the defaults."""
        if process_group is None and device_mesh is None and (
                not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError(
                "fastddp.DistributedDataParallel: the default process group is not initialized. "
                "Call torch.distributed.init_process_group(backend=...) first (torchrun sets the "
                "environment it needs), then wrap the model.")
        opts = settings.effective(options)
        bucket_cap_mb, auto_cap = resolve_cap(bucket_cap_mb, bucket_cap_mb_list, opts.bucket_cap_mb)
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
            process_group = device_mesh.get_group(mesh_dim=0)
        if process_group is not None:
            groups.check_member(process_group)
        else:
            process_group = dist.distributed_c10d._get_default_group()

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        delayed = []
        for name, param in delay_all_reduce_named_params or ():
            ignore.add(name)
            delayed.append(param)
        module_params = [p for n, p in module.named_parameters() if n not in ignore]
        if not any(p.requires_grad for p in module_params) and not delayed:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        for n, p in module.named_parameters():
            if isinstance(p, torch.nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    f"Modules with uninitialized parameters can't be used with DistributedDataParallel "
                    f"(parameter {n!r}). Run a dummy forward pass to initialize the module first.")
            if hasattr(p, "_in_backward_optimizers") and n not in ignore:
                # their optimizer would step on this rank's unaveraged gradient
                raise NotImplementedError(
                    f"fastddp.DistributedDataParallel: parameter {n!r} has an optimizer applied in "
                    "backward (torch.distributed.optim._apply_optimizer_in_backward); fastddp does "
                    "not run in-backward optimizers after the all-reduce, so they would step on "
                    "unaveraged gradients. Step a regular optimizer after backward(), or use "
                    "torch.nn.parallel.DistributedDataParallel for this model.")
            if p.device.type == "meta":
                raise RuntimeError(
                    f"fastddp.DistributedDataParallel: parameter {n!r} is on the meta device (no "
                    "data). Materialize the module first, e.g. module.to_empty(device=...) and "
                    "initialise its parameters (or load a checkpoint), then wrap it.")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        device_types = {p.device.type for p in module_params}
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but "
                f"input module parameters locate in {device_types}.")
        devices = {p.device for p in module_params}
        if len(devices) > 1:
            raise NotImplementedError(
                "fastddp.DistributedDataParallel: the module's parameters span several devices "
                f"({sorted(str(d) for d in devices)}); fastddp keeps one comm stream per module and "
                "supports single-device modules only. Put the module on one device per process (one "
                "process per GPU), or use torch.nn.parallel.DistributedDataParallel for "
                "model-parallel modules.")
        device_type = next(iter(device_types))
        if not device_ids or device_type == "cpu":
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters {devices}.")
            ids, out_dev = None, None
        else:
            from torch._utils import _get_device_index

            ids = [_get_device_index(x, True) for x in device_ids]
            out_dev = _get_device_index(output_device if output_device is not None else device_ids[0], True)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)
        if broadcast_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided." if forward_sync_buffers is not None else
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers "
                "at init.", FutureWarning, stacklevel=3)
        if forward_sync_buffers is not None:
            fwd_sync, init_sync_buffers = bool(forward_sync_buffers), True
        else:
            fwd_sync = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = fwd_sync
        return cls(
            process_group=process_group, device_mesh=device_mesh, device_ids=ids, output_device=out_dev,
            dim=dim, device_type=device_type, device=module_params[0].device,
            parameters_to_ignore=frozenset(ignore), delay_params=tuple(delayed),
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            all_params_delayed=bool(delayed) and not any(p.requires_grad for p in module_params),
            init_sync=bool(init_sync), init_sync_buffers=init_sync_buffers, forward_sync_buffers=fwd_sync,
            bucket_cap_mb=bucket_cap_mb,
            bucket_cap_mb_list=tuple(bucket_cap_mb_list) if bucket_cap_mb_list else None,
            find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, mixed_precision=mixed_precision,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            check_finite=resolve_mode(check_finite if check_finite is not None else opts.check_finite),
            auto_bucket_cap=auto_cap, options=opts)
