"""Block-scaled fp8 (e4m3) kernels: quantize (with error feedback and the
health flag), dequantize, and the shard sum (dequantize every rank's slice,
add in fp32 in rank order, quantize again).

Two of the three layers (kernel -> launcher): the ``@triton.jit`` kernels
and their launchers; the ops (:func:`fastddp.kernels.quantize_fp8`, ...)
validate and choose the backend.  The arithmetic is
:mod:`fastddp.kernels.reference`'s fp8 rule, bit for bit (NaN positions,
not payloads).  fp8 is handled as its 8 raw bits (uint8, what the wire
carries), encoded with integer arithmetic: no device or interpreter
float8 conversion is trusted.  A program covers ``G`` blocks of ``B``
elements as a ``[G, B]`` tile (the interpreter wants few, large programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton_common as C
from ._counters import bump as _bump

__all__ = ["launch_quantize_fp8", "launch_dequantize_fp8", "launch_reduce_fp8_shards"]


@triton.jit
def _scale_exp(b_amax):
    """[G] block maxima -> [G] int32 k, scale = 2^k: the smallest power of two
    with amax / 2^k <= 448 (= 1.75 * 2^8), at least 2^-126; 0 where amax is 0."""
    b_ab = b_amax.to(tl.uint32, bitcast=True)
    b_e = ((b_ab >> 23) & 0xFF).to(tl.int32)
    b_k = b_e - 135 + tl.where((b_ab & 0x7FFFFF) > 0x600000, 1, 0)  # mantissa > 1.75: one more
    b_k = tl.where(b_e == 0, -126, b_k)  # a subnormal amax
    b_k = tl.maximum(b_k, -126)
    return tl.where(b_amax == 0, 0, b_k)


@triton.jit
def _pow2(b_k):
    return ((b_k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _encode(b_y, m_fin):
    """fp32 (|y| <= 448) -> e4m3 bits, nearest even; NaN (0x7F, signed) where not m_fin."""
    b_u = b_y.to(tl.uint32, bitcast=True)
    b_sign = (b_u >> 24) & 0x80
    b_a = b_u & 0x7FFFFFFF
    b_nr = ((b_a + ((b_a >> 20) & 1) + 0x7FFFF) >> 20) - 960  # normal: 3 mantissa bits, rebias 127 -> 7
    b_t = tl.abs(b_y) * 512.0  # subnormal: multiples of 2^-9, rounded by the 2^23 trick (exact below 8)
    b_sub = ((b_t + 8388608.0) - 8388608.0).to(tl.uint32)
    b_c = tl.where(b_a >= 0x3C800000, b_nr, b_sub)  # |y| >= 2^-6: normal
    b_c = tl.where(m_fin, b_c, 0x7F)
    return (b_c | b_sign).to(tl.uint8)


@triton.jit
def _decode(b_q):
    """e4m3 bits -> fp32, exactly."""
    b_c = b_q.to(tl.uint32)
    b_sign = (b_c & 0x80) << 24
    b_e = (b_c >> 3) & 0xF
    b_m = b_c & 7
    b_norm = (b_sign | ((b_e + 120) << 23) | (b_m << 20)).to(tl.float32, bitcast=True)
    # subnormal: m * 2^-9, its sign OR-ed in as a bit (``-x`` is ``0 - x`` in
    # triton 3.6, which turns -0.0 (0x80) into +0.0)
    b_sub = ((b_m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | b_sign).to(tl.float32, bitcast=True)
    b_d = tl.where(b_e == 0, b_sub, b_norm)
    return tl.where((b_c & 0x7F) == 0x7F, float("nan"), b_d)


@triton.jit
def _quantize_kernel(
    x_ptr,  # *Pointer* to fp32 [n]: the values
    q_ptr,  # *Pointer* to uint8 [n]: their e4m3 bits
    s_ptr,  # *Pointer* to fp32 [n / B]: one scale per block
    r_ptr,  # *Pointer* to fp32 [n]: error-feedback residual (unused without HAS_RES)
    flag_ptr,  # *Pointer* to the int32 health flag (unused without HAS_HEALTH)
    n_blocks,  # blocks in all
    B: tl.constexpr,  # elements per block (a power of two)
    G: tl.constexpr,  # blocks per program
    HAS_RES: tl.constexpr,  # x += r; r = x - dequantize(q)
    HAS_HEALTH: tl.constexpr,  # OR SOURCE_NONFINITE / RESIDUAL_NONFINITE into the flag
):
    i_p = tl.program_id(0)
    ob_0 = i_p.to(tl.int64) * G  # first block of this program
    o_0 = ob_0 * B  # its first element: int64, it passes 2^31 past 2 G elements
    o_b = tl.arange(0, G)  # [G] int32 block indices, from ob_0
    m_b = o_b < n_blocks - ob_0  # [G]
    o = o_b[:, None] * B + tl.arange(0, B)[None, :]  # [G, B] int32 (G * B: one tile), from o_0
    m = m_b[:, None] & (tl.arange(0, B)[None, :] < B)  # [G, B]
    b_x = tl.load(x_ptr + o_0 + o, mask=m, other=0.0)  # [G, B]
    if HAS_HEALTH:
        b_h = tl.where(m & ~(tl.abs(b_x) < float("inf")), 1, 0)  # Health.SOURCE_NONFINITE
    if HAS_RES:
        b_r = tl.load(r_ptr + o_0 + o, mask=m, other=0.0)  # [G, B]
        if HAS_HEALTH:
            b_h = b_h | tl.where(m & ~(tl.abs(b_r) < float("inf")), 4, 0)  # RESIDUAL_NONFINITE
        b_x = b_x + b_r
    m_fin = tl.abs(b_x) < float("inf")  # [G, B]
    b_amax = tl.max(tl.where(m_fin, tl.abs(b_x), 0.0), axis=1)  # [G]
    b_k = _scale_exp(b_amax)
    b_s = _pow2(b_k)  # [G]
    b_q = _encode(b_x * _pow2(-b_k)[:, None], m_fin)  # [G, B]
    tl.store(q_ptr + o_0 + o, b_q, mask=m)
    tl.store(s_ptr + ob_0 + o_b, b_s, mask=m_b)
    if HAS_RES:
        b_n = b_x - _decode(b_q) * b_s[:, None]
        tl.store(r_ptr + o_0 + o, tl.where(tl.abs(b_n) < float("inf"), b_n, 0.0), mask=m)
    if HAS_HEALTH:
        b_hh = tl.max(tl.max(b_h & 1, axis=1), axis=0) | tl.max(tl.max(b_h & 4, axis=1), axis=0)
        if b_hh != 0:
            tl.atomic_or(flag_ptr, b_hh)


@triton.jit
def _dequantize_kernel(
    q_ptr,  # *Pointer* to uint8 [n]: e4m3 bits
    s_ptr,  # *Pointer* to fp32 [n / B]: scales
    out_ptr,  # *Pointer* to fp32 [n]
    n_blocks,  # blocks in all
    B: tl.constexpr,  # elements per block
    G: tl.constexpr,  # blocks per program
):
    i_p = tl.program_id(0)
    ob_0 = i_p.to(tl.int64) * G  # first block of this program
    o_0 = ob_0 * B  # its first element: int64, it passes 2^31 past 2 G elements
    o_b = tl.arange(0, G)  # [G] int32 block indices, from ob_0
    m_b = o_b < n_blocks - ob_0  # [G]
    o = o_b[:, None] * B + tl.arange(0, B)[None, :]  # [G, B] int32 (G * B: one tile), from o_0
    m = m_b[:, None] & (tl.arange(0, B)[None, :] < B)  # [G, B]
    b_q = tl.load(q_ptr + o_0 + o, mask=m, other=0)
    b_s = tl.load(s_ptr + ob_0 + o_b, mask=m_b, other=1.0)
    tl.store(out_ptr + o_0 + o, _decode(b_q) * b_s[:, None], mask=m)


@triton.jit(do_not_specialize=["world"])  # one binary for every world size
def _reduce_fp8_kernel(
    src_q,  # *Pointer* to uint8 [world * n]: every rank's slice, rank order
    src_s,  # *Pointer* to fp32 [world * n / B]: their scales
    out_q,  # *Pointer* to uint8 [n] (may be src_q's first slice)
    out_s,  # *Pointer* to fp32 [n / B] (may be src_s's first slice)
    flag_ptr,  # *Pointer* to the int32 health flag (unused without HAS_HEALTH)
    n,  # elements per slice
    n_blocks,  # blocks per slice
    world,  # slices (the world size): a runtime bound, so the loop is not unrolled per rank
    B: tl.constexpr,  # elements per block
    G: tl.constexpr,  # blocks per program
    HAS_HEALTH: tl.constexpr,  # OR Health.OVERFLOW where finite inputs sum to NaN/inf
):
    i_p = tl.program_id(0)
    ob_0 = i_p.to(tl.int64) * G  # first block of this program
    o_0 = ob_0 * B  # its first element: int64, it passes 2^31 past 2 G elements
    o_b = tl.arange(0, G)  # [G] int32 block indices, from ob_0
    m_b = o_b < n_blocks - ob_0  # [G]
    o = o_b[:, None] * B + tl.arange(0, B)[None, :]  # [G, B] int32 (G * B: one tile), from o_0
    m = m_b[:, None] & (tl.arange(0, B)[None, :] < B)  # [G, B]
    # slice k starts at k * n (k * n_blocks scales): int64, as it passes 2^31
    # once (world - 1) * n >= 2^31 while n itself is still an int32 argument
    n_64 = n.to(tl.int64)
    nb_64 = n_blocks.to(tl.int64)
    # slice 0 starts the sum, slices 1 .. world-1 are added in rank order by a
    # runtime while loop (why not static_range or range(): the bf16 shard
    # sum's comment in shard_kernel.py)
    b_acc = _decode(tl.load(src_q + o_0 + o, mask=m, other=0)) \
        * tl.load(src_s + ob_0 + o_b, mask=m_b, other=1.0)[:, None]  # [G, B]
    m_in = m
    if HAS_HEALTH:
        m_in = m_in & (tl.abs(b_acc) < float("inf"))
    k = 1
    while k < world:
        b_v = _decode(tl.load(src_q + o_0 + k * n_64 + o, mask=m, other=0)) \
            * tl.load(src_s + ob_0 + k * nb_64 + o_b, mask=m_b, other=1.0)[:, None]  # [G, B]
        if HAS_HEALTH:
            m_in = m_in & (tl.abs(b_v) < float("inf"))
        b_acc = b_acc + b_v
        k += 1
    m_fin = tl.abs(b_acc) < float("inf")
    b_amax = tl.max(tl.where(m_fin, tl.abs(b_acc), 0.0), axis=1)  # [G]
    b_k = _scale_exp(b_amax)
    b_q = _encode(b_acc * _pow2(-b_k)[:, None], m_fin)
    tl.store(out_q + o_0 + o, b_q, mask=m)
    tl.store(out_s + ob_0 + o_b, _pow2(b_k), mask=m_b)
    if HAS_HEALTH:
        b_h = tl.max(tl.max(tl.where(m_in & ~m_fin, 2, 0), axis=1), axis=0)  # Health.OVERFLOW
        if b_h != 0:
            tl.atomic_or(flag_ptr, b_h)


_INTERPRETED = C.is_interpreted(_quantize_kernel)


def _tile(block: int) -> int:
    """Blocks per program: ~BLOCK elements per program, as the pack's."""
    return max(1, C.block_for(_INTERPRETED) // block)


def launch_quantize_fp8(x, q, scales, block, residual, health) -> None:
    nb = x.numel() // block
    if nb == 0:
        return
    g = _tile(block)
    _quantize_kernel[(triton.cdiv(nb, g),)](
        x, q, scales, residual if residual is not None else x, health if health is not None else x,
        nb, B=block, G=g, HAS_RES=residual is not None, HAS_HEALTH=health is not None,
        num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False)
    _bump("launches")


def launch_dequantize_fp8(q, scales, out, block) -> None:
    nb = out.numel() // block
    if nb == 0:
        return
    g = _tile(block)
    _dequantize_kernel[(triton.cdiv(nb, g),)](q, scales, out, nb, B=block, G=g,
                                              num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False)
    _bump("launches")


def launch_reduce_fp8_shards(src_q, src_s, out_q, out_s, world, block, health) -> None:
    n = out_q.numel()
    nb = n // block
    if nb == 0:
        return
    g = _tile(block)
    _reduce_fp8_kernel[(triton.cdiv(nb, g),)](
        src_q, src_s, out_q, out_s, health if health is not None else out_s, n, nb,
        world, B=block, G=g, HAS_HEALTH=health is not None,
        num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False)
    _bump("launches")
