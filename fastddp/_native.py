"""The per-parameter readiness countdown in C++ (``csrc/countdown.cpp``), as
torch's reducer keeps it; this module builds and loads it.

Torch's reducer puts a C++ post hook on every parameter's ``AccumulateGrad``
node; a Python hook per parameter costs a GIL round trip and a Python call
each (measured: 600 tensors, ~2.5 ms of a 27 ms backward on one core).  The
native hook counts a bucket down without Python and calls into Python once
per bucket, when its last gradient is in.

Three modes, set by the reducer between steps (never inside a backward):

``PY``     every hook calls the Python hook body (``on_hook(i, False)``): the
           iterations that track something (unused parameters, static
           graph's first backward, the ready order of the rebuild, debug
           checks, a second backward, the bucket tuner)
``FAST``   the countdown: ``on_bucket(b)`` when bucket ``b``'s last
           parameter is ready; a parameter ready twice calls
           ``on_hook(i, True)`` (the Python side raises torch's error)
``IDLE``   nothing: backwards that are not reduced and track nothing
           (``no_sync()`` without find_unused_parameters/static_graph)

Compiled autograd collects the hooks of the nodes it traces: each native
hook hands it ``ca_hooks[i]``, a Python post hook (the reducer's readiness
hook, run eagerly), so a compiled backward sees what eager autograd sees.

``FASTDDP_NATIVE=0`` turns it off (Python hooks, same gradients);
``FASTDDP_NATIVE=require`` makes a failed build an error instead of a
warning and the Python fallback.  It switches these hooks only: the fp8 CPU
loops are a kernel path with their own loader (``fastddp.kernels._fp8_native``).
The build, its cache and its lock rules: ``fastddp.kernels._native_build``.
"""

from __future__ import annotations

import os

from . import settings
from .kernels._native_build import Extension

__all__ = ["countdown_module", "enabled", "main", "PY", "FAST", "IDLE", "EXTENSION"]

PY, FAST, IDLE = 0, 1, 2

#: the countdown's extension (its build state; tests swap it for a fresh one)
EXTENSION = Extension(
    "fastddp_native", [os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "countdown.cpp")],
    env="FASTDDP_NATIVE", what="readiness hooks",
    fallback="the Python hooks are used (same gradients, ~3 us more per parameter per backward)",
    instead="Python hooks", mode=lambda: settings.get().native.value)


def enabled() -> bool:
    return EXTENSION.enabled()


def countdown_module():
    """The compiled module (built on first use, then loaded from torch's
    extension cache), or None where it is off or cannot be built."""
    return EXTENSION.module(stacklevel=3)


def main() -> None:
    """``python -c "import fastddp._native as n; n.main()"``: build it now
    (CI and the GPU check do, before timed tests)."""
    EXTENSION.main()
