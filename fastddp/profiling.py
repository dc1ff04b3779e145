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
import os

import torch

__all__ = ["enable", "disable", "enabled", "range"]

_state = {"on": None}  # None: not decided yet -> read FASTDDP_NVTX once
_NULL = contextlib.nullcontext()
_profiler_on = torch._C._autograd._profiler_enabled


def enabled() -> bool:
    on = _state["on"]
    if on is None:
        on = _state["on"] = os.environ.get("FASTDDP_NVTX", "0") not in ("", "0")
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
