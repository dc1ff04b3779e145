"""Where each tensor of a pack/unpack lives in the flat buffer: :class:`Layout`
(shapes, offsets, the memory order of each slot)."""

from __future__ import annotations

from typing import Sequence

import torch

from . import reference
from ._strides import is_dense, row_major_strides, same_memory_order

__all__ = ["Layout"]


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


# ============================================================ validation
