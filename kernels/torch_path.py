"""The fast plain-torch path: what serves CPU tensors without the Triton
interpreter, and the tensors a kernel call copies alone.

Same results as :mod:`fastddp.kernels.reference` (the contract, bit for bit;
tests hold them to it), in a handful of C++ calls per bucket rather than per
tensor: ``_foreach_*`` ops where the dtypes allow it.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Sequence

import torch

from . import _fp8_native, reference

__all__ = ["pack_views", "unpack_views"]


def pack_views(srcs: Sequence[torch.Tensor], views: Sequence[torch.Tensor],
               scale: float = 1.0, divide: float | None = None,
               residuals: Sequence[torch.Tensor] | None = None,
               flat: torch.Tensor | None = None, health: torch.Tensor | None = None) -> None:
    """:func:`fastddp.kernels.reference.pack_views`, fast.

    Where the source dtype is the compute dtype (fp32, or fp64) the scale runs
    as one ``_foreach_*`` in that dtype (the contract's ``x * C(scale)``,
    rounded once) and the cast as one ``_foreach_copy_`` (round to nearest
    even); fp16/bf16 sources go tensor by tensor (``_foreach_mul_`` on 16-bit
    tensors would round the scale itself to 16 bits).  ``flat``: the whole
    buffer, when the views tile it exactly; the scale is then one op on it.
    ``health``: the contract's bits, with device ops (no host sync)."""
    if health is None:
        _pack_plain(srcs, views, scale, divide, residuals, flat)
        return
    if not views or views[0].device.type != "cpu":  # fallback tensors of a kernel call: no host sync
        oks = reference.health_inputs(srcs, views, residuals)
        _pack_plain(srcs, views, scale, divide, residuals, flat)
        reference.health_update(health, views, *oks)
        return
    # CPU: a finite destination means no bit is set (a NaN/inf source, residual
    # or cast overflow all leave a NaN/inf there), so a healthy bucket costs one
    # reduction over it; the exact bits are worked out only when it is not.
    res_ok = None
    if residuals is not None and not all(bool(torch.isfinite(r).all()) for r in residuals):
        res_ok = [torch.isfinite(r).reshape(v.shape) for r, v in zip(residuals, views)]
    src_ok = None
    in_place = any(map(_same_start, srcs, views))
    if in_place:  # the pack overwrites its sources: what the bits need of them is read first
        if not bool(torch.isfinite(_ends(srcs, None)).all()):
            src_ok = [torch.isfinite(s).reshape(v.shape) for s, v in zip(srcs, views)]
    _pack_plain(srcs, views, scale, divide, residuals, flat)
    if src_ok is None and res_ok is None and bool(torch.isfinite(_ends(views, flat)).all()):
        return
    if src_ok is None:  # (in place: the sources were all finite)
        src_ok = [torch.isfinite(s).reshape(v.shape) if not in_place else torch.ones(v.shape, dtype=torch.bool)
                  for s, v in zip(srcs, views)]
    reference.health_update(health, views, src_ok, res_ok)


def _ends(tensors: Sequence[torch.Tensor], flat: torch.Tensor | None) -> torch.Tensor:
    """The extreme values of ``tensors`` (``flat``: the one tensor they tile):
    finite exactly when every element is (NaN propagates through min/max and
    the inf-norm, an inf is one of the ends; neither overflows)."""
    if flat is not None:
        return torch.stack(torch.aminmax(flat)) if flat.numel() else flat
    tensors = [t for t in tensors if t.numel()]  # no inf-norm of an empty tensor
    return torch.stack(torch._foreach_norm(tensors, float("inf"))) if tensors else torch.empty(0)


