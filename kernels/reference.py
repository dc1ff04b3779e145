"""Plain-torch twin of the fused pack/unpack kernels.

One implementation serves three roles (see STYLE.md, "the reference lives in
the package"): the CPU path of the reducer, the oracle of the kernel tests and
the baseline of the benchmarks.  Never copy it into tests or benches.

Arithmetic contract (the Triton kernels match it bit for bit):

* compute dtype ``C`` is float64 when the source or the destination is
  float64, float32 otherwise;
* ``pack``:   ``dst[o:o+n] = cast_dst( src.to(C) * C(scale) )``
  or, with ``divide``, ``cast_dst( src.to(C) / C(divide) )``;
* ``unpack``: ``v = src[o:o+n].to(C) * C(scale)`` (or ``/ C(divide)``),
  ``dst = cast_dst(dst.to(C) + v)`` when ``accumulate`` else ``cast_dst(v)``;
* casts round to nearest even like ``Tensor.to``; a scale of exactly 1.0 with
  no divide is a pure cast (a copy when the dtypes agree);
* ``pack`` with a residual ``r`` (error feedback), in ``r``'s dtype:
  ``x = scaled(src) + r; dst = cast_dst(x); r = x - dst.to(r.dtype)``, and a
  non-finite new ``r`` is stored as 0 (one overflowing step must not poison
  the next);
* ``pack`` with a health flag ORs :class:`Health` bits into it:
  ``SOURCE_NONFINITE`` if any source value is NaN/inf, ``RESIDUAL_NONFINITE``
  if any residual value read is, ``OVERFLOW`` if an element whose source (and
  residual) are finite is stored NaN/inf (the 16-bit cast overflowed, or the
  scaling or the residual's add did).

Torch's own rules for DDP follow from this: the default reducer multiplies
each gradient by ``fp32(1/W)``; ``batched_grad_copy`` and ``allreduce_hook``
divide by ``W``.  On CUDA, torch's ``div`` by a CPU scalar multiplies by the
reciprocal instead; the CUDA launcher mirrors that, so each device matches
torch on that device.
"""

from __future__ import annotations

import enum
from operator import attrgetter
from typing import Sequence

import torch

__all__ = ["Health", "compute_dtype", "default_offsets", "first_nonfinite", "pack", "unpack", "pack_views",
           "unpack_views"]


