"""fastddp.kernels: fused gradient pack/unpack.

``pack(srcs, dst, offsets=None, scale=1.0, divide=None, *, layout=None,
residual=None, health=None)`` gathers many separate tensors into one flat
buffer, scales and casts them (error feedback and a gradient health flag in
the same launch), in one launch per source dtype.  ``unpack(src, dsts, offsets=None, scale=1.0, divide=None,
accumulate=False)`` does the reverse in one launch per destination dtype.

Backends (chosen by :mod:`fastddp.kernels._backend`, once, cached):

* ``triton``: compiled Triton kernels, for CUDA tensors;
* ``interpret``: the same kernel source under the Triton interpreter, for CPU
  tensors when ``TRITON_INTERPRET=1`` was set before import (how CI tests the
  kernels);
* ``reference``: the plain-torch twin (:mod:`fastddp.kernels.reference`), for
  CPU tensors otherwise.  Inside a kernel call, a tensor whose memory order
  is not its layout slot's (a transposed gradient, say) is copied with torch,
  alone; the rest of the call stays in its one launch per dtype.

The arithmetic contract is written in :mod:`fastddp.kernels.reference`.
"""

from __future__ import annotations

from ._backend import backend, reset_backend, triton_available as _triton_available
from ._counters import launch_count, reset_launch_count, stats

if _triton_available():
    # Import the kernel modules *before* binding the functions ``pack`` and
    # ``unpack``: the first import of a submodule sets it as an attribute of
    # this package, which would shadow the functions of the same name.  This
    # is also when TRITON_INTERPRET is read (by @triton.jit).
    try:
        from . import pack as _pack_module, unpack as _unpack_module  # noqa: F401
    except Exception as _exc:  # a broken Triton must not take the reference path down
        import warnings

        warnings.warn(f"fastddp.kernels: Triton kernels unavailable ({_exc!r}); "
                      "CPU calls use the reference, kernel calls will raise", RuntimeWarning)

from ._ops import Layout, pack, unpack
from . import reference
from .reference import Health, first_nonfinite

__all__ = [
    "Health",
    "Layout",
    "backend",
    "first_nonfinite",
    "launch_count",
    "pack",
    "reference",
    "reset_backend",
    "reset_launch_count",
    "stats",
    "unpack",
]
