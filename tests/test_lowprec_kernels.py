"""The shard sum of bf16 transport with fp32 accumulation
(``fastddp.kernels.reduce_shards``): the plain-torch CPU path and the Triton
kernel (interpreter session), bit for bit against the naive contract in
``kernels/reference.py``, and against a numpy oracle of the rule; edge
values, odd sizes, in place; the health bit; bad inputs; the launch budget
in the reducer's loop.

NaN positions must agree, not NaN payloads (torch's own vectorised and
scalar CPU casts produce different ones).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import reference, torch_path
from fastddp.kernels._switch import interpreter_requested
from tests._dist import STAND_IN, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model
from tests._compare import assert_bits

INTERPRET = interpreter_requested()
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
BF16 = torch.bfloat16
SIZES = [1, 2, 7, 255, 257, 16383, 16385, 70001]  # around BLOCK (16K interpreted) and the CPU chunk (64K)


def _values(n: int, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(10.0, torch.empty(n).uniform_(-42, 38, generator=g))  # subnormal .. near max
    x = (torch.randn(n, generator=g).sign() * mag).to(BF16)
    if specials and n > 8:
        x[:: 11] = 0.0
        x[3:: 13] = -0.0
        x[5:: 17] = 3.3895e38  # bf16's largest: pairs of these overflow
        x[6:: 19] = float("inf")
        x[7:: 23] = float("nan")
        x[8:: 29] = 9.2e-41  # subnormal
    return x


def _oracle(src: torch.Tensor, world: int) -> torch.Tensor:
    """numpy: widen to fp32, add in rank order in fp32, round once to bf16 (nearest even)."""
    n = src.numel() // world
    u = src.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16
    parts = u.view(np.float32).reshape(world, n)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = parts[0].copy()
        for k in range(1, world):
            acc = (acc + parts[k]).astype(np.float32)
    b = acc.view(np.uint32).astype(np.uint64)
    r = ((b + ((b >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    r = np.where(np.isnan(acc), np.uint16(0x7FC0), r)
    return torch.from_numpy(r.view(np.int16).copy()).view(BF16)


def _naive(src, world, health=None):
    out = torch.empty(src.numel() // world, dtype=BF16, device=src.device)
    return reference.reduce_shards(src, out, world, health)


# ---------------------------------------------- contract (default session)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_reference_is_the_rule(world):
    """The naive contract equals an independent numpy oracle of the rule."""
    for n in (1, 7, 300):
        src = _values(world * n, world * 1000 + n)
        assert_bits(_naive(src, world), _oracle(src, world), f"W={world} n={n}")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", SIZES)
def test_torch_path_matches_reference(world, n):
    src = _values(world * n, world * 7919 + n)
    h_ref, h = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    want = _naive(src, world, h_ref)
    out = torch.empty(n, dtype=BF16)
    torch_path.reduce_shards(src, out, world, h)
    assert_bits(out, want, f"W={world} n={n}")
    assert int(h) == int(h_ref)
    inplace = src.clone()
    torch_path.reduce_shards(inplace, inplace[:n], world)
    assert_bits(inplace[:n], want, "in place")


def test_health_bit_only_for_finite_inputs_that_overflow():
    big = torch.tensor([3.3895e38, 3.3895e38], dtype=BF16)  # two finite values, sum rounds to inf
    for fn in (reference.reduce_shards, torch_path.reduce_shards):
        h = torch.zeros(1, dtype=torch.int32)
        fn(big, torch.empty(1, dtype=BF16), 2, h)
        assert int(h) == int(K.Health.OVERFLOW)
        h.zero_()  # an inf input is the sender's SOURCE bit, not an overflow here
        fn(torch.tensor([float("inf"), 1.0], dtype=BF16), torch.empty(1, dtype=BF16), 2, h)
        assert int(h) == 0
        fn(torch.tensor([1.0, -2.0], dtype=BF16), torch.empty(1, dtype=BF16), 2, h)
        assert int(h) == 0


@pytest.mark.parametrize("case, exc, words", [
    (lambda: K.reduce_shards(torch.zeros(6, dtype=BF16), torch.zeros(2, dtype=BF16), world=2),
     ValueError, "2 slices"),
    (lambda: K.reduce_shards(torch.zeros(4, dtype=torch.float16), torch.zeros(2, dtype=torch.float16), world=2),
     TypeError, "bfloat16 or float32"),
    (lambda: K.reduce_shards(torch.zeros(4), torch.zeros(2, dtype=BF16), world=2), TypeError, "one dtype"),
    (lambda: K.reduce_shards(torch.zeros(4, dtype=BF16), torch.zeros(2, dtype=BF16), world=0),
     ValueError, "world"),
    (lambda: K.reduce_shards(torch.zeros(4, 1, dtype=BF16), torch.zeros(2, dtype=BF16), world=2),
     ValueError, "1-D"),
    (lambda: K.reduce_shards(torch.zeros(4, dtype=BF16), torch.zeros(2, dtype=BF16), world=2,
                             health=torch.zeros(1)), TypeError, "int32"),
])
def test_bad_inputs(case, exc, words):
    with pytest.raises(exc, match=words):
        case()


# ------------------------------------------------- the kernel (interpreter)
@pytest.mark.interpret
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", SIZES[:-1])
def test_kernel_matches_reference(world, n):
    assert K.backend(DEVICE) in ("interpret", "triton")
    src = _values(world * n, world * 104729 + n)
    h_ref = torch.zeros(1, dtype=torch.int32)
    want = _naive(src, world, h_ref)
    d_src = src.to(DEVICE)
    out = torch.empty(n, dtype=BF16, device=DEVICE)
    h = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.reset_launch_count()
    K.reduce_shards(d_src, out, world, health=h)
    assert K.launch_count() == 1
    assert_bits(out.cpu(), want, f"W={world} n={n}")
    assert int(h) == int(h_ref)
    d_src2 = d_src.clone()
    K.reduce_shards(d_src2, d_src2[:n], world)
    assert_bits(d_src2[:n].cpu(), want, "in place")


@pytest.mark.interpret
def test_kernel_at_hundreds_of_ranks():
    """257 slices (the loop over ranks is a runtime loop): the reference's bits."""
    world, n = 257, 300
    src = _values(world * n, 257)
    h_ref = torch.zeros(1, dtype=torch.int32)
    want = _naive(src, world, h_ref)
    d_src = src.to(DEVICE)
    h = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.reduce_shards(d_src, d_src[:n], world, health=h)
    assert_bits(d_src[:n].cpu(), want, f"W={world} n={n}")
    assert int(h) == int(h_ref)


