"""fastddp.kernels: fused gradient pack/unpack.

``pack(srcs, dst, offsets=None, scale=1.0, divide=None, *, layout=None,
residual=None, health=None)`` gathers many separate tensors into one flat
buffer, scales and casts them, with error feedback and a gradient health
flag in the same launch: one launch per source dtype.  ``unpack(src, dsts,
offsets=None, scale=1.0, divide=None, accumulate=False, *, layout=None)``
does the reverse in one launch per destination dtype.

For the low-precision reductions: ``reduce_shards(src, out, world)`` (bf16
slices summed in fp32 in rank order, rounded once) and block-scaled fp8
``quantize_fp8`` / ``dequantize_fp8`` / ``reduce_fp8_shards`` (the rule is
written once, in :mod:`fastddp.kernels.reference`); one launch each;
``quantize_fp8_gather``, a ``pack`` and a ``quantize_fp8`` in one pass on the
CPU's native loops.

Backends (chosen in the op layer, :mod:`fastddp.kernels._ops`, from a
capability probe made once and cached):

* ``triton``: compiled Triton kernels, for CUDA tensors;
* ``interpret``: the same kernel source under the Triton interpreter, for CPU
  tensors when ``TRITON_INTERPRET=1`` was set before import (how CI tests the
  kernels);
* ``reference``: plain torch (:mod:`fastddp.kernels.torch_path`, held to the
  naive contract :mod:`fastddp.kernels.reference`), for CPU tensors otherwise
  and CUDA tensors under the interpreter.

Inside a kernel call, a tensor whose memory order is not its layout slot's
(a transposed gradient, say) is copied with torch, alone; the rest of the
call stays in its one launch per dtype.

Modules: ``_ops`` (op layer), ``_layout`` (``Layout``), ``_table_ring`` (the pointer tables of the launches), ``pack_kernel`` / ``unpack_kernel`` /
``shard_kernel`` / ``fp8_kernel`` (kernel + launcher), ``_triton_common`` (tables shared by the launchers),
``torch_path`` (fast plain torch), ``reference`` (the arithmetic contract).
"""

from __future__ import annotations

from ._ops import (Layout, add_served_source, backend, count_served, launch_count, retire_served_source, pack, reset_backend, reset_launch_count, stats, unpack,
                   triton_available as _triton_available)
from ._ops import dequantize_fp8, quantize_fp8, quantize_fp8_gather, reduce_fp8_shards, reduce_shards
from . import reference
from .reference import Health, first_nonfinite


def prepare_fp8(device=None) -> None:
    """Build (or load from the cache) the fp8 CPU loops now where they will
    serve ``device``'s fp8 calls (the plain-torch backend on the CPU), so the
    one-time build happens when the fp8 mode is chosen, not in a training
    step.  Elsewhere, or with FASTDDP_FP8_NATIVE=0, it does nothing."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu" and backend(dev) == "reference":
        from . import _fp8_native

        _fp8_native.module()

if _triton_available():
    # Import the kernels now: TRITON_INTERPRET is read when @triton.jit runs.
    try:
        from . import pack_kernel as _pack_kernel, unpack_kernel as _unpack_kernel  # noqa: F401
        from . import shard_kernel as _shard_kernel  # noqa: F401
        from . import fp8_kernel as _fp8_kernel  # noqa: F401
    except Exception as _exc:  # a broken Triton must not take the reference path down
        import warnings

        warnings.warn(f"fastddp.kernels: Triton kernels unavailable ({_exc!r}); "
                      "CPU calls use the reference, kernel calls will raise", RuntimeWarning)

__all__ = [
    "prepare_fp8",
    "Health",
    "Layout",
    "add_served_source",
    "retire_served_source",
    "backend",
    "count_served",
    "first_nonfinite",
    "launch_count",
    "pack",
    "dequantize_fp8",
    "quantize_fp8",
    "quantize_fp8_gather",
    "reduce_fp8_shards",
    "reduce_shards",
    "reference",
    "reset_backend",
    "reset_launch_count",
    "stats",
    "unpack",
]
