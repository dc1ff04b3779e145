"""Element offsets past 2^31 in every Triton kernel, bit for bit against
``kernels/reference.py``.

``tl.program_id`` and ``tl.arange`` are int32, and so is an integer kernel
argument below 2^31: a slice's start ``k * n`` in the shard sums wrapped
once ``(world - 1) * n >= 2^31`` (a bucket of just over 2 G elements, at any
world size), giving wrong sums and no error.  The cases sit at those boundaries: the first size that
wrapped, an odd size (a partial last program), a world whose last slice
alone wraps, the size just below (a control), and a slice or tensor of more
than 2^31 elements (a program's own offset past 2^31).

Cheaply, under the interpreter: the buffers are ``torch.empty`` of several
GB that are never filled (fresh pages cost no memory until written), only
the first and the last program of each launch run (:class:`_Programs`,
each with its real ``tl.program_id``), and only their windows of the
buffers are written and compared.  A shard buffer sits 2^31 elements into
its allocation, so that a wrapped (negative) offset reads zeros there and
the old kernels fail by value, not by a crash.  Each test asserts the
process grew by less than :data:`_RSS_LIMIT`.  On CUDA the same tests run
every program over buffers of the same sizes (up to about 20 GB of device
memory at once; skipped where the GPU has less free).
"""

from __future__ import annotations

import os

import pytest
import torch

import fastddp.kernels as K
from fastddp.kernels import _triton_common as C
from fastddp.kernels import reference as R
from tests.test_kernels import assert_bits

pytestmark = pytest.mark.interpret

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
BF16, U8 = torch.bfloat16, torch.uint8
BLOCK = C.BLOCK_INTERPRET  # the windows below are the interpreted programs' (on CUDA: just ranges)
GUARD = 2 ** 31  # elements before a shard buffer: where a wrapped slice offset lands
_RSS_LIMIT = 1 << 30


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(autouse=True)
def _cheap():
    """The test wrote only its windows: the process grew by less than 1 GiB."""
    before = _rss()
    yield
    if DEVICE.type == "cpu":
        grown = _rss() - before
        assert grown < _RSS_LIMIT, f"the test grew the process by {grown / 2**20:.0f} MiB"


