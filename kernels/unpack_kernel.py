"""Fused unpack: scatter one flat buffer into many tensors, scale, cast back,
store or accumulate.

Two of the three layers (kernel -> launcher -> op): the private ``@triton.jit``
:func:`_unpack_kernel` and its launcher :func:`launch_unpack` (tables, grid,
one launch per destination dtype).  The op, :func:`fastddp.kernels.unpack`,
validates, chooses the backend and calls the launcher.  The arithmetic is
:func:`fastddp.kernels.reference.unpack_views`'s, bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import _triton_common as C
from ._counters import bump as _bump

__all__ = ["launch_unpack"]


@triton.jit
def _unpack_kernel(
    ptr_table,  # *Pointer* to int64 [5 + n_tensors] (header _HEAD = 5): flat src address, scale (fp64 bits; fp32 value as fp64 bits), two unused slots, destination addresses (0: the op layer copies that one)
    chunk_table,  # *Pointer* to int64 [n_chunks, 4] rows: (ptr-table slot, start in destination, start in src, length)
    SRC_T: tl.constexpr,  # element type of the flat source (bf16 as tl.uint16 bits)
    DST_T: tl.constexpr,  # element type of this launch's destinations (bf16 as tl.uint16 bits)
    C_T: tl.constexpr,  # compute dtype: tl.float64 if source or destination is fp64, else tl.float32
    MODE: tl.constexpr,  # 0 cast only, 1 multiply by the scale, 2 divide by it
    ACC: tl.constexpr,  # add to the destination (in the compute dtype) instead of overwriting it
    RAW: tl.constexpr,  # same dtype, no scaling, no accumulation: copy the bits
    BLOCK: tl.constexpr,  # elements per program
):
    SRC_B: tl.constexpr = SRC_T.primitive_bitwidth // 8  # bytes per element
    DST_B: tl.constexpr = DST_T.primitive_bitwidth // 8
    i_c = tl.program_id(0)
    p_row = chunk_table + i_c.to(tl.int64) * 4  # int64: i_c * 4 passes 2^31 past 2^29 chunks
    i_t = tl.load(p_row)
    o_dst = tl.load(p_row + 1)
    o_src = tl.load(p_row + 2)
    n = tl.load(p_row + 3)
    a_dst = tl.load(ptr_table + i_t)  # the destination's address; 0: not ours (copied by the launcher)
    n = tl.where(a_dst == 0, 0, n)
    a_dst = a_dst + o_dst * DST_B  # this chunk's first byte
    a_src = tl.load(ptr_table) + o_src * SRC_B
    o = tl.arange(0, BLOCK)  # [BLOCK]
    m = o < n  # [BLOCK]
    # Per chunk, at run time: a full chunk at a 16-byte aligned address loads
    # (stores) unmasked and vectorised; any other chunk takes masked scalar
    # accesses.  The hinted pointer is made inside its branch: the hint sits
    # on the op that makes the value, which the other branch must not share.
    full = n == BLOCK
    fast_dst = full & (a_dst % 16 == 0)
    if full & (a_src % 16 == 0):
        b_x = tl.load(tl.multiple_of(a_src.to(tl.pointer_type(SRC_T)), 16) + o)  # [BLOCK]
    else:
        b_x = tl.load(a_src.to(tl.pointer_type(SRC_T)) + o, mask=m)  # [BLOCK]
    if RAW:
        b_y = b_x
    else:
        # widen to the compute dtype (exact); bf16 arrives as its raw bits
        if SRC_T == tl.uint16:
            b_x = (b_x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        b_x = b_x.to(C_T)
        if MODE != 0:
            if C_T == tl.float64:
                b_s = tl.load(ptr_table + 1).to(tl.float64, bitcast=True)
            else:  # an fp32 value widened to fp64: narrowing it back is exact
                b_s = tl.load(ptr_table + 2).to(tl.float64, bitcast=True).to(tl.float32)
            if MODE == 1:
                b_x = b_x * b_s
            elif C_T == tl.float64:
                b_x = b_x / b_s
            else:
                b_x = tl.math.div_rn(b_x, b_s)  # IEEE division; fp32 `/` may be approximate
        if ACC:
            if fast_dst:
                b_d = tl.load(tl.multiple_of(a_dst.to(tl.pointer_type(DST_T)), 16) + o)  # [BLOCK]
            else:
                b_d = tl.load(a_dst.to(tl.pointer_type(DST_T)) + o, mask=m)  # [BLOCK]
            if DST_T == tl.uint16:
                b_d = (b_d.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            b_x = b_d.to(C_T) + b_x
        # narrow to the destination, round to nearest even; fp64 -> fp16/bf16
        # goes through fp32 as torch does (c10::Half/BFloat16 take a float)
        if DST_T == tl.uint16:
            b_u = b_x.to(tl.float32).to(tl.uint32, bitcast=True)  # [BLOCK]
            b_r = (b_u + ((b_u >> 16) & 1) + 0x7FFF) >> 16
            m_nan = (b_u & 0x7FFFFFFF) > 0x7F800000
            b_y = tl.where(m_nan, (b_u >> 16) | 0x40, b_r).to(tl.uint16)
        elif DST_T == tl.float16:
            b_y = b_x.to(tl.float32).to(tl.float16)
        else:
            b_y = b_x.to(DST_T)
    if fast_dst:
        tl.store(tl.multiple_of(a_dst.to(tl.pointer_type(DST_T)), 16) + o, b_y)
    else:
        tl.store(a_dst.to(tl.pointer_type(DST_T)) + o, b_y, mask=m)


_INTERPRETED = C.is_interpreted(_unpack_kernel)


def launch_unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], layout, scale: float,
                  divide: float | None, accumulate: bool) -> list[int]:
    """Refresh the layout's pointer table and launch one grid of ``n_chunks``
    programs per destination dtype.  Inputs were validated by the op layer
    (:func:`fastddp.kernels.unpack`), which also holds the interpreter lock or
    the device guard.  Returns the indices of the destinations the kernels
    left alone (memory order not their slot's): the op layer writes those."""
    binding = C.get_binding("unpack", layout, dsts, src, C.block_for(_INTERPRETED))
    plan = binding.plan
    mode, s64, s32 = C.scale_slots(scale, divide, src.device)
    with binding.lock:
        table, fallback = binding.refresh(src, dsts, s64, s32)
        try:
            for g in plan.groups:
                if g.n_chunks == 0:
                    continue  # only empty tensors of this dtype
                _unpack_kernel[(g.n_chunks,)](
                    table, g.chunks,
                    SRC_T=C.STORAGE[plan.flat_kind], DST_T=C.STORAGE[g.kind],
                    C_T=C.compute_type(plan.flat_kind, g.kind),
                    MODE=mode, ACC=bool(accumulate),
                    RAW=(mode == C.MODE_CAST and not accumulate and g.kind == plan.flat_kind),
                    BLOCK=plan.block, num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False,
                )
                _bump("launches")
        finally:
            binding.after_launch()
    return fallback
