"""The native fp8 CPU loops (kernels/_fp8_native.py, kernels/csrc/fp8_cpu.cpp):
bit for bit the contract of kernels/reference.py, non-finite blocks handed
back to the torch path, and their switch, FASTDDP_FP8_NATIVE, apart from the
readiness hooks' FASTDDP_NATIVE.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from fastddp.kernels._native_build import switch

OFF = switch("FASTDDP_FP8_NATIVE") == "off"


@contextlib.contextmanager
def _env(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fp8_mod():
    from fastddp.kernels import _fp8_native
    mod = _fp8_native.module()
    assert mod is not None, ("the native fp8 loops did not build here (a C++ compiler and torch's "
                             "headers are needed); FASTDDP_FP8_NATIVE=0 runs without them")
    assert hasattr(mod, "fp8_quantize")
    return mod



def _boundary_blocks(block: int) -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours and the
    fp32 values either side of it (both signs, zeros, fp32 subnormals), in
    blocks that each hold 448 (scale 1): every rounding decision of the cast."""
    from fastddp.kernels import reference as R
    vals = R._fp8_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    fin = vals[torch.isfinite(vals)].unique()
    mids = (fin[1:] + fin[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    c = torch.cat([fin, -fin, mids, -mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   -torch.nextafter(mids, up), -torch.nextafter(mids, down),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0 ** -127, 2.0 ** -10, 3 * 2.0 ** -11])])
    c = c[c.abs() <= 448]
    c = torch.cat([c, torch.zeros((-c.numel()) % (block - 1))]).view(-1, block - 1)
    return torch.cat([c, torch.full((c.shape[0], 1), 448.0)], 1).reshape(-1).contiguous()


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
@pytest.mark.parametrize("block", [32, 256])
def test_fp8_native_is_the_contract_bit_for_bit(block):
    """The native loops against kernels/reference.py: every rounding boundary
    of the e4m3 cast, random blocks over 60 decades, with error feedback, the
    shard sum at W = 2, 3, 4 and the decode."""
    from fastddp.kernels import reference as R
    mod = _fp8_mod()
    g = torch.Generator().manual_seed(3)
    xs = [_boundary_blocks(block)]
    for mag in (1e-30, 1e-6, 1.0, 1e6, 1e30):
        x = torch.randn(block * 64, generator=g) * mag
        x[::7] *= 1e-7  # subnormal e4m3 codes in every block
        xs.append(x)
    for x in xs:
        for with_res in (False, True):
            n = x.numel()
            r = (torch.randn(n, generator=g) * x.abs().max() * 1e-3) if with_res else None
            q1, s1 = torch.empty(n, dtype=torch.uint8), torch.empty(n // block)
            q2, s2 = q1.clone(), s1.clone()
            r1, r2 = (r.clone(), r.clone()) if with_res else (None, None)
            assert mod.fp8_quantize(x, r1, q1, s1, block) == n // block
            R.quantize_fp8(x, q2, s2, block, r2)
            assert torch.equal(q1, q2) and torch.equal(s1, s2)
            if with_res:
                assert torch.equal(r1.view(torch.int32), r2.view(torch.int32))
            d1, d2 = torch.empty(n), torch.empty(n)
            mod.fp8_dequantize(q1, s1, d1, block)
            R.dequantize_fp8(q2, s2, d2, block)
            assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
    for world in (2, 3, 4):
        n = block * 32
        parts = [_quantized(block, n, g) for _ in range(world)]
        sq, ss = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        o1q, o1s = torch.empty(n, dtype=torch.uint8), torch.empty(n // block)
        o2q, o2s = o1q.clone(), o1s.clone()
        assert mod.fp8_reduce_shards(sq, ss, o1q, o1s, world, block) == n // block
        R.reduce_fp8_shards(sq, ss, o2q, o2s, world, block)
        assert torch.equal(o1q, o2q) and torch.equal(o1s, o2s), world


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
def test_fp8_native_scale_rule_at_every_exponent():
    """The block scale from the max's bits (no frexp): one block per fp32
    exponent (subnormals included) and per mantissa either side of the rule's
    edge (m = 0.875, amax = 1.75 * 2^x) and at its ends, both signs, with
    smaller values beside it and error feedback: scales, codes and residual
    equal the reference's (the clamp at 2^-126 and the 0.875 edge are where a
    rule read from the bits could differ)."""
    from fastddp.kernels import reference as R
    mod = _fp8_mod()
    block = 32
    bits = []
    for e in range(0, 255):
        for m in (0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF):
            if e or m:
                bits.append((e << 23) | m)
    amax = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(amax.numel(), block, generator=g) * 2 - 1) * amax[:, None]
    x[:, 3] = amax
    x[1::2, 7] = -amax[1::2]  # the max's sign: negative in every other block
    x = x.reshape(-1).contiguous()
    n = x.numel()
    top = (amax.view(torch.int32) >> 23 < 254).repeat_interleave(block)  # x + residual stays finite
    for res in (None, torch.where(top, torch.randn(n, generator=g) * x.abs() * 1e-3, 0.0)):
        q1, s1, r1 = torch.empty(n, dtype=torch.uint8), torch.empty(n // block), None if res is None else res.clone()
        q2, s2, r2 = q1.clone(), s1.clone(), None if res is None else res.clone()
        assert mod.fp8_quantize(x, r1, q1, s1, block) == n // block
        R.quantize_fp8(x, q2, s2, block, r2)
        assert torch.equal(s1, s2) and torch.equal(q1, q2)
        if res is not None:
            assert torch.equal(r1.view(torch.int32), r2.view(torch.int32))
    z = torch.zeros(block)  # an all-zero block: scale 1
    qz, sz = torch.empty(block, dtype=torch.uint8), torch.empty(1)
    mod.fp8_quantize(z, None, qz, sz, block)
    assert sz.item() == 1.0 and not qz.any()


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
def test_fp8_native_decodes_every_code():
    """All 256 codes (subnormals, both zeros, both NaN codes) decoded from
    their bits, times scales from the smallest to large, in the decode and
    in the shard sum's inputs: bit for bit the reference's (NaN bits too)."""
    from fastddp.kernels import reference as R
    mod = _fp8_mod()
    block = 256
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4)
    s = torch.tensor([1.0, 2.0 ** -126, 2.0 ** 100, 0.5])
    d1, d2 = torch.empty(q.numel()), torch.empty(q.numel())
    mod.fp8_dequantize(q, s, d1, block)
    R.dequantize_fp8(q, s, d2, block)
    assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
    fin = q.view(-1, block)[:, :].clone()
    fin[(fin & 0x7F) == 0x7F] = 0  # the shard sum of finite codes: every code but NaN on each side
    o1q, o1s = torch.empty(block * 2, dtype=torch.uint8), torch.empty(2)
    o2q, o2s = o1q.clone(), o1s.clone()
    sq, ss = fin.reshape(-1).contiguous(), torch.tensor([1.0, 2.0 ** -20, 0.5, 2.0 ** -126])
    assert mod.fp8_reduce_shards(sq, ss, o1q, o1s, 2, block) == 2
    R.reduce_fp8_shards(sq, ss, o2q, o2s, 2, block)
    assert torch.equal(o1q, o2q) and torch.equal(o1s, o2s)


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
@pytest.mark.parametrize("flush", [False, True], ids=["subnormals", "flush_denormal"])
def test_fp8_native_scales_either_side_of_the_fold(flush):
    """The loops fold a block's scale into the decode's one multiply where
    s < 2^8 (csrc: fp8_decode_times, fp8_round_folded) and keep the plain rule
    above it, and where the thread reads fp32 subnormals as 0
    (torch.set_flush_denormal(True): the fold builds subnormal codes as fp32
    subnormals): all 256 codes times every power-of-two scale, 2^-126 to
    2^127, in the decode; the shard sum at W = 2 of blocks at every scale
    (sums that need scales either side of 2^8); the quantize of blocks whose
    max spans every exponent, with error feedback; against the reference run
    under the same flag, bit for bit (NaN bits too)."""
    from fastddp.kernels import reference as R
    mod = _fp8_mod()
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        block = 256
        scales = torch.tensor([2.0 ** e for e in range(-126, 128)])
        q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(scales.numel())
        d1, d2 = torch.empty(q.numel()), torch.empty(q.numel())
        mod.fp8_dequantize(q, scales, d1, block)
        R.dequantize_fp8(q, scales, d2, block)
        assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
        fin = q.clone()
        fin[(fin & 0x7F) == 0x7F] = 0x7E
        half = fin.numel() // 2  # W = 2: slice 0 at scales 2^-126..2^0, slice 1 at 2^-9..2^117
        o1q, o1s = torch.empty(half, dtype=torch.uint8), torch.empty(half // block)
        o2q, o2s = o1q.clone(), o1s.clone()
        s_in = torch.cat([scales[:half // block], scales[half // block:] * 2.0 ** -10])
        n1 = mod.fp8_reduce_shards(fin, s_in, o1q, o1s, 2, block)
        R.reduce_fp8_shards(fin, s_in, o2q, o2s, 2, block)
        assert torch.equal(o1q[:n1 * block], o2q[:n1 * block]) and torch.equal(o1s[:n1], o2s[:n1])
        assert n1 == half // block  # every sum finite: the native pass did all of it
        g = torch.Generator().manual_seed(11)
        x = (torch.randn(scales.numel(), block, generator=g) * scales[:, None] * 100).reshape(-1)
        x = torch.where(x.isfinite(), x, 0.0).contiguous()
        x[::5] *= 2.0 ** -12  # subnormal codes in every block
        for res in (None, x * 1e-3):
            q1, s1, r1 = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(scales.numel()), None
            q2, s2, r2 = q1.clone(), s1.clone(), None
            if res is not None:
                r1, r2 = res.clone(), res.clone()
            assert mod.fp8_quantize(x, r1, q1, s1, block) == scales.numel()
            R.quantize_fp8(x, q2, s2, block, r2)
            assert torch.equal(q1, q2) and torch.equal(s1, s2)
            if res is not None:
                assert torch.equal(r1.view(torch.int32), r2.view(torch.int32))
    finally:
        torch.set_flush_denormal(False)


def _gather_case(g, block, nonfinite: str | None):
    """Parts of random sizes at random gaps (slots not aligned to blocks),
    magnitudes over 40 decades;
    ``nonfinite``: a NaN in a part ("part"), an inf in the residual
    ("residual"), or none."""
    sizes = [int(v) for v in torch.randint(1, 3 * block, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)]
    offs, o = [], 0
    for z in sizes:
        o += int(torch.randint(0, block // 3, (1,), generator=g))
        offs.append(o)
        o += z
    n = -(-(o + 1) // block) * block
    parts = [torch.randn(z, generator=g) * 10.0 ** float(torch.randint(-20, 20, (1,), generator=g)) for z in sizes]
    res = torch.randn(n, generator=g) * 1e-3
    if nonfinite == "part":
        parts[len(parts) // 2][parts[len(parts) // 2].numel() // 2] = float("nan")
    if nonfinite == "residual":
        res[offs[-1]] = float("inf")
    return parts, offs, n, res


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("nonfinite", [None, "part", "residual"])
def test_quantize_gather_is_the_pack_then_the_quantize(native, nonfinite):
    """kernels.quantize_fp8_gather (the fp8 mode's deferred pack read straight
    into the quantize) against kernels.pack then kernels.quantize_fp8: the
    same codes, scales, residual and health bits, with and without the
    native loops, with a NaN in a part or an inf in the residual (the native
    pass stops at that block, the two calls do the rest), scale 1/2 and 1/3."""
    from fastddp import kernels
    with _env(FASTDDP_FP8_NATIVE=native):
        if native == "1" and OFF:
            pytest.skip("FASTDDP_FP8_NATIVE=0")
        g = torch.Generator().manual_seed(11)
        for trial in range(12):
            block = (32, 256)[trial % 2]
            parts, offs, n, res0 = _gather_case(g, block, nonfinite)
            scale = (0.5, 1 / 3)[trial % 2]
            for res in (None, res0):
                got, want = [], []
                x0 = torch.randn(n, generator=g)  # what lies between the parts is read from x
                for out, fused in ((got, True), (want, False)):
                    x = x0.clone()
                    q, s = torch.empty(n, dtype=torch.uint8), torch.empty(n // block)
                    r = None if res is None else res.clone()
                    h = torch.zeros(1, dtype=torch.int32)
                    if fused:
                        kernels.quantize_fp8_gather(parts, offs, scale, x, q, s, block, residual=r, health=h)
                    else:
                        kernels.pack(parts, x, offs, scale=scale)
                        kernels.quantize_fp8(x, q, s, block, residual=r, health=h)
                    out += [q, s.view(torch.int32), h] + ([] if r is None else [r.view(torch.int32)])
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (trial, res is None)
                if nonfinite == "part" or (nonfinite == "residual" and res is not None):
                    assert got[2].item() != 0  # the health bit came through the fallback


def test_quantize_gather_refuses_bad_parts():
    from fastddp import kernels
    x, q, s = torch.zeros(64), torch.empty(64, dtype=torch.uint8), torch.empty(2)
    with pytest.raises(ValueError, match="2 parts but 1 offsets"):
        kernels.quantize_fp8_gather([torch.ones(3), torch.ones(3)], [0], 0.5, x, q, s, 32)


def _quantized(block, n, g):
    from fastddp.kernels import reference as R
    x = torch.randn(n, generator=g) * 10
    q, s = torch.empty(n, dtype=torch.uint8), torch.empty(n // block)
    R.quantize_fp8(x, q, s, block)
    return q, s


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
def test_fp8_nonfinite_blocks_go_to_the_contract():
    """A NaN in block 5: the native pass stops there untouched, the torch path
    does block 5 on (NaN code, health bit): the whole equals the reference."""
    from fastddp.kernels import reference as R, torch_path as TP
    mod = _fp8_mod()
    B, n = 64, 64 * 12
    x = torch.randn(n)
    x[B * 5 + 3] = float("nan")
    x[B * 9] = float("inf")
    r0 = torch.randn(n) * 1e-3
    q, s = torch.zeros(n, dtype=torch.uint8), torch.zeros(n // B)
    assert mod.fp8_quantize(x, r0.clone(), q, s, B) == 5
    out = []
    for fn in (TP.quantize_fp8, R.quantize_fp8):
        q, s, r, h = torch.empty(n, dtype=torch.uint8), torch.empty(n // B), r0.clone(), torch.zeros(1, dtype=torch.int32)
        fn(x, q, s, B, r, h)
        out.append((q, s, r, h))
    (q1, s1, r1, h1), (q2, s2, r2, h2) = out
    assert torch.equal(q1, q2) and torch.equal(s1, s2) and torch.equal(h1, h2) and int(h1) != 0
    assert torch.equal(r1.view(torch.int32), r2.view(torch.int32))
    # an overflowing shard sum: the native pass hands the block over unwritten
    q, s = torch.full((2 * B,), 0x7E, dtype=torch.uint8), torch.full((2,), 2.0 ** 119)  # 448 * 2^119, finite; twice: inf
    oq, os_ = torch.zeros(B, dtype=torch.uint8), torch.zeros(1)
    assert mod.fp8_reduce_shards(q, s, oq, os_, 2, B) == 0
    h1, h2 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a = (torch.empty(B, dtype=torch.uint8), torch.empty(1))
    b = (torch.empty(B, dtype=torch.uint8), torch.empty(1))
    TP.reduce_fp8_shards(q, s, *a, 2, B, h1)
    R.reduce_fp8_shards(q, s, *b, 2, B, h2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(h1, h2) and int(h1) != 0


class _Recorder:
    """Stands in for the compiled loops: records each call, then runs the
    real one (or refuses, when the path must not be reached)."""

    def __init__(self, real, refuse=False):
        self.real, self.refuse, self.calls = real, refuse, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if self.refuse:
                raise AssertionError(f"{name}: the native fp8 loops were called while switched off")
            return getattr(self.real, name)(*args)
        return call


def _round_trip_equals_the_contract():
    from fastddp.kernels import reference as R, torch_path as TP
    B, n = 32, 32 * 40
    x, r0 = torch.randn(n) * 3, torch.randn(n) * 1e-3
    out = []
    for fn, dq in ((TP.quantize_fp8, TP.dequantize_fp8), (R.quantize_fp8, R.dequantize_fp8)):
        q, s, r = torch.empty(n, dtype=torch.uint8), torch.empty(n // B), r0.clone()
        fn(x, q, s, B, r)
        d = torch.empty(n)
        dq(q, s, d, B)
        out.append((q, s, r, d))
    (q1, s1, r1, d1), (q2, s2, r2, d2) = out
    assert torch.equal(q1, q2) and torch.equal(s1, s2)
    assert torch.equal(r1.view(torch.int32), r2.view(torch.int32)) and torch.equal(d1.view(torch.int32), d2.view(torch.int32))


@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
def test_the_readiness_switch_leaves_the_fp8_path_alone(monkeypatch):
    """FASTDDP_NATIVE=0 (Python readiness hooks) still runs the native fp8
    loops: the kernel path is not the reducer's switch."""
    from fastddp.kernels import _fp8_native
    rec = _Recorder(_fp8_mod())
    monkeypatch.setattr(_fp8_native.EXTENSION, "_module", rec)
    with _env(FASTDDP_NATIVE="0", FASTDDP_FP8_NATIVE=None):
        assert _fp8_native.module() is rec
        _round_trip_equals_the_contract()
    assert rec.calls == ["fp8_quantize", "fp8_dequantize"]  # torch_path's two calls; the reference has none


def test_fp8_switch_off_keeps_to_the_torch_ops(monkeypatch):
    """FASTDDP_FP8_NATIVE=0: no build, no native call, the same bits (the
    torch ops), whatever FASTDDP_NATIVE says."""
    from fastddp.kernels import _fp8_native

    def no_build():
        raise AssertionError("built while FASTDDP_FP8_NATIVE=0")
    monkeypatch.setattr(_fp8_native.EXTENSION, "_module", _Recorder(None, refuse=True))
    monkeypatch.setattr(_fp8_native.EXTENSION, "_load", no_build)
    for readiness in ("1", "0"):
        with _env(FASTDDP_FP8_NATIVE="0", FASTDDP_NATIVE=readiness):
            assert _fp8_native.module() is None and not _fp8_native.enabled()
            _round_trip_equals_the_contract()


def test_fp8_failed_build_warns_once_and_require_raises(monkeypatch):
    from fastddp.kernels import _fp8_native, torch_path as TP
    ext = _fp8_native.EXTENSION
    builds = []

    def fail():
        builds.append(1)
        raise RuntimeError("c++: command not found")
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_failed", None)
    monkeypatch.setattr(ext, "_load", fail)
    with _env(FASTDDP_FP8_NATIVE=None):
        with pytest.warns(RuntimeWarning, match="native fp8 CPU loops could not be built .*command not found"
                                                ".*torch ops.*FASTDDP_FP8_NATIVE=0"):
            _round_trip_equals_the_contract()
        assert TP._native_fp8(torch.zeros(4)) is None and builds == [1]  # tried once per process
    with _env(FASTDDP_FP8_NATIVE="require"), pytest.raises(RuntimeError, match="could not be built"):
        _fp8_native.module()



@pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")
def test_choosing_the_fp8_mode_builds_its_cpu_loops(monkeypatch):
    """The fp8 mode's one-time build (or cache load) happens when the mode is
    chosen (register_comm_hook), not in the first training step; a CUDA
    device, a backend other than the plain-torch one, or the switch off asks
    for nothing."""
    from fastddp import hooks, kernels, reduction
    from fastddp.kernels import _fp8_native

    real, loads = _fp8_mod(), []
    monkeypatch.setattr(_fp8_native.EXTENSION, "_module", None)
    monkeypatch.setattr(_fp8_native.EXTENSION, "_load", lambda: loads.append(1) or real)

    def choose(device):
        reduction.choose(hooks.fp8_compress_hook, hooks.FP8CompressionState(), False, True, torch.device(device))
    with _env(FASTDDP_FP8_NATIVE="0"):
        choose("cpu")
    choose("cuda")
    assert loads == []
    choose("cpu")
    assert loads == ([1] if kernels.backend("cpu") == "reference" else [])
