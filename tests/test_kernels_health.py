"""The gradient health flag fused into the pack launch, and error feedback that
recovers from an overflowing step.

Interpreter session on CPU tensors (``TRITON_INTERPRET=1``); on a CUDA
machine without the interpreter the same tests run the compiled kernels.
Oracle: :func:`fastddp.kernels.reference.pack_views` with ``health=``.
"""

from __future__ import annotations

import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import Health, Layout, reference
from tests._compare import assert_bits

from .test_kernels import (BF16, BLOCK, DEVICE, DTYPES, FP16, FP32, FP64, SCALINGS, THIRD, _name,
                           grads, sentinel)

from .test_kernels import SPECIAL_VALUES  # noqa: E402 (the expected interpreter warnings)

pytestmark = [pytest.mark.interpret, SPECIAL_VALUES]

# tensor sizes: odd ones and one spanning two chunks (a full one and a tail)
NUMELS = [1, 7, 33, BLOCK + 1, 5]
PLANTS = ["clean", "nan", "inf", "big"]


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _planted(dtype: torch.dtype, plant: str, seed: int = 0) -> list[torch.Tensor]:
    """Finite gradients with one bad value at odd places: in tensor 2 at 31, and
    in the second chunk of tensor 3 (its last element)."""
    srcs = grads(dtype, NUMELS, seed=seed)
    big = {FP16: 65504.0, BF16: 3.3e38, FP32: 3.4e38, FP64: 1e300}[dtype]  # the dtype's largest-ish finite
    val = {"nan": float("nan"), "inf": float("-inf"), "big": big}.get(plant)
    if val is not None:
        srcs[2][31] = val
        srcs[3][-1] = val if plant != "big" else -big
    return srcs


def _check(srcs, dst_dtype, lay=None, residual=None, **scaling):
    """Public pack with a health flag vs the reference; dst, residual and flag bit-exact.
    Returns (flag value, launches of the call)."""
    lay = lay if lay is not None else Layout.for_tensors(srcs)
    got, want = sentinel(dst_dtype, lay.total), sentinel(dst_dtype, lay.total)
    f_got, f_want = _flag(), _flag()
    r_want = residual.clone() if residual is not None else None
    before = K.stats()
    K.pack(srcs, got, layout=lay, residual=residual, health=f_got, **scaling)
    after = K.stats()
    assert after["reference_calls"] == before["reference_calls"]
    reference.pack_views(srcs, lay.views(want), residuals=None if r_want is None else lay.views(r_want),
                         health=f_want, **scaling)
    assert_bits(got, want, f"dst {_name(dst_dtype)} {scaling}")
    if residual is not None:
        assert_bits(residual, r_want, "residual")
    assert int(f_got) == int(f_want), (Health(int(f_got)), Health(int(f_want)))
    return int(f_got), after["launches"] - before["launches"]


@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize("dst", DTYPES, ids=_name)
@pytest.mark.parametrize("src", DTYPES, ids=_name)
def test_flag_matches_the_reference_every_pair(src, dst, plant):
    srcs = _planted(src, plant)
    for name, scaling in SCALINGS.items():
        flag, launches = _check(srcs, dst, **scaling)
        assert launches == 1
        bad_src = plant in ("nan", "inf")
        assert bool(flag & Health.SOURCE_NONFINITE) == bad_src
        if plant == "clean":
            assert flag == 0
        if plant == "big" and name == "cast":  # independently: does the planted value fit dst?
            overflows = bool(srcs[2][31:32].cpu().to(dst).isinf())
            assert flag == (Health.OVERFLOW if overflows else 0), Health(flag)
        assert not flag & Health.RESIDUAL_NONFINITE


@pytest.mark.parametrize("dst", [FP16, BF16, FP32], ids=_name)
@pytest.mark.parametrize("src", [FP32, FP16, BF16], ids=_name)
def test_flag_with_a_residual(src, dst):
    """Planted source values and planted residual values, one launch a call."""
    lay = Layout([(n,) for n in NUMELS])
    for plant in PLANTS:
        for res_plant in ("clean", "nan", "inf"):
            r = (torch.randn(lay.total, generator=torch.Generator().manual_seed(3)) * 1e-3).to(DEVICE)
            if res_plant != "clean":
                r[lay.offsets[1] + 4] = float("nan") if res_plant == "nan" else float("inf")
            flag, launches = _check(_planted(src, plant, seed=1), dst, lay=lay, residual=r, scale=THIRD)
            assert launches == 1
            assert bool(flag & Health.RESIDUAL_NONFINITE) == (res_plant != "clean")
            assert bool(r.isfinite().all()), "a non-finite residual must not survive the step"


