"""Block-scaled fp8 (e4m3) on the wire, summed in fp32 (``fp8_compress_hook``):
the two-phase engine's fp8 codec."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import groups, kernels
from .base import Reduction
from .compression import ResidualBook
from .datapath import Scaling, alias_views, pack_sources, unpack_grads
from .kinds import Kind
from .twophase import ShardWire, TwoPhaseEngine

__all__ = ["BlockFp8", "Fp8Gather", "Fp8Wire", "is_exempt"]


def is_exempt(rule, p) -> bool:
    """``FP8CompressionState.exempt``'s rule: None exempts 1-D parameters; a
    callable decides; else a collection of the exempt parameters."""
    if rule is None:
        return p.dim() <= 1
    if callable(rule):
        return bool(rule(p))
    return any(p is q for q in rule)


@dataclass(eq=False)
class Fp8Wire(ShardWire):
    """A bucket's fp8 buffers.  ``stage``: the bucket's non-exempt values in
    fp32, laid out like the bucket, padded to W shards of ``shard`` elements
    (whole blocks); ``q``/``s``: their fp8 bits and one scale per block;
    ``exbuf``: the exempt values, compact, fp32; ``ex_views``: the exempt
    parameters' slots inside ``stage`` (made once: the unpack fills them and
    zeroes them again in one call per bucket).  ``rq``/``rs``: the shard
    sum's input (every rank's slice): the all-to-all's receive when in one
    piece, else one chunk's, reused chunk after chunk.  Chunked
    (:meth:`layout_wire`): ``wire``/``recv`` and each piece's offset and size."""

    world: int
    block: int
    shard: int
    ex: list            # bucket positions sent exempt (fp32 all-reduce)
    q8: list            # bucket positions sent in fp8
    lay8: object        # kernels.Layout of the q8 grads inside ``stage``
    lay_ex: object      # kernels.Layout of the exempt grads inside ``exbuf``
    stage: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor
    exbuf: torch.Tensor
    ex_views: list      # views of ``stage`` at the ``ex`` positions
    bounds: list        # fp8 pieces of whole blocks
    s_bounds: list      # ... and their scales
    rq: torch.Tensor
    rs: torch.Tensor
    nbytes: int
    w_off: list = None
    w_piece: list = None
    wire: torch.Tensor | None = None
    recv: torch.Tensor | None = None
    encode: tuple | None = None  # (residual, health): the pack's quantize, due piece by piece at the issue
    decode: bool = False  # the flat mode's: each piece decoded into ``stage`` as it lands (finish_piece)

    @property
    def chunked(self) -> bool:
        return len(self.bounds) > 1

    def _ranges(self, k: int) -> list:
        """The ``stage`` ranges piece ``k``'s first collective sends: its slice
        ``[a, b)`` of every rank's shard."""
        (a, b), S = self.bounds[k], self.shard
        return [(j * S + a, j * S + b) for j in range(self.world)]

    def encode_piece(self, k: int) -> None:
        """The pack's quantize (error feedback read and rewritten there) of
        what piece ``k`` sends, just before its first collective: a chunked
        bucket's first piece goes on the wire while the next is quantized
        (one launch for a bucket in one piece).  Blocks are quantized
        independently, so the bits are the whole bucket's at once."""
        if self.encode is None:
            return
        (res, health), B = self.encode, self.block
        for lo, hi in self._ranges(k) if self.chunked else [(0, self.q.numel())]:
            kernels.quantize_fp8(self.stage[lo:hi], self.q[lo:hi], self.s[lo // B:hi // B], B,
                                 residual=None if res is None else res[lo:hi], health=health)
        if k == len(self.bounds) - 1:
            self.encode = None

    def layout_wire(self) -> None:
        """A chunked bucket's wire: per chunk ``[a, b)`` (``n`` fp8 values,
        ``nb`` scales), every rank's piece back to back in rank order, each
        piece its ``n`` fp8 bytes then its scales' ``4 nb`` bytes.  One call
        per chunk and phase, not two: on gloo over TCP the scales' small call
        travelled behind the values' in the same connection, so the two
        worker threads never had two chunks in flight (the all-to-all phase
        at ~65% of the link's rate, the all-gather at ~75%, in a step on a
        0.2 Gbit/s link).  ``wire``: the all-to-all's send and the
        all-gather's receive; ``recv``: the all-to-all's receive, then this
        rank's piece of the all-gather."""
        W = self.world
        off, piece, o = [], [], 0
        for (a, b), (sa, sb) in zip(self.bounds, self.s_bounds):
            off.append(o)
            piece.append((b - a) + 4 * (sb - sa))
            o += W * piece[-1]
        self.w_off, self.w_piece = off, piece
        self.wire = torch.empty(o, dtype=torch.uint8, device=self.q.device)
        self.recv = torch.empty_like(self.wire)

    def _wire_pairs(self, chunks):
        """(piece of the wire, piece of the shard-major buffer) for each of
        ``chunks`` and every rank row: its fp8 bytes, then its scales' bytes;
        the two directions of staging copy along these pairs."""
        W = self.world
        q = self.q.view(W, -1)
        s = self.s.view(torch.uint8).view(W, -1)
        for k in chunks:
            (a, b), (sa, sb), o, p = self.bounds[k], self.s_bounds[k], self.w_off[k], self.w_piece[k]
            v = self.wire[o:o + W * p].view(W, p)
            yield v[:, :b - a], q[:, a:b]
            yield v[:, b - a:], s[:, 4 * sa:4 * sb]

    def stage_in(self):
        if self.chunked and not self.decode:
            for wire, buf in self._wire_pairs(range(len(self.bounds))):
                buf.copy_(wire)

    def finish_piece(self, k):
        """``decode``: piece ``k``'s all-gather is in: its fp8 sums unstaged
        and dequantized into ``stage`` (ONE launch for a bucket in one piece),
        while the later pieces are still on the wire."""
        if not self.decode:
            return
        if self.chunked:
            for wire, buf in self._wire_pairs([k]):
                buf.copy_(wire)
        self._decode(self._ranges(k) if self.chunked else [(0, self.q.numel())])

    def _decode(self, ranges) -> None:
        B = self.block
        for lo, hi in ranges:
            kernels.dequantize_fp8(self.q[lo:hi], self.s[lo // B:hi // B], self.stage[lo:hi], B)

    def send_recv(self, k):
        """Piece ``k`` quantized (:meth:`encode_piece`) and, chunked, staged
        (a piece at a time: no :meth:`stage_out`)."""
        self.encode_piece(k)
        if not self.chunked:  # the buffers themselves, values and scales in two calls
            return [(self.rq, self.q), (self.rs, self.s)]
        for wire, buf in self._wire_pairs([k]):
            wire.copy_(buf)
        o, p, W = self.w_off[k], self.w_piece[k], self.world
        return [(self.recv[o:o + W * p], self.wire[o:o + W * p])]

    def reduce_piece(self, k, health):
        W, B = self.world, self.block
        if not self.chunked:
            n, nb = self.shard, self.shard // B
            rq, rs = self.rq, self.rs
            kernels.reduce_fp8_shards(rq, rs, rq[:n], rs[:nb], W, B, health=health)
            return [(self.q, rq[:n]), (self.s, rs[:nb])]
        (a, b), (sa, sb) = self.bounds[k], self.s_bounds[k]
        n, nb = b - a, sb - sa
        o, p = self.w_off[k], self.w_piece[k]
        got = self.recv[o:o + W * p].view(W, p)
        rq, rs = self.rq[:W * n], self.rs[:W * nb]
        rq.view(W, n).copy_(got[:, :n])
        rs.view(torch.uint8).view(W, 4 * nb).copy_(got[:, n:])
        kernels.reduce_fp8_shards(rq, rs, rq[:n], rs[:nb], W, B, health=health)
        mine = self.recv[o:o + p]  # this chunk's received bytes are read: reuse
        mine[:n].copy_(rq[:n])
        mine[n:].copy_(rs[:nb].view(torch.uint8))
        return [(self.wire[o:o + W * p], mine)]

    def start_extra(self, pg):
        return [groups.all_reduce(self.exbuf, pg, async_op=True)] if self.ex else []

    def zero(self):
        self.encode = None  # what a joined rank sends stands for zeros: nothing of a stale stage
        self.q.zero_()
        self.s.fill_(1.0)
        self.exbuf.zero_()


@dataclass(eq=False)
class Fp8Gather(Fp8Wire):
    """Two ranks: the whole fp8 bucket all-gathered, then summed where it
    lands.  Round 0: ONE all-gather per piece of every rank's fp8 values and
    scales (at W = 2 the same bytes each way as the two phases' all-to-all
    plus all-gather, in one collective instead of two, all on the module's
    group at the bucket's issue); round 1, local: ONE launch per piece
    dequantizes the W copies, adds them in fp32 in rank order and quantizes
    the sum again into ``q``/``s``, over the whole bucket.  The two phases'
    shards are whole blocks of the same bucket, so every element meets the
    same addends in the same order and every block the same quantization:
    the bits are the two phases', with one collective per piece fewer and
    the sum (and its decoding into ``stage``) as a round of its own (the
    phase-2 thread's, during backward).
    Pieces (``bounds``) cut the whole bucket, not a shard; chunked, each
    piece's ``n`` fp8 bytes then its scales' ``4 nb`` bytes travel side by
    side in ``wire`` (this rank's pieces) and ``recv`` (every rank's, piece
    by piece)."""

    def layout_wire(self) -> None:
        off, piece, o = [], [], 0
        for (a, b), (sa, sb) in zip(self.bounds, self.s_bounds):
            off.append(o)
            piece.append((b - a) + 4 * (sb - sa))
            o += piece[-1]
        self.w_off, self.w_piece = off, piece
        self.wire = torch.empty(o, dtype=torch.uint8, device=self.q.device)
        self.recv = torch.empty(self.world * o, dtype=torch.uint8, device=self.q.device)

    def _ranges(self, k: int) -> list:
        return [self.bounds[k]]

    def stage_in(self):
        """Round 1 wrote the sums into ``q``/``s`` themselves."""

    def finish_piece(self, k):
        """Round 1 decoded them too."""

    def run(self, r, k, pg, health):
        W, B = self.world, self.block
        if r == 0:
            self.encode_piece(k)
        if not self.chunked:
            if r == 0:
                return [groups.all_gather_into_tensor(self.rq, self.q, pg),
                        groups.all_gather_into_tensor(self.rs, self.s, pg)]
            kernels.reduce_fp8_shards(self.rq, self.rs, self.q, self.s, W, B, health=health)
            self._decode([(0, self.q.numel())])
            return []
        (a, b), (sa, sb), o, p = self.bounds[k], self.s_bounds[k], self.w_off[k], self.w_piece[k]
        n, nb = b - a, sb - sa
        got = self.recv[W * o:W * (o + p)]
        if r == 0:
            self.wire[o:o + n].copy_(self.q[a:b])
            self.wire[o + n:o + p].copy_(self.s.view(torch.uint8)[4 * sa:4 * sb])
            return [groups.all_gather_into_tensor(got, self.wire[o:o + p], pg)]
        rq, rs = self.rq[:W * n], self.rs[:W * nb]
        rq.view(W, n).copy_(got.view(W, p)[:, :n])
        rs.view(torch.uint8).view(W, 4 * nb).copy_(got.view(W, p)[:, n:])
        kernels.reduce_fp8_shards(rq, rs, self.q[a:b], self.s[sa:sb], W, B, health=health)
        self._decode([(a, b)])  # the twin's stage, as the two phases' finish would
        return []


class BlockFp8(Reduction):
    """Block-scaled fp8 (e4m3) on the wire, summed in fp32 (``fp8_compress_hook``)::

        pack      the bucket's non-exempt grads * fp32(1/W) into an fp32 stage
                  laid out like the bucket, padded to W shards of whole blocks
                  (ONE launch; exempt slots stay 0); the exempt grads (default:
                  1-D params) * fp32(1/W) into a compact fp32 buffer (one
                  launch)
        issue     the stage -> fp8 bits + one power-of-two scale per block,
                  error feedback read and rewritten there (ONE launch; a big
                  bucket's a piece at a time, each piece's all-to-all issued
                  before the next is quantized); all-to-all of the fp8 shards
                  and of their scales; the exempt buffer's fp32 all-reduce (the
                  engine); a big bucket in chunks of whole blocks, each chunk's
                  fp8 bytes and its scales' bytes side by side in ONE call per
                  phase (:meth:`Fp8Wire.layout_wire`)
        phase 2   ONE launch per piece dequantizes the W slices of this rank's
                  shard, adds them in fp32 in rank order and quantizes the sum
                  again; all-gather fp8 + scales (the engine)
        finish    as each piece's all-gather lands, dequantize it into the
                  stage (ONE launch for a bucket in one piece; CPU: while the
                  later pieces are still on the wire)
        unpack    the exempt values into their slots (one launch), the stage
                  -> .grad (ONE launch), the exempt slots back to 0 (one call)

    Bytes: 1 per element + 4 per block of scales, + 4 per exempt element.
    The residual (error feedback) keeps this rank's quantization error; the
    re-quantization of the sum is shared by all ranks and not fed back.

    ``gather`` (two ranks, :func:`fastddp.reduction.choose`): the two-phase
    mode this one is the twin of; the codec is :class:`Fp8Gather` (over the
    twin's buffers), one all-gather per piece and the sum where it lands:
    the same bytes and bits, one collective instead of two.

    Composed of its codec (:class:`Fp8Wire` or :class:`Fp8Gather`, one per
    bucket), the two-phase engine that runs the wire's rounds and the
    residual book."""

    kind = Kind.FP8
    scaling = Scaling.MUL
    fused = True
    wire_dtype = torch.float8_e4m3fn

    def __init__(self, state, gather: "BlockFp8 | None" = None):
        #: the two-phase mode this one is the one-collective twin of (two
        #: ranks): the gather wire shares its stage and fp8 buffers (one of
        #: the two runs a step), so the twin costs only its receive buffers
        self.gather = gather
        self.tunes_buckets = bool(getattr(state, "tune_buckets", False))  # FP8CompressionState's; not hierarchical's
        self.book = ResidualBook(state.error_feedback)
        self.engine = TwoPhaseEngine(getattr(state, "chunk_bytes", None))
        self.block = state.block_size
        self.exempt_rule = state.exempt

    def _exempt(self, p) -> bool:
        return is_exempt(self.exempt_rule, p)

    def adopt_residual(self, ctx, bucket, values) -> bool:
        """The book's adoption (laid out like the bucket, padded to whole
        shards), with the exempt parameters' slots zeroed: they travel in
        fp32 and keep no residual here."""
        if not self.book.error_feedback:
            return False
        views = bucket.layout.views(self.book.adopt(bucket, values, ctx.world * self.shard_wire(ctx, bucket).shard))
        for k, p in enumerate(bucket.params):
            if self._exempt(p):
                views[k].zero_()
        return True

    def shard_wire(self, ctx, bucket) -> Fp8Wire:
        d = self.engine.wires.get(bucket.index)
        if self.gather is not None:
            base = self.gather.shard_wire(ctx, bucket)
            return d if d is not None and d.q is base.q else self._gather_wire(bucket, base)
        if d is not None and d.world == ctx.world:
            return d
        if bucket.complex or bucket.flat.dtype != torch.float32:
            raise TypeError(f"fp8_compress_hook: bucket {bucket.index} holds {bucket.flat.dtype}"
                            f"{' complex' if bucket.complex else ''} gradients; the fp8 path reduces "
                            "float32 gradients (use bf16_fp32acc_hook, or no hook, for other dtypes)")
        W, B, N, dev = ctx.world, self.block, bucket.flat.numel(), bucket.flat.device
        shard = -(-N // (W * B)) * B
        ex = [k for k, p in enumerate(bucket.params) if self._exempt(p)]
        q8 = [k for k in range(len(bucket.params)) if k not in ex]
        lay = bucket.layout

        def sub(ks, offsets):
            return kernels.Layout([lay.shapes[k] for k in ks], offsets, [lay.strides[k] for k in ks])

        ex_numels = [lay.numels[k] for k in ex]
        bounds = self.engine.bounds(shard, W, 1, B, dev)
        n = max(b - a for a, b in bounds)
        q = torch.zeros(W * shard, dtype=torch.uint8, device=dev)
        s = torch.ones(W * shard // B, dtype=torch.float32, device=dev)
        exbuf = torch.zeros(sum(ex_numels), dtype=torch.float32, device=dev)
        stage = torch.zeros(W * shard, dtype=torch.float32, device=dev)
        stage_views = lay.views(stage)
        d = Fp8Wire(world=W, block=B, shard=shard, ex=ex, q8=q8,
                    lay8=sub(q8, [lay.offsets[k] for k in q8]),
                    lay_ex=sub(ex, kernels.reference.default_offsets(ex_numels)),
                    stage=stage, q=q, s=s, exbuf=exbuf, ex_views=[stage_views[k] for k in ex],
                    bounds=bounds, s_bounds=[(a // B, b // B) for a, b in bounds],
                    rq=torch.empty(W * n, dtype=torch.uint8, device=dev),
                    rs=torch.empty(W * n // B, dtype=torch.float32, device=dev),
                    nbytes=q.numel() + 4 * s.numel() + 4 * exbuf.numel(), decode=True)
        if d.chunked:
            d.layout_wire()
        self.engine.wires[bucket.index] = d
        return d

    def _gather_wire(self, bucket, base: Fp8Wire) -> Fp8Gather:
        """The one-collective wire over ``base``'s buffers (the two-phase
        twin's), with pieces of the whole bucket and receive buffers of its own."""
        W, B, L, dev = base.world, base.block, base.q.numel(), base.q.device
        bounds = self.engine.bounds(L, W, 1, B, dev)
        n = max(b - a for a, b in bounds)
        d = Fp8Gather(world=W, block=B, shard=base.shard, ex=base.ex, q8=base.q8, lay8=base.lay8,
                      lay_ex=base.lay_ex, stage=base.stage, q=base.q, s=base.s, exbuf=base.exbuf,
                      ex_views=base.ex_views, bounds=bounds, s_bounds=[(a // B, b // B) for a, b in bounds],
                      rq=torch.empty(W * n, dtype=torch.uint8, device=dev),
                      rs=torch.empty(W * n // B, dtype=torch.float32, device=dev), nbytes=base.nbytes)
        if d.chunked:
            d.layout_wire()
        self.engine.wires[bucket.index] = d
        return d

    def pack(self, ctx, bucket, grads) -> None:
        d = self.shard_wire(ctx, bucket)
        res, health = self.book.residual_for_pack(bucket, ctx.world * d.shard), bucket.health
        scale = 1.0 / ctx.divisor()
        src, plain = pack_sources(ctx, bucket, grads)
        # Each value flagged once: the exempt ones by their pack, the others by
        # the quantize, which reads all of the stage (x * fp32(1/W) is finite
        # exactly when x is; the stage's other slots hold zeros).
        if d.q8:
            kernels.pack([src[k] for k in d.q8], d.stage, layout=d.lay8, scale=scale)
        if d.ex:
            kernels.pack([src[k] for k in d.ex], d.exbuf, layout=d.lay_ex, scale=scale, health=health)
        d.encode = (res, health)  # the quantize: piece by piece at the issue (Fp8Wire.encode_piece)
        if plain:
            alias_views(ctx, bucket, grads)

    def issue(self, ctx, bucket):
        return self.engine.start(ctx, bucket, self.engine.wires[bucket.index], bucket.health)

    def shadow(self, ctx, bucket):
        return self.engine.shadow(ctx, self.shard_wire(ctx, bucket), bucket)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        self.book.finished(bucket)
        d = self.engine.wires[bucket.index]  # its sums already decoded into the stage (Fp8Wire.finish_piece)
        if d.ex:
            kernels.unpack(d.exbuf, d.ex_views, layout=d.lay_ex)
        unpack_grads(ctx, bucket, d.stage, track_unused)
        if d.ex:  # the stage is the next pack's destination: exempt slots must read 0 again
            torch._foreach_zero_(d.ex_views)  # one call (torch's multi-tensor launch on CUDA), not one per slot

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """Residuals follow their parameters into the rebuilt buckets (a stale
        one is dropped); they are sized at each new bucket's first pack."""
        self.book.carry_residuals(old_locate, new_buckets)
        self.engine.reset()
