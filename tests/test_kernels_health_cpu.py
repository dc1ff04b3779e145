"""The CPU (plain-torch) pack's health bits equal the reference contract's,
for planted NaN / inf / cast overflow / non-finite residuals: its fast "is the
destination finite" test must never hide a bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from fastddp.kernels import reference, torch_path

CASES = ["clean", "nan", "inf", "neg_inf", "overflow", "res_nan", "huge_finite"]


def _inputs(case, dst_dtype, with_res):
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(n, generator=g) for n in (1, 17, 4099, 300)]
    res = [torch.zeros(s.numel()) for s in srcs] if with_res else None
    if case == "nan":
        srcs[2][77] = float("nan")
    elif case == "inf":
        srcs[1][16] = float("inf")
    elif case == "neg_inf":
        srcs[3][0] = float("-inf")
    elif case == "overflow":
        srcs[2][5] = 1e6  # finite, beyond fp16 after the scaling
    elif case == "res_nan" and with_res:
        res[0][0] = float("nan")
    elif case == "huge_finite":
        for s in srcs:
            s.fill_(3e38)  # a sum would overflow; min/max do not
    total = sum(s.numel() for s in srcs)
    return srcs, res, total


@pytest.mark.parametrize("case,dst_dtype,with_res", list(itertools.product(
    CASES, [torch.float32, torch.float16, torch.bfloat16], [False, True])))
def test_cpu_path_health_bits_equal_the_reference(case, dst_dtype, with_res):
    out = {}
    for name, impl in (("reference", reference.pack_views), ("torch_path", torch_path.pack_views)):
        srcs, res, total = _inputs(case, dst_dtype, with_res)
        flat = torch.empty(total, dtype=dst_dtype)
        views, o = [], 0
        for s in srcs:
            views.append(flat.narrow(0, o, s.numel()))
            o += s.numel()
        health = torch.zeros(1, dtype=torch.int32)
        kwargs = {"flat": flat} if name == "torch_path" else {}
        impl(srcs, views, 0.5, None, res, health=health, **kwargs)
        out[name] = (int(health.item()), flat.clone())
    assert out["torch_path"][0] == out["reference"][0], (case, out["reference"][0], out["torch_path"][0])
    assert torch.equal(out["torch_path"][1].float().nan_to_num(), out["reference"][1].float().nan_to_num())
    if case == "clean":
        assert out["reference"][0] == 0


@pytest.mark.parametrize("case", ["clean", "nan", "inf", "overflow"])
@pytest.mark.parametrize("scaling", [{"divide": 3}, {"scale": 4.0}, {}])
def test_cpu_path_in_place_pack_bits(case, scaling):
    """The flat bucket as its own source: the bits describe the values as they
    were read, before the pack overwrote them (an in-place overflow is
    OVERFLOW, not SOURCE_NONFINITE)."""
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(4099, generator=g)
    if case == "nan":
        flat[77] = float("nan")
    elif case == "inf":
        flat[4098] = float("-inf")
    elif case == "overflow":
        flat[5] = 3e38  # finite; times 4 it is not
    out = {}
    for name, impl in (("reference", reference.pack_views), ("torch_path", torch_path.pack_views)):
        t = flat.clone()
        health = torch.zeros(1, dtype=torch.int32)
        kwargs = {"flat": t} if name == "torch_path" else {}
        impl([t], [t], health=health, **scaling, **kwargs)
        out[name] = (int(health), t)
    assert out["torch_path"][0] == out["reference"][0], (case, scaling, out["reference"][0], out["torch_path"][0])
    assert torch.equal(out["torch_path"][1].nan_to_num(), out["reference"][1].nan_to_num())
    assert out["reference"][0] == {"clean": 0, "nan": 1, "inf": 1,
                                   "overflow": 2 if scaling.get("scale") == 4.0 else 0}[case]