@pytest.mark.interpret
def test_kernel_health_is_silent_on_finite_sums():
    src = _values(4 * 1000, 5, specials=False).to(DEVICE)
    h = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.reduce_shards(src, torch.empty(1000, dtype=BF16, device=DEVICE), 4, health=h)
    want = torch.zeros(1, dtype=torch.int32)
    reference.reduce_shards(src.cpu(), torch.empty(1000, dtype=BF16), 4, want)
    assert int(h) == int(want)


# ---------------------------------- the loop over ranks: one body, any world
def _shard_kernels():
    from fastddp.kernels import fp8_kernel, shard_kernel
    return {"bf16": shard_kernel._reduce_shards_kernel, "fp8": fp8_kernel._reduce_fp8_kernel}


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_world_is_a_runtime_argument(name):
    """The shard sums take the world size as a plain argument, not a
    constexpr (a constexpr world unrolled the loop once per rank and compiled
    a new binary per world size)."""
    import inspect

    fn = _shard_kernels()[name]
    fn = getattr(fn, "fn", fn)  # JITFunction or the interpreter's wrapper -> the Python function
    params = inspect.signature(fn).parameters
    assert "world" in params and "constexpr" not in str(params["world"].annotation), params
    assert "tl.static_range(" not in inspect.getsource(fn)


_SIGS = {
    "bf16": ({"src_ptr": "*i16", "out_ptr": "*i16", "flag_ptr": "*i32", "n": "i32", "world": "i32",
              "BLOCK": "constexpr", "HAS_HEALTH": "constexpr"}, {"BLOCK": 1024, "HAS_HEALTH": True}),
    "fp8": ({"src_q": "*u8", "src_s": "*fp32", "out_q": "*u8", "out_s": "*fp32", "flag_ptr": "*i32",
             "n": "i32", "n_blocks": "i32", "world": "i32", "B": "constexpr", "G": "constexpr",
             "HAS_HEALTH": "constexpr"}, {"B": 256, "G": 4, "HAS_HEALTH": True}),
}


