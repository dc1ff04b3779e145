"""Fused shard sum: the reduce step of bf16 transport with fp32 accumulation
(and of the fp32 reduce-scatter inside a host: :func:`_reduce_shards_f32_kernel`).

Two of the three layers (kernel -> launcher -> op): the private
``@triton.jit`` :func:`_reduce_shards_kernel` and its launcher
:func:`launch_reduce_shards`.  The op, :func:`fastddp.kernels.reduce_shards`,
validates, chooses the backend and calls the launcher.  The arithmetic is
:func:`fastddp.kernels.reference.reduce_shards`'s, bit for bit: the ``world``
slices widened to fp32, added in rank order, rounded once to bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton_common as C
from ._counters import bump as _bump

__all__ = ["launch_reduce_shards"]


@triton.jit(do_not_specialize=["world"])  # one binary for every world size
def _reduce_shards_kernel(
    src_ptr,  # *Pointer* to int16 [world * n]: the bf16 bits of every rank's slice, rank order
    out_ptr,  # *Pointer* to int16 [n]: the bf16 bits of the sum (may be src's first slice)
    flag_ptr,  # *Pointer* to the int32 health flag (unused without HAS_HEALTH)
    n,  # elements per slice
    world,  # slices to add (the world size): a runtime bound, so the loop is not unrolled per rank
    BLOCK: tl.constexpr,  # elements per program
    HAS_HEALTH: tl.constexpr,  # OR Health.OVERFLOW into the flag where finite inputs sum to NaN/inf
):
    # Offsets: 64-bit scalar bases, 32-bit lanes.  A program's first element
    # (i_p * BLOCK) passes 2^31 in a slice of over 2 G elements, and slice k's
    # start (k * n) once (world - 1) * n >= 2^31 while n itself is still an
    # int32 argument: both are computed in int64.
    i_p = tl.program_id(0)
    o_0 = i_p.to(tl.int64) * BLOCK  # first element of this program in a slice
    n_64 = n.to(tl.int64)
    o = tl.arange(0, BLOCK)  # [BLOCK] int32, from o_0
    m = o < n_64 - o_0  # [BLOCK]
    p_src = src_ptr + o_0
    # slice 0 starts the sum (not 0 + x: the sum of one -0.0 is -0.0, as the
    # reference's); slices 1 .. world-1 are added in rank order by a runtime
    # loop: one copy of its body whatever the world size (static_range
    # unrolled it per rank: 1 MB of PTX and 90 s to compile at 256 ranks).
    # A while loop, not range(): triton 3.6's interpreter cannot take a
    # tensor as range()'s bound under numpy >= 2.4 (int() of a 1-element
    # array), a comparison it can.
    b_u = tl.load(p_src + o, mask=m, other=0).to(tl.uint16, bitcast=True)  # [BLOCK]
    m_in = m  # [BLOCK] every input finite
    if HAS_HEALTH:
        m_in = m_in & ((b_u & 0x7F80) != 0x7F80)
    b_acc = (b_u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)  # widening bf16 -> fp32 is exact
    k = 1
    while k < world:
        b_u = tl.load(p_src + k * n_64 + o, mask=m, other=0).to(tl.uint16, bitcast=True)  # [BLOCK]
        if HAS_HEALTH:
            m_in = m_in & ((b_u & 0x7F80) != 0x7F80)
        b_acc = b_acc + (b_u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        k += 1
    # one rounding to bf16, nearest even, on the integer bits (the
    # interpreter's .to(tl.bfloat16) truncates)
    b_w = b_acc.to(tl.uint32, bitcast=True)  # [BLOCK]
    b_r = (b_w + ((b_w >> 16) & 1) + 0x7FFF) >> 16
    m_nan = (b_w & 0x7FFFFFFF) > 0x7F800000
    b_y = tl.where(m_nan, (b_w >> 16) | 0x40, b_r).to(tl.uint16)  # [BLOCK]
    tl.store(out_ptr + o_0 + o, b_y.to(tl.int16, bitcast=True), mask=m)
    if HAS_HEALTH:
        b_h = tl.where(m_in & ((b_y & 0x7F80) == 0x7F80), 2, 0)  # [BLOCK] Health.OVERFLOW
        if tl.max(b_h, axis=0) != 0:
            tl.atomic_or(flag_ptr, tl.max(b_h, axis=0))


@triton.jit(do_not_specialize=["world"])
def _reduce_shards_f32_kernel(
    src_ptr,  # *Pointer* to float32 [world * n]: every rank's slice, rank order
    out_ptr,  # *Pointer* to float32 [n]: the sum (may be src's first slice)
    flag_ptr,  # *Pointer* to the int32 health flag (unused without HAS_HEALTH)
    n,  # elements per slice
    world,  # slices to add: a runtime bound (one binary for every world size)
    BLOCK: tl.constexpr,  # elements per program
    HAS_HEALTH: tl.constexpr,  # OR Health.OVERFLOW into the flag where finite inputs sum to NaN/inf
):
    # The fp32 twin of the kernel above: the same offsets, the same rank
    # order, no rounding step (the sum is the output's dtype).
    i_p = tl.program_id(0)
    o_0 = i_p.to(tl.int64) * BLOCK
    n_64 = n.to(tl.int64)
    o = tl.arange(0, BLOCK)  # [BLOCK] int32, from o_0
    m = o < n_64 - o_0  # [BLOCK]
    p_src = src_ptr + o_0
    b_acc = tl.load(p_src + o, mask=m, other=0.0)  # [BLOCK] fp32, slice 0 starts the sum
    m_in = m
    if HAS_HEALTH:
        m_in = m_in & (tl.abs(b_acc) < float("inf"))
    k = 1
    while k < world:
        b_x = tl.load(p_src + k * n_64 + o, mask=m, other=0.0)  # [BLOCK]
        if HAS_HEALTH:
            m_in = m_in & (tl.abs(b_x) < float("inf"))
        b_acc = b_acc + b_x
        k += 1
    tl.store(out_ptr + o_0 + o, b_acc, mask=m)
    if HAS_HEALTH:
        b_h = tl.where(m_in & ~(tl.abs(b_acc) < float("inf")), 2, 0)  # [BLOCK] Health.OVERFLOW
        if tl.max(b_h, axis=0) != 0:
            tl.atomic_or(flag_ptr, tl.max(b_h, axis=0))


_INTERPRETED = C.is_interpreted(_reduce_shards_kernel)


def launch_reduce_shards(src: torch.Tensor, out: torch.Tensor, world: int,
                         health: torch.Tensor | None) -> list[int]:
    """One grid over ``out``.  Inputs were validated by the op layer, which
    also holds the interpreter lock or the device guard."""
    n = out.numel()
    if n == 0:
        return []
    block = C.block_for(_INTERPRETED)
    if src.dtype == torch.float32:
        _reduce_shards_f32_kernel[(triton.cdiv(n, block),)](
            src, out, health if health is not None else out, n, world, BLOCK=block,
            HAS_HEALTH=health is not None, num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False,
        )
        _bump("launches")
        return []
    _reduce_shards_kernel[(triton.cdiv(n, block),)](
        src.view(torch.int16), out.view(torch.int16), health if health is not None else out,
        n, world, BLOCK=block, HAS_HEALTH=health is not None,
        num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False,
    )
    _bump("launches")
    return []
