"""Fused pack: gather many tensors into one flat buffer, scale, cast.

Two of the three layers (kernel -> launcher -> op): the private ``@triton.jit``
:func:`_pack_kernel` and its launcher :func:`launch_pack` (tables, grid, one
launch per source dtype).  The op, :func:`fastddp.kernels.pack`, validates,
chooses the backend and calls the launcher.  The arithmetic is
:func:`fastddp.kernels.reference.pack_views`'s, bit for bit.

Error feedback (``residual=``, 16-bit gradient compression) runs inside the
same launch: the kernel variant ``HAS_RESIDUAL`` also reads and rewrites the
residual, whose address sits in the pointer table and whose chunks start at
the destination's offsets.  The gradient health flag (``health=``) too: the
variant ``HAS_HEALTH`` tests each element it already holds in registers and
ORs :class:`~fastddp.kernels.Health` bits into one int32 with one atomic per
program that found something (none in a healthy step).  Without either
option the kernel compiles to the very code it did before they existed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import _triton_common as C
from ._counters import bump as _bump

__all__ = ["launch_pack"]


@triton.jit
def _pack_kernel(
    ptr_table,  # *Pointer* to int64 [5 + n_tensors]: flat dst address, scale (fp64 bits; fp32 value as fp64 bits), residual address (0: none), health-flag address (0: none), source addresses (0: the op layer copies that one)
    chunk_table,  # *Pointer* to int64 [n_chunks, 4] rows: (ptr-table slot, start in source, start in dst, length)
    SRC_T: tl.constexpr,  # element type of this launch's sources (bf16 as tl.uint16 bits)
    DST_T: tl.constexpr,  # element type of the flat destination (bf16 as tl.uint16 bits)
    C_T: tl.constexpr,  # compute dtype: the residual's with one, else tl.float64 if source or destination is fp64, else tl.float32
    MODE: tl.constexpr,  # 0 cast only, 1 multiply by the scale, 2 divide by it
    RAW: tl.constexpr,  # same dtype, no scaling, no residual: copy the bits
    BLOCK: tl.constexpr,  # elements per program
    HAS_RESIDUAL: tl.constexpr = False,  # error feedback: x += r; dst = cast(x); r = x - upcast(dst)
    HAS_HEALTH: tl.constexpr = False,  # OR this chunk's Health bits into the int32 flag at ptr_table[4]
):
    SRC_B: tl.constexpr = SRC_T.primitive_bitwidth // 8  # bytes per element
    DST_B: tl.constexpr = DST_T.primitive_bitwidth // 8
    i_c = tl.program_id(0)
    p_row = chunk_table + i_c.to(tl.int64) * 4  # int64: i_c * 4 passes 2^31 past 2^29 chunks
    i_t = tl.load(p_row)
    o_src = tl.load(p_row + 1)
    o_dst = tl.load(p_row + 2)
    n = tl.load(p_row + 3)
    a_src = tl.load(ptr_table + i_t)  # the source's address; 0: not ours (copied by the launcher)
    n = tl.where(a_src == 0, 0, n)
    a_src = a_src + o_src * SRC_B  # this chunk's first byte
    a_dst = tl.load(ptr_table) + o_dst * DST_B
    o = tl.arange(0, BLOCK)  # [BLOCK]
    m = o < n  # [BLOCK]
    # Per chunk, at run time: a full chunk at a 16-byte aligned address loads
    # (stores) unmasked and vectorised; any other chunk takes masked scalar
    # accesses.  The hinted pointer is made inside its branch: the hint sits
    # on the op that makes the value, which the other branch must not share.
    full = n == BLOCK
    if full & (a_src % 16 == 0):
        b_x = tl.load(tl.multiple_of(a_src.to(tl.pointer_type(SRC_T)), 16) + o)  # [BLOCK]
    else:
        b_x = tl.load(a_src.to(tl.pointer_type(SRC_T)) + o, mask=m)  # [BLOCK]
    if HAS_HEALTH:
        # the source as it is, before any scaling or cast
        if SRC_T == tl.uint16:
            m_src = (b_x & 0x7F80) != 0x7F80  # [BLOCK] finite (bf16 bits: exponent not all ones)
        else:
            m_src = tl.abs(b_x) < float("inf")  # [BLOCK] finite (NaN compares false)
        b_h = tl.where(m_src, 0, 1)  # [BLOCK] Health.SOURCE_NONFINITE
    if RAW:
        b_y = b_x
    else:
        # widen to the compute dtype (fp64 -> fp32 rounds, with an fp32
        # residual, like ``Tensor.to``); bf16 arrives as its raw bits
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
        if HAS_RESIDUAL:
            # the residual is indexed like the destination; rounded separately
            # from the scaling (no FMA: launched with enable_fp_fusion=False)
            RES_B: tl.constexpr = C_T.primitive_bitwidth // 8
            a_res = tl.load(ptr_table + 3) + o_dst * RES_B
            fast_res = full & (a_res % 16 == 0)
            if fast_res:
                b_e = tl.load(tl.multiple_of(a_res.to(tl.pointer_type(C_T)), 16) + o)  # [BLOCK]
            else:
                b_e = tl.load(a_res.to(tl.pointer_type(C_T)) + o, mask=m)  # [BLOCK]
            if HAS_HEALTH:
                m_res = tl.abs(b_e) < float("inf")  # [BLOCK] finite
                b_h = b_h | tl.where(m_res, 0, 4)  # Health.RESIDUAL_NONFINITE
                m_src = m_src & m_res  # finite inputs
            b_x = b_x + b_e
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
        if HAS_HEALTH:
            # finite inputs stored as inf/NaN: the cast overflowed (or the scaling or the residual's add did)
            if DST_T == tl.uint16:
                m_dst = (b_y & 0x7F80) != 0x7F80  # [BLOCK]
            else:
                m_dst = tl.abs(b_y) < float("inf")  # [BLOCK]
            b_h = b_h | tl.where(m_src & ~m_dst, 2, 0)  # Health.OVERFLOW
        if HAS_RESIDUAL:
            # new residual: what the destination lost, x - upcast(dst), in C_T;
            # a non-finite one (x inf/NaN, or dst overflowed) is stored as 0,
            # so one bad step cannot poison every later one
            if DST_T == tl.uint16:
                b_w = (b_y.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(C_T)
            else:
                b_w = b_y.to(C_T)
            b_n = b_x - b_w  # [BLOCK]
            b_n = tl.where(tl.abs(b_n) < float("inf"), b_n, 0.0)
            if fast_res:
                tl.store(tl.multiple_of(a_res.to(tl.pointer_type(C_T)), 16) + o, b_n)
            else:
                tl.store(a_res.to(tl.pointer_type(C_T)) + o, b_n, mask=m)
    if full & (a_dst % 16 == 0):
        tl.store(tl.multiple_of(a_dst.to(tl.pointer_type(DST_T)), 16) + o, b_y)
    else:
        tl.store(a_dst.to(tl.pointer_type(DST_T)) + o, b_y, mask=m)
    if HAS_HEALTH:
        # one reduction per program; the exact bits and the one atomic only
        # where something was found (a healthy step issues no atomic)
        b_h = tl.where(m, b_h, 0)  # masked-off lanes hold no data
        if tl.max(b_h, axis=0) != 0:
            b_bits = tl.max(b_h & 1, axis=0) | tl.max(b_h & 2, axis=0) | tl.max(b_h & 4, axis=0)
            tl.atomic_or(tl.load(ptr_table + 4).to(tl.pointer_type(tl.int32)), b_bits)


_INTERPRETED = C.is_interpreted(_pack_kernel)


def launch_pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, layout, scale: float,
                divide: float | None, residual: torch.Tensor | None = None,
                health: torch.Tensor | None = None) -> list[int]:
    """Refresh the layout's pointer table and launch one grid of ``n_chunks``
    programs per source dtype; the residual and the health flag, if any, ride
    in those same launches.  Inputs were validated by the op layer
    (:func:`fastddp.kernels.pack`), which also holds the interpreter lock or
    the device guard.  Returns the indices of the sources the kernels left
    alone (memory order not their slot's): the op layer copies those."""
    binding = C.get_binding("pack", layout, srcs, dst, C.block_for(_INTERPRETED))
    plan = binding.plan
    mode, s64, s32 = C.scale_slots(scale, divide, dst.device)
    has_res = residual is not None
    res_t = C.STORAGE[C.CODE[residual.dtype]] if has_res else None  # error feedback runs in the residual's dtype
    with binding.lock:
        table, fallback = binding.refresh(dst, srcs, s64, s32, residual.data_ptr() if has_res else 0,
                                          health.data_ptr() if health is not None else 0)
        try:
            for g in plan.groups:
                if g.n_chunks == 0:
                    continue  # only empty tensors of this dtype
                _pack_kernel[(g.n_chunks,)](
                    table, g.chunks,
                    SRC_T=C.STORAGE[g.kind], DST_T=C.STORAGE[plan.flat_kind],
                    C_T=res_t if has_res else C.compute_type(g.kind, plan.flat_kind),
                    MODE=mode, RAW=(mode == C.MODE_CAST and g.kind == plan.flat_kind and not has_res),
                    BLOCK=plan.block, HAS_RESIDUAL=has_res, HAS_HEALTH=health is not None,
                    num_warps=C.NUM_WARPS_GPU, enable_fp_fusion=False,
                )
                _bump("launches")
        finally:
            binding.after_launch()
    return fallback
