"""``torch.compile`` rows for the end-to-end runner (see :mod:`bench.wrappers`).

=================  ===========================================================
name               what
=================  ===========================================================
torch-compile      torch.compile(torch DDP), default (inductor) backend; the
                   graph is split at its buckets by dynamo's DDPOptimizer
fastddp-compile    torch.compile(fastddp DDP), the same; fastddp is dynamo's
                   active DDP module, so the split follows fastddp's buckets
=================  ===========================================================

Compilation happens in the runner's warm-up steps (the first call of a
compiled module compiles it; on CPU inductor builds C++ and takes seconds to
minutes).  torch's DDP cannot be compiled with ``bucket_cap_mb < 1`` (its
DDPOptimizer asserts that the 1 MiB first bucket is not larger than the cap):
the torch row is then reported unavailable, fastddp's row still runs.

Registered by :func:`specs`, which :func:`bench.wrappers.registry` extends its
list with, handing in the spec class and the two DDP factories: this module
imports nothing from :mod:`bench.wrappers` (no import circle); nothing runs
at import.
"""

from __future__ import annotations

import functools

__all__ = ["COMPILE_WRAPPERS", "specs"]

#: Not in the default set (compiling costs minutes on CPU): ask for them with
#: ``--wrappers ...,torch-compile,fastddp-compile``.
COMPILE_WRAPPERS = ("torch-compile", "fastddp-compile")


def _compiled(build, model, process_group, options, backend: str | None = None, *, torch_ddp: bool = False):
    import torch

    if torch_ddp and options.bucket_cap_mb is not None and options.bucket_cap_mb < 1:
        raise RuntimeError("torch's DDP fails to compile with bucket_cap_mb < 1 (DDPOptimizer: first "
                           "bucket larger than the cap)")
    if torch_ddp and getattr(options, "wire", None) is not None:
        raise RuntimeError("torch's compiled DDP traces its collectives by group name, which a Python "
                           "process group (the simulated wire) does not have in c10d's registry")
    ddp, note = build(model, process_group, options)
    compiled = torch.compile(ddp) if backend is None else torch.compile(ddp, backend=backend)
    # The runner reads counters (bytes on the wire, stats) from the module it
    # gets: the compiled wrapper forwards attribute reads to the DDP module.
    what = f"torch.compile({type(ddp).__module__.split('.')[0]} DDP{', ' + backend if backend else ''})"
    return compiled, "; ".join(n for n in (what, note) if n)


def specs(spec, torch_factory, fastddp_factory) -> list:
    """The compile rows as ``spec`` objects (:class:`bench.wrappers.WrapperSpec`),
    compiling what ``torch_factory`` / ``fastddp_factory`` build."""
    P = functools.partial
    return [
        spec("torch-compile", "torch", "compile", P(_compiled, torch_factory, torch_ddp=True)),
        spec("fastddp-compile", "fastddp", "compile", P(_compiled, fastddp_factory),
             baselines=("torch-compile", "torch")),
    ]


# -- overlap probe: ``python -m bench.compile_wrappers`` -----------------------------

def first_grad_node(loss, param):
    """The autograd node whose output is ``param``'s gradient (the probes hook it)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is param:
                return fn
            stack.append(nxt)
    raise RuntimeError("no autograd node produces the first parameter's gradient")


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
    sys.path.insert(0, root)
    from bench.compile_wrappers import overlap_rank  # by module name: the ranks import it
    from tests._dist import World

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
