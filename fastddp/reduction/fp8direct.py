"""The fp8 wire's sums decoded straight into where they go: the part of an
:class:`~.fp8wire.Fp8Wire` that, on the CPU, dequantizes each piece's sums
into the gradients themselves (bucket views: into the flat bucket) instead
of into the stage, saving the unpack's copy out of it (a write and a read of
4 bytes per value); and, there, defers the pack to each range's quantize,
which reads the gradients times fp32(1/W) itself.  The same values land (a
decode is elementwise), so the same bits."""

from __future__ import annotations

import torch

from .. import kernels
from .datapath import unpack_grads

__all__ = ["DIRECT_VALUES_PER_CALL", "DirectDecode", "overlaps"]

#: decoding into the gradients costs a launch per gradient each piece touches,
#: plus one per edge of a slot inside a block: taken only where every extra
#: launch saves at least this many values' copy (~40 us of memory traffic on
#: one core; a launch, Python's cold-cache call included, costs well under that)
DIRECT_VALUES_PER_CALL = 1 << 16


def overlaps(slots, lo: int, hi: int):
    """``(slot, x0, x1)`` for each of ``slots`` (``(offset, numel, ...)``)
    that overlaps the range ``[lo, hi)``: the overlap is ``[x0, x1)``."""
    for slot in slots:
        x0, x1 = max(slot[0], lo), min(slot[0] + slot[1], hi)
        if x0 < x1:
            yield slot, x0, x1


