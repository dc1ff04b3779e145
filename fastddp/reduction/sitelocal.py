"""Cross-site training's inner reduction (:class:`SiteLocal`): each bucket
averaged over the ranks of this rank's host only, exactly as torch's DDP over
those ranks would (``grad * fp32(1/L)`` in the one fused pack, a SUM
all-reduce of the flat bucket on the host's group, the unpack); during the
warm-up the whole group's plain all-reduce (torch's default path), or, where
the warm-up names a wire, the hierarchical mode with it (``warm``: every call
goes to it until the warm-up ends).

The phase is :class:`SiteState`'s ``local``, switched by
:class:`fastddp.cross_site.CrossSite` between steps, on every rank at the
same step.  With one rank per host nothing crosses any link: the pack
scales by 1 and the result is the rank's own gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Pending
from ..hook_states import SiteState
from .datapath import Scaling, fill_flat, unpack_grads
from .kinds import Kind
from .plain import Reduction

__all__ = ["SiteLocal", "SiteState", "site_local_hook"]


def site_local_hook(state: SiteState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The same reduction as a Python comm hook (where fastddp's fused path
    does not run it): mean over the host's ranks once the warm-up is over,
    else over the whole group."""
    t = bucket.buffer()
    group = state.inside if state.local else None
    n = state.ranks_per_host if state.local else dist.get_world_size()
    t.div_(n)
    if state.local and n == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(t)
        return fut
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


site_local_hook._fastddp_fused = (Kind.SITE, None)


class SiteLocal(Reduction):
    """See the module docstring."""

    kind = Kind.SITE
    scaling = Scaling.MUL
    fused = True

    def __init__(self, state: SiteState, warm: Reduction | None = None):
        self.state, self.warm = state, warm

    def _warming(self) -> Reduction | None:
        return self.warm if self.warm is not None and not self.state.local else None

    @property
    def wire_dtype(self):
        w = self._warming()
        return None if w is None else w.wire_dtype

    def boundary(self, ctx) -> None:
        if (w := self._warming()) is not None:
            w.boundary(ctx)

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        if self.warm is not None:
            self.warm.carry_over(old_buckets, old_locate, new_buckets)

    def residual_of(self, bucket_index: int):
        w = self._warming()
        return None if w is None else w.residual_of(bucket_index)

    def check_result(self, bucket, result) -> None:
        if (w := self._warming()) is not None:
            w.check_result(bucket, result)

    def stats(self) -> dict:
        w = self._warming()
        return w.stats() if w is not None and hasattr(w, "stats") else {}

    def pack(self, ctx, bucket, grads) -> None:
        if (w := self._warming()) is not None:
            return w.pack(ctx, bucket, grads)
        L = self.state.ranks_per_host if self.state.local else None
        fill_flat(ctx, bucket, grads, Scaling.MUL, bucket.health, divisor=L)

    def issue(self, ctx, bucket) -> Pending:
        if (w := self._warming()) is not None:
            return w.issue(ctx, bucket)
        if not self.state.local:
            return ctx.comm.all_reduce(bucket.flat)
        if self.state.ranks_per_host == 1:
            return Pending()
        return ctx.comm.all_reduce(bucket.flat, group=self.state.inside)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        if (w := self._warming()) is not None:
            return w.unpack(ctx, bucket, result, track_unused)
        unpack_grads(ctx, bucket, bucket.flat, track_unused)

    def shadow(self, ctx, bucket) -> Pending:
        return self.issue(ctx, bucket)  # unreachable: freeze refuses join()

    def freeze(self, why: str) -> None:
        raise RuntimeError("fastddp: join() is not supported with fastddp.CrossSite: the outer sync "
                           "needs every rank at every sync step; give every rank the same number of "
                           "steps (e.g. drop_last=True or a sampler with equal shards)")
