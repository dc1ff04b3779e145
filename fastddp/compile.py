"""torch.compile and compiled autograd: fastddp speaks dynamo's DDP protocol.

Dynamo splits a compiled graph at gradient-bucket boundaries (its
``DDPOptimizer``, ``torch/_dynamo/backends/distributed.py``) only when
``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()``
returns a module while a frame is being compiled
(``torch/_dynamo/convert_frame.py``); it reads that module's
``bucket_bytes_cap`` and, per parameter, the ``_ddp_ignored`` marker.  Without
the split, the compiled backward is one autograd node: every gradient appears
at its end and no bucket can be on the wire while backward still computes.

What this module does, as torch's own DDP does it::

    torch.compile(ddp)(x)
      ddp.forward          frame SKIPPED by dynamo (eager_frame): buffer
                           broadcast, prepare_for_backward, profiling ranges
                           run in Python, never traced, never a graph break
        run_module()       torch DDP's _active_ddp_module = ddp (skipped too)
          ddp.module(x)    a fresh frame: dynamo compiles it and, seeing the
                           active module, splits it with DDPOptimizer at
                           ``ddp.bucket_bytes_cap`` (first bucket: the plan's)
    loss.backward()        one compiled backward node per split, each
                           followed by its params' AccumulateGrad + readiness
                           hook: buckets are issued while earlier layers'
                           backward still runs

Compiled autograd (``torch._dynamo.compiled_autograd._enable(compiler)``, or
``torch._dynamo.config.compiled_autograd = True`` with ``backward()`` called
inside a compiled function) traces the whole backward, Python hooks
included, into one graph.  The readiness hook's code is marked
:func:`eager`: dynamo breaks the compiled-autograd graph at each hook call
and runs the hook eagerly in place, so the pack and the all-reduce are
issued where eager autograd would issue them (one graph break per
parameter: the cost).  That engine does not run callbacks queued with
``queue_callback`` from an eager hook, so there the reducer finalises as the
last bucket is issued (:func:`in_compiled_autograd`): every parameter's
gradient is in by then.

How frames are kept out of dynamo: a per-code-object frame policy (what
``torch._dynamo.disable`` itself sets), so nothing wraps the methods and
eager runs pay nothing; on a torch without it, ``torch._dynamo.disable``
applied lazily at attribute lookup (never importing torch._dynamo here).
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Any, Callable

import torch

from ._torch_ddp import TorchDDP

__all__ = ["bucket_bytes_cap", "eager", "eager_frame", "first_bucket_bytes_cap", "in_compiled_autograd",
           "run_module"]


def in_compiled_autograd() -> bool:
    """True while compiled autograd runs a backward graph (its engine does
    not run ``queue_callback`` callbacks queued from an eager hook)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(ca is not None and getattr(ca, "in_compiled_autograd_region", False))


def bucket_bytes_cap(ddp) -> int:
    """The cap dynamo splits compiled graphs at: the plan's bucket cap, at
    least the first bucket's cap (DDPOptimizer asserts first <= cap)."""
    bucket = ddp.reducer.opts.bucket if ddp.reducer is not None else None
    if bucket is None:
        return 25 * 1024 * 1024
    return max(bucket.bucket_bytes_cap, bucket.first_bucket_bytes_cap)


def first_bucket_bytes_cap(ddp) -> int:
    """The plan's first-bucket cap (1 MiB with the default cap, else the cap)."""
    bucket = ddp.reducer.opts.bucket if ddp.reducer is not None else None
    return bucket.first_bucket_bytes_cap if bucket is not None else bucket_bytes_cap(ddp)


def _code_strategy():
    """dynamo's per-code-object frame policy (``torch._C._dynamo.eval_frame``,
    what ``torch._dynamo.disable`` itself uses), or None where this torch
    lacks it.  Read without importing torch._dynamo."""
    ev = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    setter = getattr(ev, "set_code_exec_strategy", None)
    strategy = getattr(ev, "_FrameExecStrategy", None)
    action = getattr(ev, "_FrameAction", None)
    if setter is None or strategy is None or action is None:
        return None
    return setter, strategy, action


