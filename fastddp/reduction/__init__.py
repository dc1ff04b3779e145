"""How a bucket is reduced: one mode per bucket kind, chosen once by
:func:`choose`.

=================  ==================================================  ===============
mode (Kind)        what                                                scaling
=================  ==================================================  ===============
AllReduce          torch's default path / ``batched_grad_copy`` /      MUL / DIV
                   fastddp's (or torch's) ``allreduce_hook``
PythonHook         any other comm hook, called with a GradBucket       NONE (hook divides)
FusedCompression   fp16/bf16 hooks: scale in fp32, cast, 16-bit wire,  MUL, before the cast
                   optional error feedback in the same pack launch
Fp32Accumulate     ``bf16_fp32acc_hook``: the two-phase engine with    MUL, before the cast
                   a bf16 codec (fp32 shard sum, one rounding)
BlockFp8           ``fp8_compress_hook``: the two-phase engine with a  MUL, before quantizing
                   block-scaled e4m3 codec, fp32 shard sum
Hierarchical       ``hierarchical_hook``: fp32 inside each host, fp32/ MUL, at the pack
                   bf16/fp8 between hosts (the engine's rounds)
AutoPrecision      ``auto_precision_hook``: one of the modes above,     the chosen mode's
                   chosen from measured steps, switched between steps
NoOp               ``noop_hook``: nothing on the wire                  NONE
SiteLocal          cross-site training's inner reduction: the mean     MUL (1/L)
                   over the host's L ranks (:mod:`fastddp.cross_site`)
SparseAllReduce    a sparse parameter's bucket without a hook          DIV (in place)
=================  ==================================================  ===============

Layers, bottom up: :mod:`.context` (what a mode sees of a step),
:mod:`.datapath` (fill, unpack, bucket views), :mod:`.plain`,
:mod:`.compression` (16-bit wire, error-feedback residuals),
:mod:`.twophase` (all-to-all -> fp32 shard sum -> all-gather) with its codecs
:mod:`.fp32acc` and :mod:`.fp8`; :mod:`.sitelocal` (cross-site training's
inner reduction).  No mode sees the reducer: each call gets the
step's :class:`StepContext`.
"""

from __future__ import annotations

import functools

import torch

from .. import groups, kernels, settings
from .compression import FusedCompression, ResidualBook
from .context import StepContext
from .datapath import REDUCED_NONFINITE, Scaling, fill_flat, unpack_grads
from .fp8 import BlockFp8
from .fp32acc import Fp32Accumulate
from .hierarchical import Hierarchical
from .kinds import Kind
from .base import Reduction
from .plain import IN_PLACE_MIN_NUMEL, AllReduce, NoOp, PythonHook, SparseAllReduce, fused_state
from .twophase import CHUNK_BYTES, MAX_CHUNKS, PhaseTwo, TwoPhaseEngine, chunk_bounds

__all__ = ["Kind", "Scaling", "StepContext", "Reduction", "AllReduce", "PythonHook", "FusedCompression",
           "Fp32Accumulate", "BlockFp8", "Hierarchical", "NoOp", "SparseAllReduce", "TwoPhaseEngine", "ResidualBook", "choose",
           "fill_flat", "unpack_grads", "chunk_bounds", "CHUNK_BYTES", "MAX_CHUNKS", "REDUCED_NONFINITE",
           "IN_PLACE_MIN_NUMEL"]


def choose(hook, state, batched_grad_copy: bool, group_ok: bool,
           device: torch.device | None = None, pg=None, trial: bool = True,
           options=None, largest: int | None = None) -> tuple[Reduction, Reduction]:
    """The bucket modes for a DDP module: ``(dense, sparse)``.

    ``hook``/``state``: the registered comm hook (None: none); a hook tagged
    by :mod:`fastddp.hooks` runs as its fused path when ``group_ok`` (its
    state's group is the module's), else as an ordinary callback.
    ``device``: the parameters' (default CPU); it decides the kernel backend
    the modes pack with.  ``pg``: the module's process group (the
    hierarchical hook resolves its topology on it, collectively).  ``trial``:
    the CPU's in-place rule (no hook: :func:`_all_reduce`) and the run of
    ``bf16_fp32acc_hook`` and ``fp8_compress_hook`` at two ranks
    (:func:`.choices.two_rank_choice`) may be decided by trial steps; a mode
    that measures its own candidates passes False.
    ``options``: the module's resolved :class:`~fastddp.options.Options` (the
    in-place threshold, chunk bytes where a state sets none, ranks per host
    where a state sets none); None: :func:`fastddp.settings.effective`'s.
    ``largest``: the most elements of any dense parameter of the module (None:
    unknown); the in-place choice is not built where no gradient can use it
    (:func:`.choices.without_idle_choice`)."""
    dense, sparse = _choose(hook, state, batched_grad_copy, group_ok, device, pg, trial,
                            settings.effective() if options is None else options)
    if largest is not None:
        from .choices import without_idle_choice

        dense = without_idle_choice(dense, largest)
    return dense, sparse


