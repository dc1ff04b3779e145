"""Layouts own their pointer tables; strided and misaligned tensors stay in the
one launch.

Interpreter session (``TRITON_INTERPRET=1``) on CPU tensors; on a CUDA machine
without the interpreter the same tests run the compiled kernels (``DEVICE``),
and the ``gpu`` tests check what only a GPU has: no host-device sync and no
table copy in a steady-state step.
"""

from __future__ import annotations

import time

import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import Layout, reference
from fastddp.kernels import _triton_common as TC
from tests._compare import assert_bits

from .test_kernels import BF16, BLOCK, DEVICE, FP16, FP32, INTERPRET, THIRD, make, sentinel

from .test_kernels import SPECIAL_VALUES  # noqa: E402 (the expected interpreter warnings)

pytestmark = [pytest.mark.interpret, SPECIAL_VALUES]


def _delta(before: dict, key: str) -> int:
    return K.stats()[key] - before[key]


# ------------------------------------------------ 1a: tables per Layout
def test_equal_layouts_keep_their_own_tables():
    """Repeated layers: identically shaped buckets share the immutable chunk
    table but not the pointer table, so calls alternating between them
    rewrite nothing after each layout's first call."""
    numels = [33, 2, 70]
    lays = [Layout([(n,) for n in numels]) for _ in range(3)]
    srcs = [make(FP32, numels, seed=k) for k in range(3)]
    flats = [torch.zeros(sum(numels), dtype=BF16, device=DEVICE) for _ in range(3)]
    outs = [[torch.zeros(n, device=DEVICE) for n in numels] for _ in range(3)]
    before = K.stats()
    for step in range(3):
        for k in range(3):
            K.pack(srcs[k], flats[k], layout=lays[k], scale=THIRD)
            K.unpack(flats[k], outs[k], layout=lays[k], accumulate=True)
        if step == 0:
            assert _delta(before, "table_uploads") == 6  # each layout's pack and unpack table, once
    assert _delta(before, "table_uploads") == 6, K.stats()
    assert _delta(before, "launches") == 18 and _delta(before, "table_waits") == 0
    plans = {id(b.plan) for lay in lays for b in lay.cache.values()}
    tables = {id(b) for lay in lays for b in lay.cache.values()}
    assert len(plans) == 2 and len(tables) == 6, "chunk tables shared (pack, unpack), pointer tables not"
    for k in range(3):
        want = torch.zeros(sum(numels), dtype=BF16, device=DEVICE)
        reference.pack(srcs[k], want, scale=THIRD)
        assert_bits(flats[k], want, f"layout {k}")


def test_a_changed_pointer_or_scale_rewrites_that_table_only():
    numels = [5, 40]
    a, b = Layout([(n,) for n in numels]), Layout([(n,) for n in numels])
    sa, sb = make(FP32, numels, seed=1), make(FP32, numels, seed=2)
    fa, fb = (torch.zeros(45, dtype=FP16, device=DEVICE) for _ in range(2))
    K.pack(sa, fa, layout=a)
    K.pack(sb, fb, layout=b)
    before = K.stats()
    K.pack(sa, fa, layout=a)
    K.pack(sb, fb, layout=b)
    assert _delta(before, "table_uploads") == 0
    K.pack(sa, fa, layout=a, scale=0.5)  # the scale lives in the table
    assert _delta(before, "table_uploads") == 1
    sa2 = make(FP32, numels, seed=3)
    K.pack(sa2, fa, layout=a, scale=0.5)  # new tensors
    K.pack(sb, fb, layout=b)              # b untouched
    assert _delta(before, "table_uploads") == 2
    want = torch.zeros(45, dtype=FP16, device=DEVICE)
    reference.pack(sa2, want, scale=0.5)
    assert_bits(fa, want, "a after its changes")


