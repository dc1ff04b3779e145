"""A reduction that knows hosts from ranks (``hierarchical_hook``): fp32
inside each host, the chosen wire between hosts, on the two-phase engine.

With H hosts of L ranks, bucket of N elements, host shard S (N / L rounded
up to whole pieces of the between-hosts format)::

    pack      grads * fp32(1/W) -> an fp32 stage of L*S elements, laid out
              like the bucket (ONE launch; fp8: the exempt 1-D grads into a
              compact fp32 buffer instead)
    round 0   all-to-all of the stage inside the host (fp32)       at issue
    round 1   sum this rank's shard over the host's L ranks in fp32, rank
              order (ONE launch): this rank's piece of its host's sum.
              fp32: all-reduce it across the hosts (the group of the ranks
              with this local rank on every host).  bf16 / fp8: encode it
              (one launch, error feedback in it) and all-to-all its H
              pieces across the hosts                  at the next bucket's issue
    round 2   bf16 / fp8: sum this rank's piece over the H hosts in fp32 and
              encode the sum once (ONE launch); all-gather it across the
              hosts                                     at the end of backward
    last      decode (bf16 / fp8: ONE launch); all-gather the host shards
              inside the host into the stage (fp32)
    unpack    the stage -> .grad (ONE launch)

Only the host shard crosses between hosts: per step each host sends
2(H-1)/H of the gradient in the wire's format (1.0x at two hosts), where a
flat ring sends 2(W-1)/W of it per host link crossing.  Inside a host the
sum is exact fp32; a compressed format's rounding enters once per host, not
once per rank.  The fp8 format's exempt parameters (1-D by default) are
all-reduced in fp32 over the whole group beside round 0 (a few bytes; summing
them inside the host first and then across measured no different:
0.519 (0.507-0.530) against 0.508 (0.492-0.525) x torch's fp16 hook).
Error feedback keeps the host shard's own encoding error (S fp32 per bucket
and rank); it is not per parameter, so a rebuild of the buckets resets it.
"""

from __future__ import annotations

import torch

from .. import groups, kernels
from .base import Reduction
from .compression import ResidualBook
from .datapath import Scaling, alias_views, pack_sources, unpack_grads
from .fp8 import is_exempt
from .fp8wire import Fp8Wire
from .fp32acc import SHARD_ALIGN, Bf16Shards
from .kinds import Kind
from .twophase import ShardWire, TwoPhaseEngine

__all__ = ["Hierarchical", "HierWire", "host_shard_numel"]

_WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def host_shard_numel(n: int, local: int, hosts: int, align: int) -> int:
    """Elements of a host shard: ``ceil(n / local)`` rounded up to ``hosts``
    pieces of whole ``align`` units (so the between-hosts all-to-all splits
    it evenly, in whole fp8 blocks)."""
    unit = hosts * align
    return -(-n // (local * unit)) * unit


class HierWire(ShardWire):
    """One bucket's buffers: the fp32 ``stage`` (L shards of S), the inside
    all-to-all's receive (``recv``; its first slice becomes ``host``, this
    rank's piece of its host's sum), and the between-hosts codec ``inner``
    (None for fp32; a flat bf16 or fp8 wire over the H hosts)."""

    early_rounds = 2  # round 1 waits for the inside hop only: run at the next bucket's issue

    def _encoded(self, inner) -> list:
        """The between-hosts codec's encoded buffers (after its all-gather: the host's result)."""
        return [inner.q, inner.s] if self.fmt == "fp8" else [inner.wire]

    def __init__(self, fmt: str, L: int, H: int, S: int, stage, recv, inside, across, inner, block: int,
                 ex: list, exbuf, gather_encoded: bool = True):
        self.fmt, self.L, self.H, self.S, self.block = fmt, L, H, S, block
        self.world = L * H
        self.stage, self.recv = stage, recv
        self.host = recv[:S]
        self.inside, self.across, self.inner = inside, across, inner
        self.inside_late = inside  # the last round's group (the phase-2 thread's twin where it runs it)
        self.ex, self.exbuf = ex, exbuf
        self.rounds = 3 if inner is None else 4
        self.bounds = [(0, S)]
        self.gathered = None  # the encoded all-gather's receive buffers (compressed wires)
        if inner is not None and gather_encoded:
            self.gathered = [torch.empty(L * t.numel(), dtype=t.dtype, device=t.device)
                             for t in self._encoded(inner)]
        self.residual = None  # set by the pack (error feedback)
        self.host_layout = kernels.Layout.for_tensors([self.host])
        cross = S * 4 if inner is None else inner.nbytes
        self.nbytes = cross + 4 * exbuf.numel()  # what this rank hands to the between-hosts hop
        gathered = S * 4 if self.gathered is None else sum(t.numel() * t.element_size()
                                                           for t in self._encoded(inner))
        self.bytes_inside = (L - 1) * (S * 4 + gathered)  # the inside all-to-all + all-gather, sent

    def pieces(self, r: int) -> int:
        return 1 if r in (0, self.rounds - 1) or self.inner is None else len(self.inner.bounds)

    def run(self, r: int, k: int, pg, health) -> list:
        if r == 0:
            return [groups.all_to_all_single(self.recv, self.stage, self.inside)]
        if r == self.rounds - 1:
            if self.inner is None:
                return [groups.all_gather_into_tensor(self.stage, self.host, self.inside_late)]
            self.inner.stage_in()
            if self.gathered is None:
                self._decode()
                return [groups.all_gather_into_tensor(self.stage, self.host, self.inside_late)]
            # the host's reduced shards travel inside the host still encoded
            # (decoding is exact, so the bits are the same): fp8 4x, bf16 2x
            # fewer bytes than fp32; every rank decodes the whole bucket (finish)
            return [groups.all_gather_into_tensor(o, i, self.inside_late)
                    for o, i in zip(self.gathered, self._encoded(self.inner))]
        if r == 1:
            if k == 0:
                kernels.reduce_shards(self.recv, self.host, self.L, health=health)
                if self.inner is None:
                    return [groups.all_reduce(self.host, self.across, async_op=True)]
                self._encode(health)
                self.inner.stage_out()
            return [groups.all_to_all_single(o, i, self.across) for o, i in self.inner.send_recv(k)]
        return [groups.all_gather_into_tensor(o, i, self.across) for o, i in self.inner.reduce_piece(k, health)]

    def stage_in(self) -> None:
        """After the last round: the gathered encoded shards -> the fp32 stage (ONE launch)."""
        if self.gathered is None:
            return
        if self.fmt == "fp8":
            kernels.dequantize_fp8(self.gathered[0], self.gathered[1], self.stage, self.block)
        else:
            self.stage.copy_(self.gathered[0])

    def _encode(self, health) -> None:
        if self.fmt == "fp8":  # quantized a piece at a time as its all-to-all is issued (Fp8Wire.encode_piece)
            self.inner.encode = (self.residual, health)
        else:
            kernels.pack([self.host], self.inner.wire, layout=self.host_layout, residual=self.residual,
                         health=health)

    def _decode(self) -> None:
        if self.fmt == "fp8":
            kernels.dequantize_fp8(self.inner.q, self.inner.s, self.host, self.block)
        else:
            self.host.copy_(self.inner.wire)  # bf16 -> fp32 is exact

    def start_extra(self, pg) -> list:
        return [groups.all_reduce(self.exbuf, pg, async_op=True)] if self.ex else []

    def zero(self) -> None:
        self.stage.zero_()
        self.exbuf.zero_()


class Hierarchical(Reduction):
    """``hierarchical_hook``'s fused path over a resolved topology (see the
    module docstring).  ``inside``/``across``: this rank's sub-groups.
    Composed as the flat two-phase modes are: its wire (:class:`HierWire`,
    which holds the between-hosts codec), the engine that runs the wire's
    rounds, and the residual book of the host shards."""

    kind = Kind.HIER
    scaling = Scaling.MUL
    fused = True
    #: the last round gathers the compressed shards inside the host (True),
    #: or decodes this rank's shard and gathers fp32 (False): the same bits
    gather_encoded = True

    def __init__(self, state, topology, inside, across):
        self.book = ResidualBook(state.error_feedback)
        self.engine = TwoPhaseEngine(getattr(state, "chunk_bytes", None))
        self.fmt = state.wire
        self.wire_dtype = _WIRE_DTYPES[self.fmt]
        self.topology, self.inside, self.across = topology, inside, across
        self.inside_late = inside  # the builder gives the phase-2 thread's twin with the thread
        self.block = state.block_size
        self.exempt_rule = state.exempt
        self.bytes_between = 0
        self.bytes_inside = 0

    def stats(self) -> dict:
        t = self.topology
        return {"hierarchy": {"hosts": t.num_hosts, "ranks_per_host": t.ranks_per_host, "source": t.source,
                              "wire": self.fmt, "bytes_between_hosts": self.bytes_between,
                              "bytes_inside_host": self.bytes_inside}}

    def _exempt(self, p) -> bool:
        return self.fmt == "fp8" and is_exempt(self.exempt_rule, p)

    def shard_wire(self, ctx, bucket) -> HierWire:
        d = self.engine.wires.get(bucket.index)
        if d is not None:
            return d
        if bucket.complex or not bucket.flat.is_floating_point():
            raise TypeError(f"hierarchical_hook: bucket {bucket.index} holds {bucket.flat.dtype}"
                            f"{' complex' if bucket.complex else ''} gradients; the hierarchical reduction "
                            "takes real floating-point gradients (use no hook for the others)")
        L, H = self.topology.ranks_per_host, self.topology.num_hosts
        if ctx.world != L * H:
            raise RuntimeError(f"hierarchical_hook: the topology has {L * H} ranks but the process group "
                               f"{ctx.world}")
        B, N, dev = self.block, bucket.flat.numel(), bucket.flat.device
        S = host_shard_numel(N, L, H, B if self.fmt == "fp8" else SHARD_ALIGN)
        stage = torch.zeros(L * S, dtype=torch.float32, device=dev)
        ex = [k for k, p in enumerate(bucket.params) if self._exempt(p)]
        lay = bucket.layout
        ex_numels = [lay.numels[k] for k in ex]
        exbuf = torch.zeros(sum(ex_numels), dtype=torch.float32, device=dev)
        recv = torch.empty_like(stage)
        d = HierWire(self.fmt, L, H, S, stage, recv, self.inside, self.across, self._inner(recv[:S], S, H, dev),
                     B, ex, exbuf, self.gather_encoded)
        d.inside_late = self.inside_late
        if ex:
            q8 = [k for k in range(len(bucket.params)) if k not in ex]
            d.q8 = q8
            d.lay8 = kernels.Layout([lay.shapes[k] for k in q8], [lay.offsets[k] for k in q8],
                                    [lay.strides[k] for k in q8])
            d.lay_ex = kernels.Layout([lay.shapes[k] for k in ex], kernels.reference.default_offsets(ex_numels),
                                      [lay.strides[k] for k in ex])
            views = lay.views(stage)
            d.ex_views = [views[k] for k in ex]
        self.engine.wires[bucket.index] = d
        return d

    def _inner(self, host, S: int, H: int, dev):
        """The between-hosts codec: a flat wire over the H hosts (None: fp32)."""
        if self.fmt == "fp32":
            return None
        piece = S // H
        if self.fmt == "bf16":
            wire = torch.zeros(S, dtype=torch.bfloat16, device=dev)
            bounds = self.engine.bounds(piece, H, 2, SHARD_ALIGN, dev)
            return Bf16Shards(H, wire, torch.empty_like(wire), bounds,
                               torch.empty_like(wire) if len(bounds) > 1 else None, 2 * S)
        B = self.block
        bounds = self.engine.bounds(piece, H, 1, B, dev)
        n = max(b - a for a, b in bounds)
        inner = Fp8Wire(world=H, block=B, shard=piece, ex=[], q8=[], lay8=None, lay_ex=None, stage=host,
                        q=torch.zeros(S, dtype=torch.uint8, device=dev),
                        s=torch.ones(S // B, dtype=torch.float32, device=dev),
                        exbuf=torch.zeros(0, dtype=torch.float32, device=dev), ex_views=[],
                        bounds=bounds, s_bounds=[(a // B, b // B) for a, b in bounds],
                        rq=torch.empty(H * n, dtype=torch.uint8, device=dev),
                        rs=torch.empty(H * n // B, dtype=torch.float32, device=dev), nbytes=S + 4 * (S // B))
        if inner.chunked:
            inner.layout_wire()
        return inner

    def pack(self, ctx, bucket, grads) -> None:
        d = self.shard_wire(ctx, bucket)
        d.residual = self.book.residual_for_pack(bucket, d.S)  # None without error feedback (fp32 has none)
        health, scale = bucket.health, 1.0 / ctx.divisor()
        src, plain = pack_sources(ctx, bucket, grads)
        if d.ex:
            kernels.pack([src[k] for k in d.q8], d.stage, layout=d.lay8, scale=scale, health=health)
            kernels.pack([src[k] for k in d.ex], d.exbuf, layout=d.lay_ex, scale=scale, health=health)
        else:
            kernels.pack(list(src), d.stage, layout=bucket.layout, scale=scale, health=health)
        if plain:
            alias_views(ctx, bucket, grads)

    def issue(self, ctx, bucket):
        d = self.engine.wires[bucket.index]
        self.bytes_between += d.nbytes
        self.bytes_inside += d.bytes_inside
        return self.engine.start(ctx, bucket, d, bucket.health)

    def shadow(self, ctx, bucket):
        return self.engine.shadow(ctx, self.shard_wire(ctx, bucket), bucket)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        self.book.finished(bucket)
        d = self.engine.wires[bucket.index]
        if d.ex:
            kernels.unpack(d.exbuf, d.ex_views, layout=d.lay_ex)
        unpack_grads(ctx, bucket, d.stage, track_unused)
        if d.ex:  # the stage is the next pack's destination: exempt slots must read 0 again
            torch._foreach_zero_(d.ex_views)

    def residual_of(self, bucket_index: int):
        """None: the residual is the host shard's, not laid out like the bucket."""
        return None

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """A rebuild: the host shards change, so the residuals start again at 0."""
        self.book.clear()
        self.engine.reset()