def _choose(hook, state, batched_grad_copy, group_ok, device, pg, trial, options) -> tuple[Reduction, Reduction]:
    if hook is None:
        return _all_reduce(Scaling.DIV if batched_grad_copy else Scaling.MUL, device, options, trial=trial), \
            SparseAllReduce()
    from ..hook_states import CompressionState, FP8CompressionState

    tag = getattr(hook, "_fastddp_fused", None)
    _check_state(hook, tag, state)
    error_feedback = isinstance(state, CompressionState) and state.error_feedback
    if tag is None:
        return PythonHook(hook, state), PythonHook(hook, state)
    kind, dtype = tag
    if kind is Kind.AUTO:
        from .choices import build

        return build(state, batched_grad_copy, group_ok, device, pg, functools.partial(choose, options=options),
                     options.ranks_per_host)
    if kind is Kind.HIER:
        return _hierarchical(hook, state, group_ok, device, pg, options)
    if kind is Kind.SITE:
        from .sitelocal import SiteLocal, SiteState

        state = fused_state("site_local_hook", state, SiteState, group_ok)
        warm = None
        if state.warmup_wire != "exact":  # the warm-up on the hierarchical mode with that wire
            from ..hooks import HierarchicalState, hierarchical_hook

            hier = HierarchicalState(wire=state.warmup_wire, ranks_per_host=state.ranks_per_host)
            warm = _hierarchical(hierarchical_hook, hier, True, device, pg, options)[0]
        return SiteLocal(state, warm), PythonHook(hook, state)
    if kind is Kind.FP8:
        if not group_ok:
            raise ValueError("fp8_compress_hook runs only as fastddp's fused path: its state's "
                             "process_group must be None or the DDP module's process group")
        fp8_state = state if isinstance(state, FP8CompressionState) else FP8CompressionState()
        if state is not None and not isinstance(state, FP8CompressionState):
            raise TypeError(f"fp8_compress_hook takes an FP8CompressionState (or None), got {type(state).__name__}")
        kernels.prepare_fp8(device)  # its CPU loops' one-time build: now, not in a step
        mode = _phase_two(BlockFp8(fp8_state), device, pg, options)
        world = 1 if pg is None else groups.size(pg)
        if world < 2:
            mode.tunes_buckets = False  # one rank: no wire to tune the buckets for
        if trial and world == 2:
            from .choices import two_rank_choice

            mode = two_rank_choice(mode, _phase_two(BlockFp8(fp8_state, gather=mode), device, pg, options),
                                   fp8_state.error_feedback, device, pg, one="all-gather")
        return mode, PythonHook(hook, state)
    if error_feedback and kind not in (Kind.COMPRESS, Kind.FP32ACC):
        raise ValueError("CompressionState(error_feedback=True) applies to the fp16/bf16 "
                         "compression hooks and bf16_fp32acc_hook only")
    if not group_ok:
        if error_feedback:
            raise ValueError("fastddp: CompressionState.process_group must be None or the DDP "
                             "module's process group")
        return PythonHook(hook, state), PythonHook(hook, state)
    sparse = PythonHook(hook, state)  # sparse buckets: the hook itself, as torch
    if kind is Kind.ALLREDUCE:
        return _all_reduce(Scaling.DIV, device, options, fused=True), sparse
    if kind is Kind.NOOP:
        return NoOp(), sparse
    reference = kernels.backend(device) == "reference"
    if kind is Kind.FP32ACC:
        mode = _phase_two(Fp32Accumulate(error_feedback, getattr(state, "chunk_bytes", None), reference),
                          device, pg, options)
        if trial and pg is not None and groups.size(pg) == 2:
            from .choices import two_rank_choice

            mode = two_rank_choice(mode, FusedCompression(torch.bfloat16, error_feedback, reference),
                                   error_feedback, device, pg, one="all-reduce")
        return mode, sparse
    return FusedCompression(dtype, error_feedback, reference), sparse


