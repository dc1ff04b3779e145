"""The side-by-side parity harness: torch's DDP and the wrapper under test,
trained together inside one rank of one process group.

:func:`side_by_side` runs INSIDE every rank (call it from a body that
``world.run`` sends).  The same module is built once and deep-copied; one
copy is wrapped in the reference (default :func:`tests._dist.torch_reference`,
torch's DDP, adapted where this torch lacks an argument), the other in the
wrapper under test (default :func:`tests._dist.ddp_class`), both with the same
options; both see the same per-rank data.  Each step runs the reference's
forward + backward, then the test's, so both issue their collectives in the
same order on every rank.  Checked, every one bit for bit unless ``tol`` is
given (:mod:`tests._compare`):

* the state after construction (the init sync);
* at the start of each step, the grads after ``zero_grad``;
* every ``.grad`` after EVERY backward (``no_sync`` micro-steps included),
  and the losses (bit for bit; none with ``tol``);
* after each optimizer step, the state (parameters and buffers);
* at the end, with ``check_synced``: every rank holds the same parameters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Callable

import torch

from tests._compare import compare_grads, compare_state
from tests._dist import ddp_class, torch_reference
from tests._models import loss_fn, make_batch, make_model

__all__ = ["SGD_MOMENTUM", "SideBySide", "side_by_side"]

#: the optimizer both wrappers step unless told otherwise (``torch.optim.SGD``'s arguments)
SGD_MOMENTUM = dict(lr=0.05, momentum=0.9)


@dataclasses.dataclass
class SideBySide:
    """What :func:`side_by_side` leaves for the caller's own checks."""
    ref: torch.nn.Module
    """the reference wrapper (torch's DDP)"""
    test: torch.nn.Module
    """the wrapper under test"""
    checks: int
    """how many backward passes had every ``.grad`` compared"""


def _perturb(module, rank, buffers, params):
    with torch.no_grad():
        if buffers:  # rank-local buffers: the init sync (or its absence) must show
            for b in module.buffers():
                if b.is_floating_point():
                    b.add_(0.25 * (rank + 1))
        if params:
            for p in module.parameters():
                p.add_(0.01 * rank)


def _register(ddp, hook, is_ref):
    spec = hook(is_ref) if callable(hook) else hook
    if spec is not None:
        ddp.register_comm_hook(*spec)


