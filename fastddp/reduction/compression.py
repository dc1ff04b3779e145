"""fastddp's fp16/bf16 hooks as a fused path, and the error-feedback
residuals every compressed mode keeps (:class:`ResidualBook`)."""

from __future__ import annotations

import torch

from .. import kernels
from ..comm import Pending
from .datapath import Scaling, alias_views, fill_flat, plain_grads, unpack_grads
from .kinds import Kind
from .base import Reduction

__all__ = ["ResidualBook", "FusedCompression"]


class ResidualBook:
    """Error-feedback residuals per bucket (fp32, one slot per parameter
    element, laid out like the bucket), and which buckets are packed but not
    yet unpacked.  A residual written by a pack whose iteration never reached
    its unpack (a caught error: check_finite, a failed hook, an exception in
    backward) is zeroed at the bucket's next pack: it would carry part of a
    gradient the user never applied.  At a rebuild the finished residuals
    follow their parameters into the new buckets (:meth:`carry_residuals`),
    copied there when each new bucket's residual is first sized."""

    def __init__(self, error_feedback: bool):
        self.error_feedback = error_feedback
        self.residual: dict[int, torch.Tensor] = {}
        self.unfinished: set[int] = set()  # buckets packed whose unpack has not run yet
        self._carry = None  # (old residuals, old locate, new buckets not yet sized)

    def residual_for_pack(self, bucket, numel: int) -> torch.Tensor | None:
        """The residual the bucket's pack reads and rewrites (None without
        error feedback): ``numel`` fp32 elements, the bucket's first."""
        res = None
        if self.error_feedback:
            res = self.residual.get(bucket.index)
            if res is None or res.numel() != numel:
                res = self.residual[bucket.index] = self._new_residual(bucket, numel)
            elif bucket.index in self.unfinished:
                res.zero_()  # the last pack's iteration was abandoned: its residual is stale
        self.unfinished.add(bucket.index)
        return res

    def finished(self, bucket) -> None:
        """The bucket's unpack ran: its residual is current."""
        self.unfinished.discard(bucket.index)

    def residual_of(self, bucket_index: int) -> torch.Tensor | None:
        return self.residual.get(bucket_index)

    def finished_residuals(self) -> dict:
        """The residuals of buckets whose last pack reached its unpack (the
        others are stale), by bucket index; the book is left empty."""
        out = {i: t for i, t in self.residual.items() if i not in self.unfinished}
        self.clear()
        return out

    def clear(self) -> None:
        """Every residual dropped (a rebuild that changes their layout)."""
        self.residual, self.unfinished, self._carry = {}, set(), None

    def adopt(self, bucket, values: torch.Tensor | None, numel: int) -> torch.Tensor:
        """Start ``bucket``'s residual of ``numel`` elements from another
        mode's (its first ``bucket.flat.numel()`` elements, laid out like the
        bucket), or from zeros (``values`` None); returns it.  ``values`` is
        handed over, not shared (its last owner emptied its book): where it is
        fp32, on the bucket's device and large enough, it becomes the residual
        itself, so a change of format allocates and copies nothing (on the CPU
        a fresh 100 MB residual cost ~60 ms of page faults, ~90 with the copy:
        a bias against every compressed format in auto precision's trial,
        which switches at every step)."""
        n = bucket.flat.numel()
        if (values is not None and values.dtype == torch.float32 and values.device == bucket.flat.device
                and values.dim() == 1 and values.stride(0) == 1
                and values.untyped_storage().nbytes() // 4 >= values.storage_offset() + numel):
            # the whole memory, also where ``values`` is a shorter view of it (the bf16 wire's residual
            # in an fp8 one's padded storage)
            res = values.as_strided((numel,), (1,))
            res[n:].zero_()  # a padded tail is laid out like no bucket
        else:
            res = torch.zeros(numel, dtype=torch.float32, device=bucket.flat.device)
            if values is not None:
                k = min(n, values.numel(), numel)
                res[:k].copy_(values[:k])
        self.residual[bucket.index] = res
        self.unfinished.discard(bucket.index)
        return res

    def carry_residuals(self, old_locate, new_buckets) -> None:
        """A rebuild: the residuals worth carrying (stale ones dropped) wait
        for the new buckets; the book starts empty."""
        old = {i: t for i, t in self.residual.items() if i not in self.unfinished}
        self.residual, self.unfinished = {}, set()
        self._carry = (old, old_locate, {b.index for b in new_buckets if not b.sparse}) \
            if self.error_feedback and old else None

    def _new_residual(self, bucket, numel: int) -> torch.Tensor:
        res = torch.zeros(numel, dtype=torch.float32, device=bucket.flat.device)
        if self._carry is not None:
            old_res, old_locate, todo = self._carry
            views = bucket.layout.views(res)
            for pos, i in enumerate(bucket.indices):
                ob, opos = old_locate[i]
                if ob.index in old_res:
                    views[pos].copy_(ob.layout.views(old_res[ob.index])[opos])
            todo.discard(bucket.index)
            if not todo:
                self._carry = None
        return res


class FusedCompression(Reduction):
    """fastddp's fp16/bf16 hooks as a fused path: the pack scales by fp32(1/W)
    and casts into a 16-bit wire buffer (allocated once per bucket) in ONE
    launch, optionally with error feedback (an fp32 residual per bucket, read
    and rewritten by the same launch: the :class:`ResidualBook` it holds);
    all-reduce on the wire; the unpack casts back.  ``reference``: the
    bucket's device is served by the plain torch backend (decided once, by
    :func:`~fastddp.reduction.choose`).  ``wire_numel(ctx, bucket)``: the
    wire's elements where they are more than the bucket's (a two-phase wire
    padded to whole shards: :class:`~fastddp.reduction.fp32acc.Fp32Accumulate`
    holds one of these as its codec's cast)."""

    kind = Kind.COMPRESS
    scaling = Scaling.MUL
    fused = True

    def __init__(self, dtype: torch.dtype, error_feedback: bool, reference: bool = False, wire_numel=None):
        self.book = ResidualBook(error_feedback)
        self.dtype = self.wire_dtype = dtype
        self.reference = reference
        self.wire: dict[int, torch.Tensor] = {}
        self._wire_numel = wire_numel

    def wire_numel(self, ctx, bucket) -> int:
        """Elements of the bucket's wire buffer (its first ``flat.numel()`` are the bucket's)."""
        return bucket.flat.numel() if self._wire_numel is None else self._wire_numel(ctx, bucket)

    def adopt_residual(self, ctx, bucket, values) -> bool:
        if not self.book.error_feedback:
            return False
        self.book.adopt(bucket, values, bucket.flat.numel())
        return True

    def buffer(self, ctx, bucket) -> torch.Tensor:
        """The bucket's wire buffer, sized (zeros) the first time."""
        w = self.wire.get(bucket.index)
        numel = self.wire_numel(ctx, bucket)
        if w is None or w.numel() != numel:
            # zeros: a padded wire's tail is never written by the pack
            w = self.wire[bucket.index] = torch.zeros(numel, dtype=self.dtype, device=bucket.flat.device)
        return w

    def pack(self, ctx, bucket, grads) -> None:
        wire = self.buffer(ctx, bucket)
        residual, health = self.book.residual_for_pack(bucket, bucket.flat.numel()), bucket.health
        if self.reference:
            # CPU (no Triton): the bucket is the scratch, scaled in place
            # (x * fp32(1/W), as the kernel) and cast into the wire: no
            # bucket-sized temporary, a few ops per bucket.  The flag is the
            # cast's alone: it reads every value fill_flat wrote (x * fp32(1/W)
            # is finite exactly when x is), so fill_flat does not flag them too.
            fill_flat(ctx, bucket, grads, Scaling.MUL)
            kernels.pack([bucket.flat], wire, layout=bucket.flat_layout, residual=residual, health=health)
            return
        scale = 1.0 / ctx.divisor()
        if plain_grads(ctx, bucket, grads):
            # ONE launch: separate grads -> scale in fp32 -> 16-bit wire (+ residual, + health).
            kernels.pack(bucket.kernel_grads(grads), wire, layout=bucket.layout, scale=scale,
                         residual=residual, health=health)
            alias_views(ctx, bucket, grads)
            return
        fill_flat(ctx, bucket, grads, Scaling.NONE)  # flagged once, by the cast that reads it all
        kernels.pack([bucket.flat], wire, layout=bucket.flat_layout, scale=scale, residual=residual,
                     health=health)

    def issue(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(self.wire[bucket.index])

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        self.book.finished(bucket)
        unpack_grads(ctx, bucket, self.wire[bucket.index], track_unused)

    def shadow(self, ctx, bucket) -> Pending:
        return ctx.comm.all_reduce(torch.zeros_like(self.buffer(ctx, bucket)))

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """Residuals follow their parameters (:class:`ResidualBook`); wire
        buffers are made anew."""
        self.book.carry_residuals(old_locate, new_buckets)
        self.wire = {}