def test_cast_overflow_is_bit_1_and_only_for_finite_inputs():
    x = torch.tensor([1.0, 70000.0, -1e5, 2.0], device=DEVICE)
    flag, _ = _check([x], FP16)
    assert flag == Health.OVERFLOW
    flag, _ = _check([x], FP16, scale=THIRD)  # scaled before the cast: 70000/3 fits
    assert flag == (Health.OVERFLOW if 1e5 / 3 > 65519 else 0)
    flag, _ = _check([torch.tensor([float("inf"), 70000.0], device=DEVICE)], FP16)
    assert flag == Health.SOURCE_NONFINITE | Health.OVERFLOW
    flag, _ = _check([torch.tensor([float("inf"), 1.0], device=DEVICE)], FP16)
    assert flag == Health.SOURCE_NONFINITE  # inf in, inf out: not an overflow
    flag, _ = _check([torch.tensor([3.4e38, 1.0], device=DEVICE)], BF16)
    assert flag == Health.OVERFLOW
    flag, _ = _check([torch.tensor([3.4e38], dtype=FP64, device=DEVICE)], FP32)
    assert flag == 0
    flag, _ = _check([torch.tensor([1e300], dtype=FP64, device=DEVICE)], FP32)
    assert flag == Health.OVERFLOW


def test_flag_is_sticky_until_the_caller_zeroes_it():
    lay = Layout([(n,) for n in NUMELS])
    flag = _flag()
    wire = torch.empty(lay.total, dtype=FP16, device=DEVICE)
    K.pack(_planted(FP32, "nan"), wire, layout=lay, health=flag)
    K.pack(_planted(FP32, "clean"), wire, layout=lay, health=flag)
    assert int(flag) == Health.SOURCE_NONFINITE
    K.pack(_planted(FP32, "big"), wire, layout=lay, health=flag)
    assert int(flag) == Health.SOURCE_NONFINITE | Health.OVERFLOW
    flag.zero_()
    K.pack(_planted(FP32, "clean"), wire, layout=lay, health=flag)
    assert int(flag) == 0


def test_no_flag_is_the_old_behaviour_and_launch_count():
    """With and without the flag: the same bytes, the same launches; the flag
    costs no table rewrite in steady state (its address does not change)."""
    dts = [FP32, BF16, FP16, FP32]
    numels = [5, 9, BLOCK + 3, 40]
    srcs = [grads(dt, [n], seed=i)[0] for i, (dt, n) in enumerate(zip(dts, numels))]
    srcs[1][3] = float("nan")
    lay = Layout.for_tensors(srcs)
    a, b = sentinel(BF16, lay.total), sentinel(BF16, lay.total)
    flag = _flag()
    before = K.stats()
    K.pack(srcs, a, layout=lay, scale=THIRD)
    n_plain = K.stats()["launches"] - before["launches"]
    before = K.stats()
    K.pack(srcs, b, layout=lay, scale=THIRD, health=flag)
    assert K.stats()["launches"] - before["launches"] == n_plain == 3
    assert_bits(a, b, "with and without the flag")
    assert int(flag) == Health.SOURCE_NONFINITE
    before = K.stats()
    for _ in range(2):
        K.pack(srcs, b, layout=lay, scale=THIRD, health=flag)
    assert K.stats()["table_uploads"] == before["table_uploads"]


def test_fallback_tensors_report_into_the_same_flag():
    """A tensor copied with torch (not its slot's memory order) still sets the flag."""
    x = grads(FP32, [24], seed=2)[0].reshape(4, 6)
    x[1, 2] = float("inf")
    srcs = [grads(FP32, [5], seed=1)[0], x.t()]
    lay = Layout.for_tensors(srcs)
    before = K.stats()
    flag, launches = _check(srcs, FP16)
    assert launches == 1 and K.stats()["fallback_tensors"] - before["fallback_tensors"] == 1
    assert flag == Health.SOURCE_NONFINITE
    del lay


def test_error_feedback_recovers_from_an_overflowing_step():
    """Step 1 overflows the fp16 wire: the residual stays finite (0 where it
    would have been inf/NaN), and two clean steps later dst and residual are
    finite and equal the reference recurrence."""
    lay = Layout([(n,) for n in NUMELS])
    r_got = torch.zeros(lay.total, device=DEVICE)
    r_want = r_got.clone()
    for step in range(4):
        srcs = grads(FP32, NUMELS, seed=step)
        if step == 1:
            srcs[2][3] = 1e6      # fp16 overflow of a finite value
            srcs[3][-2] = float("nan")
        got, want = sentinel(FP16, lay.total), sentinel(FP16, lay.total)
        f_got, f_want = _flag(), _flag()
        K.pack(srcs, got, layout=lay, scale=0.5, residual=r_got, health=f_got)
        reference.pack_views(srcs, lay.views(want), scale=0.5, residuals=lay.views(r_want), health=f_want)
        assert_bits(got, want, f"step {step}: dst")
        assert_bits(r_got, r_want, f"step {step}: residual")
        assert int(f_got) == int(f_want)
        assert bool(r_got.isfinite().all()), f"step {step}: residual poisoned"
        if step == 1:
            assert int(f_got) == Health.SOURCE_NONFINITE | Health.OVERFLOW
            assert r_got[lay.offsets[2] + 3].item() == 0.0
        if step >= 2:
            assert int(f_got) == 0 and bool(got.isfinite().all()), f"step {step} did not recover"


