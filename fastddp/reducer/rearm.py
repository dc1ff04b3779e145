"""A second backward through one forward's outputs (``retain_graph=True``,
two losses of one forward): reduced too, not just the first."""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from .. import compile as _compile

__all__ = ["SecondBackward"]


class SecondBackward:
    """Watches a synced forward's outputs and re-arms the reducer when a
    later backward reaches them.  The ``.grad`` then hold avg(g) from the
    first reduction (the same on every rank) plus this backward's local
    increment d: reducing the total gives avg(avg(g) + d) = avg(g) + avg(d) =
    avg(g + d), the average of what both backwards accumulated locally
    (exactly where the arithmetic is exact).  Every rank must run the same
    number of backwards, as it must run the same forwards.  A backward that
    reaches no DDP output (a forward through ``ddp.module``) stays local, as
    in torch."""

    def __init__(self, reducer):
        self._reducer = weakref.ref(reducer)
        self._reduced_at, self._unused = 0, []
        # one object for the reducer's life (compiled autograd would recompile
        # for a new hook each step); called eagerly under compiled autograd
        self._hook = _compile.eager(self._on_output)
        if reducer.arming.native is not None:  # (holds the hook, not this object: no cycle through C++)
            reducer.arming.native.set_on_output(self._hook)

    def watch(self, outputs: Sequence[torch.Tensor]) -> None:
        r = self._reducer()
        self._reduced_at, self._unused = r.steps_reduced, r.ready.unused
        if r.arming.native is not None:  # a C++ pre hook, which calls Python only where it may re-arm
            r.arming.native.watch(outputs)
            return
        seen = set()
        for t in outputs:
            fn = t.grad_fn  # a pre-hook on the node: a fifth of Tensor.register_hook's cost
            if fn is not None and fn not in seen:
                seen.add(fn)
                fn.register_prehook(self._hook)

    def _on_output(self, _grad_outputs):
        # An output's node runs before any parameter's AccumulateGrad of the
        # same backward: re-arming here is in time for all of them.
        r = self._reducer()
        if r is None or r.ready.expect_hooks or r.steps_reduced == self._reduced_at:
            return  # the forward's first backward (or one that failed) is still the one armed
        self._rearm(r)

    def _rearm(self, r) -> None:
        why = None
        if r.divisor.pending:
            why = ("inside join(): the ranks that have joined shadow one backward per forward "
                   "and would not match this one's collectives")
        elif r.co.refuse_extra_backward is not None:
            why = r.co.refuse_extra_backward()
        if why is not None:
            raise RuntimeError(
                f"fastddp: a second backward through the outputs of one DDP forward "
                f"(backward(retain_graph=True) twice, or two losses of one forward) on rank "
                f"{r.rank} cannot be averaged {why}. Sum the losses and call backward once, or "
                "run a new forward for each backward.")
        r.rearm(list(self._unused))
