"""The plain-torch reference of pack/unpack, the public API around it, Layout,
backend choice; and (without a GPU) that the Triton kernels compile for sm_90.

Default session (no TRITON_INTERPRET): on CPU every call is served by
:mod:`fastddp.kernels.reference`.  Its semantics are checked against direct
torch expressions of the contract written in its docstring, never against a
copy of it.
"""

from __future__ import annotations

import inspect
import os
import re

import numpy as np
import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import Layout, reference
from tests._compare import assert_bits

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FP32, FP16, BF16, FP64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [FP32, FP16, BF16, FP64]
THIRD = float(np.float32(1 / 3))


def _name(dt):
    return str(dt).replace("torch.", "")


def values(dtype, n=257, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=FP64) * torch.pow(2.0, torch.randint(-12, 12, (n,), generator=gen).to(FP64))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 70000.0, 1e-40, 65504.0])
    x[:8] = special[:n]
    return x.to(dtype)


def contract(x, c, scale=1.0, divide=None):
    """The docstring's ``x.to(C) * C(scale)`` / ``x.to(C) / C(divide)`` as a torch expression."""
    if divide is not None:
        return x.to(c) / divide
    if scale != 1.0:
        return x.to(c) * scale
    return x.to(c)


SCALINGS = {"scale": dict(scale=THIRD), "divide": dict(divide=3), "cast": dict(), "pow2": dict(scale=0.5)}


# ------------------------------------------------------------- contract
def test_compute_dtype():
    for a in DTYPES:
        for b in DTYPES:
            want = FP64 if FP64 in (a, b) else FP32
            assert reference.compute_dtype(a, b) == want


def test_default_offsets():
    assert reference.default_offsets([]) == []
    assert reference.default_offsets([3, 0, 5, 1]) == [0, 3, 3, 8]


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_pack_is_the_contract(src, dst, scaling):
    kw = SCALINGS[scaling]
    srcs = [values(src, n, seed=n) for n in (1, 33, 257)]
    flat = torch.full((300,), 7.0, dtype=dst)
    reference.pack(srcs, flat, **kw)
    c = reference.compute_dtype(src, dst)
    at = 0
    for s in srcs:
        assert_bits(flat[at:at + s.numel()], contract(s, c, **kw).to(dst), f"pack {_name(src)}->{_name(dst)} {kw}")
        at += s.numel()
    assert flat[at:].eq(7).all()
    public = torch.full((300,), 7.0, dtype=dst)
    K.pack(srcs, public, **kw)
    assert_bits(public, flat, "public pack == reference")


@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "acc"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_unpack_is_the_contract(src, dst, scaling, accumulate):
    kw = SCALINGS[scaling]
    flat = values(src, 300, seed=1)
    numels, offsets = [5, 1, 200], [0, 10, 11]
    dsts = [values(dst, n, seed=10 + n) for n in numels]
    before = [d.clone() for d in dsts]
    reference.unpack(flat, dsts, offsets, accumulate=accumulate, **kw)
    c = reference.compute_dtype(src, dst)
    for d, b, o, n in zip(dsts, before, offsets, numels):
        v = contract(flat[o:o + n], c, **kw)
        want = (b.to(c) + v).to(dst) if accumulate else v.to(dst)
        assert_bits(d, want, f"unpack {_name(src)}->{_name(dst)} {kw} acc={accumulate}")
    public = [b.clone() for b in before]
    K.unpack(flat, public, offsets, accumulate=accumulate, **kw)
    for p, d in zip(public, dsts):
        assert_bits(p, d, "public unpack == reference")


def test_scale_one_is_a_copy_and_keeps_shapes():
    srcs = [values(FP32, 6).reshape(2, 3), values(FP32, 4).reshape(2, 2)]
    flat = torch.empty(10)
    K.pack(srcs, flat)
    assert_bits(flat, torch.cat([s.reshape(-1) for s in srcs]), "copy")
    outs = [torch.empty(2, 3), torch.empty(2, 2)]
    K.unpack(flat, outs)
    for o, s in zip(outs, srcs):
        assert_bits(o, s, "round trip")