def test_first_nonfinite():
    ts = [torch.zeros(3, device=DEVICE), torch.ones(2, 2, device=DEVICE), torch.zeros(5, device=DEVICE)]
    assert K.first_nonfinite(ts) is None and K.first_nonfinite([]) is None
    ts[2][4] = float("nan")
    assert K.first_nonfinite(ts) == 2
    ts[1][1, 0] = float("-inf")
    assert K.first_nonfinite(ts) == 1


def test_health_argument_checks():
    srcs = grads(FP32, [4, 5], seed=0)
    wire = torch.zeros(9, dtype=FP16, device=DEVICE)
    with pytest.raises(TypeError, match="1-element int32"):
        K.pack(srcs, wire, health=torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="1-element int32"):
        K.pack(srcs, wire, health=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="health is on meta"):
        K.pack(srcs, wire, health=torch.zeros(1, dtype=torch.int32, device="meta"))


# ------------------------------------------------------------- in place
@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize("scaling", ["divide", "cast", "scale"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_in_place_pack_divides_and_flags_in_one_launch(dtype, scaling, plant):
    """The flat bucket as its own source (how check_finite checks a bucket
    whose grads are already its views): one launch, the bits of torch's
    ``flat.div_(W)`` (or the contract's scale / plain copy), the flag of the
    values as they were read."""
    flat = torch.cat(_planted(dtype, plant, seed=3))
    lay = Layout([flat.shape])
    before = flat.clone()
    want = before.clone()
    f_want, f_got = _flag(), _flag()
    reference.pack_views([before], lay.views(want), health=f_want, **SCALINGS[scaling])
    if scaling == "divide":
        assert_bits(want, before.clone().div_(3), "reference vs torch's div_")
    n0 = K.launch_count()
    K.pack([flat], flat, layout=lay, health=f_got, **SCALINGS[scaling])
    assert K.launch_count() - n0 == 1
    assert_bits(flat, want, f"in place {_name(dtype)} {scaling}")
    assert int(f_got) == int(f_want), (Health(int(f_got)), Health(int(f_want)))
    assert bool(int(f_got) & Health.SOURCE_NONFINITE) == (plant in ("nan", "inf"))


def test_view_mode_check_finite_is_one_launch_per_bucket():
    """gradient_as_bucket_view with check_finite: a bucket whose grads are its
    views is divided and flagged by one in-place pack launch; no torch op
    runs over the flat bucket (an isfinite/any/or chain would cost ~9 more
    device ops and ~7 bytes of temporaries per element)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from fastddp import DistributedDataParallel as F
    from tests._dist import single_rank_group
    from tests._models import loss_fn, make_batch, make_model

    class FlatOps(TorchDispatchMode):
        def __init__(self, flats):
            super().__init__()
            self.flats = {f.data_ptr(): f.numel() for f in flats}
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":  # the bucket's collective
                return func(*args, **(kwargs or {}))
            for t in tree_leaves((args, kwargs or {})):
                if isinstance(t, torch.Tensor) and t.dim() == 1 and self.flats.get(t.data_ptr()) == t.numel():
                    self.ops.append(str(func))
                    break
            return func(*args, **(kwargs or {}))

    with single_rank_group():
        m = make_model("deep")
        ddp = F(m, gradient_as_bucket_view=True, check_finite="raise")
        for step in range(4):
            m.zero_grad(set_to_none=False)  # the grads stay bucket views
            x, y = make_batch("deep", 0, step)
            loss = loss_fn(ddp(x), y)
            if step < 3:
                loss.backward()
                continue
            buckets = ddp.reducer.buckets
            assert all(len(b.params) > 1 for b in buckets)  # a view's ops are not the flat bucket's
            mode = FlatOps([b.flat for b in buckets])
            n0 = K.launch_count()
            with mode:
                loss.backward()
            launches = K.launch_count() - n0
        assert mode.ops == [], mode.ops
        assert launches == len(buckets), (launches, len(buckets))
        assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("hook,view", [("fp16", False), ("fp16", True), ("fp8", False), ("fp8", True)])
def test_each_gradient_value_is_flagged_once_with_the_kernels(hook, view):
    """The compressed paths with the Triton kernels (not the CPU twin's
    branch): each value is read by one flagging launch."""
    from tests._dist import single_rank_group
    from tests.test_health import _flag_reads

    with single_rank_group():
        per_step, n = _flag_reads(hook, view)
    assert per_step[1:] == [n] * (len(per_step) - 1), (per_step, n)
