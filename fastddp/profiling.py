"""Named ranges for Nsight Systems and torch.profiler; free when off.

Every phase of the reducer is wrapped in :func:`range` with a stable name:

* ``fastddp/pack[b]``      gather bucket ``b``'s grads (+ scale + cast)
* ``fastddp/allreduce[b]`` issue bucket ``b``'s collective (async)
* ``fastddp/wait[b]``      wait for bucket ``b``'s collective at the end of backward
* ``fastddp/unpack[b]``    scatter bucket ``b`` back into ``.grad``
* ``fastddp/finalize``     the end-of-backward callback as a whole
* ``fastddp/forward``      the DDP wrapper's forward (buffer sync, forward, graph walk)

A range is emitted when ranges are enabled (``FASTDDP_NVTX=1`` in the
environment when the reducer is built, or :func:`enable`) or whenever a
torch.profiler session is recording (a single C call decides; nothing else
runs).  NVTX ranges are pushed only for CUDA and only when enabled.
"""

from __future__ import annotations

import contextlib

import torch

from . import settings

__all__ = ["enable", "disable", "enabled", "range"]

_state = {"on": None}  # None: not decided yet -> FASTDDP_NVTX (fastddp.settings)
_NULL = contextlib.nullcontext()
_profiler_on = torch._C._autograd._profiler_enabled


def enabled() -> bool:
    on = _state["on"]
    if on is None:
        on = _state["on"] = settings.get().nvtx
    return on


def enable() -> None:
    """Emit ranges (record_function + NVTX on CUDA) from now on."""
    _state["on"] = True


def disable() -> None:
    """Stop emitting ranges unless a torch.profiler session records."""
    _state["on"] = False


class _Range:
    __slots__ = ("name", "nvtx", "rf")

    def __init__(self, name: str, nvtx: bool):
        self.name = name
        self.nvtx = nvtx
        self.rf = None

    def __enter__(self):
        self.rf = torch.autograd.profiler.record_function(self.name)
        self.rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self.rf.__exit__(*exc)
        return False


def range(name: str, cuda: bool = False):  # noqa: A001 - mirrors nvtx.range
    """A context manager for a named range; a shared no-op when off."""
    on = _state["on"]
    if on is None:
        on = enabled()
    if not on and not _profiler_on():
        return _NULL
    return _Range(name, nvtx=bool(on and cuda))


def reducer_stats(r) -> dict:
    """What a reducer did, as plain data (``DistributedDataParallel.stats()``)."""
    from . import kernels

    hook, fused = r.comm_hook, r.fused_path
    chain = r.arming.chain  # the native issue chain counts its own collectives (in flight ones too)
    flying = chain.counts() if chain is not None else (0, 0)
    return {
        "world_size": r.world,
        "iterations": r.num_iterations,
        "steps_reduced": r.steps_reduced,
        "has_rebuilt_buckets": r.has_rebuilt_buckets,
        "kernel_backend": kernels.backend(r.device),
        "comm_hook": None if hook is None else getattr(hook, "__name__", repr(hook)),
        "fused_path": None if fused is None else (fused[0], str(fused[1]) if fused[1] else None),
        "collectives": r.comm.collectives + flying[0],
        "bytes_on_wire": r.comm.bytes_on_wire + flying[1],
        "exposed_comm_ms_last": [round(t * 1e3, 3) for t in r.exposed_comm_s],
        "exposed_comm_source": "host",
        **r.comm.exposed_stats(),
        "debug": r.debug,
        "check_finite": r.opts.check_finite,
        "buckets": [b.describe(r.names) for b in r.buckets],
        **({"autotune": r.tuner.report()} if r.tuner is not None else {}),
        **(r.mode.stats() if hasattr(r.mode, "stats") else {}),
    }


def ddp_logging_data(ddp) -> dict:
    """torch's ``_get_ddp_logging_data`` keys for a fastddp module."""
    from . import groups

    r = ddp.reducer
    return {
        "module_name": type(ddp.module).__name__,
        "world_size": groups.size(ddp.process_group),
        "rank": groups.rank(ddp.process_group),
        "backend_name": groups.backend_name(ddp.process_group),
        "bucket_cap_bytes": r.opts.bucket.bucket_bytes_cap if r else 0,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "can_set_static_graph": 0,
        "has_rebuilt_buckets": int(r.has_rebuilt_buckets) if r else 0,
        "bucket_sizes": r.plans.bucket_sizes() if r else [],
        "comm_hook": "" if r is None or r.comm_hook is None else getattr(r.comm_hook, "__qualname__", ""),
    }
