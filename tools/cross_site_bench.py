"""Cross-site training against its peers on the real link (the netns rig):
loss per step and step time of a small char-level transformer LM trained on
the Python standard library's own source (every machine has it).

    python tools/cross_site_bench.py --rates 0.2,0.05 --steps 600 --out /tmp/cs.json

Two network namespaces joined by a shaped veth (:mod:`tools.netlink`), L
ranks in each (``--per-host``).  Every run trains from the same
initialisation on the same data order (rank r's batch at step t is drawn by
a generator seeded with (r, t)), so a run's loss curve depends on its
algorithm only; the step times depend on the link.  Runs, side by side at
each rate:

* ``local``: no communication (each rank alone): the floor of a step;
* ``host``: torch's DDP over each host's ranks only (no sync between
  hosts): the floor of exact-inside-a-host training;
* ``torch-ddp``: torch's DDP (the exact baseline);
* ``torch-postlocal-H``: torch's post-local SGD (``post_localSGD_hook`` with
  the host as subgroup + ``PostLocalSGDOptimizer`` with a periodic averager),
  after the same warm-up;
* ``fastddp-hier-fp8``: fastddp's best exact mode on this link
  (``hierarchical_hook``, fp8 between hosts);
* ``cross-H-WIRE``: ``fastddp.CrossSite(sync_every=H, wire=WIRE)``, DiLoCo's
  outer step (lr 0.7, Nesterov 0.9) after the same warm-up; ``-avg``: plain
  averaging (lr 1, momentum 0); ``-LR_M``: that outer lr and momentum;
  a last ``-wFORMAT``: the warm-up on the hierarchical mode with that wire.

``--curve-rate`` runs the loss curves once, at that rate (the exact runs'
curves do not depend on the link); the other rates time ``--time-steps``
steps of each (after ``--skip`` steps).  Per run: validation loss every
``--eval-every`` steps (rank 0's model; outside the timed region), rank 0's
step times, the bytes out of each host (veth counters), CrossSite's stats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CTX = 64


# ------------------------------------------------------------------ the task
def corpus(limit: int = 4 << 20):
    """The standard library's .py files (sorted), as bytes: train / validation."""
    import torch

    root = Path(os.__file__).parent
    chunks, n = [], 0
    for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        b = p.read_bytes()
        chunks.append(b)
        n += len(b)
        if n >= limit:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def make_model(d: int, layers: int, heads: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.register_buffer("mask", torch.triu(torch.ones(CTX, CTX, dtype=torch.bool), 1), persistent=False)

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=self.mask[:x.shape[1], :x.shape[1]], need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(256, d), nn.Parameter(torch.zeros(CTX, d))
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[:idx.shape[1]]
            return self.head(self.ln(self.blocks(x)))

    torch.manual_seed(0)
    return LM()


def batch(data, rank: int, step: int, size: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    at = torch.randint(0, len(data) - CTX - 1, (size,), generator=g)
    x = torch.stack([data[i:i + CTX] for i in at.tolist()])
    y = torch.stack([data[i + 1:i + CTX + 1] for i in at.tolist()])
    return x, y


# ------------------------------------------------------------------ one rank
class _Local:
    """The model alone, called as a DDP module is (``.module``)."""

    def __init__(self, net):
        self.module = net

    def __call__(self, x):
        return self.module(x)


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, val = corpus()
    vx, vy = batch(val, 10_000, 0, 32)
    net = make_model(a.d, a.layers, a.heads)
    L = a.per_host
    kind = a.run.split("-")
    inner_lr = a.lr
    opt = None
    if kind[0] == "local":  # no communication at all: the floor a step can reach
        model = _Local(net)
        opt = torch.optim.AdamW(net.parameters(), lr=inner_lr)
    elif kind[0] == "host":  # torch's DDP over the host's ranks only: the floor of exact-inside-a-host
        sub, _ = dist.new_subgroups(group_size=L)
        model = torch.nn.parallel.DistributedDataParallel(net, process_group=sub)
        opt = torch.optim.AdamW(model.parameters(), lr=inner_lr)
    elif kind[0] == "torch":
        model = torch.nn.parallel.DistributedDataParallel(net)
        inner = torch.optim.AdamW(model.parameters(), lr=inner_lr)
        opt = inner
        if kind[1] == "postlocal":
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                       post_localSGD_hook)
            from torch.distributed.algorithms.model_averaging import averagers
            from torch.distributed.optim import PostLocalSGDOptimizer

            sub, _ = dist.new_subgroups(group_size=L)
            model.register_comm_hook(PostLocalSGDState(None, sub, start_localSGD_iter=a.warmup),
                                     post_localSGD_hook)
            opt = PostLocalSGDOptimizer(inner, averagers.PeriodicModelAverager(int(kind[2]), a.warmup))
    else:
        import fastddp

        model = fastddp.DistributedDataParallel(net)
        inner = torch.optim.AdamW(model.parameters(), lr=inner_lr)
        opt = inner
        if kind[0] == "fastddp":  # fastddp-hier-fp8
            from fastddp.hooks import HierarchicalState, hierarchical_hook

            model.register_comm_hook(HierarchicalState(wire=kind[2], ranks_per_host=L), hierarchical_hook)
        else:  # cross-H-WIRE[-avg|-LR_MOMENTUM|-dilo][-wWARMUPWIRE]: the outer step (DiLoCo's, plain
            # averaging or the given lr_momentum) and the warm-up's wire (default --warmup-wire)
            step = kind[3] if len(kind) > 3 else "dilo"
            outer = ({} if step == "dilo" else dict(outer_lr=1.0, outer_momentum=0.0) if step == "avg" else
                     dict(zip(("outer_lr", "outer_momentum"), map(float, step.split("_")))))
            if len(kind) > 4:
                a.warmup_wire = kind[4][1:]
            opt = fastddp.CrossSite(model, inner, sync_every=int(kind[1]), wire=kind[2],
                                    warmup_steps=a.warmup, ranks_per_host=L, warmup_wire=a.warmup_wire, **outer)
    steps, evals, times = a.steps, [], []

    def evaluate(t):
        with torch.no_grad():
            loss = F.cross_entropy(model.module(vx).reshape(-1, 256), vy.reshape(-1)).item()
        evals.append((t, loss))

    first = a.first_step
    for t in range(first, first + steps):
        x, y = batch(train, rank, t, a.batch)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if a.eval_every and (t % a.eval_every == 0 or t == first + steps - 1):
            evaluate(t)
    if hasattr(opt, "finish"):
        opt.finish(average=False)  # the sync in flight, if any: before the group goes
    dist.barrier()
    if rank == 0:
        out = {"run": a.run, "steps": steps, "first_step": first, "step_s": times, "evals": evals,
               "params": sum(p.numel() for p in net.parameters()), "warmup": a.warmup,
               "warmup_wire": a.warmup_wire}
        if hasattr(opt, "stats") and callable(opt.stats):
            out["cross_site"] = opt.stats()
        Path(a.result).write_text(json.dumps(out))
    dist.destroy_process_group()


# ------------------------------------------------------------------ the driver
def period(run: str) -> int:
    """Steps between syncs of a periodic run (1: every step)."""
    kind = run.split("-")
    return int(kind[1]) if kind[0] == "cross" else int(kind[2]) if kind[1:2] == ["postlocal"] else 1


def run_one(link, a, run: str, steps: int, first: int, eval_every: int, tmp: Path, warmup: int) -> dict:
    res = tmp / f"{run}-{link.spec.gbit}-{first}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--run", run, "--steps", str(steps),
            "--first-step", str(first), "--eval-every", str(eval_every), "--result", str(res),
            "--per-host", str(a.per_host), "--d", str(a.d), "--layers", str(a.layers), "--heads", str(a.heads),
            "--batch", str(a.batch), "--lr", str(a.lr), "--warmup", str(warmup), "--warmup-wire", a.warmup_wire]
    before = [link.counters(s)[0] for s in (0, 1)]
    t0 = time.monotonic()
    link.run_ranks(argv, timeout_s=a.timeout)
    wall = time.monotonic() - t0
    after = [link.counters(s)[0] for s in (0, 1)]
    out = json.loads(res.read_text())
    out.update(rate_gbit=link.spec.gbit, wall_s=wall, bytes_out=[y - x for x, y in zip(before, after)])
    s = out["step_s"] or [0.0]  # a fixed-cost run trains no step
    out["median_step_s"] = statistics.median(s)
    # the mean over the last two sync periods (whole intervals: a sync's cost is in one of its steps)
    tail = s[-2 * period(run):] if period(run) > 1 else s[len(s) // 3:]
    out["mean_step_s"] = sum(tail) / len(tail)
    print(f"{run:22s} {link.spec.gbit} Gbit/s: {len(s)} steps from {first}, median {out['median_step_s']*1e3:.0f} ms, "
          f"mean {out['mean_step_s']*1e3:.0f} ms, last eval {out['evals'][-1] if out['evals'] else None}, "
          f"bytes out {out['bytes_out']}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", default="torch-ddp")
    p.add_argument("--result")
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--runs", default="local,host,torch-ddp,torch-postlocal-16,fastddp-hier-fp8,cross-16-fp8,cross-64-fp8,"
                                     "cross-16-fp32,cross-64-fp32")
    p.add_argument("--rates", default="0.2,0.05", help="Gbit/s of the timed runs")
    p.add_argument("--curve-rate", type=float, default=None, help="Gbit/s of the loss-curve runs (none: skip)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--time-steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=120, help="timed runs start at this step (past the warm-up)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--warmup-wire", default="exact", help="CrossSite's warmup_wire (exact, fp32, bf16, fp8)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--fixed", action="store_true",
                   help="also run each kind with no step at the first rate: the bytes every run sends besides its steps")
    p.add_argument("--out", default="cross_site_bench.json")
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return
    import tempfile

    sys.path.insert(0, str(REPO))
    from tools.netlink import NetnsLink, parse_link

    tmp = Path(tempfile.mkdtemp(prefix="cross-site-bench-"))
    runs = a.runs.split(",")
    results: dict = {"config": vars(a), "curves": {}, "timed": {}, "fixed": {}}
    if a.curve_rate is not None:
        with NetnsLink(parse_link(f"netns:{a.curve_rate}"), ranks_per_host=a.per_host) as link:
            for run in runs:
                results["curves"][run] = run_one(link, a, run, a.steps, 0, a.eval_every, tmp, a.warmup)
                Path(a.out).write_text(json.dumps(results, indent=1))
    for i, rate in enumerate(float(r) for r in a.rates.split(",") if r):
        with NetnsLink(parse_link(f"netns:{rate}"), ranks_per_host=a.per_host) as link:
            for kind in sorted({r.split("-")[0] for r in runs}) if (a.fixed and i == 0) else ():
                run = next(r for r in runs if r.split("-")[0] == kind)
                results["fixed"][kind] = run_one(link, a, run, 0, 0, 0, tmp, 0)
            for run in runs:
                # timed past any warm-up (its steps cost what torch-ddp's do): 3 sync periods, the
                # mean over the last two; the exact runs: --time-steps, the mean over the last 2/3
                steps = max(a.time_steps, 3 * period(run))
                results["timed"][f"{run}@{rate}"] = run_one(link, a, run, steps, a.skip, 0, tmp, 0)
                Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