class DirectDecode:
    """One wire's: where this step's sums are decoded (:meth:`choose`), how
    (:meth:`decode_into`, :meth:`parts`) and the unpack that is left
    (:meth:`land`).  ``slots``: ``(offset in the stage, numel, 1-D view of
    the tensor's memory)``, sorted (None: into the stage, as usual);
    ``grads``: the ``.grad`` tensors the slots are (None: the flat bucket);
    ``pack_scale``: the slots are the pack's sources too, not packed yet."""

    def __init__(self, block: int):
        self.block = block
        self.slots = self.grads = self.pack_scale = None
        self.ok: bool | None = None  # the slots' geometry makes it pay (worth): decided once per wire
        self.tmp: torch.Tensor | None = None  # one block: a slot's edge inside a block is decoded here first

    def aim(self, slots: list | None, grads: list | None, pack_scale: float | None = None) -> None:
        """This step's sums decode into ``slots`` (None: into the stage).
        ``pack_scale``: each range's quantize reads the slots times the scale
        itself (a big bucket's first piece leaves before the rest is even
        read), and the sums are decoded into them only after its
        collectives, so after that read."""
        self.slots, self.grads, self.pack_scale = slots, grads, pack_scale

    def clear(self) -> None:
        self.slots = self.grads = self.pack_scale = None

    def worth(self, wire, geometry) -> bool:
        """Whether decoding into slots of ``geometry`` (``(offset, numel)``
        in the stage) pays over ``wire``'s ranges (one launch each into the
        stage), by bytes and calls (:data:`DIRECT_VALUES_PER_CALL`); decided
        once per wire (a plan's geometry is fixed)."""
        if self.ok is None:
            B, extra = self.block, 0
            for lo, hi in wire.all_ranges():
                extra -= 1  # the range's one launch into the stage, saved
                for _, x0, x1 in overlaps(geometry, lo, hi):
                    extra += 1 + (x0 % B != 0) + (x1 % B != 0)
            self.ok = extra <= 0 or sum(n for _, n in geometry) >= DIRECT_VALUES_PER_CALL * extra
        return self.ok

    def parts(self, lo: int, hi: int) -> tuple[list, list]:
        """The deferred pack of the stage range ``[lo, hi)``: the slots' parts
        in it and their offsets in the range, which the quantize multiplies by
        :attr:`pack_scale` as it reads them (the pack's own product: the same bits)."""
        parts, offs = [], []
        for (o, _, src), x0, x1 in overlaps(self.slots, lo, hi):
            parts.append(src[x0 - o:x1 - o])
            offs.append(x0 - lo)
        return parts, offs

    def decode_into(self, q: torch.Tensor, s: torch.Tensor, lo: int, hi: int) -> None:
        """The stage range ``[lo, hi)`` (whole blocks) of ``q``/``s`` decoded
        into the slots it overlaps: their whole blocks in one launch each, a
        slot's part of a block it shares through :attr:`tmp`."""
        B = self.block
        if self.tmp is None:
            self.tmp = torch.empty(B, dtype=torch.float32, device=q.device)
        for (o, _, dst), x0, x1 in overlaps(self.slots, lo, hi):
            a, b = -(-x0 // B) * B, x1 // B * B  # the whole blocks inside [x0, x1)
            if a < b:
                kernels.dequantize_fp8(q[a:b], s[a // B:b // B], dst[a - o:b - o], B)
                edges = ((x0, a), (b, x1))
            else:
                edges = ((x0, x1),)
            for e0, e1 in edges:
                while e0 < e1:  # at most two blocks
                    k = e0 // B
                    e = min(e1, (k + 1) * B)
                    kernels.dequantize_fp8(q[k * B:(k + 1) * B], s[k:k + 1], self.tmp, B)
                    dst[e0 - o:e - o].copy_(self.tmp[e0 - k * B:e - k * B])
                    e0 = e

    # ------------------------------------------------- the mode's two calls
    def choose(self, ctx, bucket, wire, grads, plain: bool, scale: float) -> None:
        """At the pack: on the CPU, into the grads (bucket views: into the
        flat bucket, which they are) where every ``.grad`` is the tensor the
        unpack would write, laid out as its slot, and where the slots'
        geometry pays (:meth:`worth`), their pack then deferred; else into the
        stage.  Not where a gradient must be left as it was until the
        parameter is known used (find_unused_parameters, static_graph), nor
        under mixed precision's swap (it runs before any value reaches ``.grad``)."""
        if ctx.comm.cuda or ctx.pre_unpack is not None or ctx.keeps_unused:
            return self.aim(None, None)  # (CUDA: the one stage launch each way, on the comm stream)
        if ctx.view_mode:
            n = bucket.flat.numel()
            return self.aim([(0, n, bucket.flat)] if self.worth(wire, [(0, n)]) else None, None)
        lay = bucket.layout
        if not plain or not self.worth(wire, [(lay.offsets[k], lay.numels[k]) for k in wire.q8]):
            return self.aim(None, None)
        slots = []
        for k in wire.q8:
            g, st = grads[k], lay.strides[k]
            if g.dtype != torch.float32 or g.device.type != "cpu" or (
                    not g.is_contiguous() if st is None else tuple(g.stride()) != tuple(st)):
                return self.aim(None, None)
            slots.append((lay.offsets[k], lay.numels[k], g.as_strided((g.numel(),), (1,), g.storage_offset())))
        self.aim(sorted(slots, key=lambda t: t[0]), list(grads), scale)

    def land(self, ctx, bucket, wire, track_unused: bool) -> None:
        """The unpack where the sums were decoded into the grads: the exempt
        values into theirs (one launch, the pack's layout) and nothing else
        to copy.  A ``.grad`` replaced since the pack (a hook's) gets the sums too."""
        kept = self.grads
        self.slots = self.grads = None
        if kept is None:  # bucket views: the flat bucket holds the sums
            if wire.ex:
                kernels.unpack(wire.exbuf, [bucket.grad_views[k] for k in wire.ex], layout=wire.lay_ex)
            return unpack_grads(ctx, bucket, bucket.flat, track_unused)
        for k in wire.q8:
            p = bucket.params[k]
            if p.grad is None:
                p.grad = kept[k]
            elif p.grad is not kept[k]:
                p.grad.copy_(kept[k])
        if wire.ex:
            grads = [bucket.params[k].grad for k in wire.ex]
            if any(g is None for g in grads):  # (a hook's doing): the exempt slots, fresh tensors
                for k, g in zip(wire.ex, grads):
                    if g is None:
                        bucket.params[k].grad = torch.empty_like(kept[k])
                grads = [bucket.params[k].grad for k in wire.ex]
            kernels.unpack(wire.exbuf, grads, layout=wire.lay_ex)