def _untouched(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements that read as zeros; on CPU never written, so they cost
    no memory (a multi-GB ``torch.empty`` is a fresh mapping)."""
    if DEVICE.type == "cuda":
        need = n * torch.empty(0, dtype=dtype).element_size()
        if torch.cuda.mem_get_info(DEVICE)[0] < need + (1 << 30):
            pytest.skip(f"needs {need / 2**30:.1f} GiB more of free GPU memory")
        return torch.zeros(n, dtype=dtype, device=DEVICE)
    return torch.empty(n, dtype=dtype)


def _same_fp8(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """e4m3 bits equal, NaN (0x7F / 0xFF) compared as NaN."""
    a, e = actual.cpu(), expected.cpu()
    an, en = (a & 0x7F) == 0x7F, (e & 0x7F) == 0x7F
    bad = (an != en) | (~an & ~en & (a != e))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} fp8 codes differ; "
                             f"first [{i}]: got 0x{int(a[i]):02x} want 0x{int(e[i]):02x}")


def _after_guard(n: int, dtype: torch.dtype) -> torch.Tensor:
    return _untouched(GUARD + n, dtype)[GUARD:]


class _Programs:
    """Stands in for an interpreted kernel: each launch runs only its first and
    last programs, each as a one-program launch whose ``tl.program_id(0)``
    reads as its index in the real grid."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.ran: list[tuple[int, int]] = []  # (grid size, program) per program run

    def __getitem__(self, grid):
        (n_programs,) = grid

        def launch(*args, **kwargs):
            from triton.runtime import interpreter
            builder = interpreter.InterpreterBuilder
            real = builder.create_get_program_id
            for p in sorted({0, n_programs - 1}):
                def shifted(self, axis, _p=p):
                    h = real(self, axis)
                    if axis == 0:
                        h.data = h.data + _p  # int32, as the real one
                    return h
                builder.create_get_program_id = shifted
                try:
                    self.kernel[(1,)](*args, **kwargs)
                finally:
                    builder.create_get_program_id = real
                self.ran.append((n_programs, p))
        return launch


@pytest.fixture
def programs(monkeypatch):
    """``programs(module, name)``: run only the first and last programs of
    that kernel's launches (interpreter); nothing changes on CUDA."""
    stand_ins = []

    def restrict(module, name):
        if DEVICE.type == "cuda":
            return None
        if not C.is_interpreted(getattr(module, name)):
            pytest.fail("the interpreter session must import the kernels under TRITON_INTERPRET=1")
        from triton.runtime import interpreter
        if not hasattr(interpreter.InterpreterBuilder, "create_get_program_id"):
            pytest.fail("this triton's interpreter has no InterpreterBuilder.create_get_program_id "
                        "to shift program ids with; adapt _Programs")
        s = _Programs(getattr(module, name))
        monkeypatch.setattr(module, name, s)
        stand_ins.append(s)
        return s

    yield restrict
    for s in stand_ins:
        assert s.ran, "the stand-in kernel never ran: the op took another path"


def _windows(n: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """[start, end) of the first and the last program's elements."""
    last = (n - 1) // block * block
    return sorted({(0, min(block, n)), (last, n)})


def _bf16(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 4.0 ** torch.randint(-8, 8, (n,), generator=g)).to(BF16)


# --------------------------------------------------------- bf16 shard sum
SHARD_CASES = [
    pytest.param(3, 2 ** 30, id="W3-n2^30-first-wrapping"),        # (W-1) n = 2^31
    pytest.param(3, 2 ** 30 + 1, id="W3-n2^30+1-odd"),             # a one-element last program
    pytest.param(5, 2 ** 29 + 3, id="W5-last-slice-only-wraps"),   # 3n < 2^31 <= 4n
    pytest.param(3, 2 ** 30 - 1, id="W3-just-below"),              # (W-1) n < 2^31: never wrapped
    pytest.param(2, 2 ** 31 + BLOCK + 5, id="W2-n-past-2^31"),     # program * BLOCK past 2^31
]


@pytest.mark.parametrize("world,n", SHARD_CASES)
def test_shard_sum_offsets_past_2_31(programs, world, n):
    from fastddp.kernels import shard_kernel
    programs(shard_kernel, "_reduce_shards_kernel")
    src = _after_guard(world * n, BF16)
    out = src[:n]  # in place, as the bf16 + fp32-sum hook calls it
    wins = _windows(n)
    for w, (a, b) in enumerate(wins):
        for k in range(world):
            src[k * n + a:k * n + b] = _bf16(b - a, seed=10 * w + k).to(DEVICE)
    src[n - 1] = src[2 * n - 1] = 3.0e38  # the last element overflows: the health bit
    want, want_h = [], torch.zeros(1, dtype=torch.int32)
    for a, b in wins:
        part = torch.cat([src[k * n + a:k * n + b].cpu() for k in range(world)])
        o = torch.empty(b - a, dtype=BF16)
        R.reduce_shards(part, o, world, health=want_h)
        want.append(o)
    health = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.reduce_shards(src, out, world, health=health)
    for (a, b), o in zip(wins, want):
        assert_bits(out[a:b], o, f"shard sum, world {world}, n {n}, elements [{a}, {b})")
    assert health.item() == want_h.item() == int(R.Health.OVERFLOW)


# ---------------------------------------------------------- fp8 shard sum
FP8_CASES = [
    pytest.param(3, 2 ** 30, 256, id="W3-n2^30-first-wrapping"),
    pytest.param(3, 2 ** 31 - 128, 128, id="W3-largest-int32-n"),  # 2n wraps to -256
    pytest.param(5, 2 ** 29 + 2 ** 20, 32, id="W5-last-slice-only-wraps"),
    pytest.param(3, 2 ** 30 - 256, 256, id="W3-just-below"),
]


def _fp8_window(m: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch.empty(m, dtype=U8), torch.empty(m // block)
    R.quantize_fp8(_bf16(m, seed).float(), q, s, block)
    return q, s


@pytest.mark.parametrize("world,n,block", FP8_CASES)
def test_fp8_shard_sum_offsets_past_2_31(programs, world, n, block):
    from fastddp.kernels import fp8_kernel
    programs(fp8_kernel, "_reduce_fp8_kernel")
    nb = n // block
    src_q = _after_guard(world * n, U8)
    src_s = _untouched(world * nb, torch.float32)
    tile = max(1, BLOCK // block) * block  # elements per interpreted program
    wins = _windows(n, tile)
    for w, (a, b) in enumerate(wins):
        for k in range(world):
            q, s = _fp8_window(b - a, block, seed=10 * w + k)
            if w == len(wins) - 1 and k < 2:  # the last element overflows: the health bit
                q[-1], s[-1] = 0x7E, 2.0 ** 119  # 448 * 2^119 (finite) twice: past fp32's max
            src_q[k * n + a:k * n + b] = q.to(DEVICE)
            src_s[k * nb + a // block:k * nb + b // block] = s.to(DEVICE)
    want, want_h = [], torch.zeros(1, dtype=torch.int32)
    for a, b in wins:
        pq = torch.cat([src_q[k * n + a:k * n + b].cpu() for k in range(world)])
        ps = torch.cat([src_s[k * nb + a // block:k * nb + b // block].cpu() for k in range(world)])
        oq, os_ = torch.empty(b - a, dtype=U8), torch.empty((b - a) // block)
        R.reduce_fp8_shards(pq, ps, oq, os_, world, block, health=want_h)
        want.append((oq, os_))
    health = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.reduce_fp8_shards(src_q, src_s, src_q[:n], src_s[:nb], world, block, health=health)
    for (a, b), (oq, os_) in zip(wins, want):
        what = f"fp8 shard sum, world {world}, n {n}, elements [{a}, {b})"
        _same_fp8(src_q[a:b], oq, what)
        assert_bits(src_s[a // block:b // block], os_, what + " (scales)")
    assert health.item() == want_h.item() == int(R.Health.OVERFLOW)


# --------------------------------------- fp8 quantize / dequantize, one tensor
def test_fp8_quantize_dequantize_past_2_31(programs):
    """A program's first element (program * blocks * block) past 2^31."""
    from fastddp.kernels import fp8_kernel
    programs(fp8_kernel, "_quantize_kernel")
    programs(fp8_kernel, "_dequantize_kernel")
    block = 256
    n = 2 ** 31 + 2 ** 20
    x, res = _untouched(n, torch.float32), _untouched(n, torch.float32)
    q, s = _untouched(n, U8), _untouched(n // block, torch.float32)
    wins = _windows(n)
    for w, (a, b) in enumerate(wins):
        x[a:b] = _bf16(b - a, seed=w).float().to(DEVICE)
        res[a:b] = (_bf16(b - a, seed=w + 7).float() * 1e-3).to(DEVICE)
    x[n - 1] = float("inf")  # SOURCE_NONFINITE from the far end
    want, want_h = [], torch.zeros(1, dtype=torch.int32)
    for a, b in wins:
        wx, wr = x[a:b].cpu(), res[a:b].cpu().clone()
        wq, ws = torch.empty(b - a, dtype=U8), torch.empty((b - a) // block)
        R.quantize_fp8(wx, wq, ws, block, residual=wr, health=want_h)
        wd = torch.empty(b - a)
        R.dequantize_fp8(wq, ws, wd, block)
        want.append((wq, ws, wr, wd))
    health = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.quantize_fp8(x, q, s, block, residual=res, health=health)
    K.dequantize_fp8(q, s, x, block)  # into x: its windows were read
    for (a, b), (wq, ws, wr, wd) in zip(wins, want):
        what = f"fp8 of {n} elements, [{a}, {b})"
        _same_fp8(q[a:b], wq, what)
        assert_bits(s[a // block:b // block], ws, what + " (scales)")
        assert_bits(res[a:b], wr, what + " (residual)")
        assert_bits(x[a:b], wd, what + " (dequantized)")
    assert health.item() == want_h.item() == int(R.Health.SOURCE_NONFINITE)


# ------------------------------------------------------------ pack / unpack
def test_pack_unpack_offsets_past_2_31(programs):
    """One tensor of more than 2^31 elements at a flat offset: its last chunk
    starts past 2^31 in the tensor and in the flat buffer (the chunk table's
    int64 offsets, times the element size)."""
    from fastddp.kernels import pack_kernel, unpack_kernel
    programs(pack_kernel, "_pack_kernel")
    programs(unpack_kernel, "_unpack_kernel")
    n, off = 2 ** 31 + BLOCK + 3, 5
    t = _untouched(n, torch.float16)
    flat = _untouched(off + n, BF16)
    wins = _windows(n)
    for w, (a, b) in enumerate(wins):
        t[a:b] = (_bf16(b - a, seed=w).float() * 64).half().to(DEVICE)
    lay = K.Layout([t.shape], [off])
    want_p, want_u = [], []
    for a, b in wins:
        p = torch.empty(b - a, dtype=BF16)
        R.pack_views([t[a:b].cpu()], [p], scale=0.25)
        u = torch.empty(b - a, dtype=torch.float16)
        R.unpack_views([p], [u], scale=3.0)
        want_p.append(p)
        want_u.append(u)
    K.pack([t], flat, scale=0.25, layout=lay)
    for (a, b), p in zip(wins, want_p):
        assert_bits(flat[off + a:off + b], p, f"pack of {n} elements at offset {off}, [{a}, {b})")
    K.unpack(flat, [t], scale=3.0, layout=lay)
    for (a, b), u in zip(wins, want_u):
        assert_bits(t[a:b], u, f"unpack of {n} elements at offset {off}, [{a}, {b})")
