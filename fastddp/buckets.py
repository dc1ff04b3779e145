"""One bucket's tensors: the flat buffer, the per-parameter views, the layout
the kernels launch with, and the collective in flight."""

from __future__ import annotations

from typing import Sequence

import torch

from . import kernels, planner
from .comm import Pending

__all__ = ["Bucket"]

_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64,
            torch.complex32: torch.float16}


class Bucket:
    """Runtime state of one bucket of the plan.

    ``flat`` is real: a complex bucket holds the real view of its params'
    gradients (``layout`` / ``views`` over real elements), while
    ``grad_views`` are what ``.grad`` aliases with ``gradient_as_bucket_view``
    (the complex views of ``flat`` for complex params, else ``views``).  A
    sparse bucket (one parameter) has no flat buffer: ``sparse_grad`` is the
    gradient in flight.  ``reduction`` is the bucket mode's strategy
    (:mod:`fastddp.reduction`), which owns any further buffers (wire,
    residual)."""

    __slots__ = ("index", "spec", "params", "indices", "layout", "flat", "views", "size",
                 "pending", "work", "ready_event", "flat_layout", "complex", "grad_views",
                 "hook_layout", "sparse", "sparse_grad", "reduction", "health", "prefilled",
                 "in_place", "_segments")

    def __init__(self, spec: planner.BucketSpec, params: Sequence[torch.Tensor], dtype: torch.dtype | None = None):
        self.index = spec.index
        self.spec = spec
        self.indices = list(spec.param_indices)
        self.params = [params[i] for i in self.indices]
        self.size = len(self.params)
        self.pending = self.size
        self.sparse = spec.sparse
        self.sparse_grad = None
        self.work: Pending | None = None
        self.reduction = None
        self.health: torch.Tensor | None = None  # check_finite: this bucket's int32 flag (a view)
        self.prefilled = 0  # grads the native hooks already copied into their views this iteration
        self.in_place: list | None = None  # this step's tensor per segment (a mode that reduces grads in place)
        self._segments: tuple | None = None  # (min_numel, segments(min_numel))
        self.ready_event = torch.cuda.Event() if spec.device.type == "cuda" else None
        dtype = dtype or spec.dtype
        self.complex = dtype.is_complex
        if self.sparse:
            self.flat = self.layout = self.flat_layout = self.hook_layout = None
            self.views = self.grad_views = [None]
            return
        if self.complex:
            self.layout = kernels.Layout([(*p.shape, 2) for p in self.params],
                                         [2 * o for o in spec.offsets])
            self.flat = torch.zeros(2 * spec.numel, dtype=_REAL_OF[dtype], device=spec.device)
            self.views = self.layout.views(self.flat)
            self.grad_views = [torch.view_as_complex(v) for v in self.views]
            self.hook_layout = kernels.Layout([p.shape for p in self.params], spec.offsets)
        else:
            # bucket views keep each dense param's strides (torch's rule): a
            # channels_last grad is then moved in memory order by the one launch
            self.layout = kernels.Layout.for_tensors(self.params, spec.offsets, keep_strides=True)
            self.flat = torch.zeros(spec.numel, dtype=dtype, device=spec.device)
            self.views = self.grad_views = self.layout.views(self.flat)
            self.hook_layout = self.layout
        self.flat_layout = kernels.Layout([self.flat.shape])  # the flat bucket as one tensor

    def reset(self) -> None:
        """A new (or abandoned) iteration: every gradient pending, nothing in flight."""
        self.pending, self.work, self.sparse_grad, self.in_place = self.size, None, None, None

    def segments(self, min_numel: int) -> tuple:
        """The bucket cut so that each gradient of at least ``min_numel``
        elements can be reduced where it is: ``((start, stop, pos), ...)`` in
        slot order, ``pos`` the position of such a parameter whose slot is
        ``flat[start:stop]``, or -1 for a run of smaller slots between them.
        ``()`` when no dense parameter is that large.  The same on every rank
        (it depends on the plan alone): the collectives follow it."""
        if self._segments is not None and self._segments[0] == min_numel:
            return self._segments[1]
        out: list = []
        if not self.sparse and not self.complex:
            slots = sorted(zip(self.layout.offsets, self.layout.numels, range(self.size)))
            if any(n >= min_numel for _, n, _ in slots):
                for off, n, k in slots:
                    if n >= min_numel:
                        out.append((off, off + n, k))
                    elif out and out[-1][2] < 0:
                        out[-1] = (out[-1][0], off + n, -1)
                    elif n:
                        out.append((off, off + n, -1))
        self._segments = (min_numel, tuple(out))
        return self._segments[1]

    def adopt_grads(self) -> None:
        """gradient_as_bucket_view after a rebuild (torch's initialize_bucket_views):
        live grads move into this bucket and become views of it."""
        if self.sparse:
            return
        with torch.no_grad():
            for p, v in zip(self.params, self.grad_views):
                if p.grad is not None and p.grad is not v:
                    v.copy_(p.grad)
                    p.grad = v

    def kernel_grads(self, grads):
        """The grads as the kernels see them (real views of complex grads)."""
        if not self.complex:
            return grads
        return [None if g is None else torch.view_as_real(g) for g in grads]

    def hook_buffer(self) -> torch.Tensor:
        """The flat buffer a comm hook receives (complex for a complex bucket, as torch)."""
        if self.sparse:
            return self.sparse_grad
        return torch.view_as_complex(self.flat.view(-1, 2)) if self.complex else self.flat

    def hook_numel(self) -> int:
        return self.flat.numel() // 2 if self.complex else self.flat.numel()

    def nbytes(self) -> int:
        """Bytes of the flat buffer (sparse: of the gradient in flight)."""
        if self.sparse:
            g = self.sparse_grad
            if g is None:
                return 0
            g = g if g.is_coalesced() else g.coalesce()
            return g.values().numel() * g.element_size() + g.indices().numel() * 8
        return self.flat.numel() * self.flat.element_size()

    def describe(self, names: Sequence[str]) -> dict:
        return {"index": self.index,
                "dtype": str(self.params[0].dtype if self.sparse or self.complex else self.flat.dtype),
                "device": str(self.params[0].device), "numel": self.spec.numel,
                "bytes": self.nbytes(), "sparse": self.sparse,
                "params": [names[i] for i in self.indices]}
