"""The module's buffers, broadcast from one rank before each synchronising
forward (torch's ``forward_sync_buffers``, once ``broadcast_buffers``): a
part the DDP front holds."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import groups

__all__ = ["ForwardBuffers"]


class ForwardBuffers:
    """The buffers DDP broadcasts (those not in ``ignore``) and the group
    they go over: ``group`` None is the module's process group ``pg``;
    cross-site training narrows it to the host (:class:`fastddp.CrossSite`).
    ``tensors`` and ``named`` are torch's ``modules_buffers`` and
    ``named_module_buffers``."""

    def __init__(self, module: torch.nn.Module, ignore, pg, bucket_bytes: int):
        self.module, self.ignore, self.pg, self.bucket_bytes = module, ignore, pg, bucket_bytes
        self.group = None
        self.collect()

    def collect(self) -> None:
        """The module's buffers now (a forward may have replaced one)."""
        named = [(n, b) for n, b in self.module.named_buffers() if n not in self.ignore]
        self.tensors = [b for _, b in named]
        self.named = dict(named)

    def broadcast(self, src: int) -> None:
        """From group rank ``src`` (c10d's broadcast_coalesced takes the group
        rank as the root, as torch's DDP passes it) to every rank."""
        group = self.pg if self.group is None else self.group
        if groups.size(group) == 1:
            # from the one rank to itself: nothing moves, so neither the broadcast nor the walk
            # over the module's buffers it needs runs (torch's DDP runs both: ~0.45 ms a forward
            # on the bench's convnet at world 1, tools/step_python.py)
            return
        with torch.no_grad():
            self.collect()
            with torch.autograd._unsafe_preserve_version_counter(tuple(self.tensors)):
                dist._broadcast_coalesced(group, self.tensors, self.bucket_bytes, src)
