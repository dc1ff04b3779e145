"""Uneven inputs: ``DistributedDataParallel.join()`` on torch's join protocol
(``torch.distributed.algorithms.join``: ``Join``, ``Joinable``, ``JoinHook``).

A rank that runs out of data enters the ``Join`` context's loop and, for every
iteration the other ranks still run, calls :meth:`DDPJoinHook.main_hook`,
which issues the same collectives as one training iteration, in the same
order, with zeros: the one bucket rebuild, the buffer broadcast, the
"will you sync gradients" all-reduce, one all-reduce per bucket (through the
same comm path: plain, fused 16-bit wire, or the registered hook) and the
used-parameter map.  When every rank has joined, :meth:`post_hook` broadcasts
the final model from the last rank to join.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from . import groups

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp.will_sync_module_buffers():
            rank = ddp._find_common_rank(groups.rank(ddp.process_group), False)
            ddp._broadcast_buffers(rank)
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        ddp.reducer.shadow_backward()
        if ddp.find_unused_parameters:
            ddp.reducer.shadow_used_map()
        ddp.reducer.push_all_rebuilt_params()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = ddp._find_common_rank(groups.rank(ddp.process_group), is_last_joiner)
        from torch.distributed.utils import _sync_module_states

        _sync_module_states(module=ddp.module, process_group=ddp.process_group,
                            broadcast_bucket_size=ddp.broadcast_bucket_size, src=src,
                            params_and_buffers_to_ignore=ddp.parameters_to_ignore,
                            broadcast_buffers=ddp.forward_sync_buffers)


def find_common_rank(ddp, input_rank: int, rank_cond: bool) -> int:
    """The largest rank for which ``rank_cond`` holds (torch's _find_common_rank)."""
    t = torch.tensor([input_rank if rank_cond else -1], device=ddp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group)
    if t.item() == -1:
        raise RuntimeError("fastddp: no rank qualified as the source of the model sync "
                           "(expected at least one rank to satisfy the join condition)")
    return int(t.item())
