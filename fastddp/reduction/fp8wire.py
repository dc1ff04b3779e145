"""The fp8 codec of the two-phase engine (:class:`Fp8Wire`: a bucket's
block-scaled e4m3 buffers, quantized a piece at a time at the issue and
decoded as each piece lands) and its two-rank twin (:class:`Fp8Gather`: one
all-gather per piece, summed where it lands).  The mode that packs and
unpacks them: :class:`fastddp.reduction.fp8.BlockFp8`; the hierarchical
wire's between-hosts hop holds an :class:`Fp8Wire` too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import groups, kernels
from .fp8direct import DirectDecode
from .twophase import ShardWire

__all__ = ["Fp8Gather", "Fp8Wire"]


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
    direct: DirectDecode = None  # the sums decoded straight into the grads (its part; made with the wire)
    gathers = False  # (class attribute) Fp8Gather: one all-gather of every rank's whole bucket per piece

    def __post_init__(self):
        self.direct = DirectDecode(self.block)

    @property
    def chunked(self) -> bool:
        return len(self.bounds) > 1

    def all_ranges(self) -> list:
        """Every piece's :meth:`_ranges`: one launch each way into the stage."""
        return [r for k in range(len(self.bounds)) for r in self._ranges(k)]

    def _ranges(self, k: int) -> list:
        """The ``stage`` ranges piece ``k``'s first collective sends: its slice
        ``[a, b)`` of every rank's shard; a bucket in one piece is one range
        (one launch each way)."""
        if not self.chunked:
            return [(0, self.q.numel())]
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
        (res, health), B, due = self.encode, self.block, self.direct.pack_scale
        for lo, hi in self._ranges(k):
            r = None if res is None else res[lo:hi]
            if due is not None:  # the pack's product read straight from the slots (one pass)
                parts, offs = self.direct.parts(lo, hi)
                kernels.quantize_fp8_gather(parts, offs, due, self.stage[lo:hi], self.q[lo:hi],
                                            self.s[lo // B:hi // B], B, residual=r, health=health)
            else:
                kernels.quantize_fp8(self.stage[lo:hi], self.q[lo:hi], self.s[lo // B:hi // B], B,
                                     residual=r, health=health)
        if k == len(self.bounds) - 1:
            self.encode = self.direct.pack_scale = None

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
        rank's piece of the all-gather.  (:class:`Fp8Gather`: ``wire`` holds
        this rank's pieces only, ``recv`` every rank's.)"""
        rows = 1 if self.gathers else self.world  # the ranks' pieces this rank sends, per chunk
        off, piece, o = [], [], 0
        for (a, b), (sa, sb) in zip(self.bounds, self.s_bounds):
            off.append(o)
            piece.append((b - a) + 4 * (sb - sa))
            o += rows * piece[-1]
        self.w_off, self.w_piece = off, piece
        self.wire = torch.empty(o, dtype=torch.uint8, device=self.q.device)
        self.recv = torch.empty(self.world * o // rows, dtype=torch.uint8, device=self.q.device)

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
        self._decode(self._ranges(k))

    def _decode(self, ranges) -> None:
        B = self.block
        if self.direct.slots is not None:  # (an attribute read, not a property: no frame per piece)
            for lo, hi in ranges:
                self.direct.decode_into(self.q, self.s, lo, hi)
            return
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
        self.direct.clear()  # (and its sums go nowhere but the stage)
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

    gathers = True

    def _ranges(self, k: int) -> list:
        return [self.bounds[k]]  # pieces of the whole bucket (one piece: all of it)

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
            self._decode(self._ranges(k))
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
