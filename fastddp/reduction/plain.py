"""The plain bucket modes and the interface every mode answers.

Every mode answers the same calls, made by the reducer with the step's
:class:`~fastddp.reduction.context.StepContext` (never the reducer):

* ``pack(ctx, bucket, grads)``  -- the bucket's grads into what goes on the
  wire (ONE fused launch where the grads are separate tensors), scaled by the
  mode's rule;
* ``issue(ctx, bucket)``        -- start the collective, return its ``Pending``;
* ``unpack(ctx, bucket, result, track_unused)`` -- the reduced values into
  ``.grad`` (ONE launch, or none where the grads are bucket views);
* ``shadow(ctx, bucket)``       -- join(): the same collective on zeros;
* ``early_copy(world)``         -- whether the native hooks may copy each grad
  into its slot as it arrives, and how it is scaled;
* ``carry_over(...)``           -- a rebuild replaced the buckets;
* ``residual_of(b)``, ``freeze(why)`` -- bucket ``b``'s error-feedback
  residual (None: none); join(): stop anything that needs collectives.
"""

from __future__ import annotations

import torch

from ..comm import Pending
from .datapath import (REDUCED_NONFINITE, Scaling, fill_flat, flag_nonfinite, sparse_zeros,
                       take_sparse_grad, unpack_grads, unpack_sparse)
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


class Reduction:
    """One bucket mode (see the module docstring)."""

    kind: Kind
    scaling: Scaling = Scaling.NONE
    fused: bool = False
    """A fastddp hook run as this fused path (not as a Python callback)."""
    wire_dtype: torch.dtype | None = None
    """The dtype on the wire where the mode fixes it (None: the bucket's)."""

    def pack(self, ctx, bucket, grads) -> None:
        fill_flat(ctx, bucket, grads, self.scaling, bucket.health)

    def issue(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(bucket.flat)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        unpack_grads(ctx, bucket, bucket.flat, track_unused)

    def check_result(self, bucket, result) -> None:
        """check_finite, after the collective: modes whose packs set the flag need nothing."""

    def shadow(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(torch.zeros_like(bucket.flat))

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """A rebuild replaced the buckets: move per-parameter state along."""

    def residual_of(self, bucket_index: int) -> torch.Tensor | None:
        """Bucket ``bucket_index``'s error-feedback residual (None: the mode keeps none)."""
        return None

    def freeze(self, why: str) -> None:
        """join() is starting (every rank at the same step): from now on the
        mode issues no collective of its own beyond the buckets'."""

    def early_copy(self, world: int) -> tuple[float, float] | None:
        """On the CPU the native hooks may copy each grad into its bucket slot
        as it arrives, scaled as this mode's pack would: ``(scale, divide)``
        (scale 0: a plain copy, else multiply by it; divide > 0: divide by it
        instead), or None where the mode's pack must see the grads itself."""
        return None


class AllReduce(Reduction):
    """SUM all-reduce of the flat bucket, pre-scaled by torch's rule."""

    kind = Kind.ALLREDUCE

    def __init__(self, scaling: Scaling, fused: bool = False):
        self.scaling = scaling
        self.fused = fused

    def early_copy(self, world: int) -> tuple[float, float] | None:
        if self.scaling is Scaling.MUL:
            return 1.0 / world, 0.0
        return 0.0, float(world)  # DIV: copy-then-divide as one division, the same bits


class NoOp(Reduction):
    """``noop_hook``: nothing on the wire, the grads left as they are."""

    kind = Kind.NOOP
    fused = True

    def issue(self, ctx, bucket) -> Pending:
        return Pending()

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

    def pack(self, ctx, bucket, grads) -> None:
        if bucket.sparse:
            take_sparse_grad(ctx, bucket)
        else:
            fill_flat(ctx, bucket, grads, Scaling.NONE, bucket.health)

    def _call(self, ctx, bucket, buffer) -> Pending:
        from ..hooks import GradBucket

        layout = None if bucket.sparse else bucket.hook_layout
        fut = self.hook(self.state, GradBucket(bucket.index, ctx.num_buckets, buffer, bucket.params,
                                               None, layout))
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

