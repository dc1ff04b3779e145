"""Uneven inputs: ``DistributedDataParallel.join()`` on torch's join protocol
(``torch.distributed.algorithms.join``: ``Join``, ``Joinable``, ``JoinHook``).

A rank that runs out of data enters the ``Join`` context's loop and, for every
iteration the other ranks still run, calls :meth:`DDPJoinHook.main_hook`,
which issues the same collectives as one training iteration, in the same
order, with zeros: the first step's settings check (:mod:`fastddp.agree`),
the one bucket rebuild, the buffer broadcast, the
"will you sync gradients" all-reduce, one all-reduce per bucket (through the
same comm path: plain, fused 16-bit wire, or the registered hook) and the
used-parameter map.  When every rank has joined, :meth:`post_hook` broadcasts
the final model from the last rank to join.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from . import agree, groups

__all__ = ["DDPJoinHook", "find_common_rank", "global_requires_backward_grad_sync", "shadow_backward",
           "shadow_used_map", "sync_final_model"]


class DDPJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        agree.once(ddp)  # (a rank that joined before the first forward: the others check there)
        ddp.reducer.rebuild_buckets()
        if ddp.will_sync_module_buffers():
            rank = find_common_rank(ddp, groups.rank(ddp.process_group), False)
            ddp.forward_buffers.broadcast(rank)
        should_sync = global_requires_backward_grad_sync(ddp, is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        shadow_backward(ddp.reducer)
        if ddp.find_unused_parameters:
            shadow_used_map(ddp)
        ddp.reducer.plans.push_all_rebuilt_params()

    def post_hook(self, is_last_joiner: bool) -> None:
        sync_final_model(self.ddp, is_last_joiner)


def sync_final_model(ddp, is_last_joiner: bool) -> None:
    """Every rank takes the model of the last rank to join (ties: the largest rank)."""
    src = find_common_rank(ddp, groups.rank(ddp.process_group), is_last_joiner)
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(module=ddp.module, process_group=ddp.process_group,
                        broadcast_bucket_size=ddp.broadcast_bucket_size, src=src,
                        params_and_buffers_to_ignore=ddp.parameters_to_ignore,
                        broadcast_buffers=ddp.forward_sync_buffers)


def shadow_used_map(ddp) -> None:
    """A joined rank's side of the used-parameter map all-reduce (it used nothing)."""
    groups.all_reduce(torch.zeros(len(ddp.reducer.params), dtype=torch.int32, device=ddp.device),
                      ddp.process_group)


def find_common_rank(ddp, input_rank: int, rank_cond: bool) -> int:
    """The largest rank for which ``rank_cond`` holds (torch's _find_common_rank)."""
    t = torch.tensor([input_rank if rank_cond else -1], device=ddp.device)
    groups.all_reduce(t, ddp.process_group, op=dist.ReduceOp.MAX)
    if t.item() == -1:
        raise RuntimeError("fastddp: no rank qualified as the source of the model sync "
                           "(expected at least one rank to satisfy the join condition)")
    return int(t.item())


def shadow_backward(reducer) -> None:
    """A joined rank mirrors one backward of the ranks still training: the
    same collectives, bucket by bucket in order, on zeros (each bucket's mode
    issues its own collective: plain, fused 16-bit wire, or the hook)."""
    comm = reducer.comm
    with comm.comm_context(), torch.no_grad():
        for p in [b.reduction.shadow(reducer.ctx, b) for b in reducer.buckets]:
            comm.wait(p)
        if reducer.health is not None:
            reducer.health.shadow(reducer)  # the check_finite flags' all-gather


def global_requires_backward_grad_sync(ddp, is_joined_rank: bool):
    """join(): every rank learns whether this iteration's backward syncs."""
    flag = torch.ones(1, device=ddp.device) if (not is_joined_rank and ddp.require_backward_grad_sync) \
        else torch.zeros(1, device=ddp.device)
    work = groups.all_reduce(flag, ddp.process_group, async_op=True)
    if is_joined_rank:
        groups.wait(work)
        return flag.item() != 0
    return None
