"""Block-scaled fp8 (e4m3) gradients (``fastddp.hooks.fp8_compress_hook``).

* the rule (kernels/reference.py) against an independent numpy oracle:
  power-of-two scale, e4m3 round to nearest even by brute force over the
  format's 256 codes, at the edges (zeros, subnormals, amax at 448, inf/nan);
* the CPU path and the Triton kernels (interpreter session) bit for bit
  against the reference, error feedback and health included;
* the fused reduction on gloo ranks against the reference pipeline
  recomputed here from every rank's gradients (exempt 1-D params in fp32,
  error feedback across the bucket rebuild), bytes on the wire, check_finite,
  bad configurations.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fastddp.kernels as K
from fastddp.kernels import reference as R
from tests._dist import STAND_IN, world2, world3  # noqa: F401
from tests._models import loss_fn, make_batch, make_model

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
U8 = torch.uint8

# every finite non-negative e4m3 value, by code (0x00..0x7E)
_CODES = np.arange(0x7F)
_E, _M = _CODES >> 3, _CODES & 7
E4M3 = np.where(_E == 0, _M * 2.0 ** -9, (1 + _M / 8) * 2.0 ** (_E - 7))


def oracle_quantize(x: np.ndarray, block: int):
    """numpy/fp64: the documented rule, independently of torch's fp8 cast."""
    xb = x.astype(np.float32).reshape(-1, block)
    fin = np.isfinite(xb)
    amax = np.where(fin, np.abs(xb), 0).max(axis=1).astype(np.float64)
    k = np.zeros(len(amax), dtype=np.int64)
    for i, a in enumerate(amax):
        if a > 0:
            k[i] = max(int(np.ceil(np.log2(a / 448.0))), -126)
            while 2.0 ** (k[i] - 1) >= a / 448.0 and k[i] - 1 >= -126:  # smallest power of two
                k[i] -= 1
            while a / 2.0 ** k[i] > 448.0:
                k[i] += 1
    s = 2.0 ** k
    y = np.abs(xb.astype(np.float64)) / s[:, None]
    d = np.abs(y[..., None] - E4M3)  # [nb, block, 127]
    best = d.min(-1, keepdims=True)
    ties = d == best
    code = np.where(ties.sum(-1) > 1, np.argmax(ties & (_CODES % 2 == 0), -1), d.argmin(-1))
    sign = np.signbit(xb).astype(np.int64) << 7
    q = np.where(fin, code | sign, 0x7F | sign).astype(np.uint8)
    return q.reshape(-1), s.astype(np.float32)


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(10.0, torch.empty(n).uniform_(-44, 37, generator=g))
    return torch.randn(n, generator=g).sign() * mag


def _edge_blocks(block: int) -> torch.Tensor:
    """One block per edge case."""
    rows = [torch.zeros(block),                                     # all zeros (scale 1)
            torch.full((block,), -0.0),                             # negative zeros
            torch.linspace(-448.0, 448.0, block),                   # amax exactly 448: scale 1
            torch.linspace(-449.0, 1e-3, block),                    # amax just above: scale 2
            torch.full((block,), 1e-42) * torch.arange(block),      # fp32 subnormals: scale 2^-126
            torch.ones(block) * 2.0 ** -7 * torch.arange(block) / block,  # many e4m3 subnormals
            torch.tensor([float("inf"), float("-inf"), float("nan")] + [1.0] * (block - 3)),
            torch.tensor([3.0e38, -3.4e38] + [1e-30] * (block - 2))]  # near fp32's max
    # exact ties of e4m3 rounding: 1 + 1/16 (between 1 and 1.125) scaled to amax 448
    t = torch.full((block,), 1.0625)
    t[0] = 448.0 / 256.0 * 256.0
    rows.append(t)
    return torch.cat(rows)


BLOCKS = [16, 32, 256]


