"""Plain-torch twin of the fused pack/unpack kernels.

The arithmetic contract, written naively: one tensor at a time, each step a
plain torch op, so that it is obviously right.  It is the oracle of the
kernel tests and of the fast plain-torch path (:mod:`fastddp.kernels.torch_path`,
which serves CPU tensors without the interpreter), and the baseline of the
benchmarks' bit-exact checks: one oracle that lives in the package, so
tests and benches cannot drift from it.  Never copy it into tests or benches.

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
               health: torch.Tensor | None = None) -> None:
    """Write each ``srcs[i]`` into ``views[i]`` (a view of the flat bucket shaped,
    and strided, like its layout slot), scaled and cast; with ``residuals``
    (views of the residual, likewise) apply error feedback; with ``health`` (a
    1-element int32 tensor) OR the :class:`Health` bits into it."""
    oks = health_inputs(srcs, views, residuals) if health is not None else None
    for i, (s, v) in enumerate(zip(srcs, views)):
        if residuals is None:
            c = compute_dtype(s.dtype, v.dtype)
            v.copy_(_scaled(s.reshape(v.shape).to(c), scale, divide))
            continue
        r = residuals[i].view(v.shape)
        c = r.dtype  # error feedback runs in the residual's dtype
        x = _scaled(s.reshape(v.shape).to(c), scale, divide) + r
        v.copy_(x)
        r_new = x - v.to(c)
        r.copy_(torch.where(torch.isfinite(r_new), r_new, 0.0))
    if oks is not None:
        health_update(health, views, *oks)


def health_inputs(srcs: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
                  residuals: Sequence[torch.Tensor] | None):
    """What the health bits need from before the pack: which source (and
    residual) elements are finite, shaped like the views."""
    src_ok = [torch.isfinite(s).reshape(v.shape) for s, v in zip(srcs, views)]
    res_ok = [torch.isfinite(r).reshape(v.shape) for r, v in zip(residuals, views)] if residuals is not None else None
    return src_ok, res_ok


def health_update(health: torch.Tensor, views: Sequence[torch.Tensor], src_ok, res_ok) -> None:
    """OR the :class:`Health` bits of a finished pack into ``health`` (device ops, no host sync)."""
    in_ok = src_ok if res_ok is None else [a & b for a, b in zip(src_ok, res_ok)]
    bits = [_any_not(src_ok) * int(Health.SOURCE_NONFINITE),
            _any_true([a & ~torch.isfinite(v) for a, v in zip(in_ok, views)]) * int(Health.OVERFLOW)]
    if res_ok is not None:
        bits.append(_any_not(res_ok) * int(Health.RESIDUAL_NONFINITE))
    health.bitwise_or_(sum(bits).to(device=health.device, dtype=torch.int32).reshape(health.shape))


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
    if len({t.device for t in tensors}) == 1:
        bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).nonzero()
        return int(bad[0, 0]) if bad.numel() else None
    for i, t in enumerate(tensors):
        if not bool(torch.isfinite(t).all()):
            return i
    return None


def unpack_views(views: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
                 scale: float = 1.0, divide: float | None = None, accumulate: bool = False) -> None:
    """Reverse of :func:`pack_views`: ``dsts[i] (=|+=) cast(views[i] * scale)``."""
    for v, d in zip(views, dsts):
        c = compute_dtype(v.dtype, d.dtype)
        val = _scaled(v.reshape(d.shape).to(c), scale, divide)
        if accumulate:
            val = d.to(c) + val
        d.copy_(val)


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


# ------------------------------------------------------------------ shard sum
# The reduce half of a reduce-scatter done as all-to-all + local sum: after
# the all-to-all, ``src`` holds this rank's shard as sent by every rank, back
# to back in rank order (``world`` slices of ``out.numel()`` elements).
#
# Contract: ``out = cast_out( ((src_0.f32 + src_1.f32) + src_2.f32) + ... )``:
# the slices widened to fp32 (exact from bf16/fp16), summed in fp32 strictly
# in rank order, then ONE rounding to ``out``'s dtype (nearest even).  Every
# rank computes its shard with the same rule, so the all-gathered result is
# the same on every rank, and the error of the sum does not grow with the
# world size the way a 16-bit ring's per-hop rounding does.  ``out`` may be
# ``src``'s first slice (in place).  ``health``: ``OVERFLOW`` if an element
# whose ``world`` inputs are finite comes out NaN/inf.

def reduce_shards(src: torch.Tensor, out: torch.Tensor, world: int,
                  health: torch.Tensor | None = None) -> torch.Tensor:
    """The shard sum above, one plain torch op per rank's slice."""
    n = out.numel()
    parts = [src[k * n:(k + 1) * n].to(torch.float32) for k in range(world)]  # copies: out may alias
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    out.copy_(acc)
    if health is not None:
        ok = torch.stack([torch.isfinite(p) for p in parts]).all(0)
        bad = (ok & ~torch.isfinite(out)).any().to(torch.int32) * int(Health.OVERFLOW)
        health.bitwise_or_(bad.reshape(health.shape).to(health.device))
    return out


