"""One rank's view of a run (:class:`RankContext`) and what the ranks agree
on between steps: every rank's times (:func:`all_gather`), rank 0's
decisions (:func:`from_lead`, :func:`agree`, :func:`agree_stop`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import BenchConfig
from .meta import load_average

__all__ = ["RankContext", "all_gather", "agree", "from_lead", "agree_stop"]


class RankContext:
    """One rank's view of the run."""

    def __init__(self, cfg: BenchConfig, rank: int, world: int, local_rank: int, device: torch.device):
        self.cfg, self.rank, self.world, self.local_rank, self.device = cfg, rank, world, local_rank, device
        self.cuda = device.type == "cuda"
        self.lead = rank == 0
        self.elapsed: dict[str, float] = {}  # "<model><section tag>" -> seconds
        self.load_start = load_average()
        self.models_done = 0   # models benchmarked so far, all sections
        self.used_s = 0.0      # their time, build to last profiled step (rank 0's decides)
        self.meter = None      # --link: host 1's veth counters (linkbytes.LinkMeter)

    def barrier(self) -> None:
        if self.cuda:
            dist.barrier(device_ids=[self.local_rank])
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def agree_any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over ranks."""
        t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64,
                         device=self.device if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]


def all_gather(ctx: RankContext, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), on the CPU, in rank order."""
    if ctx.cuda:
        t = t.to(ctx.device)
    out = [torch.empty_like(t) for _ in range(ctx.world)]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]


def from_lead(ctx: RankContext, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    if ctx.cuda:
        t = t.to(ctx.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def agree(ctx: RankContext, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a rebuild only where its time fits rank 0's budget)."""
    return bool(from_lead(ctx, int(flag)))


_STOPS = (None, "precision", "budget")


def agree_stop(ctx: RankContext, reason: str | None) -> str | None:
    """Rank 0's stop decision, on every rank (its clock and its rule decide)."""
    return _STOPS[from_lead(ctx, _STOPS.index(reason))]
