"""torch's ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``:
some parameters leave the buckets; their grads live in one flat buffer that
is averaged (divided by W, then SUM all-reduced) when the gradient of
``param_to_hook_all_reduce`` is computed.  torch never waits for that work;
fastddp waits at the end of backward, so the optimizer never reads a
half-reduced buffer."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import groups

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    def __init__(self, params: Sequence[torch.nn.Parameter], hook_param: torch.nn.Parameter, pg,
                 broadcast_bucket_size: int):
        self.params = list(params)
        self.pg = pg
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device,
                                  dtype=self.params[0].dtype)
        dist._broadcast_coalesced(pg, [p.detach() for p in self.params], broadcast_bucket_size, 0)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.work = None
        hook_param.register_hook(self._hook)

    def _hook(self, grad):
        self.buffer.div_(groups.size(self.pg))
        self.work = groups.all_reduce(self.buffer, self.pg, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._wait)
        return grad

    def _wait(self) -> None:
        if self.work is not None:
            groups.wait(self.work)
            self.work = None

    def clear_grad_buffer(self) -> None:
        """After each forward (torch's ``_clear_grad_buffer``): the params'
        grads are views of the buffer, zeroed where they were dropped."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    p.grad.zero_()
        if all_none:
            self.buffer.zero_()