def _check_state(hook, tag, state) -> None:
    """A fastddp hook state reaches the one hook it belongs to (each state is
    a class of its own: :data:`~fastddp.hook_states.STATES`), else a clear
    error naming the state, the hook and the fix."""
    from .. import hook_states as hs

    if not isinstance(state, hs.STATES):
        return  # None, a process group (torch's convention) or a user hook's own state
    name = getattr(hook, "__name__", hook)
    want = {Kind.FP8: (hs.FP8CompressionState, "fastddp.hooks.fp8_compress_hook"),
            Kind.HIER: (hs.HierarchicalState, "fastddp.hooks.hierarchical_hook"),
            Kind.AUTO: (hs.AutoPrecisionState, "fastddp.hooks.auto_precision_hook"),
            Kind.SITE: (hs.SiteState, "cross-site training's site_local_hook")}
    owner = next((h for cls, h in want.values() if isinstance(state, cls)),
                 "fastddp's compression hooks (fp16/bf16, bf16_fp32acc, allreduce, noop)")
    if tag is None:
        raise TypeError(f"{type(state).__name__} is the state of {owner}; {name!r} is not "
                        f"{'one of them' if isinstance(state, hs.CompressionState) else 'it'}")
    cls = want.get(tag[0], (hs.CompressionState, ""))[0]
    if not isinstance(state, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{name} takes {article} {cls.__name__} (or None), got {type(state).__name__} "
                        f"(the state of {owner})")


def _phase_two(mode, device, pg, options):
    """A two-phase mode: its rounds after the first on the module group's
    phase-2 thread where waits block the host (:class:`~.twophase.PhaseTwo`);
    the options' chunk bytes where its state set none."""
    mode.engine.phase_two = PhaseTwo.of(pg, device, kernels.backend(device))
    if mode.engine.chunk_bytes is None:
        mode.engine.chunk_bytes = options.chunk_bytes
    return mode


def _all_reduce(scaling: Scaling, device, options, fused: bool = False, trial: bool = True) -> Reduction:
    """The plain all-reduce.  On the CPU its large grads may be reduced where
    they are: ``FASTDDP_IN_PLACE_NUMEL`` elements or more where set (0:
    never), else (auto) where paired trial steps measure it faster than one
    collective per bucket (``trial``; without: never).  On a GPU the one fused
    pack is the point."""
    cpu = device is None or torch.device(device).type == "cpu"
    least = options.in_place_numel
    least = None if least == "auto" else least
    if not cpu or least == 0 or (least is None and not trial):
        return AllReduce(scaling, fused=fused)
    if least is None:
        from .choices import in_place_choice

        return in_place_choice(scaling, fused, IN_PLACE_MIN_NUMEL)
    return AllReduce(scaling, fused=fused, in_place_min=least)


def _hierarchical(hook, state, group_ok: bool, device, pg, options) -> tuple[Reduction, Reduction]:
    """``hierarchical_hook``: the topology resolved on ``pg`` (collective),
    its sub-groups made once; where it cannot apply, the same wire flat."""
    import logging

    from .. import topology
    from ..hooks import HierarchicalState

    state = fused_state("hierarchical_hook", state, HierarchicalState, group_ok)
    sparse = PythonHook(hook, state)
    topo = topology.resolve(pg, state.ranks_per_host or options.ranks_per_host)
    if isinstance(topo, topology.Flat):
        if groups.rank(pg) == 0:
            logging.getLogger("fastddp.topology").warning(
                "fastddp: hierarchical_hook(wire=%s) runs flat: %s", state.wire, topo.why)
        if state.wire == "fp32":
            return _all_reduce(Scaling.MUL, device, options, fused=True), sparse
        if state.wire == "bf16":
            reference = kernels.backend(device) == "reference"
            return (_phase_two(Fp32Accumulate(state.error_feedback, state.chunk_bytes, reference), device, pg,
                               options), sparse)
        kernels.prepare_fp8(device)
        return _phase_two(BlockFp8(state), device, pg, options), sparse
    if state.wire == "fp8":
        kernels.prepare_fp8(device)
    inside, across = topology.subgroups(pg, topo)
    mode = _phase_two(Hierarchical(state, topo, inside, across), device, pg, options)
    if mode.engine.phase_two is not None:  # the thread runs every round after the first: the last one inside the host
        mode.inside_late = topology.late_inside(pg, topo)  # on a group of its own (across: the thread's alone)
    return mode, sparse
