"""The Triton pack/unpack kernels, bit for bit against the plain-torch reference.

Runs in the interpreter session (``TRITON_INTERPRET=1``, tests/run.sh) on CPU
tensors; on a machine with CUDA and without the interpreter the same tests run
the compiled kernels on the GPU (``DEVICE`` below).  The tests marked ``gpu``
need CUDA: they check what only a GPU has (reciprocal division, the pinned
pointer ring under async launches, streams, no allocation).

Comparisons: NaN positions must agree (torch's own vectorised and scalar CPU
paths produce different NaN payloads); every other element bit for bit.
"""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import Layout, reference
from fastddp.kernels import _triton_common as TC
from tests._compare import assert_bits

# The inputs are special values on purpose (inf, NaN, overflow to fp16, 1e300 ->
# fp32): under TRITON_INTERPRET=1 the kernels' arithmetic runs in numpy, which
# warns on each (RuntimeWarning: overflow/invalid value), from triton's interpreter
# module only. Expected here; the results are checked bit for bit instead.
SPECIAL_VALUES = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
pytestmark = [pytest.mark.interpret, SPECIAL_VALUES]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
BLOCK = TC.BLOCK_INTERPRET if DEVICE.type == "cpu" else TC.BLOCK_GPU

FP32, FP16, BF16, FP64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [FP32, FP16, BF16, FP64]
THIRD = float(np.float32(1 / 3))  # the kind of scale torch's reducer uses: fp32(1/W)
SCALINGS = {"scale": dict(scale=THIRD), "divide": dict(divide=3), "cast": dict()}