def side_by_side(
    rank: int,
    world_size: int,
    model: str | Callable[[], torch.nn.Module],
    *,
    kwargs: dict | None = None,
    ref_kwargs: dict | None = None,
    test_kwargs: dict | None = None,
    make_ref: Callable[..., torch.nn.Module] | None = None,
    make_test: Callable[..., torch.nn.Module] | None = None,
    hook: Any = None,
    steps: int = 4,
    no_sync_micro: int = 0,
    batch: Callable[[int, int], Any] | None = None,
    step_fn: Callable[..., torch.Tensor] | None = None,
    optim: dict | None = SGD_MOMENTUM,
    set_to_none: bool = True,
    tol: dict | None = None,
    check_synced: bool = True,
    perturb_buffers: bool = False,
    perturb_params: bool = False,
) -> SideBySide:
    """Train the reference and the wrapper under test side by side; see the
    module docstring for what is compared.

    * ``model``: a :func:`tests._models.make_model` name (built with seed 7,
      called with ``step=`` and ``rank=``) or a function that builds the module.
    * ``kwargs``: the options of both wrappers; ``ref_kwargs`` /
      ``test_kwargs``: added for one of them only (e.g. a process group).
    * ``make_ref(module, **options)`` / ``make_test(module, **options)``: build
      the wrappers.  The default reference is :func:`torch_reference`, told
      ``hook=True`` when a hook is given.
    * ``hook``: ``(state, hook)`` registered on both, or a function
      ``hook(is_ref) -> (state, hook) | None`` (a fresh state per wrapper,
      another hook for each, or none on one of them).
    * ``no_sync_micro``: backward passes under ``no_sync()`` before each
      synchronising one.
    * ``batch(step, micro) -> (x, y)``: the rank's data (default:
      :func:`make_batch` of the model's name for this rank).
    * ``step_fn(ddp, x, y, step, is_ref) -> loss``: one forward + backward of
      one wrapper (default: ``loss_fn(ddp(x, step=, rank=), y).backward()``,
      without ``step=``/``rank=`` for a module built by a function).
    * ``optim``: ``torch.optim.SGD`` arguments, or ``None`` for no optimizer
      (the grads are then set to None before each step).
    * ``set_to_none``: ``zero_grad``'s argument before each step (the last
      step's grads stay for the caller).
    * ``tol``: ``dict(rtol=, atol=)`` instead of bit for bit (worlds >= 3,
      compiled code).
    * ``check_synced``: at the end, every rank holds the same parameters (off
      for hooks that do not average).
    * ``perturb_buffers`` / ``perturb_params``: make the module's floating
      buffers / parameters rank-local before wrapping (the init sync shows).
    """
    named = isinstance(model, str)
    torch.manual_seed(1234)
    base = make_model(model, seed=7) if named else model()
    _perturb(base, rank, perturb_buffers, perturb_params)
    m_ref, m_test = base, copy.deepcopy(base)
    options = dict(kwargs or {})
    if make_ref is None:
        make_ref = functools.partial(torch_reference, hook=hook is not None)
    ref = make_ref(m_ref, **options, **(ref_kwargs or {}))
    test = (make_test or ddp_class())(m_test, **options, **(test_kwargs or {}))
    if hook is not None:
        _register(ref, hook, True)
        _register(test, hook, False)
    compare_state(ref, test, f"rank {rank} after construction", tol)

    if batch is None:
        if not named:
            raise TypeError("side_by_side: a model built by a function needs batch=")
        batch = functools.partial(make_batch, model, rank)
    if step_fn is None:
        def step_fn(ddp, x, y, step, is_ref):
            out = ddp(x, step=step, rank=rank) if named else ddp(x)
            loss = loss_fn(out, y)
            loss.backward()
            return loss
    opts = None if optim is None else [torch.optim.SGD(d.parameters(), **optim) for d in (ref, test)]

    def backward_both(step, micro, where):
        """One backward of each wrapper on the same batch (micro > 0: under no_sync)."""
        x, y = batch(step, micro)
        losses = []
        for d in (ref, test):
            with d.no_sync() if micro else contextlib.nullcontext():
                losses.append(step_fn(d, x, y, step, d is ref))
        if tol is None and all(isinstance(v, torch.Tensor) for v in losses):
            lr_, lt_ = (v.detach() for v in losses)
            assert torch.equal(lr_, lt_), f"{where}: loss differs: torch {lr_}, test {lt_}"
        compare_grads(ref, test, where, tol)

    checks = 0
    for step in range(steps):
        if opts is not None:
            for o in opts:
                o.zero_grad(set_to_none=set_to_none)
        else:
            for d in (ref, test):
                d.module.zero_grad(set_to_none=True)
        compare_grads(ref, test, f"rank {rank} step {step} after zero_grad", tol)
        for micro in range(1, no_sync_micro + 1):
            backward_both(step, micro, f"rank {rank} step {step} no_sync micro-step {micro - 1}")
        backward_both(step, 0, f"rank {rank} step {step} after backward")
        checks += no_sync_micro + 1
        if opts is not None:
            for o in opts:
                o.step()
        compare_state(ref, test, f"rank {rank} step {step} after the optimizer step", tol)
    if check_synced:
        flat = torch.cat([p.detach().double().flatten() for p in test.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, flat)
        for r in range(world_size):
            assert torch.equal(gathered[r], flat), f"parameters on rank {r} differ from rank {rank}'s"
    return SideBySide(ref, test, checks)