# ------------------------------------------------------------ the rule
@pytest.mark.parametrize("block", BLOCKS)
def test_reference_is_the_written_rule(block):
    x = torch.cat([_edge_blocks(block), _values(block * 6, block)])
    q, s = torch.empty(x.numel(), dtype=U8), torch.empty(x.numel() // block)
    R.quantize_fp8(x, q, s, block)
    want_q, want_s = oracle_quantize(x.numpy(), block)
    np.testing.assert_array_equal(s.numpy(), want_s)
    nan = (want_q & 0x7F) == 0x7F
    np.testing.assert_array_equal((q.numpy() & 0x7F) == 0x7F, nan)
    np.testing.assert_array_equal(q.numpy()[~nan], want_q[~nan])
    # dequantize is exact: code value * scale
    out = torch.empty(x.numel())
    R.dequantize_fp8(q, s, out, block)
    vals = np.where(want_q & 0x80, -1, 1) * E4M3[np.minimum(want_q & 0x7F, 0x7E)]
    exp = (vals * np.repeat(want_s.astype(np.float64), block))[~nan]
    np.testing.assert_array_equal(out.numpy()[~nan], exp.astype(np.float32))
    assert np.isnan(out.numpy()[nan]).all()


def test_error_feedback_residual_is_what_the_wire_lost():
    block = 32
    x, r = _values(block * 8, 1).clamp(-1e30, 1e30), _values(block * 8, 2).clamp(-1, 1)
    x[5] = float("nan")
    q, s, r1 = torch.empty(x.numel(), dtype=U8), torch.empty(8), r.clone()
    h = torch.zeros(1, dtype=torch.int32)
    R.quantize_fp8(x, q, s, block, r1, h)
    want_q, _ = oracle_quantize((x + r).numpy(), block)
    nan = (want_q & 0x7F) == 0x7F
    np.testing.assert_array_equal(q.numpy()[~nan], want_q[~nan])
    deq = torch.empty(x.numel())
    R.dequantize_fp8(q, s, deq, block)
    want_r = torch.where(torch.isfinite((x + r) - deq), (x + r) - deq, 0.0)
    assert torch.equal(r1, want_r)
    assert int(h) == int(K.Health.SOURCE_NONFINITE)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_is_dequantize_sum_requantize(world):
    block, n = 32, 32 * 5
    g = torch.Generator().manual_seed(world)
    sq = torch.randint(0, 256, (world * n,), dtype=U8, generator=g)
    ss = R.fp8_scales(torch.rand(world * n // block, generator=g) * 1e3)
    oq, os_ = torch.empty(n, dtype=U8), torch.empty(n // block)
    R.reduce_fp8_shards(sq, ss, oq, os_, world, block)
    parts = []
    for k in range(world):
        d = torch.empty(n)
        R.dequantize_fp8(sq[k * n:(k + 1) * n], ss[k * n // block:(k + 1) * n // block], d, block)
        parts.append(d.numpy())
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    want_q, want_s = oracle_quantize(acc, block)
    nan = (want_q & 0x7F) == 0x7F
    np.testing.assert_array_equal(oq.numpy()[~nan], want_q[~nan])
    np.testing.assert_array_equal(os_.numpy(), want_s)


@pytest.mark.parametrize("case, exc, words", [
    (lambda: K.quantize_fp8(torch.zeros(64), torch.zeros(64, dtype=U8), torch.zeros(1), 48), ValueError,
     "power of two"),
    (lambda: K.quantize_fp8(torch.zeros(60), torch.zeros(60, dtype=U8), torch.zeros(1), 32), ValueError,
     "whole number of blocks"),
    (lambda: K.quantize_fp8(torch.zeros(64), torch.zeros(64), torch.zeros(2), 32), TypeError, "uint8"),
    (lambda: K.quantize_fp8(torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=U8), torch.zeros(2), 32),
     TypeError, "float32"),
    (lambda: K.dequantize_fp8(torch.zeros(64, dtype=U8), torch.zeros(3), torch.zeros(64), 32), ValueError,
     "2 scales"),
    (lambda: K.reduce_fp8_shards(torch.zeros(64, dtype=U8), torch.zeros(2), torch.zeros(64, dtype=U8),
                                 torch.zeros(2), 2, 32), ValueError, "128"),
])
def test_bad_kernel_inputs(case, exc, words):
    with pytest.raises(exc, match=words):
        case()


def test_bad_states():
    import fastddp.hooks as fh
    from fastddp import reduction

    with pytest.raises(ValueError, match="power of two"):
        fh.FP8CompressionState(block_size=100)
    with pytest.raises(TypeError, match="exempt"):
        fh.FP8CompressionState(exempt=3)
    with pytest.raises(TypeError, match="fp8_compress_hook"):
        reduction.choose(fh.bf16_compress_hook, fh.FP8CompressionState(), False, True)
    with pytest.raises(TypeError, match="FP8CompressionState"):
        reduction.choose(fh.fp8_compress_hook, fh.CompressionState(), False, True)
    with pytest.raises(ValueError, match="process_group"):
        reduction.choose(fh.fp8_compress_hook, fh.FP8CompressionState(), False, False)
    with pytest.raises(RuntimeError, match="fused path"):
        fh.fp8_compress_hook(None, None)


# ------------------------------------------------------ kernels (interpreter)
@pytest.mark.interpret
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("with_res", [False, True])
def test_quantize_kernel_matches_reference(block, with_res):
    assert K.backend(DEVICE) in ("interpret", "triton")
    x = torch.cat([_edge_blocks(block), _values(block * 70, block)])  # > one program's tiles
    r = _values(x.numel(), 9).clamp(-1e3, 1e3) if with_res else None
    outs = []
    for dev, fn in (("cpu", R.quantize_fp8), (DEVICE, None)):
        q = torch.empty(x.numel(), dtype=U8, device=dev)
        s = torch.empty(x.numel() // block, device=dev)
        rr = r.clone().to(dev) if r is not None else None
        h = torch.zeros(1, dtype=torch.int32, device=dev)
        if fn is not None:
            fn(x, q, s, block, rr, h)
        else:
            K.reset_launch_count()
            K.quantize_fp8(x.to(dev), q, s, block, residual=rr, health=h)
            assert K.launch_count() == 1
        outs.append((q.cpu(), s.cpu(), None if rr is None else rr.cpu(), int(h)))
    (q1, s1, r1, h1), (q2, s2, r2, h2) = outs
    nan = (q1 & 0x7F) == 0x7F
    assert torch.equal(nan, (q2 & 0x7F) == 0x7F) and torch.equal(q1[~nan], q2[~nan])
    assert torch.equal(s1, s2) and h1 == h2
    if r1 is not None:
        assert torch.equal(r1, r2)
    d1, d2 = torch.empty(x.numel()), torch.empty(x.numel(), device=DEVICE)
    R.dequantize_fp8(q1, s1, d1, block)
    K.dequantize_fp8(q1.to(DEVICE), s1.to(DEVICE), d2, block)
    assert torch.equal(d1.nan_to_num(7.0), d2.cpu().nan_to_num(7.0))


@pytest.mark.interpret
@pytest.mark.parametrize("world", [1, 2, 3, 5, 257])  # 257: hundreds of ranks, a runtime loop
def test_reduce_kernel_matches_reference(world):
    block, n = 32, 32 * 40
    g = torch.Generator().manual_seed(world)
    sq = torch.randint(0, 256, (world * n,), dtype=U8, generator=g)
    ss = R.fp8_scales(torch.rand(world * n // block, generator=g) * 3e36)  # big: sums can overflow
    h1, h2 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    aq, as_ = torch.empty(n, dtype=U8), torch.empty(n // block)
    R.reduce_fp8_shards(sq, ss, aq, as_, world, block, h1)
    dq, ds = sq.clone().to(DEVICE), ss.clone().to(DEVICE)
    K.reduce_fp8_shards(dq, ds, dq[:n], ds[:n // block], world, block, health=h2)  # in place
    nan = (aq & 0x7F) == 0x7F
    bq = dq[:n].cpu()
    assert torch.equal(nan, (bq & 0x7F) == 0x7F) and torch.equal(aq[~nan], bq[~nan])
    assert torch.equal(as_, ds[:n // block].cpu()) and int(h1) == int(h2)


# ------------------------------------------------------ the fused reduction
def _candidates(m) -> list:
    """The fp8 modes of a wrapper: at two ranks both candidates of the
    two-rank choice (the two phases first), else the one mode."""
    mode = m.reducer.mode
    return list(mode.modes.values()) if hasattr(mode, "modes") else [mode]


def _pipeline(rank, world, opts, block=32, steps=3, exempt="default", chunked=False, costs=None):
    """Every grad equals the reference pipeline recomputed from all ranks'
    local gradients and the buckets' layout: non-exempt params quantized
    (residual per rank), dequantized, summed in fp32 in rank order,
    re-quantized; exempt (1-D) params as the fp32 sum of g * fp32(1/W).
    ``costs``: the two-rank choice's trial timed by a synthetic clock of
    ``costs[rank]``; returns (bad, chosen, trial steps, candidate per step)."""
    import fastddp
    import fastddp.hooks as fh

    local = make_model("deep")
    m = fastddp.DistributedDataParallel(copy.deepcopy(local), **opts)
    rule = {"default": None, "none": (), "weights": lambda p: p.dim() > 1}[exempt]
    m.register_comm_hook(fh.FP8CompressionState(block_size=block, exempt=rule), fh.fp8_compress_hook)
    if costs is not None:
        from tests.test_auto_precision import SyntheticClock

        m.reducer.mode.clock.synthetic = SyntheticClock(costs[rank])
    seen = []
    params = list(local.parameters())
    quant = [{"default": p.dim() > 1, "none": True, "weights": p.dim() <= 1}[exempt] for p in params]
    res = [[torch.zeros_like(p) for p in params] for _ in range(world)]  # every rank's residual
    bad = []
    for step in range(steps):
        m.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        x, y = make_batch("deep", rank, step)
        buckets = [(list(b.indices), list(b.layout.offsets), b.flat.numel()) for b in m.reducer.buckets]
        loss_fn(m(x), y).backward()
        seen.append(getattr(m.reducer.mode, "cur_name", None))
        loss_fn(local(x), y).backward()
        gs = []
        for p in params:
            parts = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(parts, p.grad)
            gs.append(parts)
        inv = 1.0 / world
        for idx, offs, n in buckets:
            shard = -(-n // (world * block)) * block
            total = world * shard
            deqs = []
            for k in range(world):
                stage = torch.zeros(total)
                rstage = torch.zeros(total)
                for i, o in zip(idx, offs):
                    if quant[i]:
                        stage[o:o + params[i].numel()] = (gs[i][k] * inv).reshape(-1)
                        rstage[o:o + params[i].numel()] = res[k][i].reshape(-1)
                q, s = torch.empty(total, dtype=U8), torch.empty(total // block)
                R.quantize_fp8(stage, q, s, block, rstage)
                for i, o in zip(idx, offs):
                    if quant[i]:
                        res[k][i] = rstage[o:o + params[i].numel()].reshape(params[i].shape).clone()
                deqs.append((q, s))
            out = torch.empty(total)
            for j in range(world):  # shard j: every rank's slice j, summed, re-quantized
                sq = torch.cat([deqs[k][0][j * shard:(j + 1) * shard] for k in range(world)])
                ss = torch.cat([deqs[k][1][j * shard // block:(j + 1) * shard // block] for k in range(world)])
                oq, os_ = torch.empty(shard, dtype=U8), torch.empty(shard // block)
                R.reduce_fp8_shards(sq, ss, oq, os_, world, block)
                R.dequantize_fp8(oq, os_, out[j * shard:(j + 1) * shard], block)
            for i, o in zip(idx, offs):
                p = list(m.parameters())[i]
                if quant[i]:
                    want = out[o:o + params[i].numel()].reshape(p.shape)
                else:
                    want = gs[i][0] * inv
                    for k in range(1, world):
                        want = want + gs[i][k] * inv
                if not torch.equal(p.grad, want):
                    bad.append((step, i, int((p.grad != want).sum())))
        for i, p in enumerate(m.parameters()):  # the module's residuals are the ones recomputed here
            r_mod = m.reducer.error_feedback_residual(i)
            want_r = res[rank][i] if quant[i] else torch.zeros_like(p)
            if not torch.equal(r_mod, want_r):
                bad.append((step, i, "residual"))
        local.load_state_dict(m.module.state_dict())
    if chunked:  # the phases did run in pieces
        if not any(c.engine.pieces(b.index) > 1 for c in _candidates(m) for b in m.reducer.buckets):
            bad.append("no bucket was chunked")
    if costs is None:
        return bad
    got = m.stats()["two_ranks"]
    return bad, got["chosen"], got["trial_steps"], seen


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("opts", [{}, {"bucket_cap_mb": 0.001}, {"gradient_as_bucket_view": True}],
                         ids=["default", "tiny", "view"])
def test_fused_matches_reference_pipeline(world2, opts):
    assert world2.run(_pipeline, opts) == [[], []]


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("exempt", ["none", "weights"])
def test_exemption_rules(world2, exempt):
    """exempt=() sends every param in fp8; a callable picks the fp32 ones."""
    assert world2.run(_pipeline, {"bucket_cap_mb": 0.001}, 32, 2, exempt) == [[], []]


def _bytes(rank, world):
    import fastddp
    import fastddp.hooks as fh

    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    m = fastddp.DistributedDataParallel(net)
    m.register_comm_hook(fh.FP8CompressionState(), fh.fp8_compress_hook)
    x = torch.randn(4, 256)
    m(x).sum().backward()
    fp32 = 4 * sum(p.numel() for p in net.parameters())
    return m.stats()["bytes_on_wire"] / fp32


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_bytes_on_the_wire(world2):
    for ratio in world2.run(_bytes):
        assert ratio <= 0.28, ratio


def _finite(rank, world):
    import fastddp
    import fastddp.hooks as fh

    m = fastddp.DistributedDataParallel(make_model("mlp"), check_finite="raise")
    m.register_comm_hook(fh.FP8CompressionState(block_size=16), fh.fp8_compress_hook)
    x, y = make_batch("mlp", rank, 0)
    loss_fn(m(x), y).backward()
    try:
        m.zero_grad(set_to_none=True)
        (loss_fn(m(x), y) * (float("inf") if rank == 1 else 1.0)).backward()
        raised = None
    except FloatingPointError as e:
        raised = str(e)
    m.zero_grad(set_to_none=True)
    loss_fn(m(x), y).backward()  # the next step works, with no stale residual
    # the step after the caught error ran; its residuals are finite (the
    # abandoned step's were dropped: the mechanism is shared with, and tested
    # exactly on, the bf16 path in tests/test_lowprec.py)
    ok = [bool(torch.isfinite(m.reducer.error_feedback_residual(i)).all())
          for i, p in enumerate(m.parameters())]
    return raised, all(ok)


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_check_finite(world2):
    for raised, ok in world2.run(_finite):
        assert raised is not None and "check_finite" in raised and ok


# ------------------------------------------------- launches per bucket (interpreter)
def _launches(rank, world):
    import fastddp
    import fastddp.hooks as fh

    m = fastddp.DistributedDataParallel(make_model("deep"), bucket_cap_mb=0.001)
    m.register_comm_hook(fh.FP8CompressionState(block_size=32), fh.fp8_compress_hook)
    out = []
    for step in range(2):
        m.zero_grad(set_to_none=True)
        x, y = make_batch("deep", rank, step)
        K.reset_launch_count()
        loss_fn(m(x), y).backward()
        buckets = m.reducer.buckets
        mixed = sum(1 for b in buckets if any(p.dim() <= 1 for p in b.params)
                    and any(p.dim() > 1 for p in b.params))
        only_ex = sum(1 for b in buckets if all(p.dim() <= 1 for p in b.params))
        st = K.stats()
        out.append((len(buckets), mixed, only_ex, K.launch_count(), st["reference_calls"], st["unpack_calls"]))
    return out


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.interpret
def test_launches_per_bucket(world2):
    """Through the stage: pack + quantize + shard sum + dequantize + unpack:
    5 launches per bucket, +2 where a bucket also holds exempt params (their
    pack and scatter); none served by the plain-torch twin."""
    for per_rank, _ in world2.run(_with_direct, None, _launches):  # (never into the grads)
        for nb, mixed, only_ex, launches, ref, _ in per_rank:
            assert ref == 0
            assert launches == 5 * nb + 2 * mixed + only_ex, (nb, mixed, only_ex, launches)


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.interpret
def test_no_unpack_of_the_stage_where_decoded_into_the_grads(world2):
    """Decoded into the grads: the only unpack left is the exempt values'
    (one per bucket holding any); none served by the plain-torch twin."""
    for per_rank, direct in world2.run(_with_direct, 0, _launches):
        assert direct > 0
        for nb, mixed, only_ex, launches, ref, unpacks in per_rank:
            assert ref == 0 and unpacks == mixed + only_ex, (nb, mixed, only_ex, unpacks)


# ------------------------------------------- the exempt slots, zeroed per bucket
def _zeroing_calls(rank, world, opts):
    """Per step, the zeroing calls each bucket's unpack makes: one
    ``torch._foreach_zero_`` over the exempt slots, no ``Tensor.zero_``."""
    import fastddp
    import fastddp.hooks as fh
    from fastddp.reduction import fp8 as fp8_mode

    m = fastddp.DistributedDataParallel(make_model("deep"), **opts)
    m.register_comm_hook(fh.FP8CompressionState(block_size=32), fh.fp8_compress_hook)
    calls, inside = {"zero_": 0, "_foreach_zero_": 0}, [False]
    real_zero, real_foreach, real_unpack = torch.Tensor.zero_, torch._foreach_zero_, fp8_mode.BlockFp8.unpack

    def zero_(self):
        calls["zero_"] += inside[0]
        return real_zero(self)

    def foreach_zero_(tensors):
        calls["_foreach_zero_"] += inside[0]
        return real_foreach(tensors)

    def unpack(self, *args, **kwargs):
        inside[0] = True
        try:
            return real_unpack(self, *args, **kwargs)
        finally:
            inside[0] = False

    out = []
    torch.Tensor.zero_, torch._foreach_zero_, fp8_mode.BlockFp8.unpack = zero_, foreach_zero_, unpack
    try:
        for step in range(2):
            m.zero_grad(set_to_none=True)
            x, y = make_batch("deep", rank, step)
            calls.update(zero_=0, _foreach_zero_=0)
            loss_fn(m(x), y).backward()
            exempt = [sum(1 for p in b.params if p.dim() <= 1) for b in m.reducer.buckets]
            out.append((dict(calls), sum(1 for e in exempt if e), max(exempt)))
    finally:
        torch.Tensor.zero_, torch._foreach_zero_, fp8_mode.BlockFp8.unpack = real_zero, real_foreach, real_unpack
    return out


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("opts", [{}, {"bucket_cap_mb": 0.001}], ids=["default", "tiny"])
def test_exempt_slots_zeroed_in_one_call_per_bucket(world2, opts):
    for per_rank, _ in world2.run(_with_direct, None, _zeroing_calls, opts):  # (through the stage)
        for calls, with_exempt, most in per_rank:
            assert calls == {"zero_": 0, "_foreach_zero_": with_exempt}, (calls, with_exempt)
        assert with_exempt >= 1 and (opts or most > 1), per_rank  # the default bucket has several


# ------------------------------------------------------- the CPU path
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("nblocks", [1, 7, 300, 1025])  # one chunk; past the 256K-element chunk at block 256
def test_cpu_path_matches_reference(block, with_res, nblocks):
    from fastddp.kernels import torch_path as T

    x = _values(block * nblocks, nblocks)
    if nblocks > 8:
        x = torch.cat([_edge_blocks(block), x])
    r = _values(x.numel(), 9).clamp(-1e3, 1e3) if with_res else None
    outs = []
    for fn in (R.quantize_fp8, T.quantize_fp8):
        q, s = torch.empty(x.numel(), dtype=U8), torch.empty(x.numel() // block)
        rr, h = (r.clone() if r is not None else None), torch.zeros(1, dtype=torch.int32)
        fn(x, q, s, block, rr, h)
        outs.append((q, s, rr, int(h)))
    (q1, s1, r1, h1), (q2, s2, r2, h2) = outs
    nan = (q1 & 0x7F) == 0x7F
    assert torch.equal(nan, (q2 & 0x7F) == 0x7F) and torch.equal(q1[~nan], q2[~nan])
    assert torch.equal(s1, s2) and h1 == h2
    if r1 is not None:
        assert torch.equal(r1, r2)
    d1, d2 = torch.empty(x.numel()), torch.empty(x.numel())
    R.dequantize_fp8(q1, s1, d1, block)
    T.dequantize_fp8(q1, s1, d2, block)
    assert torch.equal(d1.nan_to_num(7.0), d2.nan_to_num(7.0))


def test_cpu_decode_is_torchs_bit_for_bit():
    """The pair lookup returns torch's decode's exact bits for every pair of
    codes (NaN codes included), and falls back to torch where a pair would
    straddle the tensor (odd length, odd offset)."""
    from fastddp.kernels import torch_path as T

    every_pair = torch.arange(65536, dtype=torch.int32)
    q = torch.stack([every_pair & 0xFF, every_pair >> 8], 1).reshape(-1).to(U8)
    want = q.view(torch.float8_e4m3fn).to(torch.float32).view(torch.int32)
    assert torch.equal(T.decode_fp8(q).view(torch.int32), want)
    for part in (q[:7], q[1:9], q[3:]):  # odd length / odd offset
        assert torch.equal(T.decode_fp8(part).view(torch.int32),
                           part.view(torch.float8_e4m3fn).to(torch.float32).view(torch.int32))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [32 * 3, 32 * 8200])  # one chunk; two (256K-element chunks)
def test_cpu_reduce_matches_reference(world, n):
    from fastddp.kernels import torch_path as T

    block = 32
    g = torch.Generator().manual_seed(world + n)
    sq = torch.randint(0, 256, (world * n,), dtype=U8, generator=g)
    ss = R.fp8_scales(torch.rand(world * n // block, generator=g) * 3e36)
    h1, h2 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    aq, as_ = torch.empty(n, dtype=U8), torch.empty(n // block)
    R.reduce_fp8_shards(sq, ss, aq, as_, world, block, h1)
    bq_, bs_ = sq.clone(), ss.clone()
    T.reduce_fp8_shards(bq_, bs_, bq_[:n], bs_[:n // block], world, block, h2)  # in place
    nan = (aq & 0x7F) == 0x7F
    assert torch.equal(nan, (bq_[:n] & 0x7F) == 0x7F) and torch.equal(aq[~nan], bq_[:n][~nan])
    assert torch.equal(as_, bs_[:n // block]) and int(h1) == int(h2)


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("chunk_bytes", [32, 100])
def test_chunked_phases_match_reference_pipeline(world2, chunk_bytes):
    """fp8 shards cut into pieces of whole blocks (one block per piece at 32
    bytes, blocks of 32): every grad and residual still the reference pipeline's."""
    from tests.test_lowprec import _with_chunk_bytes

    assert world2.run(_with_chunk_bytes, chunk_bytes, _pipeline, {}, 32, 3, "default", True) == [[], []]


def _with_direct(rank, world, per_call, body, *args):
    """Run ``body`` with :data:`fp8direct.DIRECT_VALUES_PER_CALL` set to
    ``per_call`` in this worker (0: every fp8 bucket's sums are decoded
    straight into its grads; None: never, through the stage); returns
    ``(body's result, decodes into grads)``."""
    from fastddp.reduction import fp8direct

    D = fp8direct.DirectDecode
    old, real, worth = fp8direct.DIRECT_VALUES_PER_CALL, D.decode_into, D.worth
    seen = [0]

    def counted(self, q, s, lo, hi):
        seen[0] += 1
        return real(self, q, s, lo, hi)
    fp8direct.DIRECT_VALUES_PER_CALL, D.decode_into = per_call, counted
    if per_call is None:
        D.worth = lambda self, wire, geometry: False
    try:
        return body(rank, world, *args), seen[0]
    finally:
        fp8direct.DIRECT_VALUES_PER_CALL, D.decode_into, D.worth = old, real, worth


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("opts, chunk_bytes", [
    ({}, 0), ({"bucket_cap_mb": 0.001}, 0), ({}, 100), ({"gradient_as_bucket_view": True}, 0),
    ({"gradient_as_bucket_view": True}, 100)], ids=["default", "tiny", "chunked", "views", "views-chunked"])
def test_sums_decoded_into_the_grads_are_the_reference_pipelines(world2, opts, chunk_bytes):
    """The sums decoded straight into the grads (bucket views: into the flat
    bucket), slot by slot with the edges of slots that share a block
    (block 32, the deep model's odd sizes), piece by piece when chunked, by
    both two-rank candidates (the trial alternates them): every grad and
    residual the reference pipeline's, bit for bit."""
    from tests.test_lowprec import _with_chunk_bytes

    costs = [{"two-phase": 1.0, "all-gather": 0.5}, {"two-phase": 1.0, "all-gather": 0.9}]
    for (bad, chosen, trial, seen), direct in world2.run(
            _with_direct, 0, _with_chunk_bytes, chunk_bytes, _pipeline, opts, 32, 16, "default", chunk_bytes > 0,
            costs):
        assert bad == [] and direct > 0, (bad, direct)
        assert "two-phase" in seen and "all-gather" in seen, seen


def _replacing_grads(rank, world, body, *args):
    """Run ``body`` with every fp8 unpack preceded by what a hook could do
    after the pack: the bucket's first fp8 gradient replaced by zeros, its
    first exempt one dropped (None)."""
    from fastddp.reduction import fp8 as fp8_mode

    real = fp8_mode.BlockFp8.unpack

    def unpack(self, ctx, bucket, result, track_unused):
        d = self.engine.wires[bucket.index]
        if d.q8:
            p = bucket.params[d.q8[0]]
            p.grad = torch.zeros_like(p.grad)
        if d.ex:
            bucket.params[d.ex[0]].grad = None
        return real(self, ctx, bucket, result, track_unused)
    fp8_mode.BlockFp8.unpack = unpack
    try:
        return body(rank, world, *args)
    finally:
        fp8_mode.BlockFp8.unpack = real


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_grads_replaced_after_the_pack_get_the_sums_too(world2):
    """Decoded into the grads the pack saw: a ``.grad`` replaced (or
    dropped) before the unpack still ends with the reference's values."""
    for bad, direct in world2.run(_with_direct, 0, _replacing_grads, _pipeline, {}, 32, 3):
        assert bad == [] and direct > 0, (bad, direct)


def test_decoding_into_the_grads_is_taken_by_bytes_and_calls():
    """One slot per piece pays at once; slots of a few values in a chunked
    wire cost a launch each (plus their edges) and are left to the stage."""
    from fastddp.reduction.fp8direct import DIRECT_VALUES_PER_CALL
    from fastddp.reduction.fp8wire import Fp8Wire

    def worth(bounds, geometry):
        z, q = torch.zeros(0), torch.zeros(bounds[-1][1], dtype=U8)  # (a one-piece wire's range: all of q)
        w = Fp8Wire(world=1, block=32, shard=q.numel(), ex=[], q8=[], lay8=None, lay_ex=None, stage=z,
                    q=q, s=z, exbuf=z, ex_views=[], bounds=bounds, s_bounds=[], rq=z, rs=z, nbytes=0)
        return w.direct.worth(w, geometry)

    assert worth([(0, 64)], [(0, 64)])  # one launch for one: nothing extra
    n = DIRECT_VALUES_PER_CALL
    big = [(0, 4 * n), (4 * n, 8 * n)]  # two large slots, cut at a block boundary
    assert worth([(0, 8 * n)], big)  # one extra launch for 8n values
    small = [(o, 40) for o in range(0, 4000, 40)]  # 100 slots of 40 values, most edges inside blocks
    assert not worth([(0, 4000 // 32 * 32 + 32)], small)


def _calls_per_phase(rank, world, candidate="two-phase"):
    """One fp8 step with the buckets chunked, run by the two-rank choice's
    ``candidate``: the collective calls each phase issued, and what the
    buckets' chunking predicts for one call per chunk."""
    import fastddp
    import fastddp.groups as G
    import fastddp.hooks as fh

    m = fastddp.DistributedDataParallel(make_model("deep"), bucket_cap_mb=0.001)
    m.register_comm_hook(fh.FP8CompressionState(block_size=32), fh.fp8_compress_hook)
    m.reducer.mode.cur_name = m.reducer.mode.next_name = candidate  # step 0 runs it (the trial starts later)
    calls = {"a2a": 0, "ag": 0}
    a2a, ag = G.all_to_all_single, G.all_gather_into_tensor

    def count(kind, fn):
        def wrapped(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return wrapped
    G.all_to_all_single, G.all_gather_into_tensor = count("a2a", a2a), count("ag", ag)
    try:
        x, y = make_batch("deep", rank, 0)
        loss_fn(m(x), y).backward()
    finally:
        G.all_to_all_single, G.all_gather_into_tensor = a2a, ag
    pieces = [m.reducer.mode.candidate(candidate).engine.pieces(b.index) for b in m.reducer.buckets]
    chunked = sum(n for n in pieces if n > 1)
    single = sum(2 for n in pieces if n == 1)  # values and scales: two calls
    return calls, chunked, single


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_chunked_phases_send_values_and_scales_in_one_call(world2):
    """A chunked bucket's fp8 bytes and its scales travel in ONE call per
    chunk and phase (on gloo over TCP the scales' separate small call kept
    two chunks from ever being in flight together): the calls issued are one
    per chunk (two per one-piece bucket), and the grads are still the
    reference pipeline's (test_chunked_phases_match_reference_pipeline)."""
    from tests.test_lowprec import _with_chunk_bytes

    for calls, chunked, single in world2.run(_with_chunk_bytes, 100, _calls_per_phase):
        assert chunked > 0, "no bucket was chunked"
        assert calls == {"a2a": chunked + single, "ag": chunked + single}, (calls, chunked, single)


# ---------------------------------------- two ranks: the two phases or one all-gather
@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_the_all_gather_sends_one_call_per_piece_and_no_all_to_all(world2):
    """At two ranks the one-collective candidate all-gathers the whole fp8
    bucket: one call per piece (values and scales side by side; two for a
    one-piece bucket), no all-to-all, pieces cut from the whole bucket."""
    from tests.test_lowprec import _with_chunk_bytes

    for calls, chunked, single in world2.run(_with_chunk_bytes, 100, _calls_per_phase, "all-gather"):
        assert chunked > 0, "no bucket was chunked"
        assert calls == {"a2a": 0, "ag": chunked + single}, (calls, chunked, single)


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("chunk_bytes", [0, 100], ids=["whole", "chunked"])
def test_two_ranks_take_the_all_gather_where_measured_faster_same_bits(world2, chunk_bytes):
    """Every step's grads (the trial's, which alternates the two candidates,
    included) and every residual are the reference pipeline's bit for bit;
    the all-gather is taken where the trial measures it faster (rank 0
    clearly, rank 1 barely: the MAX over the ranks decides)."""
    from tests.test_lowprec import _with_chunk_bytes

    costs = [{"two-phase": 1.0, "all-gather": 0.5}, {"two-phase": 1.0, "all-gather": 0.9}]
    for bad, chosen, trial, seen in world2.run(_with_chunk_bytes, chunk_bytes, _pipeline, {"bucket_cap_mb": 0.001},
                                               32, 16, "default", chunk_bytes > 0, costs):
        assert bad == [] and chosen == "all-gather" and trial > 0, (bad, chosen, trial)
        assert seen[0] == "two-phase" and seen[-1] == "all-gather", seen


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_two_ranks_keep_the_two_phases_where_the_trial_cannot_tell(world2):
    costs = [{"two-phase": 1.0, "all-gather": 1.0}, {"two-phase": 1.0, "all-gather": 1.2}]
    for bad, chosen, trial, seen in world2.run(_pipeline, {}, 32, 16, "default", False, costs):
        assert bad == [] and chosen == "two-phase" and trial > 0, (bad, chosen, trial)
        assert "all-gather" in seen and seen[-1] == "two-phase", seen


def _fp8_modes(rank, world):
    """The fp8 hook's mode by world size, auto precision's fp8 candidate, and
    whether the all-gather shares the two phases' buffers."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F
    from fastddp import reduction

    m = F(make_model("mlp"))
    m.register_comm_hook(None, fh.fp8_compress_hook)
    x, y = make_batch("mlp", rank, 0)
    loss_fn(m(x), y).backward()
    shared = None
    if world == 2:
        mode, b = m.reducer.mode, m.reducer.buckets[0]
        two, one = mode.candidate("two-phase"), mode.candidate("all-gather")
        ctx = m.reducer.ctx
        a, g = two.shard_wire(ctx, b), one.shard_wire(ctx, b)
        shared = (g.stage is a.stage and g.q is a.q and g.s is a.s, mode.stats()["two_ranks"]["lowest"])
    auto = F(make_model("mlp"))
    auto.register_comm_hook(fh.AutoPrecisionState(lowest="fp8"), fh.auto_precision_hook)
    return (type(m.reducer.mode).__name__, shared,
            isinstance(auto.reducer.mode.candidate("fp8"), reduction.BlockFp8))


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_only_two_ranks_measure_one_all_gather(world2, world3):
    # at three ranks the all-gather sends (W - 1) / 2 times the two phases' bytes: no candidate
    assert world2.run(_fp8_modes) == [("AutoPrecision", (True, "fp8"), True)] * 2
    assert world3.run(_fp8_modes) == [("BlockFp8", None, True)] * 3


def test_a_cuda_bucket_waits_for_its_local_round(monkeypatch):
    """CUDA (no GPU needed: the streams and events are stand-ins): the
    all-gather's sum is a round with no collective, queued on the
    second-phase stream, so no Work orders it before the unpack; finish makes
    the waiting stream wait for an event recorded after the bucket's last
    round, one event per bucket, made once and reused every step."""
    import contextlib
    from types import SimpleNamespace

    from fastddp.reduction import twophase

    log = []

    class Event:
        def __init__(self):
            log.append("event made")

    class Work:
        def wait(self, timeout=None):
            log.append("collective waited")

    class LocalLastRound(twophase.ShardWire):
        world, bounds, nbytes = 2, [(0, 1)], 0

        def run(self, r, k, pg, health):
            log.append(f"round {r}")
            return [Work()] if r == 0 else []

        def zero(self):
            pass

    class Comm:
        cuda, pg = True, None
        stream = SimpleNamespace(wait_event=lambda e: log.append(("waited", e)))

        def phase2_context(self):
            log.append("phase-2 stream")
            return contextlib.nullcontext()

        def phase2_mark(self, event):
            log.append(("marked", event))

        def hook(self, step, nbytes):
            return step

    monkeypatch.setattr(torch.cuda, "Event", Event)
    engine, ctx = twophase.TwoPhaseEngine(eager=True), SimpleNamespace(iteration=0, comm=Comm())
    steps = []
    for it in range(2):
        ctx.iteration = it
        steps.append(engine.start(ctx, SimpleNamespace(index=0), LocalLastRound(), None))
        steps[-1].wait()
    (stream, ev), (stream1, ev1) = steps[0].queued, steps[1].queued
    assert ev1 is ev and isinstance(ev, Event), "one event per bucket, reused"
    assert stream is stream1 is Comm.stream, "waited for on the comm stream, where the unpack runs"
    rounds = ["round 0", "phase-2 stream", "collective waited", "round 1"]
    assert log == rounds + ["event made", ("marked", ev), ("waited", ev)] + rounds + [("marked", ev), ("waited", ev)], log


def _fp8_autocap(rank, world, caps):
    """Trains with the fp8 hook over ``caps`` ("default": nothing given;
    "fixed": a cap the user set; "off": the default caps and
    ``tune_buckets=False``), the two-rank choice timed by a synthetic clock;
    per step the candidate and the bucket tuner's state."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F
    from tests.test_auto_precision import SyntheticClock, _net, _train

    m = F(_net(), **({"bucket_cap_mb": 0.05} if caps == "fixed" else {}))
    m.register_comm_hook(fh.FP8CompressionState(tune_buckets=caps != "off"), fh.fp8_compress_hook)
    m.reducer.mode.clock.synthetic = SyntheticClock({"two-phase": 1.0, "all-gather": 0.6})
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    seen = []
    for k in range(60):
        _train(m, 1, rank + 2 * k, opt=opt)
        st = m.stats()
        seen.append((st["two_ranks"]["current"], st.get("autotune", {}).get("state")))
    st = m.stats()
    return seen, st["two_ranks"], st.get("autotune")


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
def test_default_caps_are_tuned_for_the_fp8_wire_after_the_two_rank_choice(world2):
    """torch's caps are sized for an fp32 all-reduce: with them the fp8 hook
    tunes the layout (as bucket_cap_mb="auto"), once its two-rank choice is
    made, every layout tried with the chosen candidate."""
    (s0, two0, tune0), (s1, two1, _) = world2.run(_fp8_autocap, "default")
    assert s0 == s1 and two0["decisions"] == two1["decisions"] and two0["chosen"] == "all-gather"
    assert tune0 is not None and tune0["state"] != "waiting", tune0
    started = next(k for k, (_, t) in enumerate(s0) if t != "waiting")  # step k is iteration k + 1
    assert started + 1 >= two0["settled_at_step"], "the bucket tuner tried layouts during the two-rank trial"
    assert {c for c, _ in s0[started:]} == {"all-gather"}, "a layout was tried with the other candidate"


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("caps", ["fixed", "off"])
def test_caps_the_user_set_or_tune_buckets_false_are_kept_by_fp8(world2, caps):
    (s0, two0, tune0), _ = world2.run(_fp8_autocap, caps)
    assert tune0 is None and two0["chosen"] == "all-gather" and {t for _, t in s0} == {None}


def test_one_rank_keeps_torchs_caps_for_fp8():
    """World 1: no wire to tune the buckets for, so no tuner (and no probe)."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F
    from tests._dist import single_rank_group

    with single_rank_group():
        m = F(make_model("mlp"))
        m.register_comm_hook(None, fh.fp8_compress_hook)
        assert not m.reducer.mode.tunes_buckets and "autotune" not in m.stats()
