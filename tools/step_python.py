"""The Python a DDP step runs outside the model, fastddp's against torch's
DDP's, at world 1 (one gloo rank, both wrappers stepped alternately on the
same model and batch): the forward's ``_pre_forward`` and ``_post_forward``,
and fastddp's end-of-backward hand-over (the native issue chain's one
Python call a step).  Medians in microseconds.

    python tools/step_python.py [--model transformer] [--steps 300] [--path default|batched|view]

It times the step's host work that is not the model's and not the
collective's: what a host-bound step pays for the wrapper.  That Python runs
right after the model's forward or backward, on caches the model has just
evicted, so each call costs several times what a warm loop of it measures;
only the figure from inside a real step says what the step pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(times: dict, key: str, fn):
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(key, []).append(time.perf_counter() - t)
    return call


def measure(model: str, steps: int, path: str = "default", warmup: int = 30) -> dict:
    """``{(wrapper, piece): median seconds}`` for ``steps`` alternated steps after ``warmup``."""
    import fastddp
    from fastddp.bench.models import model_zoo

    kw = {"default": {}, "batched": {"batched_grad_copy": True}, "view": {"gradient_as_bucket_view": True}}[path]
    spec = model_zoo()[model]
    times: dict = {}
    wrapped = {}
    for name, cls in (("torch", torch.nn.parallel.DistributedDataParallel), ("fastddp", fastddp.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = cls(spec.build(), **kw)
        ddp._pre_forward = _timed(times, f"{name} pre_forward", ddp._pre_forward)
        ddp._post_forward = _timed(times, f"{name} post_forward", ddp._post_forward)
        if name == "fastddp" and ddp.reducer.arming.chain is not None:
            # the native side calls the reducer's attribute by name (a weak reference to the reducer)
            ddp.reducer._native_chain = _timed(times, "fastddp end of backward", ddp.reducer._native_chain)
        wrapped[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    x, y = spec.make_batch(torch.Generator().manual_seed(1), torch.device("cpu"))
    for i in range(warmup + steps):
        if i == warmup:
            for v in times.values():
                v.clear()
        for ddp, opt in wrapped.values():
            spec.loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in times.items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--path", choices=["default", "batched", "view"], default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pg = os.path.join(tempfile.mkdtemp(prefix="fastddp-steppy-"), "pg")
    dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
    try:
        med = measure(args.model, args.steps, args.path)
    finally:
        dist.destroy_process_group()
    print(f"{args.model}, {args.path} path, world 1, {args.steps} steps each: medians, us")
    for name in ("torch", "fastddp"):
        parts = {k.split(" ", 1)[1]: v for k, v in med.items() if k.startswith(name + " ")}
        cols = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in parts.items())
        print(f"  {name}: {cols}; total {sum(parts.values()) * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