def test_torch_ddp_rules_differ_at_w3():
    """fp32(1/W) multiply (torch's default path) vs divide by W (batched_grad_copy)."""
    x = values(FP32, 4096, seed=3)
    a, b = torch.empty(4096), torch.empty(4096)
    K.pack([x], a, scale=THIRD)
    K.pack([x], b, divide=3)
    assert_bits(a, x * THIRD, "multiply")
    assert_bits(b, x / 3, "divide")
    fin = a.isfinite()
    assert bool((a[fin] != b[fin]).any())


# --------------------------------------------------------------- errors
def test_error_messages():
    srcs = [torch.ones(4), torch.ones(5)]
    flat = torch.zeros(9)
    with pytest.raises(ValueError, match=r"either scale=0.5 or divide=2, not both"):
        K.pack(srcs, flat, scale=0.5, divide=2)
    with pytest.raises(ValueError, match="divide=0"):
        reference.unpack(flat, srcs, divide=0)
    with pytest.raises(ValueError, match=r"tensor 1 \(numel 5\) at offset 5 does not fit in the flat buffer of 9"):
        K.pack(srcs, flat, [0, 5])
    with pytest.raises(ValueError, match="2 tensors but 1 offsets"):
        reference.pack(srcs, flat, [0])
    with pytest.raises(ValueError, match="must be 1-D"):
        K.pack(srcs, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="must be 1-D"):
        reference.unpack(torch.zeros(3, 3), srcs)
    with pytest.raises(TypeError, match="tensor 0 has dtype torch.int32"):
        K.pack([torch.ones(3, dtype=torch.int32)], flat)
    with pytest.raises(TypeError, match="flat buffer dtype torch.int64"):
        K.unpack(torch.zeros(9, dtype=torch.int64), srcs)
    with pytest.raises(ValueError, match="tensor 1 is on meta"):
        K.pack([srcs[0], torch.empty(5, device="meta")], flat)
    with pytest.raises(ValueError, match="must be contiguous"):
        K.pack(srcs, torch.zeros(18)[::2])
    lay = Layout.for_tensors(srcs)
    with pytest.raises(ValueError, match="layout has 2 tensors, got 1"):
        K.pack(srcs[:1], flat, layout=lay)
    with pytest.raises(ValueError, match="offsets or layout, not both"):
        K.unpack(flat, srcs, [0, 4], layout=lay)


# --------------------------------------------------------------- Layout
def test_layout_offsets_total_and_views():
    lay = Layout([(2, 3), (4,), ()], offsets=[10, 0, 20])
    assert lay.numels == [6, 4, 1] and lay.total == 21
    flat = torch.arange(24.0)
    v = lay.views(flat)
    assert [tuple(t.shape) for t in v] == [(2, 3), (4,), ()]
    assert v[0].data_ptr() == flat[10:].data_ptr() and v[2].item() == 20.0
    assert lay.views(flat) is v  # cached per buffer
    with pytest.raises(ValueError, match=">= 21 elements"):
        lay.views(torch.zeros(20))
    with pytest.raises(ValueError, match="3 shapes but 2 offsets"):
        Layout([(1,), (2,), (3,)], offsets=[0, 1])
    assert Layout([(3,), (0,), (2,)]).offsets == [0, 3, 3]
    assert Layout([]).total == 0
    assert isinstance(lay.cache, dict)


def test_layout_view_cache_is_bounded():
    lay = Layout([(2,)])
    bufs = [torch.zeros(2) for _ in range(20)]
    for b in bufs:
        lay.views(b)
    assert len(lay._views) <= 8


def test_layout_passed_to_pack_and_unpack():
    srcs = [values(FP32, 5), values(FP32, 3)]
    lay = Layout.for_tensors(srcs, offsets=[4, 0])
    flat = torch.zeros(9, dtype=BF16)
    K.pack(srcs, flat, layout=lay, scale=THIRD)
    assert_bits(flat[4:9], (srcs[0] * THIRD).to(BF16), "at offset 4")
    assert_bits(flat[0:3], (srcs[1] * THIRD).to(BF16), "at offset 0")
    outs = [torch.zeros(5), torch.zeros(3)]
    K.unpack(flat, outs, layout=lay, accumulate=True)
    assert_bits(outs[1], torch.zeros(3) + flat[0:3].to(FP32), "unpack with layout")


