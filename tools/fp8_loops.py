"""The fp8 CPU loops against another version of their source, paired.

    python -m tools.fp8_loops OLD.cpp [--rounds 21] [--sizes 65536 4194304]
    git show HEAD:kernels/csrc/fp8_cpu.cpp > /tmp/old.cpp && python -m tools.fp8_loops /tmp/old.cpp

Builds ``OLD.cpp`` as a module of its own beside the working tree's
(``kernels/csrc/fp8_cpu.cpp``; the same builder and flags, cached by the
source's hash) and times each pass (the quantize with and without error
feedback, the decode, the shard sum at W = 2) on both, one thread,
alternating which goes first every round. It prints, per pass and size, each
side's median ns per value and the median of new ÷ old with its quartiles.
Before it times, it checks that both give the same bits: a change to the
loops must keep the contract, and a faster pass that differs is not faster.
A change to these loops is decided here, where a 2-core VM's step time
cannot tell a few ms of CPU apart (reports/intel-xeon-processor/
2026-12-07-issue43-standing.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

BLOCK = 256


def _modules(old_source: str):
    from fastddp.kernels import _fp8_native
    from fastddp.kernels._native_build import Extension

    new = _fp8_native.module()
    if new is None:
        raise SystemExit("fp8_loops: the working tree's fp8 loops did not build (FASTDDP_FP8_NATIVE=0, or no compiler)")
    if os.path.realpath(old_source) == os.path.realpath(_fp8_native.EXTENSION.sources[0]):
        return new, new  # the same source: one module (a check of the tool itself)
    old = Extension("fastddp_fp8_cpu_paired", [os.path.abspath(old_source)], env="FASTDDP_FP8_NATIVE",
                    what="the fp8 loops to compare against", fallback="nothing to compare",
                    instead="nothing").module()
    if old is None:
        raise SystemExit(f"fp8_loops: {old_source} did not build")
    return old, new


def passes(n: int, seed: int = 0) -> tuple:
    """``(setup, {name: (run, result)})`` over fresh inputs of ``n`` values
    (N(0, 1) gradients, residuals 1e-3 of them): ``setup(module)`` makes the
    decode's and the shard sum's inputs; each pass runs on a module, and
    ``result()`` returns what it wrote (to compare the two modules' bits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    r0 = torch.randn(n, generator=g) * 1e-3
    r = r0.clone()
    q, s, out = torch.empty(n, dtype=torch.uint8), torch.empty(n // BLOCK), torch.empty(n)
    q0, s0 = torch.empty(n, dtype=torch.uint8), torch.empty(n // BLOCK)
    sq, ss = torch.empty(2 * n, dtype=torch.uint8), torch.empty(2 * n // BLOCK)
    oq, os_ = torch.empty(n, dtype=torch.uint8), torch.empty(n // BLOCK)

    def setup(m):
        m.fp8_quantize(x, None, q0, s0, BLOCK)
        m.fp8_quantize(x.flip(0), None, sq[n:], ss[n // BLOCK:], BLOCK)
        sq[:n].copy_(q0)
        ss[:n // BLOCK].copy_(s0)

    def ef(m):
        r.copy_(r0)  # the same residual every call: the bits compare and the cost includes one copy
        m.fp8_quantize(x, r, q, s, BLOCK)

    return setup, {
        "quantize + error feedback": (ef, lambda: (q.clone(), s.clone(), r.clone())),
        "quantize": (lambda m: m.fp8_quantize(x, None, q, s, BLOCK), lambda: (q.clone(), s.clone())),
        "decode": (lambda m: m.fp8_dequantize(q0, s0, out, BLOCK), lambda: (out.clone(),)),
        "shard sum, W = 2": (lambda m: m.fp8_reduce_shards(sq, ss, oq, os_, 2, BLOCK), lambda: (oq.clone(), os_.clone())),
    }


def _same(a, b) -> bool:
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))


def compare(old, new, sizes, rounds: int, out=print) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        setup, p = passes(n)
        setup(old)
        for name, (run, result) in p.items():
            run(old)
            want = result()
            run(new)
            if not _same(want, result()):
                raise SystemExit(f"fp8_loops: {name} at {n} values: the two sources give different bits")
            reps = max(3, int(2e7 // n))
            t_old, t_new, ratio = [], [], []
            for k in range(rounds):
                t = {}
                for side, m in ((("old", old), ("new", new)) if k % 2 == 0 else (("new", new), ("old", old))):
                    run(m)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        run(m)
                    t[side] = (time.perf_counter() - t0) / reps / n * 1e9
                t_old.append(t["old"])
                t_new.append(t["new"])
                ratio.append(t["new"] / t["old"])
            q1, med, q3 = statistics.quantiles(ratio, n=4) if rounds > 1 else (ratio[0],) * 3
            row = {"values": n, "pass": name, "old_ns": statistics.median(t_old),
                   "new_ns": statistics.median(t_new), "ratio": statistics.median(ratio), "q1": q1, "q3": q3}
            rows.append(row)
            out(f"{n:>9} {name:<26} old {row['old_ns']:.3f}  new {row['new_ns']:.3f} ns/value  "
                f"new/old {row['ratio']:.3f} ({q1:.3f}-{q3:.3f})")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the other version of kernels/csrc/fp8_cpu.cpp")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 22])
    a = ap.parse_args(argv)
    bad = [n for n in a.sizes if n <= 0 or n % BLOCK]
    if bad:
        raise SystemExit(f"fp8_loops: --sizes must be positive multiples of {BLOCK}: {bad}")
    old, new = _modules(a.old)
    compare(old, new, a.sizes, a.rounds)


if __name__ == "__main__":
    main()
