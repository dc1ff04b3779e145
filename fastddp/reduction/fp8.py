"""Block-scaled fp8 (e4m3) on the wire, summed in fp32 (``fp8_compress_hook``):
the mode that packs and unpacks the two-phase engine's fp8 codec
(:mod:`.fp8wire`)."""

from __future__ import annotations

import torch

from .. import kernels
from .base import Reduction
from .compression import ResidualBook
from .datapath import Scaling, alias_views, pack_sources, unpack_grads
from .fp8wire import Fp8Gather, Fp8Wire
from .kinds import Kind
from .twophase import TwoPhaseEngine

__all__ = ["BlockFp8", "Fp8Gather", "Fp8Wire", "is_exempt"]


def is_exempt(rule, p) -> bool:
    """``FP8CompressionState.exempt``'s rule: None exempts 1-D parameters; a
    callable decides; else a collection of the exempt parameters."""
    if rule is None:
        return p.dim() <= 1
    if callable(rule):
        return bool(rule(p))
    return any(p is q for q in rule)


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

    On the CPU, where the bytes saved pay for the launches (:mod:`.fp8direct`),
    the sums are dequantized straight into the grads (bucket views: the flat
    bucket) as each piece lands, and each range's quantize reads the grads
    themselves times fp32(1/W) (the pack's product; one pass, the stage not
    written there: :func:`fastddp.kernels.quantize_fp8_gather`): the unpack
    then copies the exempt values only.

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
        d.direct.choose(ctx, bucket, d, grads, plain, scale)
        if d.q8 and d.direct.pack_scale is None:  # (else read a range at a time by the quantize: DirectDecode)
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
        if d.direct.slots is not None:  # ... or into the grads themselves (DirectDecode.choose)
            return d.direct.land(ctx, bucket, d, track_unused)
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
