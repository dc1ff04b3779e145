"""The ops the reducer calls: argument checks, backend dispatch, layout cache."""

from __future__ import annotations

from typing import Sequence

import torch

from . import reference
from .reference import is_dense, row_major_strides, same_memory_order
from ._backend import backend
from ._counters import _bump

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Layout:
    """The fixed layout of one bucket: the shapes of its tensors, their element
    offsets inside a flat buffer and, optionally, their strides.

    ``strides[i]`` (None: row-major) lays tensor ``i``'s slot out like a
    non-overlapping, dense tensor of those strides, e.g. a channels_last
    convolution weight: the slot still covers ``[offsets[i], offsets[i] +
    numel)``, and :meth:`views` gives ``as_strided`` views, as torch's
    reducer does for dense parameters.  A tensor whose strides are its
    slot's is then moved in memory order, inside the one launch.

    Build it once per bucket and pass it to every :func:`pack` / :func:`unpack`
    of that bucket: it caches the views of each flat buffer it has met (the
    CPU path) and its own pointer tables (Triton), so a steady-state step
    whose tensors sit where they sat last step rewrites nothing.  It holds
    views of at most the few buffers a bucket owns (its flat bucket, its wire
    buffer).
    """

    __slots__ = ("shapes", "numels", "offsets", "strides", "total", "dense", "anonymous", "_views", "cache")

    def __init__(self, shapes: Sequence[Sequence[int]], offsets: Sequence[int] | None = None,
                 strides: Sequence[Sequence[int] | None] | None = None):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = reference.default_offsets(self.numels) if offsets is None else [int(o) for o in offsets]
        if len(self.offsets) != len(self.numels):
            raise ValueError(f"Layout: {len(self.numels)} shapes but {len(self.offsets)} offsets")
        self.strides = [None] * len(self.shapes) if strides is None else _slot_strides(self.shapes, strides)
        self.total = max((o + n for o, n in zip(self.offsets, self.numels)), default=0)
        # Back to back from 0 with no gap: the tensors tile [0, total) exactly.
        self.dense = self.offsets == reference.default_offsets(self.numels)
        self.anonymous = False  # True: built by the public API for one call
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}
        self.cache: dict = {}  # backend-private (chunk tables, pointer buffers)

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None, *,
                    keep_strides: bool = False) -> "Layout":
        """The layout of ``tensors``' shapes.  ``keep_strides=True``: torch's
        bucket-view rule, each non-overlapping and dense tensor keeps its
        strides (its gradient will have them), any other is row-major."""
        strides = None
        if keep_strides:
            strides = [t.stride() if is_dense(t.shape, t.stride()) else None for t in tensors]
        return cls([t.shape for t in tensors], offsets, strides)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped (and strided) like the layout's tensors (cached per buffer)."""
        key = (flat.data_ptr(), flat.dtype, flat.numel())
        v = self._views.get(key)
        if v is None:
            if flat.numel() < self.total:
                raise ValueError(f"Layout needs a flat buffer of >= {self.total} elements, got {flat.numel()}")
            base = flat.storage_offset()
            v = [flat.narrow(0, o, n).view(s) if st is None else flat.as_strided(s, st, base + o)
                 for o, n, s, st in zip(self.offsets, self.numels, self.shapes, self.strides)]
            if len(self._views) >= 8:  # a bucket owns a handful of buffers; never grow unbounded
                self._views.clear()
            self._views[key] = v
        return v


def _slot_strides(shapes: Sequence[torch.Size], strides) -> list[tuple[int, ...] | None]:
    """Validated per-slot strides; row-major ones become None (the same memory order)."""
    if len(strides) != len(shapes):
        raise ValueError(f"Layout: {len(shapes)} shapes but {len(strides)} strides")
    out: list[tuple[int, ...] | None] = []
    for i, (shape, st) in enumerate(zip(shapes, strides)):
        if st is None:
            out.append(None)
            continue
        st = tuple(int(x) for x in st)
        if not is_dense(shape, st):
            raise ValueError(f"Layout: strides {st} of tensor {i} (shape {tuple(shape)}) overlap or leave "
                             "gaps; pass None for a row-major slot")
        out.append(None if same_memory_order(shape, st, row_major_strides(shape)) else st)
    return out


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
        return layout
    lay = Layout.for_tensors(tensors, offsets)
    lay.anonymous = True
    reference._check_layout(lay.numels, lay.offsets, flat.numel(), op)
    return lay


def _use_triton(flat: torch.Tensor) -> str | None:
    """The kernel backend for ``flat``'s device, or None for the reference.
    Tensors whose memory order is not their layout slot's are the launcher's
    business: it copies those alone with torch and launches for the rest."""
    name = backend(flat.device)
    return None if name == "reference" else name


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
    :func:`first_nonfinite` names the tensor.  Returns ``dst``."""
    # With a Layout the caller (the reducer) vouches for the tensors: only the
    # counts are checked, keeping the per-step host cost O(1) in Python.
    _check_common("pack", dst, srcs if layout is None else (), scale, divide)
    lay = _resolve_layout("pack", srcs, dst, offsets, layout)
    if residual is not None:
        _check_residual(residual, dst, lay)
    if health is not None:
        _check_health(health, dst)
    _bump("pack_calls")
    if not srcs:
        return dst
    mode = _use_triton(dst)
    if mode is not None and residual is not None and not _triton_has_residual():
        mode = None
    if mode is None:
        _bump("reference_calls")
        res_views = lay.views(residual) if residual is not None else None
        whole = dst if lay.dense and lay.total == dst.numel() else None
        reference.pack_views(srcs, lay.views(dst), scale, divide, res_views, flat=whole, health=health)
        return dst
    from .pack import pack_triton

    pack_triton(srcs, dst, lay, scale, divide, residual=residual, health=health)
    return dst


def _check_health(health: torch.Tensor, dst: torch.Tensor) -> None:
    if not isinstance(health, torch.Tensor) or health.dtype != torch.int32 or health.numel() != 1:
        raise TypeError("pack: health must be a 1-element int32 tensor (e.g. flags[b:b+1] of a "
                        f"torch.zeros(n_buckets, dtype=torch.int32)), got {getattr(health, 'dtype', health)!r}")
    if health.device != dst.device:
        raise ValueError(f"pack: health is on {health.device} but dst is on {dst.device}")


def _check_residual(residual: torch.Tensor, dst: torch.Tensor, lay: Layout) -> None:
    if residual.dim() != 1 or not residual.is_contiguous():
        raise ValueError("pack: residual must be a contiguous 1-D tensor indexed like dst")
    if residual.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"pack: residual must be float32 (or float64), got {residual.dtype}")
    if residual.device != dst.device:
        raise ValueError(f"pack: residual is on {residual.device} but dst is on {dst.device}")
    if residual.numel() < lay.total:
        raise ValueError(f"pack: residual has {residual.numel()} elements; the layout needs {lay.total}")


def _triton_has_residual() -> bool:
    """Whether the Triton pack kernel implements error feedback (else the
    reference serves those calls)."""
    import importlib

    # (``from . import pack`` would give the public function of that name)
    return bool(getattr(importlib.import_module(__package__ + ".pack"), "SUPPORTS_RESIDUAL", False))


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
    mode = _use_triton(src)
    if mode is None:
        _bump("reference_calls")
        reference.unpack_views(lay.views(src), dsts, scale, divide, accumulate)
        return dsts
    from .unpack import unpack_triton

    unpack_triton(src, dsts, lay, scale, divide, accumulate)
    return dsts
