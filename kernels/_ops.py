"""The op layer: what the reducer calls.  The public :func:`pack`,
:func:`unpack` and :class:`Layout`; every argument check (done here, once);
the backend, chosen here, once per call from a capability probe cached for
the process; the launch counters' readers (the counters live in
``_counters``, below this module and the launchers that bump them).

Layers (kernel -> launcher -> op)::

    pack()/unpack()   validate, choose the backend
      |-- "reference"            torch_path (fast plain torch)
      |-- "triton"/"interpret"   pack_kernel.launch_pack / unpack_kernel.launch_unpack
      |                          (under the interpreter lock or the device guard),
      |                          then torch_path for the tensors the kernels left alone
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Sequence

import torch

from . import reference, torch_path
# The counters (re-exported by fastddp.kernels) and the stride helpers live below
# this module and the launchers, which use them too: no import circle.
from ._counters import add_served_source, retire_served_source, bump as _bump, bump_all as _bump_all, count_served, launch_count, reset_launch_count, stats  # noqa: F401
from ._layout import Layout  # noqa: F401  (re-exported: fastddp.kernels.Layout)
from ._switch import interpreter_requested

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ============================================================ capabilities
# Detected once and cached, behind a guarded Triton import: a broken Triton must not break CPU use.

@functools.lru_cache(maxsize=None)
def _triton_status() -> tuple[bool, bool, str]:
    """(triton importable, interpreter on, reason-if-not)."""
    interpret = interpreter_requested()
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, False, f"triton not importable: {exc!r}"
    return True, interpret, ""


def triton_available() -> bool:
    return _triton_status()[0]


def backend(device: torch.device | str | None = None) -> str:
    """The backend that serves tensors on ``device`` (default CPU): ``"triton"``
    (compiled kernels, CUDA tensors), ``"interpret"`` (the kernels under
    TRITON_INTERPRET=1, CPU tensors) or ``"reference"`` (plain torch: CPU
    tensors without the interpreter, CUDA tensors under it).  The one place
    the choice is made."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ok, interp, _ = _triton_status()
    if dev.type == "cuda":
        return "triton" if ok and not interp else "reference"
    return "interpret" if ok and interp else "reference"


def reset_backend() -> None:
    """Forget the cached capability probe (tests use it to isolate themselves)."""
    _triton_status.cache_clear()


# ========================================================= argument checks
def _check_common(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale, divide) -> None:
    reference._check_scaling(scale, divide)
    if flat.dim() != 1:
        raise ValueError(f"{op}: the flat buffer must be 1-D, got shape {tuple(flat.shape)}")
    if flat.dtype not in _FLOATS:
        raise TypeError(f"{op}: flat buffer dtype {flat.dtype} is not one of fp32/fp16/bf16/fp64")
    if not flat.is_contiguous():
        raise ValueError(f"{op}: the flat buffer must be contiguous")
    for i, t in enumerate(tensors):
        if t.dtype not in _FLOATS:
            raise TypeError(f"{op}: tensor {i} has dtype {t.dtype}; supported: fp32, fp16, bf16, fp64")
        if t.device != flat.device:
            raise ValueError(f"{op}: tensor {i} is on {t.device} but the flat buffer is on {flat.device}")


def _resolve_layout(op: str, tensors, flat, offsets, layout) -> Layout:
    if layout is not None:
        if offsets is not None:
            raise ValueError(f"{op}: pass offsets or layout, not both")
        if len(layout.numels) != len(tensors):
            raise ValueError(f"{op}: layout has {len(layout.numels)} tensors, got {len(tensors)}")
        if flat.numel() < layout.total:
            raise ValueError(f"{op}: layout needs a flat buffer of >= {layout.total} elements, got {flat.numel()}")
        return layout
    lay = Layout.for_tensors(tensors, offsets)
    lay.anonymous = True
    reference._check_layout(lay.numels, lay.offsets, flat.numel(), op)
    return lay


def _check_residual(residual: torch.Tensor, dst: torch.Tensor, lay: Layout) -> None:
    if residual.dim() != 1 or not residual.is_contiguous():
        raise ValueError("pack: residual must be a contiguous 1-D tensor indexed like dst")
    if residual.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"pack: residual must be float32 (or float64), got {residual.dtype}")
    if residual.device != dst.device:
        raise ValueError(f"pack: residual is on {residual.device} but dst is on {dst.device}")
    if residual.numel() < lay.total:
        raise ValueError(f"pack: residual has {residual.numel()} elements; the layout needs {lay.total}")


