"""bf16 on the wire, summed in fp32 (``bf16_fp32acc_hook``): the two-phase
engine's bf16 codec."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .base import Reduction
from .compression import FusedCompression
from .datapath import Scaling
from .kinds import Kind
from .twophase import ShardWire, TwoPhaseEngine

__all__ = ["SHARD_ALIGN", "shard_numel", "Bf16Shards", "Fp32Accumulate"]

#: Elements each bf16 shard is padded to a multiple of (128 bytes): every
#: shard, and so every rank's slice the shard sum reads and every offset the
#: all-to-all and the all-gather see, starts 128-byte aligned, which lets the
#: sum kernel take vector accesses.
SHARD_ALIGN = 64


def shard_numel(n: int, world: int) -> int:
    """Elements per shard of an ``n``-element bucket over ``world`` ranks:
    ``ceil(n / world)`` rounded up to a multiple of :data:`SHARD_ALIGN`."""
    per = -(-n // world)
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN


@dataclass(eq=False)
class Bf16Shards(ShardWire):
    """A bucket's bf16 wire (W shards of ``shard`` elements, shard-major), the
    all-to-all's receive buffer and, when chunked, the chunk-major stage:
    piece ``[a, b)`` of every shard back to back in rank order at
    ``stage[W*a : W*b]``."""

    world: int
    wire: torch.Tensor
    recv: torch.Tensor
    bounds: list
    stage: torch.Tensor | None
    nbytes: int

    def send_recv(self, k):
        (a, b), W = self.bounds[k], self.world
        src = self.wire if self.stage is None else self.stage
        return [(self.recv[W * a:W * b], src[W * a:W * b])]

    def reduce_piece(self, k, health):
        (a, b), W = self.bounds[k], self.world
        piece = self.recv[W * a:W * b]
        kernels.reduce_shards(piece, piece[:b - a], W, health=health)
        # the all-to-all that read this stage piece is complete: gather into it
        out = self.wire if self.stage is None else self.stage[W * a:W * b]
        return [(out, piece[:b - a])]

    def stage_out(self):
        if self.stage is not None:
            wv = self.wire.view(self.world, -1)
            for a, b in self.bounds:
                self.stage[self.world * a:self.world * b].view(self.world, b - a).copy_(wv[:, a:b])

    def stage_in(self):
        if self.stage is not None:
            wv = self.wire.view(self.world, -1)
            for a, b in self.bounds:
                wv[:, a:b].copy_(self.stage[self.world * a:self.world * b].view(self.world, b - a))

    def zero(self):
        self.wire.zero_()


class Fp32Accumulate(Reduction):
    """bf16 on the wire, summed in fp32 (``bf16_fp32acc_hook``)::

        pack      grads * fp32(1/W) -> bf16 wire of W*S elements (S: ceil(N/W)
                  rounded up to a multiple of SHARD_ALIGN; the tail past the
                  bucket's N stays 0), error feedback as the fp16/bf16 path;
                  ONE launch
        issue     all-to-all of the W shards (the engine)
        finish    ONE launch per piece sums the shard from every rank in fp32,
                  in rank order, rounded once to bf16 (kernels.reduce_shards);
                  all-gather it into the wire (the engine)
        unpack    the wire -> .grad (ONE launch)

    Bytes on the wire equal a bf16 all-reduce's (plus the padding, under
    128 bytes per rank and bucket); the sum's error no longer
    grows with the world size (one rounding instead of one per ring hop).
    Chunked, the same elements meet in the same order, so the result is bit
    for bit the unchunked one.

    Composed of two parts: the fp16/bf16 path's cast (:class:`FusedCompression`,
    its wire padded to whole shards, with its residual book) and the
    two-phase engine (:class:`~.twophase.TwoPhaseEngine`) that runs the
    wire's rounds."""

    kind = Kind.FP32ACC
    scaling = Scaling.MUL
    fused = True
    wire_dtype = torch.bfloat16

    def __init__(self, error_feedback: bool, chunk_bytes: int | None = None, reference: bool = False):
        self.cast = FusedCompression(torch.bfloat16, error_feedback, reference,
                                     wire_numel=lambda ctx, bucket: ctx.world * shard_numel(bucket.flat.numel(),
                                                                                           ctx.world))
        self.book = self.cast.book
        self.engine = TwoPhaseEngine(chunk_bytes)

    def adopt_residual(self, ctx, bucket, values) -> bool:
        return self.cast.adopt_residual(ctx, bucket, values)

    def shard_wire(self, ctx, bucket) -> Bf16Shards:
        wire = self.cast.buffer(ctx, bucket)
        s = self.engine.wires.get(bucket.index)
        if s is None or s.wire is not wire:
            W = ctx.world
            bounds = self.engine.bounds(wire.numel() // W, W, wire.element_size(), SHARD_ALIGN, wire.device)
            s = self.engine.wires[bucket.index] = Bf16Shards(
                W, wire, torch.empty_like(wire), bounds,
                torch.empty_like(wire) if len(bounds) > 1 else None, wire.numel() * wire.element_size())
        return s

    def pack(self, ctx, bucket, grads) -> None:
        self.shard_wire(ctx, bucket)
        self.cast.pack(ctx, bucket, grads)

    def issue(self, ctx, bucket):
        return self.engine.start(ctx, bucket, self.engine.wires[bucket.index], bucket.health)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        self.cast.unpack(ctx, bucket, result, track_unused)

    def shadow(self, ctx, bucket):
        return self.engine.shadow(ctx, self.shard_wire(ctx, bucket), bucket)

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        self.cast.carry_over(old_buckets, old_locate, new_buckets)
        self.engine.reset()
