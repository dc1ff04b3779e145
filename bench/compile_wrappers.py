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

__all__ = ["COMPILE_WRAPPERS", "specs", "first_grad_node"]

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


# -- shared with the overlap probe (tools/compile_overlap.py) and the tests ------------

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