# -------------------------------------------------------------- backend
@pytest.mark.skipif(INTERPRET, reason="the default session runs without TRITON_INTERPRET")
def test_cpu_backend_is_reference_without_the_interpreter():
    assert K.backend() == "reference" and K.backend("cpu") == "reference"
    K.reset_backend()
    assert K.backend(torch.device("cpu")) == "reference"
    K.reset_launch_count()
    K.pack([torch.ones(3)], torch.zeros(3), scale=0.5)
    K.unpack(torch.ones(3), [torch.zeros(3)])
    s = K.stats()
    assert s == {"launches": 0, "pack_calls": 1, "unpack_calls": 1, "reference_calls": 2,
                 "fallback_tensors": 0, "table_uploads": 0, "table_waits": 0}


def test_public_names_are_the_functions():
    """Importing the kernel submodules ``pack``/``unpack`` must not shadow the functions."""
    import fastddp.kernels._ops as ops

    assert K.pack is ops.pack and K.unpack is ops.unpack
    assert callable(K.pack) and callable(K.unpack)


# ------------------------------------------- the Triton source, compiled
def _compile_sm90(fn, **constexprs):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastddp.kernels import _triton_common as TC

    if TC.is_interpreted(fn):
        pytest.skip("kernels were decorated under TRITON_INTERPRET")
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            pytest.skip("triton has no nvidia backend here")
    except ImportError:
        pytest.skip("triton backends not importable")
    # parameters left out take their defaults (e.g. pack's HAS_RESIDUAL=False), as a launch does
    for prm in inspect.signature(fn.fn).parameters.values():
        if prm.default is not inspect.Parameter.empty:
            constexprs.setdefault(prm.name, prm.default)
    sig = {n: ("constexpr" if n in constexprs else "*i64") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                    attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": 4}).asm["ptx"]


def _vector_ops(ptx: str, op: str, bits: str = "32|64") -> int:
    return len(re.findall(rf"{op}\.global\.v\d\.b(?:{bits})", ptx))


def _scalar_ops(ptx: str, op: str) -> int:
    return len(re.findall(rf"{op}\.global\.b(?:8|16|32|64)\b", ptx))


def _n_vec(elsize: int, block: int = 2048, threads: int = 128) -> int:
    """16-byte vector accesses one thread makes for a full chunk of ``elsize``-byte elements."""
    return block // threads * elsize // 16


@pytest.mark.parametrize("op, src, dst, mode", [("pack", 0, 2, 1), ("unpack", 2, 0, 1), ("pack", 3, 1, 2),
                                                ("unpack", 1, 3, 1), ("pack", 0, 0, 1), ("unpack", 2, 2, 0)])
def test_kernels_compile_for_sm90_vectorised_without_fma(op, src, dst, mode):
    """No GPU needed: PTX for sm_90 from the very kernel source.  One kernel
    holds both paths, chosen per chunk at run time: a full chunk at 16-byte
    aligned addresses is read and written entirely with 16-byte vector
    accesses, any other chunk with masked scalar ones; no FMA contraction;
    no flush-to-zero."""
    from fastddp.kernels import _triton_common as TC
    from fastddp.kernels.pack_kernel import _pack_kernel
    from fastddp.kernels.unpack_kernel import _unpack_kernel

    fn = _pack_kernel if op == "pack" else _unpack_kernel
    raw = mode == 0 and src == dst  # a bit copy (the launcher never accumulates then)
    extra = {} if op == "pack" else {"ACC": not raw}
    kw = dict(SRC_T=TC.STORAGE[src], DST_T=TC.STORAGE[dst], C_T=TC.compute_type(src, dst), MODE=mode,
              RAW=raw, BLOCK=2048, **extra)
    ptx = _compile_sm90(fn, **kw)
    # the fast path: every element of a full chunk moves in 16-byte vectors
    n_ld = _n_vec(TC.ELSIZE[src]) + (_n_vec(TC.ELSIZE[dst]) if extra.get("ACC") else 0)  # ACC loads dst
    assert _vector_ops(ptx, "ld") == n_ld, (_vector_ops(ptx, "ld"), n_ld)
    assert _vector_ops(ptx, "st") == _n_vec(TC.ELSIZE[dst])
    # the masked path: scalar accesses, one per element a thread holds
    assert _scalar_ops(ptx, "ld") >= 16 and _scalar_ops(ptx, "st") == 16
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
    if mode == 2:
        assert re.search(r"div\.rn\.f(32|64)", ptx)


@pytest.mark.parametrize("src, dst, res, mode", [(0, 2, 0, 1), (0, 1, 0, 2), (2, 1, 0, 1), (1, 2, 0, 0),
                                                 (3, 2, 3, 1)])
def test_pack_with_residual_compiles_for_sm90_vectorised_without_fma(src, dst, res, mode):
    """The error-feedback variant of the pack kernel (HAS_RESIDUAL): the
    residual rides in the same launch, loaded and stored with 16-byte vector
    accesses on the fast path, in the residual's dtype, and ``x * s + r`` is a
    multiply and an add rounded separately (no FMA), like the reference."""
    from fastddp.kernels import _triton_common as TC
    from fastddp.kernels.pack_kernel import _pack_kernel

    c = {0: "f32", 3: "f64"}[res]
    kw = dict(SRC_T=TC.STORAGE[src], DST_T=TC.STORAGE[dst], C_T=TC.STORAGE[res], MODE=mode, RAW=False,
              BLOCK=2048, HAS_RESIDUAL=True)
    ptx = _compile_sm90(_pack_kernel, **kw)
    assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
    assert re.search(rf"\badd\.rn\.{c}\b", ptx) and re.search(rf"\bsub\.rn\.{c}\b", ptx)
    if mode == 1:
        assert re.search(rf"\bmul\.rn\.{c}\b", ptx)
    if mode == 2:
        assert re.search(rf"div\.rn\.{c}\b", ptx)
    # full chunks: the residual adds exactly its 16-byte vector loads and
    # stores (16 elements a thread at BLOCK=2048, 4 warps) to the plain kernel's
    ptx_plain = _compile_sm90(_pack_kernel, **{**kw, "HAS_RESIDUAL": False, "C_T": TC.compute_type(src, dst)})
    n_vec = _n_vec(TC.ELSIZE[res])
    for op in ("ld", "st"):
        n, n0 = _vector_ops(ptx, op), _vector_ops(ptx_plain, op)
        assert n == n0 + n_vec, (op, n, n0, n_vec)
    # and, on the masked path, its scalar ones
    assert _scalar_ops(ptx, "st") == _scalar_ops(ptx_plain, "st") + 16


@pytest.mark.parametrize("src, dst, res", [(0, 2, None), (0, 1, 0), (2, 1, 0), (3, 2, None), (1, 1, None),
                                           (0, 0, None)])
def test_health_flag_rides_in_the_same_pass_and_is_absent_without_it(src, dst, res):
    """HAS_HEALTH=False (the default) is the kernel without the option: no
    atomic, the very PTX of a launch that does not mention it.  HAS_HEALTH=True
    adds the flag's one atomic OR and no memory pass: the same 16-byte vector
    accesses and the same scalar stores."""
    from fastddp.kernels import _triton_common as TC
    from fastddp.kernels.pack_kernel import _pack_kernel

    kw = dict(SRC_T=TC.STORAGE[src], DST_T=TC.STORAGE[dst], MODE=1, RAW=False, BLOCK=2048,
              C_T=TC.compute_type(src, dst) if res is None else TC.STORAGE[res], HAS_RESIDUAL=res is not None)
    plain = _compile_sm90(_pack_kernel, **kw)
    assert _compile_sm90(_pack_kernel, HAS_HEALTH=False, **kw) == plain
    assert not re.search(r"\b(?:atom|red)\.", plain)
    flagged = _compile_sm90(_pack_kernel, HAS_HEALTH=True, **kw)
    assert len(re.findall(r"\b(?:atom|red)\.global\.[\w.]*or\.b32", flagged)) == 1, \
        re.findall(r"\b(?:atom|red)\.[\w.]+", flagged)
    for op in ("ld", "st"):
        assert _vector_ops(flagged, op) == _vector_ops(plain, op), op
    assert _scalar_ops(flagged, "st") == _scalar_ops(plain, "st")
    assert not re.search(r"\bfma\.", flagged) and ".ftz" not in flagged


# ------------------------------------------------- health flag (reference)
def _ref_flag(srcs, dst_dtype, residual=None, **kw):
    lay = Layout.for_tensors(srcs)
    flat = torch.zeros(lay.total, dtype=dst_dtype)
    flag = torch.zeros(1, dtype=torch.int32)
    K.pack(srcs, flat, layout=lay, residual=residual, health=flag, **kw)
    return int(flag), flat


def test_health_flag_is_the_contract_on_the_reference_path():
    """The contract in the reference's docstring, written as direct expressions."""
    H = K.Health
    assert _ref_flag([torch.ones(3), torch.tensor([2.0, 70000.0])], FP16)[0] == H.OVERFLOW
    assert _ref_flag([torch.ones(3), torch.tensor([2.0, 70000.0])], FP16, scale=THIRD)[0] == 0  # 70000/3 fits
    assert _ref_flag([torch.tensor([2.0, 60000.0])], FP16, scale=THIRD)[0] == 0
    assert _ref_flag([torch.tensor([float("nan"), 1.0])], BF16)[0] == H.SOURCE_NONFINITE
    assert _ref_flag([torch.tensor([float("inf"), 70000.0])], FP16)[0] == H.SOURCE_NONFINITE | H.OVERFLOW
    assert _ref_flag([torch.tensor([1e300], dtype=FP64)], FP32)[0] == H.OVERFLOW
    assert _ref_flag([torch.tensor([3e38])], FP32, scale=4.0)[0] == H.OVERFLOW  # the scaling overflowed
    r = torch.tensor([0.0, float("nan"), 0.0])
    flag, flat = _ref_flag([torch.tensor([1.0, 2.0, 3.0])], FP16, residual=r)
    assert flag == H.RESIDUAL_NONFINITE
    assert r.isfinite().all(), "the non-finite residual is stored as 0"
    assert _ref_flag([torch.ones(4)], FP16)[0] == 0 and K.stats()["reference_calls"] > 0


def test_error_feedback_zeroes_a_non_finite_residual():
    """``r = x - cast(x)``, 0 where not finite: an overflowed element (x finite,
    cast inf) and a NaN source leave r finite; finite elements keep the exact
    rounding error."""
    x = torch.tensor([1.0 + 2 ** -12, 70000.0, float("nan"), -1e5, 3.0])
    r = torch.zeros(5)
    wire = torch.empty(5, dtype=FP16)
    K.pack([x], wire, residual=r)
    want = x - x.to(FP16).to(FP32)
    want = torch.where(want.isfinite(), want, 0.0)
    assert_bits(r, want, "residual")
    assert r[0].item() == 2 ** -12 and r[1].item() == 0.0 and r[2].item() == 0.0


def test_first_nonfinite_names_the_tensor():
    ts = [torch.zeros(2), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")])]
    assert K.first_nonfinite(ts) == 1 and K.first_nonfinite(ts[:1]) is None


@pytest.mark.parametrize("src, dst", [(FP32, FP32), (FP32, BF16), (FP16, FP16), (BF16, FP32), (FP64, FP16),
                                      (FP32, FP64)])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_fast_torch_path_is_the_naive_contract(src, dst, scaling):
    """torch_path (foreach ops, the CPU path) against reference (one tensor at a
    time): pack with and without the whole-buffer shortcut and a health flag,
    and unpack store / accumulate, bit for bit; few-large tensors too."""
    from fastddp.kernels import torch_path

    kw = SCALINGS[scaling]
    for numels in ([1, 33, 257, 0, 7], [1 << 18, 1 << 18]):
        srcs = [values(src, n, seed=n) for n in numels]
        lay = Layout([(n,) for n in numels])
        fast, naive = torch.full((lay.total,), 7.0, dtype=dst), torch.full((lay.total,), 7.0, dtype=dst)
        hf, hn = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        torch_path.pack_views(srcs, lay.views(fast), flat=fast, health=hf, **kw)
        reference.pack_views(srcs, lay.views(naive), health=hn, **kw)
        assert_bits(fast, naive, f"pack {_name(src)}->{_name(dst)} {kw}")
        assert int(hf) == int(hn) != 0  # values() plants NaN/inf
        for acc in (False, True):
            outs = [values(src, n, seed=n + 1) for n in numels]
            want = [o.clone() for o in outs]
            torch_path.unpack_views(lay.views(fast), outs, accumulate=acc, **kw)
            reference.unpack_views(lay.views(fast), want, accumulate=acc, **kw)
            for o, w in zip(outs, want):
                assert_bits(o, w, f"unpack acc={acc}")