# --------------------------------------------------- block-scaled fp8 (e4m3)
# The one written rule of fastddp's fp8 wire (torch.float8_e4m3fn, sent as
# uint8: gloo refuses float8 dtypes):
#
# * blocks of ``block`` consecutive elements of a flat buffer, one fp32 scale
#   each;
# * ``amax`` = the largest |x| of the block's FINITE values;
# * scale ``s`` = the smallest power of two with ``amax / s <= 448`` (e4m3's
#   largest), but at least 2^-126 (a normal fp32); ``s = 1`` when ``amax`` is 0.
#   A power of two makes ``x / s`` and ``q * s`` exact (no second rounding),
#   so the only rounding is the fp8 one, and it is the same on every device;
# * ``q = fp8(x / s)``: round to nearest even, saturated to +-448 (never
#   reached: |x / s| <= 448 by the choice of s); a NaN or inf ``x`` becomes
#   NaN (0x7F, signed) -- torch's own cast would saturate inf to 448;
# * dequantize: ``q.float() * s`` (exact).
#
# With error feedback (``residual``, fp32, indexed like ``x``): the block is
# quantized from ``x + r`` and ``r`` becomes ``(x + r) - dequantize(q)``, 0
# where that is not finite.

FP8_MAX = 448.0


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """The scale rule above, for a tensor of fp32 block maxima."""
    m, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    k = torch.where(m <= 0.875, e - 9, e - 8).clamp(min=-126)  # 448 = 0.875 * 2^9
    k = torch.where(amax == 0, 0, k)
    return torch.ldexp(torch.ones_like(amax), k)


def _fp8_encode(y: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    q = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.where(torch.signbit(y), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(finite, q, nan)


def _fp8_decode(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).to(torch.float32)


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                 residual: torch.Tensor | None = None, health: torch.Tensor | None = None) -> None:
    """``x`` (fp32, ``n`` elements, ``n % block == 0``) -> ``q`` (uint8 bits of
    e4m3) and ``scales`` (fp32, ``n / block``), by the rule above.
    ``health``: SOURCE_NONFINITE (an ``x`` value), RESIDUAL_NONFINITE (a
    residual value read)."""
    xb = x.reshape(-1, block).to(torch.float32)
    src_ok = torch.isfinite(xb)
    if residual is not None:
        rb = residual.view(-1, block)
        res_ok = torch.isfinite(rb)
        xb = xb + rb
    finite = torch.isfinite(xb)
    amax = torch.where(finite, xb.abs(), 0.0).amax(dim=1)
    s = fp8_scales(amax)
    qb = _fp8_encode(xb * (1.0 / s)[:, None], finite)  # 1/s: a power of two, exact
    q.view(-1, block).copy_(qb)
    scales.copy_(s)
    if residual is not None:
        r_new = xb - _fp8_decode(qb) * s[:, None]
        rb.copy_(torch.where(torch.isfinite(r_new), r_new, 0.0))
    if health is not None:
        bits = (~src_ok).any().to(torch.int32) * int(Health.SOURCE_NONFINITE)
        if residual is not None:
            bits = bits | (~res_ok).any().to(torch.int32) * int(Health.RESIDUAL_NONFINITE)
        health.bitwise_or_(bits.reshape(health.shape))


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> torch.Tensor:
    """``out = fp8(q) * scale`` of each element's block, exactly, in fp32."""
    out.view(-1, block).copy_(_fp8_decode(q.view(-1, block)) * scales[:, None])
    return out


def reduce_fp8_shards(src_q: torch.Tensor, src_s: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor,
                      world: int, block: int, health: torch.Tensor | None = None) -> None:
    """The fp8 shard sum: ``world`` slices (rank order) of ``out_q.numel()``
    fp8 values and their scales, dequantized, added in fp32 in rank order,
    quantized again (the rule above, no residual).  ``health``: OVERFLOW where
    finite inputs sum to a non-finite value.  ``out_q``/``out_s`` may be the
    first slices of ``src_q``/``src_s``."""
    n, nb = out_q.numel(), out_s.numel()
    parts = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
    for k in range(world):
        dequantize_fp8(src_q[k * n:(k + 1) * n], src_s[k * nb:(k + 1) * nb], parts[k], block)
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    quantize_fp8(acc, out_q, out_s, block)
    if health is not None:
        ok = torch.stack([torch.isfinite(p) for p in parts]).all(0)
        bad = (ok & ~torch.isfinite(acc)).any().to(torch.int32) * int(Health.OVERFLOW)
        health.bitwise_or_(bad.reshape(health.shape))