def _check_health(health: torch.Tensor, dst: torch.Tensor) -> None:
    if not isinstance(health, torch.Tensor) or health.dtype != torch.int32 or health.numel() != 1:
        raise TypeError("pack: health must be a 1-element int32 tensor (e.g. flags[b:b+1] of a "
                        f"torch.zeros(n_buckets, dtype=torch.int32)), got {getattr(health, 'dtype', health)!r}")
    if health.device != dst.device:
        raise ValueError(f"pack: health is on {health.device} but dst is on {dst.device}")


# ============================================================== dispatch
# The interpreter is not thread-safe: every interpreted launch takes this lock.
_INTERPRET_LOCK = threading.Lock()


def _launch(name: str, device: torch.device, launcher, *args) -> list[int]:
    """Run a kernel launcher for backend ``name`` on ``device``'s tensors."""
    if name == "interpret":
        with _INTERPRET_LOCK:
            return launcher(*args)
    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return launcher(*args)
    return launcher(*args)


def pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int] | None = None,
         scale: float = 1.0, divide: float | None = None, *, layout: Layout | None = None,
         residual: torch.Tensor | None = None, health: torch.Tensor | None = None) -> torch.Tensor:
    """Gather ``srcs`` into the flat ``dst`` at element ``offsets`` (default: back to
    back), multiplied by ``scale`` (or divided by ``divide``) and cast to
    ``dst.dtype``; one launch per source dtype.  With ``residual`` (a flat
    float32 tensor indexed like ``dst``) the launch also applies error
    feedback: ``x = src*scale + residual; dst = cast(x); residual = x - dst``
    (0 where that is not finite).

    ``health``: a 1-element int32 tensor on ``dst``'s device.  The same launch
    (no extra pass, no host sync) ORs :class:`Health` bits into it: a source
    value NaN/inf (bit 0), finite inputs stored as inf/NaN, i.e. the 16-bit
    cast overflowed (bit 1), a residual value NaN/inf (bit 2).  The kernel
    never clears it: zero it once per step (keep every bucket's flag in one
    tensor: one fill for all), read it when the step is done.  On failure,
    :func:`first_nonfinite` names the tensor.

    In place: a source may be its own slot of ``dst`` (``pack([flat], flat,
    layout=Layout([flat.shape]), divide=W, health=h)`` divides and checks a
    filled bucket in one launch): every element is read before it is
    written, by the same program, and the health bits describe the values
    as they were read.  Other overlaps of a source with ``dst`` are not
    supported.  Returns ``dst``."""
    # With a Layout the caller (the reducer) vouches for the tensors: only the
    # counts are checked, keeping the per-step host cost O(1) in Python; the
    # launcher vets new tensors when it builds their pointer table.
    _check_common("pack", dst, srcs if layout is None else (), scale, divide)
    lay = _resolve_layout("pack", srcs, dst, offsets, layout)
    if residual is not None:
        _check_residual(residual, dst, lay)
    if health is not None:
        _check_health(health, dst)
    _bump("pack_calls")
    if not srcs:
        return dst
    name = backend(dst.device)
    if name == "reference":
        _bump("reference_calls")
        res_views = lay.views(residual) if residual is not None else None
        whole = dst if lay.dense and lay.total == dst.numel() else None
        torch_path.pack_views(srcs, lay.views(dst), scale, divide, res_views, flat=whole, health=health)
        return dst
    from .pack_kernel import launch_pack

    fallback = _launch(name, dst.device, launch_pack, srcs, dst, lay, scale, divide, residual, health)
    if fallback:  # tensors not in their slot's memory order: torch, alone
        _bump("fallback_tensors", len(fallback))
        views = lay.views(dst)
        res_views = [lay.views(residual)[i] for i in fallback] if residual is not None else None
        torch_path.pack_views([srcs[i] for i in fallback], [views[i] for i in fallback], scale, divide,
                              res_views, health=health)
    return dst


def unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int] | None = None,
           scale: float = 1.0, divide: float | None = None, accumulate: bool = False,
           *, layout: Layout | None = None) -> Sequence[torch.Tensor]:
    """Scatter the flat ``src`` into ``dsts``: each slice multiplied by ``scale`` (or
    divided by ``divide``), cast to its destination's dtype and stored (or added,
    with ``accumulate=True``); one launch per destination dtype.  Returns ``dsts``."""
    _check_common("unpack", src, dsts if layout is None else (), scale, divide)
    lay = _resolve_layout("unpack", dsts, src, offsets, layout)
    _bump("unpack_calls")
    if not dsts:
        return dsts
    name = backend(src.device)
    if name == "reference":
        _bump("reference_calls")
        torch_path.unpack_views(lay.views(src), dsts, scale, divide, accumulate)
        return dsts
    from .unpack_kernel import launch_unpack

    fallback = _launch(name, src.device, launch_unpack, src, dsts, lay, scale, divide, accumulate)
    if fallback:
        _bump("fallback_tensors", len(fallback))
        views = lay.views(src)
        torch_path.unpack_views([views[i] for i in fallback], [dsts[i] for i in fallback], scale, divide,
                                accumulate)
    return dsts


# ============================================================ shard sum
_SHARD_DTYPES = (torch.bfloat16, torch.float32)


def _dispatch(device: torch.device, cpu_fn, module: str, launcher: str, *args) -> None:
    """Run a single-launch op (the shard sums, fp8): the plain-torch path on the
    reference backend, else the Triton launcher ``module.launcher`` (imported
    on first use, so the CPU path never imports Triton), with the same
    arguments."""
    name = backend(device)
    if name == "reference":
        _bump("reference_calls")
        cpu_fn(*args)
        return
    _launch(name, device, getattr(importlib.import_module(f".{module}", __package__), launcher), *args)


def reduce_shards(src: torch.Tensor, out: torch.Tensor, world: int, *,
                  health: torch.Tensor | None = None) -> torch.Tensor:
    """Sum this rank's shard as received from every rank: ``src`` holds
    ``world`` slices of ``out.numel()`` elements back to back (rank order,
    what an equal-split all-to-all delivers); ``out`` gets their fp32 sum,
    taken in rank order and rounded once (bf16) or stored as it is (fp32) (the contract:
    :func:`fastddp.kernels.reference.reduce_shards`).  ``out`` may be
    ``src``'s first slice.  ``health``: the bucket's flag; ``OVERFLOW`` is
    ORed in where finite inputs sum to NaN/inf.  One launch (Triton
    backends).  Returns ``out``."""
    world = int(world)
    if world < 1:
        raise ValueError(f"reduce_shards: world must be >= 1, got {world}")
    for what, t in (("src", src), ("out", out)):
        if t.dtype not in _SHARD_DTYPES:
            raise TypeError(f"reduce_shards: {what} has dtype {t.dtype}; the shard sum takes bfloat16 "
                            "or float32")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"reduce_shards: {what} must be a contiguous 1-D tensor")
    if src.dtype != out.dtype:
        raise TypeError(f"reduce_shards: src is {src.dtype} but out is {out.dtype}; both must be one dtype")
    if out.device != src.device:
        raise ValueError(f"reduce_shards: out is on {out.device} but src is on {src.device}")
    if src.numel() != world * out.numel():
        raise ValueError(f"reduce_shards: src holds {src.numel()} elements; {world} slices of out's "
                         f"{out.numel()} need {world * out.numel()}")
    if health is not None:
        _check_health(health, out)
    _dispatch(out.device, torch_path.reduce_shards, "shard_kernel", "launch_reduce_shards",
              src, out, world, health)
    return out


# ============================================================ block-scaled fp8
def _check_fp8(op: str, block: int, n: int, q: torch.Tensor, scales: torch.Tensor, device) -> None:
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"{op}: block={block!r} must be a power of two >= 16 (e.g. 128 or 256)")
    if n % block:
        raise ValueError(f"{op}: {n} elements are not a whole number of blocks of {block}; pad the "
                         "buffer to a multiple of the block size")
    if q.dtype != torch.uint8:
        raise TypeError(f"{op}: the fp8 tensor must be uint8 (the e4m3 bits: gloo refuses float8 "
                        f"dtypes), got {q.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{op}: scales must be float32, got {scales.dtype}")
    for what, t in (("fp8 tensor", q), ("scales", scales)):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{op}: the {what} must be a contiguous 1-D tensor")
        if t.device != device:
            raise ValueError(f"{op}: the {what} is on {t.device}, not {device}")
    if q.numel() != n or scales.numel() != n // block:
        raise ValueError(f"{op}: {n} values need an fp8 tensor of {n} and {n // block} scales, got "
                         f"{q.numel()} and {scales.numel()}")


