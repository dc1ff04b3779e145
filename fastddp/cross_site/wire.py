"""The outer sync's wire: one rank's shard of the pseudo-gradient averaged
over the hosts, in one of three formats, on the existing kernels.

Every rank of a host holds the same parameters (the inner reduction is exact
DDP inside the host), so each of the host's L ranks carries 1/L of the
model between hosts: local rank ``i`` exchanges shard ``i`` with the ranks
of local rank ``i`` on the other hosts (the ``across`` group, one rank per
host).  ``S`` (the shard) is a whole number of ``H`` pieces of ``block``
elements, so every format splits it the same way.

=======  ============================================  =====================
format   what crosses the host link                    error feedback
=======  ============================================  =====================
fp32     all-reduce of the shard (fp32)                none needed
bf16     all-to-all of bf16 pieces, fp32 sum rounded   residual of the cast
         once (``reduce_shards``), all-gather bf16
fp8      all-to-all of block-scaled e4m3 pieces + one  residual of the
         fp32 scale per block, fp32 sum quantized      quantization
         again (``reduce_fp8_shards``), all-gather
=======  ============================================  =====================

Bytes a rank sends per sync: fp32 ~2S*4*(H-1)/H, bf16 2*(H-1)/H*S*2,
fp8 2*(H-1)/H*S*(1 + 4/block).  The error-feedback residual carries what a
format dropped into the next sync (the sum of what was sent converges to the
sum of what should have been), as the bucket modes' error feedback does.
"""

from __future__ import annotations

import torch

from .. import groups, kernels

__all__ = ["FORMATS", "OuterWire", "make_wire"]

FORMATS = ("fp32", "bf16", "fp8")
BLOCK = 256
"""fp8 block (elements per fp32 scale), the bucket modes' default."""


class OuterWire:
    """Averages one fp32 shard over the ``across`` group (``hosts`` ranks)."""

    fmt = "fp32"

    def __init__(self, shard_numel: int, hosts: int, across, error_feedback: bool, device=None):
        self.S, self.H, self.across, self.device = shard_numel, hosts, across, device
        self.error_feedback = error_feedback
        self.residual = torch.zeros(shard_numel, device=device) if error_feedback else None
        self.bytes_sent = 0  # cumulative payload handed to the across collectives

    def average(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (fp32, S elements, this rank's) -> the mean over the hosts
        (in place where the format allows).  Blocking: the caller is the
        outer sync's thread (or the main thread under the interpreter)."""
        groups.all_reduce(x, self.across)
        self.bytes_sent += 2 * x.numel() * 4 * (self.H - 1) // self.H
        return x.div_(self.H)


class Bf16Wire(OuterWire):
    """all-to-all of bf16 pieces -> fp32 sum of this rank's piece, rounded
    once -> all-gather."""

    fmt = "bf16"

    def __init__(self, shard_numel, hosts, across, error_feedback, device=None):
        super().__init__(shard_numel, hosts, across, error_feedback, device)
        self.send = torch.empty(shard_numel, dtype=torch.bfloat16, device=device)
        self.recv = torch.empty(shard_numel, dtype=torch.bfloat16, device=device)

    def average(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual is not None:
            x.add_(self.residual)
        self.send.copy_(x)
        if self.residual is not None:
            torch.sub(x, self.send.float(), out=self.residual)  # what the cast dropped
        piece = self.S // self.H
        groups.wait(groups.all_to_all_single(self.recv, self.send, self.across))
        mine = self.send[:piece]
        kernels.reduce_shards(self.recv, mine, self.H)  # fp32 sum, rank order, one rounding
        groups.wait(groups.all_gather_into_tensor(self.recv, mine, self.across))
        self.bytes_sent += 2 * (self.S - piece) * 2
        return x.copy_(self.recv).div_(self.H)


class Fp8Wire(OuterWire):
    """all-to-all of block-scaled e4m3 pieces -> fp32 sum of this rank's
    piece, quantized again -> all-gather."""

    fmt = "fp8"

    def __init__(self, shard_numel, hosts, across, error_feedback, device=None):
        super().__init__(shard_numel, hosts, across, error_feedback, device)
        nb = shard_numel // BLOCK
        self.q, self.rq = (torch.empty(shard_numel, dtype=torch.uint8, device=device) for _ in range(2))
        self.s, self.rs = (torch.empty(nb, device=device) for _ in range(2))

    def average(self, x: torch.Tensor) -> torch.Tensor:
        kernels.quantize_fp8(x, self.q, self.s, BLOCK, residual=self.residual)
        piece, pb = self.S // self.H, self.S // self.H // BLOCK
        groups.wait(groups.all_to_all_single(self.rq, self.q, self.across))
        groups.wait(groups.all_to_all_single(self.rs, self.s, self.across))
        kernels.reduce_fp8_shards(self.rq, self.rs, self.q[:piece], self.s[:pb], self.H, BLOCK)
        groups.wait(groups.all_gather_into_tensor(self.rq, self.q[:piece], self.across))
        groups.wait(groups.all_gather_into_tensor(self.rs, self.s[:pb], self.across))
        self.bytes_sent += 2 * (self.S - piece) + 2 * (self.S - piece) // BLOCK * 4
        return kernels.dequantize_fp8(self.rq, self.rs, x, BLOCK).div_(self.H)


def make_wire(fmt: str, shard_numel: int, hosts: int, across, error_feedback: bool, device=None) -> OuterWire:
    """The wire of ``fmt``, its buffers on ``device`` (the parameters')."""
    cls = {"fp32": OuterWire, "bf16": Bf16Wire, "fp8": Fp8Wire}[fmt]
    return cls(shard_numel, hosts, across, error_feedback and fmt != "fp32", device)
