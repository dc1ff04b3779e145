"""What check_finite costs the pack: the same bucket packed with and without
its health flag (``pack(..., health=)``).

    python -m pytest bench/test_bench_health.py --benchmark-only -q

On CUDA this is the Triton pack (the flag adds one max-reduction per
program and no launch; target: under 3% of the pack time); on CPU the
reference path, which checks with one extra ``isfinite`` pass per source
dtype (the CPU path reads the gradients twice when asked to check).
"""

from __future__ import annotations

import pytest
import torch

import fastddp.kernels as K

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"many_small": (600, 4096), "few_large": (4, 4 << 20)}
WIRE = {"fp32": torch.float32, "fp16": torch.float16}


def _setup(shape, wire):
    n, numel = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    srcs = [torch.randn(numel, device=DEVICE, generator=g) for _ in range(n)]
    dst = torch.empty(n * numel, dtype=WIRE[wire], device=DEVICE)
    return srcs, dst, K.Layout.for_tensors(srcs), torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _run(benchmark, shape, wire, check):
    srcs, dst, lay, flag = _setup(shape, wire)
    health = flag if check else None

    def call():
        K.pack(srcs, dst, layout=lay, scale=0.5, health=health)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    call()
    benchmark.pedantic(call, rounds=5 if shape == "few_large" else 15, warmup_rounds=1)
    moved = sum(s.numel() * s.element_size() for s in srcs) + dst.numel() * dst.element_size()
    benchmark.extra_info.update(bytes_moved=moved, check=check, device=str(DEVICE))
    assert int(flag.item()) == 0  # healthy data never sets the flag


@pytest.mark.parametrize("check", [False, True], ids=["no_check", "check"])
@pytest.mark.parametrize("wire", list(WIRE))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pack_with_and_without_the_health_flag(benchmark, shape, wire, check):
    benchmark.group = f"health-{shape}-{wire}"
    _run(benchmark, shape, wire, check)