def _check_f32(op: str, what: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
        raise TypeError(f"{op}: {what} must be a contiguous 1-D float32 tensor, got {t.dtype} "
                        f"of shape {tuple(t.shape)}")


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int = 256, *,
                 residual: torch.Tensor | None = None, health: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled e4m3 by the rule of :mod:`fastddp.kernels.reference`
    (power-of-two scale per ``block`` elements, nearest even, NaN for
    non-finite values): ``x`` fp32 -> ``q`` (uint8 bits) + ``scales``; with
    ``residual`` (fp32, like ``x``) error feedback in the same launch; with
    ``health`` the SOURCE/RESIDUAL_NONFINITE bits.  Returns ``q``."""
    _check_f32("quantize_fp8", "x", x)
    _check_fp8("quantize_fp8", block, x.numel(), q, scales, x.device)
    if residual is not None:
        _check_f32("quantize_fp8", "residual", residual)
        if residual.numel() != x.numel() or residual.device != x.device:
            raise ValueError("quantize_fp8: residual must match x in size and device")
    if health is not None:
        _check_health(health, x)
    _dispatch(x.device, torch_path.quantize_fp8, "fp8_kernel", "launch_quantize_fp8",
              x, q, scales, block, residual, health)
    return q


def quantize_fp8_gather(parts: Sequence[torch.Tensor], offsets: Sequence[int], scale: float, x: torch.Tensor,
                        q: torch.Tensor, scales: torch.Tensor, block: int = 256, *,
                        residual: torch.Tensor | None = None, health: torch.Tensor | None = None) -> torch.Tensor:
    """``pack(parts, x, offsets, scale=scale)`` then ``quantize_fp8(x, q,
    scales, block, residual=..., health=...)``: the same codes, scales,
    residual and health bits.  On the CPU with the native loops it is ONE
    pass that reads each part times ``scale`` straight into its block, and
    ``x`` is read only where no part lies and not written where one does
    (the caller must not need those values of ``x`` afterwards); from a
    block holding a NaN/inf on (and on every other backend) the two calls
    do the rest.  ``parts``: 1-D fp32, at ``offsets`` in ``x``, sorted, not
    overlapping."""
    if len(parts) != len(offsets):
        raise ValueError(f"quantize_fp8_gather: {len(parts)} parts but {len(offsets)} offsets")
    _check_f32("quantize_fp8_gather", "x", x)
    _check_fp8("quantize_fp8_gather", block, x.numel(), q, scales, x.device)
    start = 0
    if backend(x.device) == "reference":
        start = torch_path.quantize_fp8_gather(parts, offsets, scale, x, q, scales, block, residual)
    if start == x.numel():
        return q
    rest, at = [], []  # the parts' values from block ``start`` on
    for t, o in zip(parts, offsets):
        if o + t.numel() > start:
            rest.append(t[max(start - o, 0):])
            at.append(max(o - start, 0))
    if rest:
        pack(rest, x[start:], at, scale=scale)
    return quantize_fp8(x[start:], q[start:], scales[start // block:], block,
                        residual=None if residual is None else residual[start:], health=health)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``out`` (fp32) = each e4m3 value of ``q`` times its block's scale, exactly."""
    _check_f32("dequantize_fp8", "out", out)
    _check_fp8("dequantize_fp8", block, out.numel(), q, scales, out.device)
    _dispatch(out.device, torch_path.dequantize_fp8, "fp8_kernel", "launch_dequantize_fp8", q, scales, out, block)
    return out


def reduce_fp8_shards(src_q: torch.Tensor, src_s: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor,
                      world: int, block: int = 256, *, health: torch.Tensor | None = None) -> torch.Tensor:
    """The fp8 shard sum: ``world`` slices of fp8 values + scales (rank
    order) dequantized, added in fp32 in rank order, quantized again into
    ``out_q`` / ``out_s`` (which may be the first slices).  One launch."""
    world = int(world)
    if world < 1:
        raise ValueError(f"reduce_fp8_shards: world must be >= 1, got {world}")
    n = out_q.numel()
    _check_fp8("reduce_fp8_shards", block, n, out_q, out_s, out_q.device)
    _check_fp8("reduce_fp8_shards", block, world * n, src_q, src_s, out_q.device)
    if health is not None:
        _check_health(health, out_q)
    _dispatch(out_q.device, torch_path.reduce_fp8_shards, "fp8_kernel", "launch_reduce_fp8_shards",
              src_q, src_s, out_q, out_s, world, block, health)
    return out_q