class Health(enum.IntFlag):
    """The bits :func:`pack` (``health=``) ORs into a bucket's int32 flag."""

    SOURCE_NONFINITE = 1    #: a source value (before scaling and cast) is NaN or inf
    OVERFLOW = 2            #: finite inputs were stored NaN/inf (a 16-bit cast overflowed)
    RESIDUAL_NONFINITE = 4  #: an error-feedback residual value read was NaN or inf


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic of one (source, destination) pair runs in."""
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def default_offsets(numels: Sequence[int]) -> list[int]:
    """Offsets that pack tensors back to back, in order."""
    out, acc = [], 0
    for n in numels:
        out.append(acc)
        acc += int(n)
    return out


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def same_memory_order(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Strides ``a`` and ``b`` lay a tensor of ``shape`` out identically (dims of
    size 1 do not count; an empty tensor has no layout)."""
    if 0 in shape:
        return True
    return len(a) == len(b) == len(shape) and all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` lay a tensor of ``shape`` out without overlap or gap
    (torch's ``is_non_overlapping_and_dense``; dims of size 1 do not count)."""
    if len(shape) != len(strides):
        return False
    if 0 in shape:
        return True
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True


def _scaled(x: torch.Tensor, scale: float, divide: float | None) -> torch.Tensor:
    # ``x`` is already in the compute dtype; python scalars are converted to
    # it by torch exactly as the kernels convert them.
    if divide is not None:
        return x / divide
    if scale != 1.0:
        return x * scale
    return x


def _check_scaling(scale: float, divide: float | None) -> None:
    if divide is not None and scale != 1.0:
        raise ValueError(
            f"pass either scale={scale} or divide={divide}, not both: they are two "
            "different rounding rules (torch multiplies by fp32(1/W) on its default "
            "path and divides by W on batched_grad_copy)"
        )
    if divide is not None and divide == 0:
        raise ValueError("divide=0: the divisor of the gradient average must be non-zero")


def pack_views(srcs: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
               scale: float = 1.0, divide: float | None = None,
               residuals: Sequence[torch.Tensor] | None = None,
               flat: torch.Tensor | None = None, health: torch.Tensor | None = None) -> None:
    """Write each ``srcs[i]`` into ``views[i]`` (a view of the flat bucket shaped
    like ``srcs[i]``), scaled and cast: the CPU path of the reducer.

    Host cost is a handful of C++ calls per bucket, not per tensor: where the
    source dtype is the compute dtype (fp32, or fp64) the scale runs as one
    ``_foreach_*`` in that dtype (the contract's ``x * C(scale)``, rounded
    once) and the cast as one ``_foreach_copy_`` (round to nearest even);
    fp16/bf16 sources go tensor by tensor (``_foreach_mul_`` on 16-bit
    tensors would round the scale itself to 16 bits).  ``flat``: the whole
    buffer, when the views tile it exactly; the scale is then one op on it.
    ``health``: a 1-element int32 tensor the :class:`Health` bits are ORed
    into (device ops, no host sync; a few passes, only when asked)."""
    if health is not None:
        src_ok = [torch.isfinite(s).reshape(v.shape) for s, v in zip(srcs, views)]
        res_ok = [torch.isfinite(r) for r in residuals] if residuals is not None else None
        _pack_plain(srcs, views, scale, divide, residuals, flat)
        in_ok = src_ok if res_ok is None else [a & b for a, b in zip(src_ok, res_ok)]
        bits = [_any_not(src_ok) * int(Health.SOURCE_NONFINITE),
                _any_true([a & ~torch.isfinite(v) for a, v in zip(in_ok, views)]) * int(Health.OVERFLOW)]
        if res_ok is not None:
            bits.append(_any_not(res_ok) * int(Health.RESIDUAL_NONFINITE))
        health.bitwise_or_(sum(bits).to(device=health.device, dtype=torch.int32).reshape(health.shape))
        return
    _pack_plain(srcs, views, scale, divide, residuals, flat)


def _any_not(oks: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d int64: 1 if any element of any of ``oks`` is False."""
    return torch.stack([~t.all() for t in oks]).any().long() if oks else torch.zeros((), dtype=torch.long)


def _any_true(ms: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.any() for t in ms]).any().long() if ms else torch.zeros((), dtype=torch.long)


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or inf, None if there is none:
    what a health flag's failure path names.  One host sync (per device)."""
    if not tensors:
        return None
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).nonzero()
        return int(bad[0, 0]) if bad.numel() else None
    for i, t in enumerate(tensors):
        if not bool(torch.isfinite(t).all()):
            return i
    return None


def _pack_plain(srcs: Sequence[torch.Tensor], views: Sequence[torch.Tensor], scale: float,
                divide: float | None, residuals: Sequence[torch.Tensor] | None,
                flat: torch.Tensor | None) -> None:
    if residuals is not None:
        for s, v, r in zip(srcs, views, residuals):
            _pack_error_feedback(s, v, r, scale, divide)
        return
    dt = views[0].dtype if views else None
    if dt in (torch.float32, torch.float64) and all(s.dtype is dt for s in srcs) \
            and all(v.dtype is dt for v in views) and _same_shapes(srcs, views):
        # The reducer's case: grads, bucket and compute share one dtype.
        if _few_large(srcs):
            # Bandwidth-bound: one pass per tensor (torch's mul_out) beats
            # copy-then-scale's two passes.
            for s, v in zip(srcs, views):
                if divide is not None:
                    torch.div(s, divide, out=v)
                elif scale != 1.0:
                    torch.mul(s, scale, out=v)
                else:
                    v.copy_(s)
            return
        torch._foreach_copy_(views, srcs)
        if divide is not None:
            flat.div_(divide) if flat is not None else torch._foreach_div_(views, divide)
        elif scale != 1.0:
            flat.mul_(scale) if flat is not None else torch._foreach_mul_(views, scale)
        return
    same_s, same_v, cast_s, cast_v, slow = [], [], [], [], []
    for s, v in zip(srcs, views):
        if s.shape != v.shape or compute_dtype(s.dtype, v.dtype) != s.dtype:
            slow.append((s, v))
        elif s.dtype == v.dtype:
            same_s.append(s)
            same_v.append(v)
        else:
            cast_s.append(s)
            cast_v.append(v)
    if same_v:
        torch._foreach_copy_(same_v, same_s)
        if divide is not None:
            torch._foreach_div_(same_v, divide)
        elif scale != 1.0:
            torch._foreach_mul_(same_v, scale)
    if cast_v:
        if divide is not None:
            cast_s = torch._foreach_div(cast_s, divide)
        elif scale != 1.0:
            cast_s = torch._foreach_mul(cast_s, scale)
        torch._foreach_copy_(cast_v, cast_s)
    for s, v in slow:
        c = compute_dtype(s.dtype, v.dtype)
        v.copy_(_scaled(s.reshape(v.shape).to(c), scale, divide))


def _same_shapes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """The foreach ops broadcast; a tensor of its slot's numel but another shape
    is reshaped (row-major order) by the per-tensor paths instead."""
    return list(map(_shape, a)) == list(map(_shape, b))


_shape = attrgetter("shape")


def _few_large(tensors: Sequence[torch.Tensor]) -> bool:
    """Few tensors averaging >= 256K elements: per-tensor ops cost little host
    time and save a memory pass."""
    n = len(tensors)
    return n <= 64 and sum(t.numel() for t in tensors) >= n * (1 << 18)


def _pack_error_feedback(s: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
                         scale: float, divide: float | None) -> None:
    """``x = s*scale + r; v = cast(x); r = x - upcast(v)`` in the residual's
    dtype, a non-finite new ``r`` stored as 0."""
    c = r.dtype
    x = _scaled(s.reshape(v.shape).to(c), scale, divide)
    x = x + r.view(v.shape)
    v.copy_(x)
    r_new = x - v.to(c)
    r.view(v.shape).copy_(torch.where(torch.isfinite(r_new), r_new, 0.0))


def pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int] | None = None,
         scale: float = 1.0, divide: float | None = None) -> torch.Tensor:
    """Gather ``srcs`` into the flat ``dst`` at ``offsets``, scaled, cast to ``dst.dtype``."""
    _check_scaling(scale, divide)
    if dst.dim() != 1:
        raise ValueError(f"pack: dst must be 1-D (a flat bucket), got shape {tuple(dst.shape)}")
    numels = [s.numel() for s in srcs]
    offs = default_offsets(numels) if offsets is None else [int(o) for o in offsets]
    _check_layout(numels, offs, dst.numel(), "pack")
    views = [dst.narrow(0, o, n).view(s.shape) for o, n, s in zip(offs, numels, srcs)]
    pack_views(srcs, views, scale, divide)
    return dst


def unpack_views(views: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
                 scale: float = 1.0, divide: float | None = None, accumulate: bool = False) -> None:
    """Reverse of :func:`pack_views`: ``dsts[i] (=|+=) cast(views[i] * scale)``.
    A plain store (no scale, no accumulate) of any dtype pair is one
    ``_foreach_copy_``: ``copy_`` casts exactly as ``.to`` does."""
    plain = not accumulate and divide is None and scale == 1.0
    if plain and _same_shapes(views, dsts):
        torch._foreach_copy_(dsts, views)  # copy_ casts exactly as .to does
        return
    fast_d, fast_v, slow = [], [], []
    for v, d in zip(views, dsts):
        if plain and v.shape == d.shape:
            fast_d.append(d)
            fast_v.append(v)
        else:
            slow.append((v, d))
    if fast_d:
        torch._foreach_copy_(fast_d, fast_v)
    for v, d in slow:
        c = compute_dtype(v.dtype, d.dtype)
        val = _scaled(v.reshape(d.shape).to(c), scale, divide)
        if accumulate:
            val = d.to(c) + val
        d.copy_(val)


def unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int] | None = None,
           scale: float = 1.0, divide: float | None = None, accumulate: bool = False) -> Sequence[torch.Tensor]:
    """Scatter slices of the flat ``src`` into ``dsts``, scaled and cast back."""
    _check_scaling(scale, divide)
    if src.dim() != 1:
        raise ValueError(f"unpack: src must be 1-D (a flat bucket), got shape {tuple(src.shape)}")
    numels = [d.numel() for d in dsts]
    offs = default_offsets(numels) if offsets is None else [int(o) for o in offsets]
    _check_layout(numels, offs, src.numel(), "unpack")
    views = [src.narrow(0, o, n).view(d.shape) for o, n, d in zip(offs, numels, dsts)]
    unpack_views(views, dsts, scale, divide, accumulate)
    return dsts


def _check_layout(numels: Sequence[int], offsets: Sequence[int], total: int, op: str) -> None:
    if len(offsets) != len(numels):
        raise ValueError(f"{op}: {len(numels)} tensors but {len(offsets)} offsets")
    for i, (o, n) in enumerate(zip(offsets, numels)):
        if o < 0 or o + n > total:
            raise ValueError(
                f"{op}: tensor {i} (numel {n}) at offset {o} does not fit in the flat "
                f"buffer of {total} elements"
            )