# ----------------------------------------------------------------- helpers
def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _bits_to_f32(bits) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Edge cases: zeros, infs, NaNs, subnormals of every dtype, overflow to
    fp16 inf, and values sitting exactly on bf16/fp16 rounding ties."""
    vals = [0.0, -0.0, 1.0, -1.0, 1 / 3, 70000.0, -70000.0, 65504.0, 65519.0, 65520.0, 3.0e38, -3.3e38,
            float("inf"), float("-inf"), float("nan"), 1e-40, -1e-41, 1.4e-45, 6e-8, 3e-5, -6.1e-5, 1e-310,
            1e300, -1e300, 1 + 2**-11, 1 + 3 * 2**-11, 2049.0, 2051.0, 1 + 2**-8, 1 + 3 * 2**-8,
            1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, 1 - 2**-40, 3 * 2**-26]
    t = torch.tensor(vals, dtype=FP64)
    ties = _bits_to_f32([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000, 0x7F7F8000, 0x7F7FFFFF,
                         0x00008000, 0x00018000, 0x80018000, 0x7FC00001, 0xFF800001, 0x7F800001])
    return torch.cat([t, ties.to(FP64)]).to(dtype)


def mixed_values(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` values of ``dtype``: specials, normals across many binades, raw bit patterns."""
    if n == 0:
        return torch.empty(0, dtype=dtype)
    spec = special_values(dtype)
    k = n // 3
    normal = (torch.randn(k, generator=gen, dtype=FP64) *
              torch.pow(2.0, torch.randint(-20, 20, (k,), generator=gen).to(FP64))).to(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(-(2 ** 15), 2 ** 15, (k * size // 2,), generator=gen, dtype=torch.int64)
    raw = raw.to(torch.int16).view(dtype) if size > 1 else raw
    out = torch.cat([spec, normal, raw.reshape(-1)])
    reps = -(-n // out.numel())
    return out.repeat(reps)[:n].contiguous()


def make(dtype: torch.dtype, numels, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [mixed_values(dtype, n, gen).to(DEVICE) for n in numels]


def offsets_with_gaps(numels, gap: int = 3) -> list[int]:
    out, at = [], gap
    for n in numels:
        out.append(at)
        at += n + gap
    return out


def total(numels, offsets=None) -> int:
    offsets = reference.default_offsets(numels) if offsets is None else offsets
    return max((o + n for o, n in zip(offsets, numels)), default=0)


def sentinel(dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.full((n,), 12345.0 if dtype != FP16 else 1234.0, dtype=dtype, device=DEVICE)


def check_pack(srcs, dst_dtype, offsets=None, extra: int = 0, layout=None, **scaling):
    """Run the public pack and the reference on sentinel-filled buffers and compare."""
    numels = [s.numel() for s in srcs]
    n = total(numels, offsets) + extra
    got, want = sentinel(dst_dtype, n), sentinel(dst_dtype, n)
    if layout is not None:
        K.pack(srcs, got, layout=layout, **scaling)
    else:
        K.pack(srcs, got, offsets, **scaling)
    reference.pack(srcs, want, offsets, **scaling)
    assert_bits(got, want, f"pack -> {_name(dst_dtype)} {scaling}")
    return got


def check_unpack(src, dst_dtype, numels, offsets=None, accumulate=False, seed=1, layout=None, **scaling):
    got = make(dst_dtype, numels, seed=seed)
    want = [d.clone() for d in got]
    if layout is not None:
        K.unpack(src, got, layout=layout, accumulate=accumulate, **scaling)
    else:
        K.unpack(src, got, offsets, accumulate=accumulate, **scaling)
    reference.unpack(src, want, offsets, accumulate=accumulate, **scaling)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits(g, w, f"unpack {_name(src.dtype)} -> {_name(dst_dtype)} tensor {i} acc={accumulate} {scaling}")
    return got


def test_backend_is_a_kernel():
    assert K.backend(DEVICE) in ("interpret", "triton")


# ------------------------------------------------------- every dtype pair
PAIR_NUMELS = [1, 7, 64, 133]


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_pack_every_pair(src, dst, scaling):
    srcs = make(src, PAIR_NUMELS)
    K.reset_launch_count()
    check_pack(srcs, dst, **SCALINGS[scaling])
    assert K.launch_count() == 1


@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "acc"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_unpack_every_pair(src, dst, scaling, accumulate):
    flat = make(src, [sum(PAIR_NUMELS) + 5], seed=3)[0]
    K.reset_launch_count()
    check_unpack(flat, dst, PAIR_NUMELS, accumulate=accumulate, **SCALINGS[scaling])
    assert K.launch_count() == 1


@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_pure_cast_equals_torch_to(src, dst):
    """scale=1.0, no divide: exactly ``Tensor.to`` (torch's own rounding)."""
    x = special_values(src).to(DEVICE)
    flat = torch.empty(x.numel(), dtype=dst, device=DEVICE)
    K.pack([x], flat)
    assert_bits(flat, x.to(dst), f"pack cast {_name(src)} -> {_name(dst)}")
    y = torch.empty(x.numel(), dtype=dst, device=DEVICE)
    K.unpack(x, [y])
    assert_bits(y, x.to(dst), f"unpack cast {_name(src)} -> {_name(dst)}")


# ------------------------------------------------------------ rounding
def test_fp32_to_bf16_rounds_to_nearest_even():
    """The interpreter's own .to(bf16) truncates; the kernels round like torch."""
    gen = torch.Generator().manual_seed(5)
    rnd = torch.randint(-(2 ** 31), 2 ** 31, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = torch.arange(-64, 64, dtype=torch.int32) * 0x10000 + 0x3F808000  # exact ties, even and odd
    x = torch.cat([rnd.view(FP32), ties.view(FP32), special_values(FP32)]).to(DEVICE)
    flat = torch.empty(x.numel(), dtype=BF16, device=DEVICE)
    K.pack([x], flat)
    assert_bits(flat, x.to(BF16), "fp32 -> bf16")
    ref = torch.empty_like(flat)
    reference.pack([x], ref)
    assert_bits(flat, ref, "fp32 -> bf16 vs reference")


def test_fp16_overflow_subnormal_and_ties():
    x = torch.tensor([70000.0, -70000.0, 65504.0, 65519.99, 65520.0, 6e-8, 2.9e-8, 3e-8, 5.96e-8, 1e-5,
                      1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 2049.0, 2051.0], dtype=FP32, device=DEVICE)
    flat = torch.empty(x.numel(), dtype=FP16, device=DEVICE)
    K.pack([x], flat)
    assert_bits(flat, x.to(FP16), "fp32 -> fp16")
    assert flat[0].item() == float("inf") and flat[1].item() == float("-inf")


@pytest.mark.parametrize("dst", [FP16, BF16], ids=_name)
def test_fp64_rounds_through_fp32_like_torch(dst):
    """torch converts double -> float -> half/bf16 (two roundings); so do the kernels."""
    x = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8 + 2 ** -40, -(1 + 2 ** -11 + 2 ** -40),
                      1 + 2 ** -8 - 2 ** -40, 65519.999999999], dtype=FP64, device=DEVICE)
    flat = torch.empty(x.numel(), dtype=dst, device=DEVICE)
    K.pack([x], flat)
    assert_bits(flat, x.to(dst), f"fp64 -> {_name(dst)}")
    assert_bits(flat, x.to(FP32).to(dst), f"fp64 -> fp32 -> {_name(dst)}")


def test_scale_and_divide_round_differently_and_each_matches():
    """scale=fp32(1/3) and divide=3 are two rounding rules; each matches its reference."""
    x = make(FP32, [4096], seed=9)[0]
    a, b = check_pack([x], FP32, scale=THIRD), check_pack([x], FP32, divide=3)
    fin = a.isfinite() & b.isfinite()
    assert bool((a[fin] != b[fin]).any()), "expected the two rules to differ somewhere"


def test_accumulate_nan_inf_destinations():
    flat = torch.tensor([1.0, float("inf"), float("nan"), -2.0, 1e38, 65504.0], device=DEVICE)
    for dt in DTYPES:
        for scaling in SCALINGS.values():
            dsts = [torch.tensor([float("inf"), 1.0, 2.0, float("nan"), 1e38, 65504.0], device=DEVICE).to(dt)]
            want = [d.clone() for d in dsts]
            K.unpack(flat, dsts, accumulate=True, **scaling)
            reference.unpack(flat, want, accumulate=True, **scaling)
            assert_bits(dsts[0], want[0], f"acc into {_name(dt)} {scaling}")


# ----------------------------------------------------------- odd sizes
ODD = [0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 255, 257, 1023, 1025, 0, 1]


@pytest.mark.parametrize("dst", [FP32, BF16], ids=_name)
def test_odd_sizes_and_a_tensor_larger_than_block(dst):
    numels = ODD + [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5]
    srcs = make(FP32, numels)
    K.reset_launch_count()
    check_pack(srcs, dst, scale=THIRD)
    assert K.launch_count() == 1
    flat = make(dst, [sum(numels)], seed=2)[0]
    check_unpack(flat, FP32, numels, accumulate=True, divide=3)
    assert K.launch_count() == 2


def test_300_tensors_one_launch_each_way():
    gen = torch.Generator().manual_seed(11)
    numels = torch.randint(0, 40, (300,), generator=gen).tolist()
    srcs = make(FP32, numels)
    K.reset_launch_count()
    got = check_pack(srcs, BF16, scale=THIRD)
    assert K.launch_count() == 1
    check_unpack(got, FP32, numels, scale=2.0)
    assert K.launch_count() == 2


@pytest.mark.parametrize("gap", [3, 16], ids=["unaligned-gaps", "aligned-gaps"])
def test_explicit_offsets_leave_gaps_untouched(gap):
    numels = [5, 0, 17, 1, 64, 33]
    srcs = make(FP16, numels)
    offsets = offsets_with_gaps(numels, gap)
    got = check_pack(srcs, FP32, offsets, extra=7, divide=3)  # the sentinel survives in every gap
    check_unpack(got, BF16, numels, offsets, accumulate=True, scale=THIRD)


def test_offsets_out_of_order():
    numels = [4, 9, 2]
    srcs = make(FP32, numels)
    offsets = [20, 0, 11]
    check_pack(srcs, FP16, offsets, scale=0.5)
    check_unpack(make(FP16, [30])[0], FP32, numels, offsets)


def test_unaligned_tensors():
    """Sources and destinations that start off a 16-byte boundary (the kernels' unaligned variant on GPU)."""
    big = make(FP32, [2 * BLOCK + 40])[0]
    srcs = [big[1:BLOCK + 6], big[BLOCK + 7:BLOCK + 30]]
    got = check_pack(srcs, FP32, scale=THIRD)
    check_pack(srcs, BF16, [1, BLOCK + 9], divide=3)
    dbig = torch.zeros(2 * BLOCK + 40, dtype=BF16, device=DEVICE)
    dsts = [dbig[3:BLOCK + 8], dbig[BLOCK + 9:BLOCK + 32]]
    want = [d.clone() for d in dsts]
    K.unpack(got, dsts, accumulate=True, scale=2.0)
    reference.unpack(got, want, accumulate=True, scale=2.0)
    for g, w in zip(dsts, want):
        assert_bits(g, w, "unaligned unpack")


def test_empty_lists_and_all_empty_tensors():
    flat = torch.zeros(4, device=DEVICE)
    assert K.pack([], flat) is flat
    assert list(K.unpack(flat, [])) == []
    K.reset_launch_count()
    srcs = [torch.empty(0, device=DEVICE), torch.empty(0, 3, device=DEVICE)]
    K.pack(srcs, flat, scale=2.0)
    K.unpack(flat, srcs, accumulate=True)
    assert K.launch_count() == 0
    assert flat.eq(0).all()


def test_shapes_are_kept():
    srcs = [t.reshape(s) for t, s in zip(make(FP32, [6, 24, 1]), [(2, 3), (2, 3, 4), (1, 1)])]
    flat = check_pack(srcs, BF16)
    dsts = [torch.zeros(s.shape, device=DEVICE) for s in srcs]
    K.unpack(flat, dsts)
    for s, d in zip(srcs, dsts):
        assert_bits(d, s.to(BF16).to(FP32), "shape round trip")


# ---------------------------------------------------- launches per dtype
def test_mixed_source_dtypes_one_launch_per_dtype():
    dts = [FP32, BF16, FP16, FP32, BF16, FP64, FP16, FP32]
    numels = [5, 9, 1, 40, 0, 3, 17, 2]
    srcs = [make(dt, [n], seed=i)[0] for i, (dt, n) in enumerate(zip(dts, numels))]
    for dst in (FP32, BF16):
        K.reset_launch_count()
        check_pack(srcs, dst, scale=THIRD)
        assert K.launch_count() == 4


def test_mixed_destination_dtypes_one_launch_per_dtype():
    dts = [BF16, FP32, FP16, BF16, FP32]
    numels = [3, 18, 7, 1, 30]
    flat = make(FP32, [sum(numels)], seed=4)[0]
    dsts = [make(dt, [n], seed=i)[0] for i, (dt, n) in enumerate(zip(dts, numels))]
    want = [d.clone() for d in dsts]
    K.reset_launch_count()
    K.unpack(flat, dsts, accumulate=True, divide=3)
    assert K.launch_count() == 3
    reference.unpack(flat, want, accumulate=True, divide=3)
    for g, w in zip(dsts, want):
        assert_bits(g, w, "mixed destinations")


def test_dtype_with_only_empty_tensors_is_not_launched():
    srcs = [make(FP32, [5])[0], torch.empty(0, dtype=BF16, device=DEVICE)]
    K.reset_launch_count()
    check_pack(srcs, FP32)
    assert K.launch_count() == 1


# ------------------------------------------------------------- fallbacks
def test_noncontiguous_input_is_copied_alone_the_rest_stays_in_the_launch():
    """A transposed tensor in a row-major slot: torch copies that one tensor,
    the others keep their one launch; results equal the reference."""
    x = make(FP32, [24])[0].reshape(4, 6).t()
    assert not x.is_contiguous()
    srcs = [make(FP32, [5])[0], x]
    K.reset_launch_count()
    flat = check_pack(srcs, BF16, scale=THIRD)
    s = K.stats()
    assert s["launches"] == 1 and s["reference_calls"] == 0 and s["fallback_tensors"] == 1
    dst = torch.zeros(4, 6, device=DEVICE).t()
    K.unpack(flat, [torch.zeros(5, device=DEVICE), dst])
    assert_bits(dst, (x * THIRD).to(BF16).to(FP32), "non-contiguous unpack")
    s = K.stats()
    assert s["launches"] == 2 and s["fallback_tensors"] == 2


# ------------------------------------------------------- layout reuse
def test_layout_reused_with_new_tensors_each_call():
    numels = [3, 70, 1, 129]
    lay = Layout([(3,), (7, 10), (1,), (129,)])
    plans = set()
    for step in range(4):
        srcs = [t.reshape(s) for t, s in zip(make(FP32, numels, seed=step), lay.shapes)]
        got = check_pack(srcs, BF16, layout=lay, scale=THIRD)
        dsts = [torch.full(s, float(step), device=DEVICE) for s in lay.shapes]
        want = [d.clone() for d in dsts]
        K.unpack(got, dsts, layout=lay, accumulate=True)
        reference.unpack(got, want, accumulate=True)
        for g, w in zip(dsts, want):
            assert_bits(g, w, f"step {step}")
        plans |= {id(p) for p in lay.cache.values()}
    assert len(plans) == 2, "one plan for pack, one for unpack, built once"


def test_same_tensors_new_values_and_new_scale():
    """Pointers unchanged: the pointer table is not rewritten, but a new scale must be seen."""
    srcs = make(FP32, [5, 40])
    lay = Layout.for_tensors(srcs)
    for scale in (0.5, 0.5, THIRD, 1.0, 4.0):
        for s in srcs:
            s.mul_(1.5)
        check_pack(srcs, FP16, layout=lay, scale=scale)
    check_pack(srcs, FP16, layout=lay, divide=7)
    check_pack(srcs, FP16, layout=lay, divide=7)


def test_plans_are_cached_without_a_layout():
    srcs = make(FP32, [3, 4, 5])
    flat = torch.zeros(12, device=DEVICE)
    K.pack(srcs, flat)
    n = len(TC._LRU)
    plan = next(reversed(TC._LRU.values()))
    K.pack(make(FP32, [3, 4, 5], seed=1), flat)
    assert len(TC._LRU) == n and next(reversed(TC._LRU.values())) is plan


def _run_in_threads(work, n: int) -> None:
    """Run ``work(i)`` for i < n in n threads at once and wait for them."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_threads_share_a_layout():
    numels = [33, 2, 70]
    lay = Layout([(n,) for n in numels])
    errors = []

    def work(seed):
        try:
            for k in range(3):
                srcs = make(FP32, numels, seed=seed * 10 + k)
                check_pack(srcs, BF16, layout=lay, scale=THIRD)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    _run_in_threads(work, 3)
    assert not errors, errors[0]


# ------------------------------------------- error feedback (residual)
# pack(..., residual=r): x = src*scale (or /divide) + r; dst = cast(x); r = x - upcast(dst),
# in r's dtype, fused into the pack launch itself.  Oracle: reference.pack_views
# with residual views (the same function the reducer's CPU path runs).

def grads(dtype: torch.dtype, numels, seed: int) -> list[torch.Tensor]:
    """Finite, gradient-like values over many binades (the recurrence stays finite)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in numels:
        x = torch.randn(n, generator=gen, dtype=FP64) * torch.pow(2.0, torch.randint(-24, 8, (n,), generator=gen)
                                                                   .to(FP64))
        out.append(x.to(dtype).to(DEVICE))
    return out


def check_pack_residual(srcs, dst_dtype, res_got, res_want, offsets=None, layout=None, what="", **scaling):
    """One public pack with a residual against the reference on the same inputs;
    dst (sentinel-filled, so gaps are checked) and residual compared bit for bit.
    Returns the number of kernel launches of the public call."""
    numels = [s.numel() for s in srcs]
    lay = layout if layout is not None else Layout([(n,) for n in numels], offsets)
    n = max(lay.total, res_got.numel())
    got, want = sentinel(dst_dtype, n), sentinel(dst_dtype, n)
    before = K.stats()
    K.pack(srcs, got, layout=lay, residual=res_got, **scaling)
    after = K.stats()
    assert after["reference_calls"] == before["reference_calls"], "served by the reference, not the kernel"
    reference.pack_views(srcs, lay.views(want), residuals=lay.views(res_want), **scaling)
    assert_bits(got, want, f"{what} pack+residual -> {_name(dst_dtype)} {scaling}: dst")
    assert_bits(res_got, res_want, f"{what} pack+residual -> {_name(dst_dtype)} {scaling}: residual")
    return after["launches"] - before["launches"]


def test_pack_kernel_supports_the_residual():
    """residual= calls are served by the kernel launch itself (the op layer has
    no per-option capability flag to consult any more)."""
    srcs = grads(FP32, [4, 5], seed=0)
    r = torch.zeros(9, device=DEVICE)
    before = K.stats()
    K.pack(srcs, torch.zeros(9, dtype=BF16, device=DEVICE), residual=r)
    after = K.stats()
    assert after["launches"] - before["launches"] == 1
    assert after["reference_calls"] == before["reference_calls"]


RES_NUMELS = [1, 7, 64, 133, 0, 31]


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dst", [FP16, BF16, FP32], ids=_name)
@pytest.mark.parametrize("src", [FP32, FP16, BF16], ids=_name)
def test_pack_residual_recurrence_every_pair(src, dst, scaling):
    """Four consecutive steps, new gradient tensors each step, one residual
    carried through: dst and residual bit-exact after every step, ONE launch a step."""
    lay = Layout([(n,) for n in RES_NUMELS])
    gen = torch.Generator().manual_seed(1)
    r0 = (torch.randn(lay.total, generator=gen) * 1e-3).to(DEVICE)  # a non-zero residual from step 0
    r_got, r_want = r0.clone(), r0.clone()
    for step in range(4):
        srcs = grads(src, RES_NUMELS, seed=10 * step + 1)
        assert check_pack_residual(srcs, dst, r_got, r_want, layout=lay, what=f"step {step}",
                                   **SCALINGS[scaling]) == 1
        if dst in (FP16, BF16):
            assert bool((r_got != 0).any()), "the 16-bit cast should leave a residual"
        else:  # fp32 x stored as fp32: nothing lost (the multiply's rounding happened before the add)
            assert bool((r_got == 0).all())


@pytest.mark.parametrize("dst", [FP16, BF16, FP32, FP64], ids=_name)
@pytest.mark.parametrize("src", [FP32, FP64], ids=_name)
def test_pack_residual_float64(src, dst):
    """A float64 residual (allowed by the public API): the arithmetic runs in fp64,
    so even an fp32 destination leaves a residual."""
    numels = [5, 70, 1]
    lay = Layout([(n,) for n in numels])
    r_got = torch.zeros(lay.total, dtype=FP64, device=DEVICE)
    r_want = r_got.clone()
    for step in range(3):
        for scaling in SCALINGS.values():
            srcs = grads(src, numels, seed=step)
            assert check_pack_residual(srcs, dst, r_got, r_want, layout=lay, what=f"fp64 r step {step}",
                                       **scaling) == 1
    if dst != FP64:
        assert bool((r_got != 0).any())


@pytest.mark.parametrize("dst", [FP16, BF16], ids=_name)
def test_pack_residual_odd_sizes_gaps_and_larger_than_block(dst):
    """Odd sizes, tensors of BLOCK +- 1 and over 2 BLOCKs, unaligned offsets with
    gaps: the residual is indexed like dst, and its gaps (like dst's) are left alone."""
    numels = ODD + [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5]
    offsets = offsets_with_gaps(numels, gap=3)
    n = total(numels, offsets) + 5
    r_got = torch.full((n,), 0.125, device=DEVICE)  # gaps must keep this
    r_want = r_got.clone()
    for step, scaling in enumerate([dict(scale=THIRD), dict(divide=3)]):
        srcs = grads(FP32, numels, seed=step)
        assert check_pack_residual(srcs, dst, r_got, r_want, offsets, what=f"step {step}", **scaling) == 1
    assert r_got[:3].eq(0.125).all() and r_got[-5:].eq(0.125).all()


def test_pack_residual_special_values():
    """Infs, NaNs, subnormals, overflow to fp16 inf, rounding ties: the residual
    is what the reference's torch ops make of them, a non-finite one (inf - inf
    = NaN, x - inf...) stored as 0; it stays finite."""
    for src in (FP32, FP16, BF16):
        for dst in (FP16, BF16):
            for scaling in SCALINGS.values():
                srcs = [special_values(src).to(DEVICE), make(src, [300], seed=4)[0]]
                numels = [s.numel() for s in srcs]
                r0 = torch.cat([special_values(FP32)[torch.randperm(numels[0])], torch.full((300,), 1e-3)])
                r_got, r_want = r0.to(DEVICE), r0.to(DEVICE).clone()
                for step in range(2):
                    assert check_pack_residual(srcs, dst, r_got, r_want, what=f"specials step {step}",
                                               **scaling) == 1
                    assert bool(r_got.isfinite().all())


def test_pack_residual_mixed_source_dtypes_one_launch_per_dtype():
    dts = [FP32, BF16, FP16, FP32, BF16, FP16]
    numels = [5, 9, 1, 40, 0, 17]
    lay = Layout([(n,) for n in numels])
    r_got = torch.zeros(lay.total, device=DEVICE)
    r_want = r_got.clone()
    for step in range(2):
        srcs = [grads(dt, [n], seed=10 * step + i)[0] for i, (dt, n) in enumerate(zip(dts, numels))]
        assert check_pack_residual(srcs, BF16, r_got, r_want, layout=lay, scale=THIRD) == 3


def test_pack_residual_pointer_changes_and_unaligned_residual():
    """The pointer table holds the residual's address: a new residual, a call
    without one in between, and a residual starting off a 16-byte boundary
    must each be seen (and an old residual never written again)."""
    numels = [33, 2, 70]
    lay = Layout([(n,) for n in numels])
    srcs = grads(FP32, numels, seed=3)
    big = torch.zeros(lay.total + 1, device=DEVICE)
    residuals = [torch.zeros(lay.total, device=DEVICE), torch.full((lay.total,), 1e-4, device=DEVICE),
                 big[1:]]  # big[1:] is 4 bytes off 16
    assert residuals[2].data_ptr() % 16 != 0
    wants = [r.clone() for r in residuals]
    for k, (rg, rw) in enumerate(zip(residuals, wants)):
        keep = [r.clone() for r in residuals]
        assert check_pack_residual(srcs, FP16, rg, rw, layout=lay, what=f"residual {k}", scale=THIRD) == 1
        check_pack(srcs, FP16, layout=lay, scale=THIRD)  # same layout, no residual
        for j, (r, kept) in enumerate(zip(residuals, keep)):
            if j != k:
                assert_bits(r, kept, f"residual {j} touched by the call with residual {k}")
    assert big[0].item() == 0.0


def test_pack_residual_shares_a_layout_across_threads():
    numels = [33, 2, 70]
    lay = Layout([(n,) for n in numels])
    errors = []

    def work(seed):
        try:
            r_got = torch.zeros(lay.total, device=DEVICE)
            r_want = r_got.clone()
            for k in range(2):
                check_pack_residual(grads(FP32, numels, seed=seed * 10 + k), BF16, r_got, r_want, layout=lay,
                                    what=f"thread {seed}", scale=THIRD)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    _run_in_threads(work, 3)
    assert not errors, errors[0]


def test_pack_residual_launcher_checks():
    """Validated once, at the public entry, also when a Layout is passed (the
    launchers below it no longer re-check)."""
    srcs = grads(FP32, [4, 5], seed=0)
    lay = Layout.for_tensors(srcs)
    flat = torch.zeros(9, dtype=BF16, device=DEVICE)
    with pytest.raises(TypeError, match="float32"):
        K.pack(srcs, flat, layout=lay, residual=torch.zeros(9, dtype=FP16, device=DEVICE))
    with pytest.raises(ValueError, match="layout needs 9"):
        K.pack(srcs, flat, layout=lay, residual=torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        K.pack(srcs, flat, layout=lay, residual=torch.zeros(18, device=DEVICE)[::2])
    with pytest.raises(TypeError, match="float32"):  # the public API says so first
        K.pack(srcs, flat, residual=torch.zeros(9, dtype=BF16, device=DEVICE))


# ---------------------------------------------------------------- errors
def test_errors():
    srcs = make(FP32, [4, 5])
    flat = torch.zeros(9, device=DEVICE)
    with pytest.raises(ValueError, match="not both"):
        K.pack(srcs, flat, scale=0.5, divide=2)
    with pytest.raises(ValueError, match="does not fit"):
        K.pack(srcs, flat, [0, 5])
    with pytest.raises(ValueError, match="does not fit"):
        K.unpack(flat, srcs, [-1, 4])
    with pytest.raises(ValueError, match="offsets"):
        K.pack(srcs, flat, [0])
    with pytest.raises(ValueError, match="is on meta"):
        K.pack([srcs[0], torch.empty(5, device="meta")], flat)
    with pytest.raises(ValueError, match="divide=0"):
        K.unpack(flat, srcs, divide=0)
    with pytest.raises(ValueError, match="elements but its layout"):
        K.pack([srcs[0], make(FP32, [6])[0]], torch.zeros(10, device=DEVICE), layout=Layout([(4,), (5,)]))
    with pytest.raises(ValueError, match=">= 9 elements"):
        K.pack(srcs, torch.zeros(8, device=DEVICE), layout=Layout.for_tensors(srcs))
    with pytest.raises(TypeError, match="dtype"):
        K.pack([torch.ones(3, dtype=torch.int32, device=DEVICE)], flat)
    # with a Layout the public API checks only counts; the launcher vets the rest
    lay = Layout([(4,), (5,)])
    with pytest.raises(TypeError, match="tensor 1 has dtype torch.int32"):
        K.pack([srcs[0], torch.ones(5, dtype=torch.int32, device=DEVICE)], flat, layout=lay)
    with pytest.raises(ValueError, match="tensor 1 is on meta"):
        K.unpack(flat, [srcs[0], torch.empty(5, device="meta")], layout=lay)


# ------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_gpu_every_pair_vs_reference(op):
    numels = [1, 255, BLOCK + 3, 4 * BLOCK]
    for src, dst in itertools.product(DTYPES, DTYPES):
        for scaling in SCALINGS.values():
            if op == "pack":
                check_pack(make(src, numels), dst, **scaling)
            else:
                for acc in (False, True):
                    check_unpack(make(src, [sum(numels)])[0], dst, numels, accumulate=acc, **scaling)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_divide_multiplies_by_the_reciprocal_like_torch():
    x = make(FP32, [1 << 16], seed=7)[0].cuda()
    flat = torch.empty_like(x)
    K.pack([x], flat, divide=3)
    assert_bits(flat, x / 3, "torch's CUDA division by a scalar")
    assert_bits(flat, x * (np.float32(1) / np.float32(3)).item(), "x * fp32(1)/fp32(3)")
    x64 = x.to(FP64)
    f64 = torch.empty_like(x64)
    K.pack([x64], f64, divide=3)
    assert_bits(f64, x64 / 3, "fp64 division on CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_pointer_ring_under_async_launches():
    """New tensors every call, no synchronisation: a pinned pointer buffer must
    never be rewritten while its copy may be in flight."""
    numels = [4097, 1, 300, 2 * BLOCK + 1]
    lay = Layout([(n,) for n in numels])
    keep = []
    for step in range(40):
        srcs = make(FP32, numels, seed=step)
        flat = torch.empty(sum(numels), dtype=BF16, device="cuda")
        torch.cuda._sleep(200_000) if step % 8 == 0 else None  # let the host run ahead
        K.pack(srcs, flat, layout=lay, scale=THIRD)
        keep.append((srcs, flat))
    torch.cuda.synchronize()
    for step, (srcs, flat) in enumerate(keep):
        want = torch.empty_like(flat)
        reference.pack(srcs, want, scale=THIRD)
        assert_bits(flat, want, f"step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_side_stream_and_no_steady_state_allocation():
    numels = [1000, 33, 4096]
    srcs = make(FP32, numels)
    lay = Layout.for_tensors(srcs)
    flat = torch.empty(sum(numels), dtype=FP16, device="cuda")
    dsts = [torch.zeros(n, device="cuda") for n in numels]
    side = torch.cuda.Stream()
    for _ in range(3):  # warm up: compile, build the plan, allocate its buffers
        K.pack(srcs, flat, layout=lay, scale=THIRD)
        K.unpack(flat, dsts, layout=lay)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for i in range(20):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            K.pack(srcs, flat, layout=lay, scale=THIRD)
            K.unpack(flat, dsts, layout=lay, accumulate=True)
        torch.cuda.current_stream().wait_stream(side)
        side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == before
    want = [torch.zeros(n, device="cuda") for n in numels]
    wflat = torch.empty_like(flat)
    reference.pack(srcs, wflat, scale=THIRD)
    reference.unpack(wflat, want)
    for _ in range(20):
        reference.unpack(wflat, want, accumulate=True)
    for g, w in zip(dsts, want):
        assert_bits(g, w, "side stream")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_pack_residual_every_pair_vs_reference():
    """Compiled kernel, aligned and unaligned offsets, chunks of BLOCK and more:
    dst and residual bit-exact vs the reference on CUDA (whose divide is a
    reciprocal multiply, as the kernel's), four steps each."""
    numels = [1, 255, BLOCK + 3, 4 * BLOCK]
    for src, dst in itertools.product([FP32, FP16, BF16], [FP16, BF16, FP32]):
        for scaling in SCALINGS.values():
            for offsets in (None, offsets_with_gaps(numels, 3)):
                lay = Layout([(n,) for n in numels], offsets)
                r_got = torch.zeros(lay.total, device=DEVICE)
                r_want = r_got.clone()
                for step in range(4):
                    assert check_pack_residual(grads(src, numels, seed=step), dst, r_got, r_want, layout=lay,
                                               what=f"{_name(src)} step {step}", **scaling) == 1