def _skip(fn: Callable, recursive: bool) -> bool:
    """Mark ``fn``'s code: dynamo never compiles its frame (nor, if
    ``recursive``, the frames it calls).  False where torch cannot."""
    found = _code_strategy()
    if found is None:
        return False
    setter, strategy, action = found
    setter(fn.__code__, strategy(action.SKIP, action.SKIP if recursive else action.DEFAULT))
    return True


class _Lazy:
    """Fallback for a torch without per-code frame policies: dynamo's
    ``disable`` applied at attribute lookup once torch._dynamo is loaded, the
    plain method before (fastddp never imports torch._dynamo itself)."""

    def __init__(self, fn: Callable, recursive: bool):
        self.fn = fn
        self.recursive = recursive
        self.disabled = None
        functools.update_wrapper(self, fn)

    def _resolve(self) -> Callable:
        fn = self.disabled
        if fn is None:
            if "torch._dynamo" not in sys.modules:
                return self.fn
            import torch._dynamo

            fn = self.disabled = torch._dynamo.disable(self.fn, recursive=self.recursive)
        return fn

    def __get__(self, obj, objtype=None):
        return self.fn if obj is None else types.MethodType(self._resolve(), obj)

    def __call__(self, *args, **kwargs):  # a plain function (the readiness hook)
        return self._resolve()(*args, **kwargs)


def eager(fn: Callable) -> Callable:
    """Decorator: the function and everything it calls run eagerly, never
    traced (pre- and post-forward bookkeeping: buffer broadcast, unused-param
    search, prepare_for_backward).  Free at run time: it marks the code."""
    return fn if _skip(fn, recursive=True) else _Lazy(fn, recursive=True)


def eager_frame(fn: Callable) -> Callable:
    """Decorator for ``forward``: dynamo skips the function's own frame (no
    graph, no graph break) and compiles the frames it calls."""
    return fn if _skip(fn, recursive=False) else _Lazy(fn, recursive=False)


@eager_frame
def run_module(ddp, inputs: tuple, kwargs: dict) -> Any:
    """``ddp.module(*inputs, **kwargs)`` with ``ddp`` as torch's active DDP
    module; dynamo skips this frame and compiles the module's, splitting it
    at ``ddp.bucket_bytes_cap`` (DDPOptimizer).  Everything it calls is torch
    or skipped: a fastddp frame called from here would itself be compiled."""
    if "torch._dynamo" not in sys.modules:
        return ddp.module(*inputs, **kwargs)  # nothing can compile: no bookkeeping
    # torch's own class holds dynamo's one active-module slot, whichever
    # class the names in torch.nn.parallel(.distributed) are swapped to
    cls = TorchDDP
    old, restore = cls._active_ddp_module, _enter(ddp)
    cls._active_ddp_module = ddp
    try:
        return _call(ddp.module, inputs, kwargs)
    finally:
        cls._active_ddp_module = old
        if restore is not None:
            torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = restore


def _call(module, inputs: tuple, kwargs: dict) -> Any:
    """The frame dynamo compiles (the wrapped module's call inlined into it):
    a torch.nn module's own frames are never entered by dynamo (as
    ``torch._dynamo.external_utils.wrap_inline`` for ``torch.compile``)."""
    return module(*inputs, **kwargs)


_MARKED: "weakref.WeakSet" = weakref.WeakSet()  # DDP modules whose ignored params are marked


@eager
def _enter(ddp):
    """Once: mark ignored params as torch does (DDPOptimizer leaves params
    with ``_ddp_ignored`` out of its bucket sizes).  Every time: DDPOptimizer
    takes its first-bucket cap from ``torch.distributed.
    _DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) and refuses a bucket cap below it
    (torch's own DDP fails to compile with ``bucket_cap_mb < 1``): while the
    forward runs, a smaller first cap of fastddp's replaces it, so the split
    follows fastddp's buckets.  Returns the value to restore, or None."""
    if ddp not in _MARKED:
        for name, p in ddp.module.named_parameters():
            if name in ddp.parameters_to_ignore:
                p._ddp_ignored = True
        _MARKED.add(ddp)
    first = first_bucket_bytes_cap(ddp)
    old = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    if old is None or first >= old:
        return None
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = first
    return old
