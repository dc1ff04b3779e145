"""Accuracy of the hierarchical reduction against the flat formats, on local
gloo ranks whose hosts come from the explicit topology (``ranks_per_host``).

``error``: one backward of an MLP from one initialisation, every rank its
own batch; the relative L2 error of the averaged gradient each path delivers
against the exact average (fp64 of every rank's local gradient), for fp32 /
bf16 + fp32 sum / fp8, flat and hierarchical, at ``H x L`` ranks.

``train``: N SGD steps at ``H x L`` with torch's DDP (fp32) and the
hierarchical hook in each format, the same data; the loss of every step
(rank 0's batch), for the curves.

    python -m tools.hier_study error --shape 2x2 4x2
    python -m tools.hier_study train --shape 2x2 --steps 300 --out reports/amd-epyc/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

FORMATS = ("fp32", "bf16", "fp8")


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 64, generator=g)
    return x, (x[:, :10] * 2).sin() + 0.1 * torch.randn(32, 10, generator=g)


def _wrap(path: str, per_host: int):
    from fastddp import DistributedDataParallel as DDP
    from fastddp import hooks

    if path == "torch":
        return nn.parallel.DistributedDataParallel(model())
    ddp = DDP(model())
    fmt, _, where = path.partition("-")
    if where == "hier":
        ddp.register_comm_hook(hooks.HierarchicalState(wire=fmt, ranks_per_host=per_host), hooks.hierarchical_hook)
    elif fmt == "bf16":
        ddp.register_comm_hook(None, hooks.bf16_fp32acc_hook)
    elif fmt == "fp8":
        ddp.register_comm_hook(hooks.FP8CompressionState(), hooks.fp8_compress_hook)
    return ddp


def _error(rank: int, world: int, per_host: int) -> dict:
    local = []
    for r in range(world):
        m = model()
        x, y = batch(r, 0)
        nn.functional.mse_loss(m(x), y).backward()
        local.append([p.grad.double() for p in m.parameters()])
    exact = [sum(g) / world for g in zip(*local)]
    den = sum(float(e.pow(2).sum()) for e in exact)
    out = {}
    for fmt in FORMATS:
        for where in ("flat", "hier"):
            ddp = _wrap(f"{fmt}-{where}", per_host)
            x, y = batch(rank, 0)
            nn.functional.mse_loss(ddp(x), y).backward()
            num = sum(float((p.grad.double() - e).pow(2).sum()) for p, e in zip(ddp.parameters(), exact))
            out[f"{fmt}-{where}"] = (num / den) ** 0.5
            if where == "hier":
                assert ddp.stats()["fused_path"][0] == "hierarchical", ddp.stats()["fused_path"]
    return out


def _train(rank: int, world: int, per_host: int, steps: int) -> dict:
    out = {}
    for path in ("torch", *(f"{f}-hier" for f in FORMATS)):
        ddp = _wrap(path, per_host)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            x, y = batch(rank, step)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[path] = losses
    return out


def _entry(rank: int, world: int, init: str, what: str, per_host: int, steps: int, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        got = _error(rank, world, per_host) if what == "error" else _train(rank, world, per_host, steps)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def run(what: str, hosts: int, per_host: int, steps: int = 0) -> dict:
    world = hosts * per_host
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        mp.spawn(_entry, args=(world, f"file://{tmp}/init", what, per_host, steps, result), nprocs=world)
        with open(result) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hier_study", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("error", "train"))
    p.add_argument("--shape", nargs="+", default=["2x2"], help="HOSTSxRANKS, e.g. 2x2 4x2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    results = {}
    for shape in a.shape:
        try:
            h, l = (int(v) for v in shape.split("x"))
        except ValueError:
            p.error(f"--shape {shape!r}: write HOSTSxRANKS, e.g. 2x2")
        results[shape] = got = run(a.what, h, l, a.steps)
        if a.what == "error":
            print(f"{shape}: " + ", ".join(f"{k} {v:.3e}" for k, v in got.items()))
        else:
            ref = got["torch"][-1]
            print(f"{shape}: final loss " + ", ".join(f"{k} {v[-1]:.5f} ({v[-1] / ref - 1:+.2%})"
                                                      for k, v in got.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
