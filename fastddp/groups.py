"""Collectives on the process-group *object* DDP was given.

torch's DDP calls the group it is handed (its C++ reducer calls
``process_group->allreduce``), so groups that ``init_process_group`` /
``new_group`` never registered work with it: Python subclasses of
``dist.ProcessGroup`` (test harnesses, fault-tolerant wrappers) and the
``Work`` subclasses they return.  ``torch.distributed``'s functions reject
those in places (``dist.get_rank(pg)``, ``dist.get_global_rank``,
``dist.get_backend``), so everything fastddp does with a group goes through
the few functions here: registered groups take ``torch.distributed``'s
functions (which also serve ``torch.compile`` and the profiler), others the
group's own methods.

A Python ``Work`` subclass may define ``wait(self, timeout)`` without a
default, as torch's own tests do; :func:`wait` always passes one
(``timedelta(0)``: the group's default, c10d's ``kNoTimeout``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

__all__ = ["is_registered", "rank", "size", "global_rank", "global_ranks", "all_reduce", "broadcast",
           "all_gather", "wait", "backend_name", "check_member"]

_NO_TIMEOUT = datetime.timedelta(0)


def is_registered(pg) -> bool:
    """True for groups made by ``init_process_group`` / ``new_group``."""
    return pg in dist.distributed_c10d._world.pg_map


def check_member(pg, what: str = "process_group") -> None:
    """``dist.new_group(ranks)`` returns a placeholder on ranks outside
    ``ranks``: say so instead of failing later with an empty message."""
    if pg is None or isinstance(pg, int):  # GroupMember.NON_GROUP_MEMBER is an int sentinel
        me = dist.get_rank() if dist.is_initialized() else "?"
        raise RuntimeError(
            f"fastddp.DistributedDataParallel: this rank (global rank {me}) is not a member of the "
            f"group passed as {what} (dist.new_group returns a placeholder on the ranks it leaves "
            "out). Wrap the model only on the group's ranks, or pass a group this rank belongs to.")


def rank(pg) -> int:
    return pg.rank()


def size(pg) -> int:
    return pg.size()


def global_rank(pg, group_rank: int) -> int:
    """The global rank of ``group_rank`` (the group rank itself for groups
    that are not registered: they have no global numbering)."""
    if is_registered(pg):
        return dist.get_global_rank(pg, group_rank)
    return group_rank


def global_ranks(pg) -> list[int]:
    """Every member's global rank, in group-rank order."""
    return [global_rank(pg, r) for r in range(size(pg))]


def backend_name(pg) -> str:
    try:
        return pg.name()
    except Exception:  # a Python group without getBackendName
        return type(pg).__name__


def all_reduce(tensor: torch.Tensor, pg, op=dist.ReduceOp.SUM, async_op: bool = False):
    """SUM (or ``op``) all-reduce of one tensor; returns the Work when
    ``async_op``."""
    if is_registered(pg):
        work = dist.all_reduce(tensor, op=op, group=pg, async_op=True)
    else:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = pg.allreduce([tensor], opts)
    if async_op:
        return work
    wait(work)
    return None


def broadcast(tensor: torch.Tensor, pg, src: int = 0) -> None:
    """Broadcast from the group rank ``src``, synchronously."""
    if is_registered(pg):
        dist.broadcast(tensor, src=dist.get_global_rank(pg, src), group=pg)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    wait(pg.broadcast([tensor], opts))


def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, pg) -> None:
    """All-gather one tensor per rank into ``out``, synchronously."""
    if is_registered(pg):
        dist.all_gather(out, tensor, group=pg)
        return
    wait(pg.allgather([out], [tensor], _c10d.AllgatherOptions()))


def wait(work) -> None:
    """Wait for a Work (a C++ one, or a Python subclass whose ``wait`` takes
    a timeout without default)."""
    work.wait(_NO_TIMEOUT)


def all_to_all_single(out: torch.Tensor, tensor: torch.Tensor, pg):
    """Equal-split all-to-all (rank r's k-th slice of ``tensor`` lands in
    rank k's r-th slice of ``out``), asynchronously: returns the Work."""
    if is_registered(pg):
        return dist.all_to_all_single(out, tensor, group=pg, async_op=True)
    return pg.alltoall_base(out, tensor, [], [], _c10d.AllToAllOptions())


def all_gather_into_tensor(out: torch.Tensor, tensor: torch.Tensor, pg):
    """Every rank's ``tensor`` back to back in ``out`` (rank order),
    asynchronously: returns the Work."""
    if is_registered(pg):
        # torch >= 2.13 names it all_gather_single (the old name warns)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, tensor, group=pg, async_op=True)
    return pg._allgather_base(out, tensor, _c10d.AllgatherOptions())


__all__ += ["all_to_all_single", "all_gather_into_tensor"]
