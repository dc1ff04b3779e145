"""Micro-benchmarks: fastddp's pack/unpack against the ways torch does it today.

    python -m pytest bench/test_bench_kernels.py --benchmark-only -q

On CPU this times the fastddp reference path (what the reducer runs on CPU);
on CUDA the Triton kernels (every timed call ends with a synchronize, so the
figures include launch and host overhead; bench/gpu_kernels.py measures the
kernels alone with CUDA events).

Methods (same inputs, same output buffer):

* ``fastddp``  ``fastddp.kernels.pack/unpack`` with a reused ``Layout``;
* ``loop``     a per-tensor ``copy_`` + ``mul_`` (torch's reducer, grad by grad);
* ``foreach``  ``torch._foreach_copy_`` + one ``mul_`` of the whole bucket
               (pack) or ``_foreach_mul_`` (unpack);
* ``cat``      ``torch.cat`` + ``mul_`` (pack only; a bucket-sized temporary
               when the wire dtype differs).

Bucket shapes: ``many_small`` (600 tensors of 4096) and ``few_large`` (4 of
4M); fp32 -> fp32 and fp32 -> bf16/fp16 wire dtypes.  ``extra_info`` records
bytes moved (read + written) and GB/s from the median.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastddp.kernels as K
from fastddp.bench import baselines

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"many_small": (600, 4096), "few_large": (4, 4 << 20)}
WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = float(np.float32(1 / 3))  # fp32(1/W), W = 3
ROUNDS = {"many_small": 15, "few_large": 5}

_CACHE: dict = {}


def _bucket(shape: str, wire: str):
    """Gradients, the flat wire buffer and a Layout, built once per (shape, wire)."""
    key = (shape, wire)
    if key not in _CACHE:
        _CACHE.clear()  # keep at most one bucket alive (the large one is 64 MB of fp32)
        n_t, n = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(n, generator=gen).to(DEVICE) for _ in range(n_t)]
        flat = torch.empty(n_t * n, dtype=WIRE[wire], device=DEVICE)
        lay = K.Layout.for_tensors(grads)
        _CACHE[key] = (grads, flat, lay, lay.views(flat))
    return _CACHE[key]


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _pack_methods(grads, flat, lay, views):
    return baselines.pack_methods(grads, flat, lay, views, SCALE)


def _unpack_methods(grads, flat, lay, views):
    return baselines.unpack_methods(grads, flat, lay, views, SCALE)


def _run(benchmark, fn, rounds, nbytes, **info):
    def timed():
        fn()
        _sync()

    timed()  # warm up: plans, compilation, allocator
    benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)
    med = benchmark.stats.stats.median
    benchmark.extra_info.update(info)
    benchmark.extra_info.update({
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "backend": K.backend(DEVICE),
        "bytes_moved": nbytes,
        "GB/s": round(nbytes / med / 1e9, 3),
        "median_us": round(med * 1e6, 1),
    })


def _nbytes(grads, flat):
    return sum(g.numel() for g in grads) * (grads[0].element_size() + flat.element_size())


@pytest.mark.parametrize("method", ["fastddp", "loop", "foreach", "cat"])
@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pack(benchmark, shape, wire, method):
    grads, flat, lay, views = _bucket(shape, wire)
    benchmark.group = f"pack {shape} fp32->{wire}"
    _run(benchmark, _pack_methods(grads, flat, lay, views)[method], ROUNDS[shape], _nbytes(grads, flat),
         op="pack", shape=shape, wire=wire, method=method)


@pytest.mark.parametrize("method", ["fastddp", "loop", "foreach"])
@pytest.mark.parametrize("wire", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_unpack(benchmark, shape, wire, method):
    grads, flat, lay, views = _bucket(shape, wire)
    benchmark.group = f"unpack {shape} {wire}->fp32"
    _run(benchmark, _unpack_methods(grads, flat, lay, views)[method], ROUNDS[shape], _nbytes(grads, flat),
         op="unpack", shape=shape, wire=wire, method=method)
