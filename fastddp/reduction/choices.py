"""The modes built from :class:`~.autoprec.AutoPrecision`'s measured
choice: ``auto_precision_hook`` (the wire format), the CPU's plain
all-reduce where ``FASTDDP_IN_PLACE_NUMEL`` is unset (the in-place layout)
and the two-phase hooks at two ranks (two phases or one collective)."""

from __future__ import annotations

import torch

from .autoprec import LOWEST_INDEX, ORDER, AutoPrecision
from .plain import AllReduce, Reduction, SparseAllReduce, fused_state
from .stepclock import decision_group

__all__ = ["build", "in_place_choice", "two_rank_choice", "without_idle_choice"]


def build(state, batched_grad_copy: bool, group_ok: bool, device, pg, choose, ranks_per_host=None):
    """``(dense, sparse)`` modes for ``auto_precision_hook``: its candidates
    built as their own hooks' fused paths by ``choose``
    (:func:`fastddp.reduction.choose`, passed in: this module sits below the
    package); sparse buckets as without a hook.  ``ranks_per_host``: the
    module options' where the state sets none."""
    from .. import topology
    from ..hooks import (AutoPrecisionState, CompressionState, FP8CompressionState, HierarchicalState,
                         bf16_fp32acc_hook, fp8_compress_hook, hierarchical_hook)

    state = fused_state("auto_precision_hook", state, AutoPrecisionState, group_ok)
    hosts_of = state.ranks_per_host or ranks_per_host
    topo = topology.resolve(pg, hosts_of)  # collective where nothing explicit is set
    hosts = not isinstance(topo, topology.Flat)
    ef, cb = state.error_feedback, state.chunk_bytes

    def hier(wire):
        hs = HierarchicalState(wire=wire, ranks_per_host=hosts_of, error_feedback=ef and wire != "fp32",
                               block_size=state.block_size, chunk_bytes=cb)
        return choose(hierarchical_hook, hs, batched_grad_copy, True, device, pg)[0]

    makers = {
        "fp32": lambda: choose(None, None, batched_grad_copy, True, device, trial=False)[0],  # one trial at a time
        "hier-fp32": lambda: hier("fp32"),
        "bf16": lambda: choose(bf16_fp32acc_hook, CompressionState(error_feedback=ef, chunk_bytes=cb),
                               batched_grad_copy, True, device, pg, trial=False)[0],
        "hier-bf16": lambda: hier("bf16"),
        "fp8": lambda: choose(fp8_compress_hook, FP8CompressionState(block_size=state.block_size,
                                                                     error_feedback=ef, chunk_bytes=cb,
                                                                     tune_buckets=False),  # auto's own ask
                              batched_grad_copy, True, device, pg, trial=False)[0],
        "hier-fp8": lambda: hier("fp8"),
    }
    names = [n for n in ORDER[:LOWEST_INDEX[state.lowest]] if hosts or not n.startswith("hier-")]
    where = topo.describe() if hosts else f"flat ({topo.why})"
    mode = AutoPrecision(state, {n: makers[n]() for n in names}, device, where)
    if len(names) > 1:  # one format makes no decisions
        mode.side, mode.decided_on = decision_group(pg, device)
    return mode, SparseAllReduce()


def in_place_choice(scaling, fused: bool, least: int) -> Reduction:
    """The CPU's plain all-reduce where ``FASTDDP_IN_PLACE_NUMEL`` is unset
    (auto): one collective per bucket (``flat``, torch's count) unless paired
    trial steps measure reducing the gradients of ``least`` elements or more
    where they are (``in-place``: no copy into the bucket and back, one
    collective per segment) faster by more than the margin over the whole
    interval.  No bucket with such a gradient (or an option that keeps one
    collective per bucket): flat at once, no trial, no collective of its own."""
    from ..hooks import AutoPrecisionState

    flat, split = AllReduce(scaling, fused), AllReduce(scaling, fused, in_place_min=least)
    state = AutoPrecisionState(lowest="fp32", error_feedback=False, watch=False, tune_buckets=False)
    mode = AutoPrecision(state, {"flat": flat, "in-place": split}, label="in_place",
                         differs=lambda ctx, bucket: bool(split.segments(ctx, bucket)))
    mode.kind, mode.fused = flat.kind, fused
    return mode


def without_idle_choice(mode: Reduction, largest: int) -> Reduction:
    """``mode``, or the flat candidate of an in-place choice (see
    :func:`in_place_choice`) where no dense parameter has its threshold's
    elements (``largest``: the most any has): no bucket of any plan can then
    be cut (:meth:`~fastddp.buckets.Bucket.segments` depends on the
    parameters' sizes alone), so the choice would settle on flat at its first
    look, and its delegation would cost each bucket of every step a dozen
    Python calls for nothing (a model of many mid-sized tensors: the
    transformer's 262,144-element weights, the convnet's)."""
    if isinstance(mode, AutoPrecision) and mode.label == "in_place" and largest < mode.modes["in-place"].in_place_min:
        return mode.modes["flat"]
    return mode


def two_rank_choice(two_phase: Reduction, one_call: Reduction, error_feedback: bool, device=None,
                    pg=None, one: str = "all-reduce") -> Reduction:
    """A two-phase hook at two ranks: its two phases (all-to-all, fp32 shard
    sum, all-gather: two collectives a bucket) unless paired trial steps
    measure ``one_call`` (one collective a bucket, candidate ``one``) faster
    by more than the margin over the whole interval.  Both give the same
    bits at two ranks:

    * ``bf16_fp32acc_hook`` / ``one="all-reduce"`` (torch's fp16/bf16 hook's
      collective on the same bf16 wire): each element is ``a + b`` of two
      bf16 values rounded once to bf16 (the fp32 add is exact unless the
      exponents lie 16 or more apart, where both round to the larger value);
      only at three ranks or more does the all-reduce's per-hop rounding
      differ.
    * ``fp8_compress_hook`` / ``one="all-gather"`` (:class:`~.fp8wire.Fp8Gather`):
      the whole fp8 bucket all-gathered, then summed and quantized again by
      the shard sum's own kernel over the whole bucket (the same bytes each
      way at two ranks, more CPU or GPU time for the sum: a trade only a
      measurement settles).

    The pack, the unpack and the error-feedback residual (bucket-shaped in
    both) are the same, so a switch carries the residuals over.
    ``device``, ``pg``: as for auto precision, its clock (CUDA events on
    CUDA) and the group its decisions are reduced on."""
    from ..hooks import AutoPrecisionState

    lowest = "fp8" if two_phase.wire_dtype == torch.float8_e4m3fn else "bf16"  # stats: the wire both send
    state = AutoPrecisionState(lowest=lowest, error_feedback=error_feedback, watch=False,
                               tune_buckets=two_phase.tunes_buckets)  # the hook's ask, after this choice
    mode = AutoPrecision(state, {"two-phase": two_phase, one: one_call}, device, label="two_ranks")
    mode.kind = two_phase.kind  # fused already, as every AutoPrecision
    mode.side, mode.decided_on = decision_group(pg, device)
    return mode
