"""The plain bucket modes: torch's all-reduce (and, on the CPU, large
gradients reduced where they are), the no-op hook, a sparse bucket, and any
Python comm hook.  The interface they answer is :mod:`.base`'s."""

from __future__ import annotations

import torch

from ..comm import Pending
from .datapath import (REDUCED_NONFINITE, Scaling, fill_flat, fill_flat_mixed, fill_native, flag_nonfinite,
                       sparse_zeros, take_sparse_grad, unpack_grads, unpack_sparse)
from .base import Reduction
from .kinds import Kind

__all__ = ["Reduction", "AllReduce", "NoOp", "SparseAllReduce", "PythonHook"]


def fused_state(hook_name: str, state, cls, group_ok: bool):
    """A fused-only hook's state: ``cls()`` for None, else checked to be a
    ``cls`` on the module's own group (errors name the hook and the fix)."""
    if state is None:
        state = cls()
    if not isinstance(state, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{hook_name} takes {article} {cls.__name__} (or None), got {type(state).__name__}")
    if not group_ok:
        raise ValueError(f"{hook_name} runs only as fastddp's fused path: its state's process_group "
                         "must be None or the DDP module's process group")
    return state


IN_PLACE_MIN_NUMEL = 1 << 20
"""On the CPU, a gradient of at least this many elements (4 MiB of fp32) may
be all-reduced where it is, skipping its copy into the bucket and back
(mlp25m's three weights, 2 ranks on 2 cores: ~17 ms less CPU per step and
rank); each such gradient costs one or two more collectives, so where
``FASTDDP_IN_PLACE_NUMEL`` is unset paired trial steps decide
(:func:`~fastddp.reduction.choices.in_place_choice`)."""


def _in_place_ok(g, flat: torch.Tensor, numel: int) -> bool:
    """``g`` can be scaled and all-reduced where it is: a dense, contiguous
    leaf gradient of the bucket's dtype filling its slot."""
    return (g is not None and g.layout is torch.strided and g.dtype is flat.dtype and not g.requires_grad
            and g.numel() == numel and g.device == flat.device and g.is_contiguous())


class AllReduce(Reduction):
    """SUM all-reduce of the flat bucket, pre-scaled by torch's rule.

    ``in_place_min`` (the CPU; None: never): a bucket holding gradients of at
    least that many elements is reduced segment by segment
    (:meth:`~fastddp.buckets.Bucket.segments`), one collective each, in slot
    order on every rank: each large gradient scaled in place (the same
    operation, so the same bits, as the copy into its slot) and all-reduced
    in ``.grad`` itself, the runs of smaller ones from the flat bucket as
    usual.  A large gradient that cannot be (missing, another dtype, not
    contiguous) goes through its slot instead: the collectives stay the
    same.  Not with bucket views (the grads are the bucket already),
    check_finite (one pass flags the flat bucket), mixed precision, or
    find_unused_parameters / static_graph (a globally unused ``.grad`` must
    stay as it was, which is known only after the packs)."""

    kind = Kind.ALLREDUCE

    def __init__(self, scaling: Scaling, fused: bool = False, in_place_min: int | None = None):
        self.scaling = scaling
        self.fused = fused
        self.in_place_min = in_place_min

    def early_copy(self, world: int) -> tuple[float, float] | None:
        if self.scaling is Scaling.MUL:
            return 1.0 / world, 0.0
        return 0.0, float(world)  # DIV: copy-then-divide as one division, the same bits

    def segments(self, ctx, bucket) -> tuple:
        """The bucket's segments when this mode reduces some of its grads
        where they are, else ``()`` (one collective of the flat bucket)."""
        if (self.in_place_min is None or ctx.view_mode or ctx.keeps_unused or ctx.pre_unpack is not None
                or bucket.health is not None):
            return ()
        return bucket.segments(self.in_place_min)

    def in_place(self, ctx, bucket) -> frozenset:
        return frozenset(pos for _, _, pos in self.segments(ctx, bucket) if pos >= 0)

    def pack_native(self, ctx, bucket) -> bool:
        return not self.segments(ctx, bucket) and fill_native(ctx, bucket, self.scaling)

    def pack(self, ctx, bucket, grads) -> None:
        segs = self.segments(ctx, bucket)
        if not segs:
            fill_flat(ctx, bucket, grads, self.scaling, bucket.health)
            return
        W = ctx.divisor()
        early = ctx.early_filled(bucket) if bucket.prefilled else bytes(bucket.size)
        bucket.prefilled = 0
        done = bytearray(bucket.size)  # reduced where they are: neither filled nor unpacked
        targets = []
        for start, stop, pos in segs:
            g = grads[pos] if pos >= 0 else None
            if pos >= 0 and not early[pos] and _in_place_ok(g, bucket.flat, stop - start):
                g.mul_(1.0 / W) if self.scaling is Scaling.MUL else g.div_(W)
                done[pos] = 1
                targets.append(g)
            else:
                targets.append(bucket.flat[start:stop])
        skip = bytes(a or b for a, b in zip(early, done))
        if not all(skip):
            fill_flat_mixed(ctx, bucket, grads, self.scaling, W, skip)
        bucket.in_place = (targets, done)

    def issue(self, ctx, bucket) -> Pending:
        if bucket.in_place is None:
            return ctx.comm.all_reduce(bucket.flat)
        return ctx.comm.all_reduce_each(bucket.in_place[0])

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        done, bucket.in_place = (None if bucket.in_place is None else bucket.in_place[1]), None
        unpack_grads(ctx, bucket, bucket.flat, track_unused, done if done and any(done) else None)

    def shadow(self, ctx, bucket) -> Pending:
        segs = self.segments(ctx, bucket)
        if not segs:
            return ctx.comm.all_reduce(torch.zeros_like(bucket.flat))
        return ctx.comm.all_reduce_each([bucket.flat.new_zeros(stop - start) for start, stop, _ in segs])


class NoOp(Reduction):
    """``noop_hook``: nothing on the wire, the grads left as they are."""

    kind = Kind.NOOP
    fused = True

    def pack(self, ctx, bucket, grads) -> None:
        fill_flat(ctx, bucket, grads, Scaling.NONE, bucket.health)

    def issue(self, ctx, bucket) -> Pending:
        return Pending()

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        unpack_grads(ctx, bucket, bucket.flat, track_unused)

    def shadow(self, ctx, bucket) -> Pending:
        return Pending()


class SparseAllReduce(Reduction):
    """A sparse parameter's bucket: its sparse .grad, divided by W in place,
    SUM-all-reduced (gloo gathers the indices)."""

    kind = Kind.SPARSE

    def pack(self, ctx, bucket, grads) -> None:
        take_sparse_grad(ctx, bucket).div_(ctx.divisor())

    def issue(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(bucket.sparse_grad, nbytes=bucket.nbytes())

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        unpack_sparse(bucket, result)

    def shadow(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(sparse_zeros(bucket), nbytes=0)


class PythonHook(Reduction):
    """A comm hook called with a :class:`~fastddp.hooks.GradBucket` (torch's
    contract: the bucket undivided; the Future holds the reduced tensor)."""

    kind = Kind.HOOK

    def __init__(self, hook, state):
        self.hook, self.state = hook, state

    def early_copy(self, world: int) -> tuple[float, float] | None:
        return 0.0, 0.0  # the bucket reaches the hook undivided: a plain copy

    def pack_native(self, ctx, bucket) -> bool:
        return not bucket.sparse and fill_native(ctx, bucket, Scaling.NONE)

    def pack(self, ctx, bucket, grads) -> None:
        if bucket.sparse:
            take_sparse_grad(ctx, bucket)
        else:
            fill_flat(ctx, bucket, grads, Scaling.NONE, bucket.health)

    def _call(self, ctx, bucket, buffer) -> Pending:
        from ..hooks import GradBucket

        layout = None if bucket.sparse else bucket.hook_layout
        fut = self.hook(self.state, GradBucket(bucket.index, ctx.num_buckets, buffer, bucket.params, layout))
        if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
            raise TypeError(
                f"fastddp: the comm hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(fut).__name__} for bucket {bucket.index}; it must return a "
                "torch.futures.Future whose value is the reduced bucket tensor")
        nbytes = bucket.nbytes() if bucket.sparse else buffer.numel() * buffer.element_size()
        return ctx.comm.hook(fut, nbytes)

    def issue(self, ctx, bucket) -> Pending:
        return self._call(ctx, bucket, bucket.hook_buffer())

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        if isinstance(result, (list, tuple)):
            result = result[0] if result else None
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"fastddp: the comm hook's Future for bucket {bucket.index} resolved to "
                f"{type(result).__name__}; it must hold one tensor (the reduced bucket)")
        if bucket.sparse:
            unpack_sparse(bucket, result)
            return
        if bucket.complex and not result.is_complex() and result.numel() == bucket.flat.numel():
            src = result.reshape(-1)  # c10d reduced the complex buffer as its real view
        elif result.numel() != bucket.hook_numel():
            raise ValueError(
                f"fastddp: the comm hook returned {result.numel()} elements for bucket "
                f"{bucket.index}, which holds {bucket.hook_numel()}; a hook must return a tensor "
                "with the bucket's numel")
        elif result.is_complex():
            src = torch.view_as_real(result.reshape(-1)).reshape(-1)
        elif result is bucket.flat:  # reduced in place (allreduce_hook): the native unpack takes it
            src = result
        else:
            src = result.reshape(-1)
        unpack_grads(ctx, bucket, src, track_unused)

    def check_result(self, bucket, result) -> None:
        """A hook reduces as it likes (PowerSGD, ...): check what it returned."""
        t = result[0] if isinstance(result, (list, tuple)) and result else result
        if isinstance(t, torch.Tensor):
            flag_nonfinite(bucket.health, t._values() if t.is_sparse else t, REDUCED_NONFINITE)

    def shadow(self, ctx, bucket) -> Pending:
        if bucket.sparse:
            bucket.sparse_grad = sparse_zeros(bucket)
            try:
                return self._call(ctx, bucket, bucket.sparse_grad)
            finally:
                bucket.sparse_grad = None
        return self._call(ctx, bucket, torch.zeros_like(bucket.hook_buffer()))