def _same_start(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A source that is its own destination slot (an in-place pack); empty
    tensors share no memory (their data_ptr may be 0 for both)."""
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()


def _pack_plain(srcs: Sequence[torch.Tensor], views: Sequence[torch.Tensor], scale: float,
                divide: float | None, residuals: Sequence[torch.Tensor] | None,
                flat: torch.Tensor | None) -> None:
    if residuals is not None:  # per tensor in any case: the contract's own loop
        reference.pack_views(srcs, views, scale, divide, residuals)
        return
    dt = views[0].dtype if views else None
    if dt in (torch.float32, torch.float64) and all(s.dtype is dt for s in srcs) \
            and all(v.dtype is dt for v in views):
        # The reducer's case: grads, bucket and compute share one dtype.
        if _few_large(srcs):
            if _same_shapes(srcs, views):  # (few tensors: a cheap check)
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
        elif _foreach_copy(views, srcs):
            if divide is not None:
                flat.div_(divide) if flat is not None else torch._foreach_div_(views, divide)
            elif scale != 1.0:
                flat.mul_(scale) if flat is not None else torch._foreach_mul_(views, scale)
            return
    same_s, same_v, cast_s, cast_v, slow = [], [], [], [], []
    for s, v in zip(srcs, views):
        if s.shape != v.shape or reference.compute_dtype(s.dtype, v.dtype) != s.dtype:
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
        c = reference.compute_dtype(s.dtype, v.dtype)
        v.copy_(reference._scaled(s.reshape(v.shape).to(c), scale, divide))


def _same_shapes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """The foreach ops broadcast; a tensor of its slot's numel but another shape
    is reshaped (row-major order) by the per-tensor paths instead."""
    return list(map(_shape, a)) == list(map(_shape, b))


_shape = attrgetter("shape")


def _foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> bool:
    """One ``_foreach_copy_``; False when a source has its slot's numel but a
    shape it does not broadcast to (then the per-tensor paths reshape it).
    Checking every shape first costs ~0.5 ms per 600 tensors on the CPU path;
    a broadcast between equal numels only adds or drops size-1 dims, so a copy
    that does not raise is the row-major copy, and one that raises is redone
    in full by the caller's general path."""
    try:
        torch._foreach_copy_(dsts, srcs)
    except RuntimeError:
        return False
    return True


def _few_large(tensors: Sequence[torch.Tensor]) -> bool:
    """Few tensors averaging >= 256K elements: per-tensor ops cost little host
    time and save a memory pass."""
    n = len(tensors)
    return n <= 64 and sum(t.numel() for t in tensors) >= n * (1 << 18)


def unpack_views(views: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
                 scale: float = 1.0, divide: float | None = None, accumulate: bool = False) -> None:
    """:func:`fastddp.kernels.reference.unpack_views`, fast: a plain store (no
    scale, no accumulate) of any dtype pair is one ``_foreach_copy_``
    (``copy_`` casts exactly as ``.to`` does)."""
    plain = not accumulate and divide is None and scale == 1.0
    if plain and _foreach_copy(dsts, views):  # copy_ casts exactly as .to does
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
        c = reference.compute_dtype(v.dtype, d.dtype)
        val = reference._scaled(v.reshape(d.shape).to(c), scale, divide)
        if accumulate:
            val = d.to(c) + val
        d.copy_(val)


#: elements per step of :func:`reduce_shards`: an fp32 accumulator of 256 KiB
#: stays in cache while the ``world`` slices stream through it.
SHARD_CHUNK = 1 << 16


def reduce_shards(src: torch.Tensor, out: torch.Tensor, world: int,
                  health: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fastddp.kernels.reference.reduce_shards`, fast: chunk by chunk,
    ``acc = slice_0; acc += slice_k`` in rank order (``add_`` of a 16-bit
    tensor into an fp32 one widens exactly and adds in fp32), one rounding
    into ``out``.  Each chunk is read before its part of ``out`` is written,
    so ``out`` may be ``src``'s first slice."""
    n = out.numel()
    if n == 0:
        return out
    parts = src.view(world, n)
    acc = torch.empty(min(n, SHARD_CHUNK), dtype=torch.float32, device=out.device)
    bad = None
    for c in range(0, n, SHARD_CHUNK):
        m = min(SHARD_CHUNK, n - c)
        a = acc[:m]
        a.copy_(parts[0, c:c + m])
        for k in range(1, world):
            a.add_(parts[k, c:c + m])
        if health is not None:
            ok = torch.isfinite(parts[:, c:c + m]).all(0)  # before out (maybe slice 0) is written
        out[c:c + m].copy_(a)
        if health is not None:
            b = (ok & ~torch.isfinite(out[c:c + m])).any()
            bad = b if bad is None else bad | b
    if bad is not None:
        health.bitwise_or_((bad.to(torch.int32) * int(reference.Health.OVERFLOW)).reshape(health.shape))
    return out


#: elements per step of the fp8 passes (whole blocks): big enough that the
#: ~10 torch calls per chunk cost little (at 64K they cost more than the
#: passes: quantize 35 -> 20 ms, dequantize 24 -> 18 ms per 6.3M elements on
#: one core at 256K), small enough that the chunk's temporaries stay near cache.
FP8_CHUNK = 1 << 18


def _native_fp8(*tensors) -> object | None:
    """The native fp8 loops (:mod:`._fp8_native`) when they are built and
    every tensor is a contiguous CPU one; else None (the torch ops below)."""
    if not all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors):
        return None
    return _fp8_native.EXTENSION.module()


def quantize_fp8_gather(parts, offsets, scale: float, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                        block: int, residual: torch.Tensor | None = None) -> int:
    """The native loops' one pass of :func:`fastddp.kernels.quantize_fp8_gather`
    over ``x`` up to its first block holding a NaN/inf: returns the element
    it stopped at (``x.numel()``: all of it), 0 where the loops are off."""
    nat = _native_fp8(x, q, scales, residual, *parts)
    fn = getattr(nat, "fp8_quantize_gather", None)
    if fn is None or any(t.dtype != torch.float32 or t.dim() != 1 for t in parts):
        return 0
    return fn(list(parts), [int(o) for o in offsets], float(scale), x, residual, q, scales, block) * block


def quantize_fp8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                 residual: torch.Tensor | None = None, health: torch.Tensor | None = None) -> None:
    """:func:`fastddp.kernels.reference.quantize_fp8`, fast: chunk by chunk;
    where every value of a chunk is finite (the steady state) a chunk costs
    an add (residual), an amax, a multiply, the fp8 cast and, with a
    residual, the decode and a subtract -- no masks: |x / s| <= 448, so
    torch's cast (nearest even) needs no clamp.  A chunk holding a NaN/inf
    goes through the contract's own code (masks, NaN codes, health bits)."""
    n = x.numel()
    start = 0
    if x.dtype == torch.float32 and (nat := _native_fp8(x, q, scales, residual)) is not None:
        start = nat.fp8_quantize(x, residual, q, scales, block) * block  # one pass; stops at a NaN/inf
        if start == n:
            return
    step = max(block, FP8_CHUNK // block * block)
    q8 = q.view(torch.float8_e4m3fn)
    for c in range(start, n, step):
        m = min(step, n - c)
        xc = x[c:c + m] if residual is None else x[c:c + m] + residual[c:c + m]
        xb = xc.view(-1, block)
        amax = xb.abs().amax(dim=1)
        if not bool(torch.isfinite(amax).all()):
            reference.quantize_fp8(x[c:c + m], q[c:c + m], scales[c // block:(c + m) // block], block,
                                   None if residual is None else residual[c:c + m], health)
            continue
        s = reference.fp8_scales(amax)
        qc = q8[c:c + m].view(-1, block)
        qc.copy_(xb * (1.0 / s)[:, None])
        scales[c // block:(c + m) // block].copy_(s)
        if residual is not None:
            torch.sub(xb, decode_fp8(q[c:c + m]).view(-1, block) * s[:, None],
                      out=residual[c:c + m].view(-1, block))


_PAIR_LUT = None


def _pair_lut():
    """Every PAIR of e4m3 bytes (a little-endian uint16) -> their two fp32
    values, as one float64 per pair: 65536 x 8 bytes, built once from the
    contract's own decode (:func:`reference._fp8_decode`), so a lookup gives
    exactly its bits (NaN codes included)."""
    global _PAIR_LUT
    if _PAIR_LUT is None:
        one = reference._fp8_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
        idx = torch.arange(65536)
        pair = torch.stack([one[idx & 0xFF], one[idx >> 8]], 1).contiguous()
        _PAIR_LUT = pair.view(torch.float64).reshape(-1).numpy()
    return _PAIR_LUT


def decode_fp8(q: torch.Tensor) -> torch.Tensor:
    """``q`` (uint8 bits of e4m3, CPU) -> a new fp32 tensor, exactly
    :func:`reference._fp8_decode` (torch's cast), ~4x faster on the CPU:
    torch decodes element by element (~4.6 ns each on one CPU core), a
    lookup of two bytes at a time in :func:`_pair_lut` costs ~1.2 ns."""
    n = q.numel()
    if n % 2 or q.device.type != "cpu" or not q.is_contiguous() or q.storage_offset() % 2:
        return reference._fp8_decode(q)
    pairs = q.view(torch.uint8).numpy().view("<u2")
    return torch.from_numpy(_pair_lut()[pairs]).view(torch.float32).view(q.shape)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`fastddp.kernels.reference.dequantize_fp8`, chunk by chunk: the
    decode (:func:`decode_fp8`), then the scale written straight into ``out``."""
    n = out.numel()
    if out.dtype == torch.float32 and (nat := _native_fp8(q, scales, out)) is not None:
        nat.fp8_dequantize(q, scales, out, block)
        return out
    step = max(block, FP8_CHUNK // block * block)
    for c in range(0, n, step):
        m = min(step, n - c)
        torch.mul(decode_fp8(q[c:c + m]).view(-1, block), scales[c // block:(c + m) // block][:, None],
                  out=out[c:c + m].view(-1, block))
    return out


def reduce_fp8_shards(src_q: torch.Tensor, src_s: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor,
                      world: int, block: int, health: torch.Tensor | None = None) -> None:
    """:func:`fastddp.kernels.reference.reduce_fp8_shards`, chunk by chunk:
    every slice of a chunk is read (dequantized and added in rank order)
    before the chunk of ``out`` (maybe slice 0) is written."""
    n, nb = out_q.numel(), out_s.numel()
    start = 0
    if (nat := _native_fp8(src_q, src_s, out_q, out_s)) is not None:
        start = nat.fp8_reduce_shards(src_q, src_s, out_q, out_s, world, block) * block  # stops at an overflow
        if start == n:
            return
    step = max(block, FP8_CHUNK // block * block)
    tmp = torch.empty(min(step, n), dtype=torch.float32, device=out_q.device)
    for c in range(start, n, step):
        m = min(step, n - c)
        b0, b1 = c // block, (c + m) // block
        acc = torch.empty(m, dtype=torch.float32, device=out_q.device)
        dequantize_fp8(src_q[c:c + m], src_s[b0:b1], acc, block)
        for k in range(1, world):
            t = tmp[:m]
            dequantize_fp8(src_q[k * n + c:k * n + c + m], src_s[k * nb + b0:k * nb + b1], t, block)
            acc.add_(t)
        if health is not None and not bool(torch.isfinite(acc).all()):
            ok = torch.ones(m, dtype=torch.bool, device=acc.device)
            for k in range(world):
                d = torch.empty(m, dtype=torch.float32, device=acc.device)
                dequantize_fp8(src_q[k * n + c:k * n + c + m], src_s[k * nb + b0:k * nb + b1], d, block)
                ok &= torch.isfinite(d)
            bad = (ok & ~torch.isfinite(acc)).any().to(torch.int32) * int(reference.Health.OVERFLOW)
            health.bitwise_or_(bad.reshape(health.shape))
        quantize_fp8(acc, out_q[c:c + m], out_s[b0:b1], block)
