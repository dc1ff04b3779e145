"""One rank of tests/test_auto_precision_link.py (run inside a network namespace).

Trains a ~1 MiB MLP with ``auto_precision_hook`` until it has settled and its
watch holds a baseline, tells the test (``OUT/settled``), waits until the test
has slowed the link (``OUT/slowed``), trains on and records each step's format;
rank 0 writes ``OUT/result.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fastddp
import fastddp.hooks as fh

MAX_BEFORE, MAX_AFTER, WAIT_S = 120, 60, 60


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    m = fastddp.DistributedDataParallel(net)
    m.register_comm_hook(fh.AutoPrecisionState(lowest="fp8", watch_steps=3, max_rounds=6), fh.auto_precision_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(8, 256)

    def step():
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return m.stats()["auto_precision"]

    for k in range(MAX_BEFORE):
        st = step()
        if st["state"] == "settled" and st["watch"]["baseline_ms"] is not None:
            break
    before = st["chosen"]
    if rank == 0:
        (out / "settled").write_text(before)
    deadline = time.monotonic() + WAIT_S
    while not (out / "slowed").exists():  # every rank waits at the same step
        if time.monotonic() > deadline:
            raise SystemExit("the test never slowed the link")
        time.sleep(0.05)
    seen = [step()["current"] for _ in range(MAX_AFTER)]
    st = m.stats()["auto_precision"]
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"before": before, "after": seen, "stats": st}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