def test_calls_without_a_layout_share_one_table_per_content():
    """The public API's per-call Layouts do not allocate a table each call."""
    srcs = make(FP32, [3, 4, 5])
    flat = torch.zeros(12, device=DEVICE)
    K.pack(srcs, flat)
    before = K.stats()
    for _ in range(3):
        K.pack(srcs, flat)
    assert _delta(before, "table_uploads") == 0


# ------------------------------------- 1b: strides, per-tensor degradation
def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last)


def _misaligned_like(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with x's strides, starting one element past a 16-byte boundary."""
    buf = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    y = buf.as_strided(x.shape, x.stride(), 1)
    y.copy_(x)
    assert y.data_ptr() % 16 != 0 and y.stride() == x.stride()
    return y


def _mix(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Contiguous, channels_last, transposed, misaligned (row-major and
    channels_last), one larger than BLOCK (full chunks: the vectorised path on
    a GPU) and one larger than BLOCK and misaligned."""
    gen_shapes = [(3, 5), (2, 3, 4, 5), (6, 7), (17,), (2, 3, 3, 3), (2 * BLOCK + 5,), (BLOCK + 3,), (1, 8, 1, 1)]
    flat = make(dtype, [torch.Size(s).numel() for s in gen_shapes], seed=seed)
    t = [f.reshape(s) for f, s in zip(flat, gen_shapes)]
    return [t[0], _channels_last(t[1]), t[2].t(), _misaligned_like(t[3]), _misaligned_like(_channels_last(t[4])),
            t[5], _misaligned_like(t[6]), _channels_last(t[7])]


def test_layout_strides_views_and_validation():
    x = _channels_last(torch.zeros(2, 3, 4, 5))
    lay = Layout.for_tensors([x, torch.zeros(3, 2).t(), torch.zeros(4)], keep_strides=True)
    assert lay.strides == [x.stride(), (1, 2), None]
    flat = torch.zeros(lay.total)
    v = lay.views(flat)
    assert v[0].stride() == x.stride() and v[0].data_ptr() == flat.data_ptr()
    assert v[1].stride() == (1, 2) and v[1].data_ptr() == flat[120:].data_ptr()
    assert v[2].is_contiguous() and v[2].data_ptr() == flat[126:].data_ptr()
    # strides equivalent to row-major (a 1x1 channels_last weight) are row-major
    assert Layout([(4, 8, 1, 1)], strides=[(8, 1, 8, 8)]).strides == [None]
    assert Layout.for_tensors([torch.zeros(6, 4)[:, ::2]], keep_strides=True).strides == [None]  # not dense
    with pytest.raises(ValueError, match="overlap or leave gaps"):
        Layout([(2, 3)], strides=[(1, 1)])
    with pytest.raises(ValueError, match="1 shapes but 2 strides"):
        Layout([(2, 3)], strides=[None, None])


@pytest.mark.parametrize("dst", [FP32, BF16, FP16], ids=str)
@pytest.mark.parametrize("scaling", [dict(scale=THIRD), dict(divide=3), dict()], ids=["scale", "divide", "cast"])
def test_strided_and_misaligned_mix_is_one_launch_each_way(dst, scaling):
    srcs = _mix(FP32)
    lay = Layout.for_tensors(srcs, keep_strides=True)
    got, want = sentinel(dst, lay.total), sentinel(dst, lay.total)
    before = K.stats()
    K.pack(srcs, got, layout=lay, **scaling)
    assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 0
    assert _delta(before, "reference_calls") == 0
    reference.pack_views(srcs, lay.views(want), **scaling)
    assert_bits(got, want, "pack of the mix")
    # independently: each slot holds its tensor in memory order
    c = reference.compute_dtype(FP32, dst)
    for i, mem in ((1, srcs[1].permute(0, 2, 3, 1)), (2, srcs[2].t())):  # channels_last, transposed
        o, n = lay.offsets[i], lay.numels[i]
        ref = reference._scaled(mem.reshape(-1).to(c), scaling.get("scale", 1.0), scaling.get("divide"))
        assert_bits(got[o:o + n], ref.to(dst), f"slot {i} in memory order")
    for acc in (False, True):
        outs = _mix(FP32, seed=5)
        wants = [o.clone() for o in outs]
        before = K.stats()
        K.unpack(got, outs, layout=lay, accumulate=acc, **scaling)
        assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 0
        reference.unpack_views(lay.views(got), wants, accumulate=acc, **scaling)
        for i, (g, w) in enumerate(zip(outs, wants)):
            assert_bits(g, w, f"unpack of the mix, tensor {i}, acc={acc}")


def test_strided_mix_with_a_residual():
    lay = Layout.for_tensors(_mix(FP32), keep_strides=True)
    r_got = (torch.randn(lay.total) * 1e-3).to(DEVICE)
    r_want = r_got.clone()
    for step in range(3):
        srcs = _mix(FP32, seed=step)
        got, want = sentinel(BF16, lay.total), sentinel(BF16, lay.total)
        before = K.stats()
        K.pack(srcs, got, layout=lay, scale=THIRD, residual=r_got)
        assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 0
        reference.pack_views(srcs, lay.views(want), scale=THIRD, residuals=lay.views(r_want))
        assert_bits(got, want, f"step {step}: dst")
        assert_bits(r_got, r_want, f"step {step}: residual")


def test_only_the_mismatched_tensors_are_copied_with_torch():
    """A slot laid out channels_last given a row-major tensor, a row-major slot
    given a transposed one and a non-dense slice: those three are copied with
    torch (the reference's arithmetic), the rest stays in the one launch."""
    model = _mix(FP32)
    lay = Layout.for_tensors(model, keep_strides=True)
    srcs = _mix(FP32, seed=7)
    srcs[1] = srcs[1].contiguous()                      # slot is channels_last
    srcs[0] = srcs[0].t().contiguous().t()              # slot is row-major
    big = make(FP32, [4 * 17], seed=9)[0]
    srcs[3] = big[::4]                                   # not dense
    for dst, scaling in ((BF16, dict(scale=THIRD)), (FP32, dict(divide=3))):
        got, want = sentinel(dst, lay.total), sentinel(dst, lay.total)
        before = K.stats()
        K.pack(srcs, got, layout=lay, **scaling)
        assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 3
        reference.pack_views(srcs, lay.views(want), **scaling)
        assert_bits(got, want, f"pack -> {dst}")
        outs = [s.clone() for s in srcs]
        outs[3] = big.clone()[::4]
        wants = [o.clone() for o in outs]
        before = K.stats()
        K.unpack(got, outs, layout=lay, accumulate=True, **scaling)
        assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 3
        reference.unpack_views(lay.views(got), wants, accumulate=True, **scaling)
        for i, (g, w) in enumerate(zip(outs, wants)):
            assert_bits(g, w, f"unpack tensor {i}")


def test_fallback_tensor_with_a_residual():
    model = _mix(FP32)
    lay = Layout.for_tensors(model, keep_strides=True)
    r_got = torch.zeros(lay.total, device=DEVICE)
    r_want = r_got.clone()
    for step in range(2):
        srcs = _mix(FP32, seed=step)
        srcs[1] = srcs[1].contiguous()
        got, want = sentinel(FP16, lay.total), sentinel(FP16, lay.total)
        before = K.stats()
        K.pack(srcs, got, layout=lay, scale=THIRD, residual=r_got)
        assert _delta(before, "launches") == 1 and _delta(before, "fallback_tensors") == 1
        reference.pack_views(srcs, lay.views(want), scale=THIRD, residuals=lay.views(r_want))
        assert_bits(got, want, "dst")
        assert_bits(r_got, r_want, "residual")


def test_memory_order_changes_at_the_same_address_are_seen():
    """Same storage, first as its slot's channels_last, then viewed row-major:
    the second call must not reuse the first call's memory-order decision."""
    x = _channels_last(make(FP32, [2 * 3 * 4 * 5])[0].reshape(2, 3, 4, 5))
    lay = Layout.for_tensors([x], keep_strides=True)
    flat = torch.zeros(lay.total, device=DEVICE)
    K.pack([x], flat, layout=lay)
    assert_bits(flat, x.permute(0, 2, 3, 1).reshape(-1), "memory order")
    y = x.permute(0, 2, 3, 1)  # same data_ptr, row-major strides, other shape
    assert y.data_ptr() == x.data_ptr() and y.is_contiguous()
    before = K.stats()
    K.pack([y], flat, layout=lay)
    assert _delta(before, "fallback_tensors") == 1
    want = torch.zeros_like(flat)
    reference.pack_views([y], lay.views(want))
    assert_bits(flat, want, "row-major view into a channels_last slot")


def _conv_stack() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, bias=False),
                            torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 1), torch.nn.Flatten(), torch.nn.LazyLinear(5))
    m(torch.zeros(1, 3, 9, 9))
    return m.to(DEVICE).to(memory_format=torch.channels_last)


