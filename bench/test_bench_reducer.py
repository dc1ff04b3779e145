"""Micro-benchmark: one reducer step in isolation (host overhead per parameter).

    python -m pytest bench/test_bench_reducer.py --benchmark-only -q

A 1-rank gloo group (the collective is a no-op copy; what is left is the
wrapper's own host work), a model of ``N`` small Linear+LayerNorm blocks,
one forward+backward per round, for: no DDP (the floor), torch's DDP and
fastddp (default and batched_grad_copy).  ``extra_info`` records the number
of parameters; the report divides (wrapper - floor) by it: microseconds of
host overhead per parameter, the figure a Python reducer lives or dies on.
Also: the cost of one profiling range when ranges are off (must be ~0).
"""

from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from fastddp import DistributedDataParallel as FastDDP
from fastddp import profiling

BLOCKS = 150  # 4 params per block -> 600 parameters


@pytest.fixture(scope="module")
def pg():
    torch.set_num_threads(1)
    path = os.path.join(tempfile.mkdtemp(prefix="fastddp-bench-"), "pg")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)]
    return torch.nn.Sequential(*layers)


WRAPPERS = {
    "local": lambda m: m,
    "torch": lambda m: torch.nn.parallel.DistributedDataParallel(m),
    "torch-batched": lambda m: torch.nn.parallel.DistributedDataParallel(m, batched_grad_copy=True),
    "fastddp": lambda m: FastDDP(m),
    "fastddp-batched": lambda m: FastDDP(m, batched_grad_copy=True),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_reducer_step(benchmark, pg, wrapper):
    if wrapper == "torch-batched" and "batched_grad_copy" not in inspect.signature(
            torch.nn.parallel.DistributedDataParallel.__init__).parameters:
        pytest.skip(f"torch {torch.__version__}'s DDP has no batched_grad_copy (new in 2.13)")
    model = WRAPPERS[wrapper](_model())
    params = list(model.parameters())
    x = torch.randn(8, 64)

    def step():
        for p in params:
            p.grad = None
        model(x).pow(2).mean().backward()

    for _ in range(3):
        step()  # warm up, rebuild buckets
    benchmark.extra_info["params"] = len(params)
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=2)


def test_profiling_range_off(benchmark):
    was = profiling.enabled()
    profiling.disable()
    try:
        def body():
            with profiling.range("fastddp/pack[0]"):
                pass
        benchmark(body)
    finally:
        (profiling.enable if was else profiling.disable)()


def test_profiling_range_baseline(benchmark):
    """The same body with a bare nullcontext: the difference to
    test_profiling_range_off is what a disabled range costs."""
    import contextlib

    null = contextlib.nullcontext()

    def body():
        with null:
            pass
    benchmark(body)