@pytest.mark.skipif(INTERPRET, reason="compiles the kernels (default session)")
@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_shard_kernels_compile_for_sm90_with_a_runtime_world(name):
    """Compiled ahead of time for sm_90 (no GPU needed: triton's ptxas), with
    ``world`` an i32 argument: a loop in the IR, not one copy per rank, and
    small code (the unrolled bf16 sum was 255 KB of PTX at 64 ranks, 1 MB at 256)."""
    triton = pytest.importorskip("triton")
    from triton.compiler import ASTSource
    try:
        from triton.backends.compiler import GPUTarget
    except ImportError:
        pytest.skip("this triton has no GPUTarget")
    sig, consts = _SIGS[name]
    try:
        k = triton.compile(ASTSource(fn=_shard_kernels()[name], signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32))
    except (RuntimeError, FileNotFoundError, PermissionError) as e:
        if "ptxas" in str(e) or isinstance(e, (FileNotFoundError, PermissionError)):
            pytest.skip(f"no usable ptxas here: {e}")
        raise
    assert "scf.while" in k.asm["ttir"] or "scf.for" in k.asm["ttir"]
    assert len(k.asm["ptx"]) < 100_000, len(k.asm["ptx"])


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="CUDA: the compiled kernel's cache")
def test_one_binary_for_every_world_size():
    """On CUDA: world sizes 2, 3, 16 and 257 launch the same compiled shard sum."""
    from fastddp.kernels import shard_kernel

    kern = shard_kernel._reduce_shards_kernel
    n = 4096
    before = None
    for world in (2, 3, 16, 257):
        src = _values(world * n, world, specials=False).to(DEVICE)
        out = torch.empty(n, dtype=BF16, device=DEVICE)
        K.reduce_shards(src, out, world)
        assert_bits(out.cpu(), _naive(src.cpu(), world), f"W={world}")
        entries = sum(len(c) for c in kern.device_caches.values()) if hasattr(kern, "device_caches") \
            else len(kern.cache)
        before = entries if before is None else before
        assert entries == before, f"world {world} compiled a new binary"


# ----------------------------------------- launches per bucket (reducer loop)
def _launch_budget(rank, world, backend):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    assert K.backend("cpu") == backend
    m = F(make_model("deep"), bucket_cap_mb=0.001)
    m.register_comm_hook(fh.CompressionState(error_feedback=True), fh.bf16_fp32acc_hook)
    local = copy.deepcopy(m.module)
    out = []
    for step in range(3):
        m.zero_grad(set_to_none=True)
        x, y = make_batch("deep", rank, step)
        K.reset_launch_count()
        loss_fn(m(x), y).backward()
        s = K.stats()
        out.append((m.reducer.num_buckets, s["pack_calls"], s["unpack_calls"], s["launches"],
                    s["reference_calls"]))
    del local
    return out


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.interpret
def test_three_launches_per_bucket(world2):
    """Interpreter in the reducer's loop: pack, shard sum, unpack: one launch
    each per bucket, no call served by the plain-torch twin."""
    for per_rank in world2.run(_launch_budget, "interpret"):
        for nb, packs, unpacks, launches, ref_calls in per_rank:
            assert launches == 3 * nb and packs == nb and unpacks == nb and ref_calls == 0, \
                (nb, packs, unpacks, launches, ref_calls)
        assert per_rank[-1][0] > 1


# ------------------------------------------- the fp32 shard sum (inside a host)
def _values32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    if n > 8:
        x[3::13] = 3.0e38  # pairs overflow fp32
        x[6::19] = float("inf")
        x[7::23] = float("nan")
        x[8::29] = 1e-44  # subnormal
    return x


def _oracle32(src: torch.Tensor, world: int) -> torch.Tensor:
    parts = src.numpy().reshape(world, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = parts[0].copy()
        for k in range(1, world):
            acc = (acc + parts[k]).astype(np.float32)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_fp32_shard_sum_is_the_rule(world):
    """fp32 slices added in rank order, no rounding step: the reference and
    the CPU path equal a numpy oracle bit for bit, in place too; the health
    bit only where finite inputs overflow."""
    for n in (1, 7, 300, 70_001):
        src = _values32(world * n, world * 31 + n)
        want = _oracle32(src, world)
        for fn in (reference.reduce_shards, torch_path.reduce_shards):
            out = torch.empty(n)
            fn(src, out, world)
            assert_bits(out, want, f"{fn.__module__} W={world} n={n}")
            inplace = src.clone()
            fn(inplace, inplace[:n], world)
            assert_bits(inplace[:n], want, "in place")
    for fn in (reference.reduce_shards, torch_path.reduce_shards):
        h = torch.zeros(1, dtype=torch.int32)
        fn(torch.tensor([3.0e38, 3.0e38]), torch.empty(1), 2, h)
        assert int(h) == int(K.Health.OVERFLOW)
        h.zero_()
        fn(torch.tensor([float("inf"), 1.0]), torch.empty(1), 2, h)
        assert int(h) == 0


@pytest.mark.interpret
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp32_kernel_matches_reference(world):
    assert K.backend(DEVICE) in ("interpret", "triton")
    for n in (1, 300, 5000):
        src = _values32(world * n, world * 7 + n)
        h_ref = torch.zeros(1, dtype=torch.int32)
        want = torch.empty(n)
        reference.reduce_shards(src, want, world, h_ref)
        d_src = src.to(DEVICE)
        out = torch.empty(n, device=DEVICE)
        h = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        K.reset_launch_count()
        K.reduce_shards(d_src, out, world, health=h)
        assert K.launch_count() == 1
        assert_bits(out.cpu(), want, f"W={world} n={n}")
        assert int(h) == int(h_ref)
        K.reduce_shards(d_src, d_src[:n], world)
        assert_bits(d_src[:n].cpu(), want, "in place")
