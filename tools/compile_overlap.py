"""Does fastddp overlap its all-reduces with backward under ``torch.compile``?

    python -m tools.compile_overlap [--modes eager,compile-nosplit,compile,ca] [--gbps G]

Two gloo ranks train an 8-layer MLP under fastddp in each mode and count,
per step, the collectives fastddp issued before backward reached the node
that computes the first parameter's gradient (the step's last gradient):
a number above zero means communication overlapped backward.  Prints one
JSON line per mode (steps 0-1, the bucket rebuild and compilation, left
out).
"""

from __future__ import annotations

def overlap_rank(rank, world_size, mode, layers=8, width=512, cap_mb=1.0, steps=7,
                 backend="aot_eager", gbps=None):
    """One rank of the probe: per step, the collectives fastddp issued before
    backward started the node that computes the FIRST parameter's gradient
    (the last gradient of the step), the bucket count, the exposed
    communication (fastddp's stats) and the step time.

    ``mode``: eager | compile | compile-nosplit (DDPOptimizer off: one graph,
    what fastddp did before it spoke dynamo's protocol) | ca (eager forward,
    compiled autograd) | compile+ca."""
    import contextlib
    import time

    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch import nn

    import fastddp
    from fastddp.bench.compile_wrappers import first_grad_node
    from fastddp.bench.simwire import SimulatedWire

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    wire = SimulatedWire(dist.group.WORLD, gbps, torch.device("cpu")) if gbps else contextlib.nullcontext()
    with wire:
        ddp = fastddp.DistributedDataParallel(model, bucket_cap_mb=cap_mb,
                                              process_group=wire if gbps else None)
        split = mode != "compile-nosplit"
        compiled = mode.startswith("compile")
        ca = mode.endswith("ca")
        rows = []
        with torch._dynamo.config.patch(optimize_ddp=split):
            run = torch.compile(ddp, backend=backend) if compiled else ddp
            first = next(ddp.module.parameters())
            for step in range(steps):
                x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank * 7 + step))
                t0 = time.perf_counter()
                loss = run(x).square().mean()
                base = ddp.stats()["collectives"]
                seen = []
                node = first_grad_node(loss, first)
                node.register_prehook(torch._dynamo.disable(
                    lambda _g: seen.append(ddp.stats()["collectives"] - base)))
                if ca:
                    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                        loss.backward()
                else:
                    loss.backward()
                dt = time.perf_counter() - t0
                st = ddp.stats()
                rows.append(dict(before=seen[0] if seen else None, buckets=len(st["buckets"]),
                                 issued=st["collectives"] - base,
                                 exposed_ms=st["exposed_comm_ms_last"][-1] if st["exposed_comm_ms_last"] else None,
                                 step_ms=dt * 1e3))
                for p in ddp.parameters():
                    p.grad = None
        return rows


def main(argv=None) -> None:
    import argparse
    import json
    import statistics
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="eager,compile-nosplit,compile,ca")
    ap.add_argument("--gbps", type=float, default=None, help="a simulated serial wire of this many GB/s (bench/simwire.py)")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--steps", type=int, default=7)
    a = ap.parse_args(argv)
    root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)  # the ranks import this module and tests._dist by name, from the clone
    from tests._dist import World
    from tools.compile_overlap import overlap_rank

    w = World(2)
    try:
        for mode in a.modes.split(","):
            res = w.run(overlap_rank, mode, 8, 512, 1.0, a.steps, a.backend, a.gbps, timeout=900)
            r0 = res[0][2:]  # steps 0-1: bucket rebuild, compilation
            med = lambda k: statistics.median(r[k] for r in r0 if r[k] is not None)  # noqa: E731
            print(json.dumps(dict(mode=mode, backend=a.backend, gbps=a.gbps, buckets=r0[-1]["buckets"],
                                  before_last_grad=[r["before"] for r in r0],
                                  exposed_ms_median=round(med("exposed_ms"), 2),
                                  step_ms_median=round(med("step_ms"), 1))), flush=True)
    finally:
        w.close()


if __name__ == "__main__":
    main()
