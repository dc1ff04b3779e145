"""The CPU loops of block-scaled fp8 in C++ (``csrc/fp8_cpu.cpp``); this
module builds and loads them for :mod:`fastddp.kernels.torch_path`.

One pass per block, bit for bit the contract of ``kernels/reference.py``
where every value is finite: each call returns the first block holding a
NaN/inf (the shard sum: the first block whose sum overflows) untouched, and
the torch path does the rest with the contract's NaN and health rules.

The switch is ``FASTDDP_FP8_NATIVE``, not ``FASTDDP_NATIVE`` (which turns
off the readiness hooks, a reducer concern): ``1`` (default) builds on the
first fp8 call on CPU tensors; ``0`` keeps to the torch ops (the same bits,
slower: no build); ``require`` makes a failed build an error.  Either way
the results are the contract's, so the switch changes speed, never values.
The build, its cache and its lock rules: :mod:`._native_build`.
"""

from __future__ import annotations

import os

from ._native_build import Extension

__all__ = ["EXTENSION", "enabled", "main", "module"]

#: the fp8 loops' extension (its build state; tests swap it for a fresh one)
EXTENSION = Extension(
    "fastddp_fp8_cpu", [os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fp8_cpu.cpp")],
    env="FASTDDP_FP8_NATIVE", what="fp8 CPU loops",
    fallback="the torch ops are used (the same bits, slower)", instead="torch ops")


def enabled() -> bool:
    return EXTENSION.enabled()


def module():
    """The compiled loops (``fp8_quantize``, ``fp8_dequantize``,
    ``fp8_reduce_shards``), or None where they are off or cannot be built."""
    return EXTENSION.module(stacklevel=3)


def main() -> None:
    """``python -c "import fastddp.kernels._fp8_native as f; f.main()"``:
    build them now (CI does, before timed tests)."""
    EXTENSION.main()
