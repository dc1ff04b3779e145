"""Gradient health: one rank's NaN must not silently poison every rank.

With ``check_finite`` on, every bucket has an int32 flag (one tensor for all
buckets) that the pack launch which already reads the gradients sets
(:class:`fastddp.kernels.Health`: a non-finite local value, a 16-bit cast that
overflowed a finite value, a non-finite error-feedback residual); where no
pack reads them (grads already bucket views, sparse values, a comm hook's
result) one device-side reduction sets it.  Nothing syncs during backward.

At the end of backward, after the collectives and BEFORE any reduced value is
written into ``.grad``, the ranks all-gather their flags (``n_buckets`` int32
each, into one buffer made once) and read them (the step's one host sync; on
CUDA through a pinned host buffer made once).  A set flag raises on every
rank (or warns, in ``"warn"`` mode): the rank whose local gradient was bad
names the first bad parameter (found by a second pass, in that case only);
the others say which rank's gradient made the average non-finite.  Healthy
steps never clear the flags (the kernels only OR into them).
"""

from __future__ import annotations

import warnings

import torch

from . import groups, kernels, settings
from .settings import configure, configured  # noqa: F401  (kept importable from here; they live in settings)

__all__ = ["HealthCheck", "resolve_mode"]


def resolve_mode(value) -> str | None:
    """The constructor's ``check_finite``, else :func:`fastddp.configure`'s,
    else ``FASTDDP_CHECK_FINITE``: None, ``"raise"`` or ``"warn"``."""
    return settings.parse_check_finite(settings.default("check_finite") if value is None else value)


class HealthCheck:
    """The flags of one reducer's buckets and the end-of-backward check."""

    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.flags = torch.zeros(0, dtype=torch.int32, device=device)
        self._reset()

    def install(self, buckets) -> None:
        self.flags = torch.zeros(len(buckets), dtype=torch.int32, device=self.device)
        for b in buckets:
            b.health = self.flags[b.index:b.index + 1]
        self._reset()

    def _reset(self) -> None:
        # The all-gather's output, its [world, n_buckets] view, its host copy
        # and a joined rank's zeros: made at the first check after an install
        # (the world is known then), reused every step after.
        self._out = self._table = self._host = self._zeros = None
        self._any = torch.zeros((), dtype=torch.bool)

    def _buffers(self, world: int) -> torch.Tensor:
        """The persistent gather output ``[world * n_buckets]`` (world 1: the flags themselves)."""
        if self._out is None:
            n = self.flags.numel()
            self._out = self.flags if world == 1 else torch.zeros(world * n, dtype=torch.int32, device=self.device)
            self._table = self._out.view(world, n)
            # CUDA: a pinned host buffer, so the read-back is a DMA into memory
            # made once (a pageable .cpu() allocates and stages every step)
            self._host = (torch.zeros(world, n, dtype=torch.int32, pin_memory=True)
                          if self.device.type == "cuda" else self._table)
        return self._out

    def _gather(self, r, flags: torch.Tensor) -> None:
        out = self._buffers(r.world)
        if r.world > 1:
            groups.wait(groups.all_gather_into_tensor(out, flags, r.pg))

    def check(self, r) -> None:
        """Every rank, end of backward, before the unpacks."""
        self._gather(r, self.flags)
        table = self._host
        if table is not self._table:
            # The step's one host sync, and it must stay: check_finite="raise"
            # raises on the host before any reduced value is written into
            # .grad, so the host has to see every rank's flags first.  The
            # copy is queued behind the packs and the all-gather on this
            # stream; waiting for the stream covers exactly that work.
            table.copy_(self._table, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        if not bool(torch.any(table, out=self._any)):
            return
        msg = self._message(r, table)  # (world 1 on the CPU: table is the flags, read before the zeroing)
        self.flags.zero_()  # failure case only
        if self.mode == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return
        raise FloatingPointError(msg)

    def shadow(self, r) -> None:
        """join(): a joined rank's part of the flags' all-gather (healthy: zeros)."""
        if r.world > 1:
            if self._zeros is None:
                self._zeros = torch.zeros_like(self.flags)
            self._gather(r, self._zeros)

    def _message(self, r, table: torch.Tensor) -> str:
        H = kernels.Health
        mine = table[r.rank]
        culprits = [k for k in range(table.shape[0])
                    if bool((table[k] & int(H.SOURCE_NONFINITE | H.OVERFLOW | H.RESIDUAL_NONFINITE)).any())]
        tail = (" Raised before the reduced values reach .grad and the optimizer (check_finite='raise'; "
                "'warn' only warns). Find the cause on that rank: a bad batch, a loss scale too high, "
                "an exploding layer.")
        if mine.any() and r.rank in culprits:
            b = int(mine.nonzero()[0, 0])
            bucket = r.buckets[b]
            bits = H(int(mine[b]) & 7)
            grads = [p.grad for p in bucket.params]
            live = [(p, g) for p, g in zip(bucket.params, grads) if g is not None]
            vals = [g._values() if g.is_sparse else g for _, g in live]
            i = kernels.first_nonfinite(vals) if H.SOURCE_NONFINITE in bits else None
            name = r.ctx.name(live[i][0]) if i is not None else None
            if H.SOURCE_NONFINITE in bits:
                what = (f"the local gradient of parameter {name!r} is non-finite (NaN/Inf) on rank "
                        f"{r.rank}" if name else f"a local gradient in bucket {b} is non-finite on rank {r.rank}")
            elif H.OVERFLOW in bits:
                what = (f"the {bucket_wire(r)} cast overflowed on rank {r.rank}: a finite gradient in "
                        f"bucket {b} ({describe(r, bucket)}) exceeds the 16-bit range after the 1/W "
                        "scaling; use bf16_compress_hook or a smaller loss scale")
            else:
                what = f"the error-feedback residual of bucket {b} is non-finite on rank {r.rank}"
            others = [k for k in culprits if k != r.rank]
            also = f" (ranks {others} too)" if others else ""
            return f"fastddp: check_finite: {what}{also}; the averaged gradient is non-finite on every rank.{tail}"
        b = int(table.any(dim=0).nonzero()[0, 0])
        if culprits:
            return (f"fastddp: check_finite: the reduced gradient became non-finite because of rank(s) "
                    f"{culprits}' local gradients (bucket {b}: {describe(r, r.buckets[b])}); this rank's "
                    f"(rank {r.rank}) local gradients are finite.{tail}")
        return (f"fastddp: check_finite: the reduced gradient of bucket {b} ({describe(r, r.buckets[b])}) "
                "became non-finite in the reduction although every rank's local gradient was finite "
                f"(e.g. a 16-bit sum that overflowed, or the comm hook's arithmetic).{tail}")


def describe(r, bucket) -> str:
    names = [r.names[i] for i in bucket.indices]
    return ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def bucket_wire(r) -> str:
    fused = r.fused_path
    return str(fused[1]).replace("torch.", "") if fused and fused[1] is not None else "16-bit"
