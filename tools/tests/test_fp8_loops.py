"""tools/fp8_loops.py: a paired comparison of the fp8 CPU loops that times
only passes giving the same bits, and prints one row per pass and size."""

from __future__ import annotations

import pytest
import torch

from fastddp.kernels._native_build import switch
from tools import fp8_loops

OFF = switch("FASTDDP_FP8_NATIVE") == "off"
pytestmark = pytest.mark.skipif(OFF, reason="FASTDDP_FP8_NATIVE=0")


def _loops():
    from fastddp.kernels import _fp8_native
    return fp8_loops._modules(_fp8_native.EXTENSION.sources[0])  # the same source: one module, no build


def test_same_source_rows_for_every_pass_and_size():
    old, new = _loops()
    assert old is new
    lines = []
    rows = fp8_loops.compare(old, new, [1024, 2048], rounds=3, out=lines.append)
    names = ["quantize + error feedback", "quantize", "decode", "shard sum, W = 2"]
    assert [(r["values"], r["pass"]) for r in rows] == [(n, p) for n in (1024, 2048) for p in names]
    assert all(r["old_ns"] > 0 and r["new_ns"] > 0 and r["q1"] <= r["q3"] for r in rows)
    assert len(lines) == len(rows) and "new/old" in lines[0]


class _OffByOne:
    """The real loops, but the decode writes one value a bit off."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def fp8_dequantize(self, q, s, out, block):
        self.mod.fp8_dequantize(q, s, out, block)
        out.view(torch.int32)[7] ^= 1


def test_different_bits_are_refused_before_any_timing():
    old, _ = _loops()
    with pytest.raises(SystemExit, match="decode at 1024 values: the two sources give different bits"):
        fp8_loops.compare(old, _OffByOne(old), [1024], rounds=3, out=lambda line: None)


def test_sizes_must_be_whole_blocks():
    with pytest.raises(SystemExit, match="multiples of 256"):
        fp8_loops.main(["unused.cpp", "--sizes", "1000"])