def test_channels_last_conv_grads_are_one_pack_and_one_unpack_launch():
    """The reducer's case: a channels_last conv stack's gradients in one Layout
    built with torch's bucket-view rule (keep_strides)."""
    m = _conv_stack()
    params = list(m.parameters())
    assert any(not p.is_contiguous() for p in params)
    lay = Layout.for_tensors(params, keep_strides=True)
    x = torch.randn(4, 3, 9, 9, device=DEVICE).contiguous(memory_format=torch.channels_last)
    m(x).square().sum().backward()
    grads = [p.grad for p in params]
    assert all(g.stride() == p.stride() for g, p in zip(grads, params))
    wire = torch.empty(lay.total, dtype=BF16, device=DEVICE)
    want = torch.empty_like(wire)
    reference.pack_views(grads, lay.views(want), scale=THIRD)
    before = K.stats()
    K.pack(grads, wire, layout=lay, scale=THIRD)
    K.unpack(wire, grads, layout=lay)
    assert _delta(before, "launches") == 2 and _delta(before, "fallback_tensors") == 0
    assert_bits(wire, want, "conv grads")
    for g, v in zip(grads, lay.views(want)):
        assert_bits(g, v.to(FP32), "grads back from the wire")


# ------------------------------------------------------------ GPU only
def _count_event_syncs(monkeypatch) -> list:
    calls: list = []
    orig = torch.cuda.Event.synchronize

    def counting(self):
        calls.append(self)
        return orig(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting)
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_steady_state_copies_no_table_and_never_waits(monkeypatch):
    """Six identically shaped buckets (repeated layers), the same grads every
    step: behind a long GPU sleep the host queues every pack and unpack
    without one table copy or one wait (their host time stays far below the
    sleep)."""
    numels = [4097, 1, 300, 2 * BLOCK + 1]
    lays = [Layout([(n,) for n in numels]) for _ in range(6)]
    srcs = [make(FP32, numels, seed=k) for k in range(6)]
    flats = [torch.empty(sum(numels), dtype=BF16, device="cuda") for _ in range(6)]
    outs = [[torch.empty(n, device="cuda") for n in numels] for _ in range(6)]
    for _ in range(2):  # compile, build the tables
        for k in range(6):
            K.pack(srcs[k], flats[k], layout=lays[k], scale=THIRD)
            K.unpack(flats[k], outs[k], layout=lays[k])
    torch.cuda.synchronize()
    syncs = _count_event_syncs(monkeypatch)
    before = K.stats()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(100_000_000)
    t1.record()
    start = time.perf_counter()
    for _ in range(5):
        for k in range(6):
            K.pack(srcs[k], flats[k], layout=lays[k], scale=THIRD)
            K.unpack(flats[k], outs[k], layout=lays[k])
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    sleep_ms = t0.elapsed_time(t1)
    assert _delta(before, "table_uploads") == 0 and _delta(before, "table_waits") == 0 and not syncs
    assert _delta(before, "launches") == 60
    assert host_ms < sleep_ms / 2, (host_ms, sleep_ms)
    for k in range(6):
        want = torch.empty_like(flats[k])
        reference.pack(srcs[k], want, scale=THIRD)
        assert_bits(flats[k], want, f"layout {k}")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_new_addresses_wait_only_when_every_slot_is_in_flight(monkeypatch):
    numels = [4097, 3, 2 * BLOCK + 1]
    lay = Layout([(n,) for n in numels])
    # inputs made up front: a pageable host-to-device copy would itself wait for the sleep
    inputs = [(make(FP32, numels, seed=k), torch.empty(sum(numels), dtype=BF16, device="cuda"))
              for k in range(TC.MAX_SLOTS + 3)]
    it = iter(inputs)

    def call():
        srcs, flat = next(it)
        K.pack(srcs, flat, layout=lay, scale=THIRD)

    call()
    torch.cuda.synchronize()
    syncs = _count_event_syncs(monkeypatch)
    before = K.stats()
    torch.cuda._sleep(100_000_000)  # every launch below queues behind this
    for _ in range(TC.MAX_SLOTS):
        call()  # the first reuses the idle slot, the others take new ones (the ring doubles)
    assert _delta(before, "table_uploads") == TC.MAX_SLOTS and _delta(before, "table_waits") == 0 and not syncs
    call()  # every slot is behind the sleep: now, and only now, the host waits
    assert _delta(before, "table_waits") == 1 and len(syncs) >= 1
    torch.cuda.synchronize()
    n = len(syncs)
    call()  # slots idle again: no wait
    assert _delta(before, "table_waits") == 1 and len(syncs) == n
    torch.cuda.synchronize()
    for step, (srcs, flat) in enumerate(inputs[:TC.MAX_SLOTS + 3]):
        want = torch.empty_like(flat)
        reference.pack(srcs, want, scale=THIRD)
        assert_bits(flat, want, f"call {step}")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_table_in_use_on_another_stream_is_not_rewritten():
    """A slot read by a launch still queued on a side stream is not reused."""
    numels = [4097, 2 * BLOCK + 1]
    lay = Layout([(n,) for n in numels])
    side = torch.cuda.Stream()
    keep = []
    for step in range(12):
        srcs = make(FP32, numels, seed=step)
        flat = torch.empty(sum(numels), dtype=FP16, device="cuda")
        stream = side if step % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if step % 3 == 0:
                torch.cuda._sleep(5_000_000)
            K.pack(srcs, flat, layout=lay, scale=THIRD)
        torch.cuda.current_stream().wait_stream(side)
        keep.append((srcs, flat))
    torch.cuda.synchronize()
    for step, (srcs, flat) in enumerate(keep):
        want = torch.empty_like(flat)
        reference.pack(srcs, want, scale=THIRD)
        assert_bits(flat, want, f"step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="compiled kernels: run without TRITON_INTERPRET")
def test_gpu_unchanged_table_used_from_a_new_stream_waits_for_its_copy():
    """Stream A queues a table copy behind a sleep; stream B then makes the same
    call (nothing to rewrite) and must run after that copy, not with the
    slot's previous content (which points at F1)."""
    numels = [4097, 2 * BLOCK + 1]
    lay = Layout([(n,) for n in numels])
    x, y = make(FP32, numels, seed=1), make(FP32, numels, seed=2)
    f1, f2 = (torch.empty(sum(numels), device="cuda") for _ in range(2))
    K.pack(x, f1, layout=lay)
    torch.cuda.synchronize()
    f1.zero_()
    torch.cuda.synchronize()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        torch.cuda._sleep(100_000_000)
        K.pack(y, f2, layout=lay)
    with torch.cuda.stream(b):
        K.pack(y, f2, layout=lay)
    torch.cuda.synchronize()
    assert bool((f1 == 0).all()), "stream B ran with the stale table"
    want = torch.empty_like(f2)
    reference.pack(y, want)
    assert_bits(f2, want, "y")
