"""How a bucket is reduced: one strategy per bucket mode.

Every mode answers the same four calls, made by the reducer:

* ``pack(r, bucket, grads)``  -- the bucket's grads into what goes on the wire
  (ONE fused launch where the grads are separate tensors), scaled by the
  mode's rule;
* ``issue(r, bucket)``        -- start the collective, return its ``Pending``;
* ``unpack(r, bucket, result, track_unused)`` -- the reduced values into
  ``.grad`` (ONE launch, or none where the grads are bucket views);
* ``shadow(r, bucket)``       -- join(): the same collective on zeros.

Modes (:func:`choose` is the only place that picks one):

=================  ==================================================  ===============
mode               what                                                scaling
=================  ==================================================  ===============
AllReduce          torch's default path / ``batched_grad_copy`` /      MUL / DIV
                   fastddp's (or torch's) ``allreduce_hook``
PythonHook         any other comm hook, called with a GradBucket       NONE (hook divides)
FusedCompression   fp16/bf16 hooks: scale in fp32, cast, 16-bit wire,  MUL, before the cast
                   optional error feedback in the same pack launch
Fp32Accumulate     ``bf16_fp32acc_hook``: bf16 all-to-all, fp32 shard  MUL, before the cast
                   sum (one rounding), bf16 all-gather
BlockFp8           ``fp8_compress_hook``: block-scaled e4m3 all-to-all, MUL, before quantizing
                   fp32 shard sum, re-quantized all-gather
NoOp               ``noop_hook``: nothing on the wire                  NONE
SparseAllReduce    a sparse parameter's bucket without a hook          DIV (in place)
=================  ==================================================  ===============

``r`` is the :class:`~fastddp.reducer.Reducer`; strategies use only its
public surface (``comm``, ``view_mode``, ``divide_factor()``,
``globally_unused()``, ``before_unpack()``, ``name()``, ``num_buckets``,
``world``, ``num_iterations``).
"""

from __future__ import annotations

import enum
import os

import torch

from . import groups, kernels
from .comm import Pending

__all__ = ["Scaling", "Reduction", "AllReduce", "PythonHook", "FusedCompression", "Fp32Accumulate", "BlockFp8", "NoOp",
           "SparseAllReduce", "choose", "fill_flat", "unpack_grads"]


#: check_finite bit for a comm hook's result (beside kernels.Health's bits)
REDUCED_NONFINITE = 8


class Scaling(enum.IntEnum):
    """What the pack applies (torch's rules, bit for bit)."""

    NONE = 0  #: a hook divides: the bucket reaches it undivided (torch's rule)
    MUL = 1   #: torch's default path: ``grad * fp32(1/W)`` (its ``mul_out``)
    DIV = 2   #: ``batched_grad_copy`` / ``allreduce_hook``: ``grad / W``


# ------------------------------------------------------------------ data path
def _plain(r, bucket, grads) -> bool:
    """Every grad exists and none aliases the bucket yet: one fused pack
    serves them straight from the separate tensors."""
    if any(g is None for g in grads):
        return False
    if r.view_mode:
        return not any(g is v for g, v in zip(grads, bucket.grad_views))
    return True


def _alias_views(r, bucket, grads) -> None:
    """gradient_as_bucket_view: the grads become views of the bucket.  The
    grads they replace were just read by a pack queued on the comm stream, so
    the allocator is told (``release``), or it hands their blocks to later
    backward kernels before the pack has read them."""
    if r.view_mode:
        release = r.comm.release
        for p, g, v in zip(bucket.params, grads, bucket.grad_views):
            if g is not None and g is not v:
                release(g)
            p.grad = v


def _flag_nonfinite(health, t: torch.Tensor, bit: int) -> None:
    """check_finite where no pack launch reads the values (grads already
    bucket views, per-parameter copies, sparse values, a hook's result): one
    device-side reduction, no host sync."""
    health.bitwise_or_((~torch.isfinite(t)).any().to(torch.int32) * bit)


def fill_flat(r, bucket, grads, scaling: Scaling, health=None) -> None:
    """Write ``grads`` into ``bucket.flat`` under ``scaling`` (torch's
    mark_variable_ready_dense + flush_deferred_copies, one launch).
    ``health``: the bucket's check_finite flag, set by that same launch."""
    W = r.divide_factor()
    done = bucket.prefilled
    if done:  # the native early copy put (some of) the grads in their slots, scaled
        bucket.prefilled = 0
        if done < bucket.size:
            _fill_flat_mixed(r, bucket, grads, scaling, W, r.early_filled(bucket))
        if health is not None:
            _flag_nonfinite(health, bucket.flat, kernels.Health.SOURCE_NONFINITE)
        return
    if _plain(r, bucket, grads):
        src = bucket.kernel_grads(grads)
        if scaling is Scaling.MUL:
            kernels.pack(src, bucket.flat, layout=bucket.layout, scale=1.0 / W, health=health)
        elif scaling is Scaling.DIV:
            kernels.pack(src, bucket.flat, layout=bucket.layout, divide=W, health=health)
        else:
            kernels.pack(src, bucket.flat, layout=bucket.layout, health=health)
        _alias_views(r, bucket, grads)
        return
    if r.view_mode and all(g is v for g, v in zip(grads, bucket.grad_views)):
        if health is not None:
            _flag_nonfinite(health, bucket.flat, kernels.Health.SOURCE_NONFINITE)
        if scaling is not Scaling.NONE:
            bucket.flat.div_(W)  # torch: per-view div_ (aliased) / flat div_ (batched)
        return
    _fill_flat_mixed(r, bucket, grads, scaling, W)
    if health is not None:
        _flag_nonfinite(health, bucket.flat, kernels.Health.SOURCE_NONFINITE)


def _fill_flat_mixed(r, bucket, grads, scaling: Scaling, W: int, filled=()) -> None:
    """Some grads missing or already aliased: torch's per-parameter rules.
    ``filled``: per bucket position, the grad went into its view as it
    arrived (the native early copy), already scaled."""
    view_mode, batched, release = r.view_mode, scaling is Scaling.DIV, r.comm.release
    deferred_src, deferred_dst, deferred = [], [], []
    for k, (p, g, v, gv) in enumerate(zip(bucket.params, grads, bucket.views, bucket.grad_views)):
        if filled and filled[k]:
            continue
        if g is None:
            v.zero_()
        elif g is gv:
            if scaling is Scaling.MUL:
                v.div_(W)
        else:
            if g.layout != torch.strided:
                raise RuntimeError(
                    f"fastddp: parameter {r.name(p)!r} has a {g.layout} gradient but its module "
                    "does not declare sparse gradients (nn.Embedding/EmbeddingBag(sparse=True) "
                    "do); fastddp reduces it only when the module declares it.")
            src = torch.view_as_real(g) if bucket.complex else g
            if batched and not g.requires_grad:
                deferred_src.append(src)
                deferred_dst.append(v)
                deferred.append((p, g, gv))
                continue
            if scaling is Scaling.NONE:
                v.copy_(src)
            else:
                torch.mul(src, 1.0 / W, out=v)
            if view_mode:
                release(g)
                p.grad = gv
    if batched:
        if deferred_src:
            torch._foreach_copy_(deferred_dst, deferred_src)
            if view_mode:
                for p, g, gv in deferred:
                    release(g)
                    p.grad = gv
        if filled:  # the early copies are divided already: the others alone (same bits)
            torch._foreach_div_([v for k, v in enumerate(bucket.views) if not filled[k]], W)
        else:
            bucket.flat.div_(W)


def unpack_grads(r, bucket, src: torch.Tensor, track_unused: bool) -> None:
    """Write the reduced ``src`` back into .grad (torch's finalize_bucket_dense)."""
    r.before_unpack(bucket)
    if r.view_mode:
        if src is not bucket.flat:
            kernels.unpack(src, [bucket.flat], layout=bucket.flat_layout)  # one launch, casts back
        for i, p, v in zip(bucket.indices, bucket.params, bucket.grad_views):
            if track_unused and r.globally_unused(i):
                continue
            g = p.grad
            if g is None:
                p.grad = v
            elif g is not v:
                raise RuntimeError(
                    f"fastddp: the gradient of {r.name(p)!r} is not the expected bucket view "
                    "with gradient_as_bucket_view=True (was .grad replaced during backward?)")
        return
    grads = [p.grad for p in bucket.params]
    unused = any(r.globally_unused(i) for i in bucket.indices) if track_unused else False
    if not unused and all(g is not None for g in grads):
        kernels.unpack(src, bucket.kernel_grads(grads), layout=bucket.layout)
        return
    for i, p, g, v in zip(bucket.indices, bucket.params, grads, bucket.layout.views(src)):
        if track_unused and r.globally_unused(i):
            continue  # globally unused: .grad untouched, as torch
        if bucket.complex:
            v = torch.view_as_complex(v)
        if g is None:
            p.grad = r.comm.hand_over(torch.empty_like(p, memory_format=torch.preserve_format).copy_(v))
        else:
            g.copy_(v)


def _take_sparse_grad(r, bucket):
    """A sparse bucket's gradient (checked), flagged for check_finite."""
    p = bucket.params[0]
    g = p.grad
    if g is None or g.layout != torch.sparse_coo:
        raise RuntimeError(
            ("Expected sparse gradient to be defined." if g is None else
             "Expected variable to have sparse gradient.") +
            f" fastddp: parameter {r.name(p)!r} belongs to a module with sparse gradients "
            f"(sparse=True) but its .grad is {'None' if g is None else g.layout} on rank {r.rank}. "
            "Sparse parameters must get a gradient in every iteration.")
    if bucket.health is not None:
        _flag_nonfinite(bucket.health, g._values(), kernels.Health.SOURCE_NONFINITE)
    bucket.sparse_grad = g
    return g


def _sparse_zeros(bucket):
    p = bucket.params[0]
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                   p.shape)


def _unpack_sparse(bucket, result) -> None:
    """The reduced sparse gradient replaces .grad (torch copies it into the
    bucket's gradient, which is the .grad tensor)."""
    p, g = bucket.params[0], bucket.sparse_grad
    bucket.sparse_grad = None
    if isinstance(result, (list, tuple)):
        result = result[0] if result else None
    if isinstance(result, torch.Tensor) and result is not g:
        g.copy_(result)
    if p.grad is not g:
        p.grad = g


# ----------------------------------------------------------------- strategies
class Reduction:
    """One bucket mode (see the module docstring)."""

    kind: str = "?"
    scaling: Scaling = Scaling.NONE
    fused: tuple | None = None  #: (kind, dtype) of a fused fastddp hook, for stats

    def pack(self, r, bucket, grads) -> None:
        fill_flat(r, bucket, grads, self.scaling, bucket.health)

    def issue(self, r, bucket) -> Pending:
        return r.comm.all_reduce(bucket.flat)

    def unpack(self, r, bucket, result, track_unused: bool) -> None:
        unpack_grads(r, bucket, bucket.flat, track_unused)

    def check_result(self, bucket, result) -> None:
        """check_finite, after the collective: modes whose packs set the flag need nothing."""

    def shadow(self, r, bucket) -> Pending:
        return r.comm.all_reduce(torch.zeros_like(bucket.flat))

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """A rebuild replaced the buckets: move per-parameter state along."""


class AllReduce(Reduction):
    """SUM all-reduce of the flat bucket, pre-scaled by torch's rule."""

    kind = "allreduce"

    def __init__(self, scaling: Scaling, fused: bool = False):
        self.scaling = scaling
        self.fused = ("allreduce", None) if fused else None


class NoOp(Reduction):
    kind = "noop"
    fused = ("noop", None)

    def issue(self, r, bucket) -> Pending:
        return Pending()

    def shadow(self, r, bucket) -> Pending:
        return Pending()


class SparseAllReduce(Reduction):
    """A sparse parameter's bucket: its sparse .grad, divided by W in place,
    SUM-all-reduced (gloo gathers the indices)."""

    kind = "sparse-allreduce"

    def pack(self, r, bucket, grads) -> None:
        _take_sparse_grad(r, bucket).div_(r.divide_factor())

    def issue(self, r, bucket) -> Pending:
        return r.comm.all_reduce(bucket.sparse_grad, nbytes=bucket.nbytes())

    def unpack(self, r, bucket, result, track_unused: bool) -> None:
        _unpack_sparse(bucket, result)

    def shadow(self, r, bucket) -> Pending:
        return r.comm.all_reduce(_sparse_zeros(bucket), nbytes=0)


class PythonHook(Reduction):
    """A comm hook called with a :class:`~fastddp.hooks.GradBucket` (torch's
    contract: the bucket undivided; the Future holds the reduced tensor)."""

    kind = "hook"

    def __init__(self, hook, state):
        self.hook, self.state = hook, state

    def pack(self, r, bucket, grads) -> None:
        if bucket.sparse:
            _take_sparse_grad(r, bucket)
        else:
            fill_flat(r, bucket, grads, Scaling.NONE, bucket.health)

    def _call(self, r, bucket, buffer) -> Pending:
        from .hooks import GradBucket

        layout = None if bucket.sparse else bucket.hook_layout
        fut = self.hook(self.state, GradBucket(bucket.index, r.num_buckets, buffer, bucket.params,
                                               None, layout))
        if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
            raise TypeError(
                f"fastddp: the comm hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(fut).__name__} for bucket {bucket.index}; it must return a "
                "torch.futures.Future whose value is the reduced bucket tensor")
        nbytes = bucket.nbytes() if bucket.sparse else buffer.numel() * buffer.element_size()
        return r.comm.hook(fut, nbytes)

    def issue(self, r, bucket) -> Pending:
        return self._call(r, bucket, bucket.hook_buffer())

    def unpack(self, r, bucket, result, track_unused: bool) -> None:
        if isinstance(result, (list, tuple)):
            result = result[0] if result else None
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"fastddp: the comm hook's Future for bucket {bucket.index} resolved to "
                f"{type(result).__name__}; it must hold one tensor (the reduced bucket)")
        if bucket.sparse:
            _unpack_sparse(bucket, result)
            return
        if bucket.complex and not result.is_complex() and result.numel() == bucket.flat.numel():
            src = result.reshape(-1)  # c10d reduced the complex buffer as its real view
        elif result.numel() != bucket.hook_numel():
            raise ValueError(
                f"fastddp: the comm hook returned {result.numel()} elements for bucket "
                f"{bucket.index}, which holds {bucket.hook_numel()}; a hook must return a tensor "
                "with the bucket's numel")
        elif result.is_complex():
            src = torch.view_as_real(result.reshape(-1)).reshape(-1)
        else:
            src = result.reshape(-1)
        unpack_grads(r, bucket, src, track_unused)

    def check_result(self, bucket, result) -> None:
        """A hook reduces as it likes (PowerSGD, ...): check what it returned."""
        t = result[0] if isinstance(result, (list, tuple)) and result else result
        if isinstance(t, torch.Tensor):
            _flag_nonfinite(bucket.health, t._values() if t.is_sparse else t, REDUCED_NONFINITE)

    def shadow(self, r, bucket) -> Pending:
        if bucket.sparse:
            bucket.sparse_grad = _sparse_zeros(bucket)
            try:
                return self._call(r, bucket, bucket.sparse_grad)
            finally:
                bucket.sparse_grad = None
        return self._call(r, bucket, torch.zeros_like(bucket.hook_buffer()))


class _ResidualBook:
    """Error-feedback residuals per bucket, and which buckets are packed but
    not yet unpacked.  A residual written by a pack whose iteration never
    reached its unpack (a caught error: check_finite, a failed hook, an
    exception in backward) is zeroed at the bucket's next pack: it would carry
    part of a gradient the user never applied; a rebuild drops it."""

    def _residual_for_pack(self, bucket) -> torch.Tensor | None:
        res = self.residual.get(bucket.index)
        if res is not None and bucket.index in self.unfinished:
            res.zero_()  # the last pack's iteration was abandoned: its residual is stale
        self.unfinished.add(bucket.index)
        return res

    def _take_finished_residuals(self) -> dict[int, torch.Tensor]:
        """At a rebuild: the residuals worth carrying (stale ones dropped); the book starts empty."""
        old = {i: t for i, t in self.residual.items() if i not in self.unfinished}
        self.residual, self.unfinished = {}, set()
        return old


class FusedCompression(_ResidualBook, Reduction):
    """fastddp's fp16/bf16 hooks as a fused path: the pack scales by fp32(1/W)
    and casts into a 16-bit wire buffer (allocated once per bucket) in ONE
    launch, optionally with error feedback (an fp32 residual per bucket, read
    and rewritten by the same launch; stale ones dropped: :class:`_ResidualBook`);
    all-reduce on the wire; the unpack casts back."""

    kind = "compress"
    scaling = Scaling.MUL

    def __init__(self, dtype: torch.dtype, error_feedback: bool):
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.fused = ("compress", dtype)
        self.wire: dict[int, torch.Tensor] = {}
        self.residual: dict[int, torch.Tensor] = {}
        self.unfinished: set[int] = set()  # buckets packed whose unpack has not run yet

    def wire_numel(self, r, bucket) -> int:
        """Elements of the bucket's wire buffer (its first ``flat.numel()`` are the bucket's)."""
        return bucket.flat.numel()

    def _wire(self, r, bucket) -> torch.Tensor:
        w = self.wire.get(bucket.index)
        numel = self.wire_numel(r, bucket)
        if w is None or w.numel() != numel:
            # zeros: a padded wire's tail is never written by the pack
            w = self.wire[bucket.index] = torch.zeros(numel, dtype=self.dtype, device=bucket.flat.device)
            if self.error_feedback and bucket.index not in self.residual:
                self.residual[bucket.index] = torch.zeros(bucket.flat.numel(), dtype=torch.float32,
                                                          device=bucket.flat.device)
        return w

    def pack(self, r, bucket, grads) -> None:
        wire = self._wire(r, bucket)
        residual, health = self._residual_for_pack(bucket), bucket.health
        if kernels.backend(bucket.flat.device) == "reference":
            # CPU (no Triton): the bucket is the scratch, scaled in place
            # (x * fp32(1/W), as the kernel) and cast into the wire: no
            # bucket-sized temporary, a few ops per bucket.
            fill_flat(r, bucket, grads, Scaling.MUL, health)
            kernels.pack([bucket.flat], wire, layout=bucket.flat_layout, residual=residual, health=health)
            return
        scale = 1.0 / r.divide_factor()
        if _plain(r, bucket, grads):
            # ONE launch: separate grads -> scale in fp32 -> 16-bit wire (+ residual, + health).
            kernels.pack(bucket.kernel_grads(grads), wire, layout=bucket.layout, scale=scale,
                         residual=residual, health=health)
            _alias_views(r, bucket, grads)
            return
        fill_flat(r, bucket, grads, Scaling.NONE, health)
        kernels.pack([bucket.flat], wire, layout=bucket.flat_layout, scale=scale, residual=residual,
                     health=health)

    def issue(self, r, bucket) -> Pending:
        return r.comm.all_reduce(self.wire[bucket.index])

    def unpack(self, r, bucket, result, track_unused: bool) -> None:
        self.unfinished.discard(bucket.index)
        unpack_grads(r, bucket, self.wire[bucket.index], track_unused)

    def shadow(self, r, bucket) -> Pending:
        return r.comm.all_reduce(torch.zeros_like(self._wire(r, bucket)))

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """Error-feedback residuals belong to parameters: they follow them
        into the rebuilt buckets (a stale one, see the class, is dropped);
        wire buffers are made anew."""
        old_res = self._take_finished_residuals()
        self.wire = {}
        if not self.error_feedback:
            return
        for b in new_buckets:
            if b.sparse:
                continue
            res = self.residual[b.index] = torch.zeros(b.flat.numel(), dtype=torch.float32,
                                                       device=b.flat.device)
            new_views = b.layout.views(res)
            for pos, i in enumerate(b.indices):
                ob, opos = old_locate[i]
                if ob.index in old_res:
                    new_views[pos].copy_(ob.layout.views(old_res[ob.index])[opos])


#: Bytes each way per collective call of a two-phase reduction's chunked
#: phases.  On a TCP link gloo's one big all-to-all carries 55-60% of a ring
#: all-reduce's rate and one big all-gather ~70%; the same bytes as calls of
#: ~1 MiB issued together carry 90% and 97-100%
#: (``reports/amd-epyc/2026-12-01-gloo-collectives-on-link.md``).  CPU
#: tensors (gloo) only: NCCL pipelines its own chunks, so CUDA buckets keep
#: one call per phase (no staging copies).  ``FASTDDP_CHUNK_BYTES`` overrides
#: it for both (0: one call per phase).
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 32


def chunk_bounds(shard: int, world: int, elem_bytes: int, align: int,
                 device: torch.device | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` pieces of a shard of ``shard`` elements, each ``align``-aligned,
    so that one collective call moves about ``CHUNK_BYTES`` each way.  Depends
    only on the sizes (and the setting), so every rank cuts the same pieces and
    issues the same calls.  One piece: the phases run unchunked (no staging)."""
    env = os.environ.get("FASTDDP_CHUNK_BYTES")
    try:
        if env is None or not env.strip():
            target = CHUNK_BYTES if device is None or device.type == "cpu" else 0
        else:
            target = int(env)
    except ValueError:
        raise ValueError(f"fastddp: FASTDDP_CHUNK_BYTES={env!r} is not a whole number of bytes "
                         "(0 turns chunking off)") from None
    units = shard // align
    each_way = (world - 1) * shard * elem_bytes
    if world < 2 or target <= 0 or units < 2 or each_way <= target:
        return [(0, shard)]
    n = min(MAX_CHUNKS, units, -(-each_way // target))
    per = -(-units // n) * align
    return [(a, min(a + per, shard)) for a in range(0, shard, per)]


def _to_stage(stage: torch.Tensor, src: torch.Tensor, world: int, bounds) -> None:
    """Chunk-major staging of a shard-major ``src``: piece ``[a, b)`` of every
    shard, back to back in rank order, at ``stage[world*a : world*b]``."""
    sv = src.view(world, -1)
    for a, b in bounds:
        stage[world * a:world * b].view(world, b - a).copy_(sv[:, a:b])


def _from_stage(dst: torch.Tensor, stage: torch.Tensor, world: int, bounds) -> None:
    """The inverse of :func:`_to_stage`."""
    dv = dst.view(world, -1)
    for a, b in bounds:
        dv[:, a:b].copy_(stage[world * a:world * b].view(world, b - a))


class _ShardStep:
    """One bucket's two-phase reduction in flight, duck-typed as the Future
    :meth:`~fastddp.comm.Comm.wait` completes: ``wait()`` finishes it on the
    calling thread (the end-of-backward callback), never on a collective's
    callback thread (the interpreter is not thread-safe, and collectives
    issued from callbacks could reach the ranks in different orders)."""

    __slots__ = ("owner", "r", "bucket", "a2a", "ag", "iteration", "health", "extra")
    # a2a / ag: the phases' Works, one per chunk (per tensor) in issue order

    def __init__(self, owner, r, bucket, a2a, iteration, health, extra=()):
        self.owner, self.r, self.bucket, self.a2a = owner, r, bucket, a2a
        self.ag, self.iteration, self.health, self.extra = None, iteration, health, extra

    def wait(self, timeout=None) -> bool:
        self.owner.finish(self)
        return True

    def value(self):
        return None


class Fp32Accumulate(FusedCompression):
    """bf16 on the wire, summed in fp32 (``bf16_fp32acc_hook``)::

        pack      grads * fp32(1/W) -> bf16 wire of W*S elements (S = ceil(N/W);
                  the tail past the bucket's N stays 0), error feedback as the
                  fp16/bf16 path; ONE launch
        issue     all-to-all of the W shards (async, as soon as the bucket is ready)
        finish    at the end of backward, for every bucket in flight, in bucket
                  order (the same collectives in the same order on every rank):
                  wait its all-to-all; ONE launch sums the shard from every rank
                  in fp32, in rank order, rounded once to bf16
                  (kernels.reduce_shards); all-gather it into the wire (async)
        unpack    wait the all-gather; the wire -> .grad (ONE launch)

    Bytes on the wire equal a bf16 all-reduce's; the sum's error no longer
    grows with the world size (one rounding instead of one per ring hop).
    A bucket moving more than ``CHUNK_BYTES`` each way runs both phases in
    chunks (:func:`chunk_bounds`): the same pieces of every shard staged back
    to back, one all-to-all per chunk issued together, each chunk summed and
    its all-gather issued as soon as its all-to-all is in; the same elements
    meet in the same order, so the result is bit for bit the unchunked one."""

    kind = "fp32acc"

    def __init__(self, error_feedback: bool):
        super().__init__(torch.bfloat16, error_feedback)
        self.fused = ("fp32acc", torch.bfloat16)
        self.recv: dict[int, torch.Tensor] = {}
        self.chunks: dict[int, tuple] = {}  # bucket -> (wire numel, bounds, stage or None)
        self.open: list[_ShardStep] = []  # in issue order

    def wire_numel(self, r, bucket) -> int:
        w = r.world
        return -(-bucket.flat.numel() // w) * w

    def _recv(self, bucket, wire) -> torch.Tensor:
        t = self.recv.get(bucket.index)
        if t is None or t.numel() != wire.numel():
            t = self.recv[bucket.index] = torch.empty_like(wire)
        return t

    def _chunks(self, r, bucket, wire) -> tuple:
        c = self.chunks.get(bucket.index)
        if c is None or c[0] != wire.numel():
            bounds = chunk_bounds(wire.numel() // r.world, r.world, wire.element_size(), 1, wire.device)
            c = self.chunks[bucket.index] = (wire.numel(), bounds,
                                             torch.empty_like(wire) if len(bounds) > 1 else None)
        return c

    def _start(self, r, bucket, wire, health) -> Pending:
        # a step left open by an abandoned iteration is dropped: its
        # all-to-all completed (every rank issued it) and nobody waits for it
        self.open = [s for s in self.open if s.iteration == r.num_iterations and s.bucket.index < bucket.index]
        recv, pg, W = self._recv(bucket, wire), r.comm.pg, r.world
        _, bounds, stage = self._chunks(r, bucket, wire)
        src = wire  # one piece: the wire itself
        if stage is not None:
            src = stage
            _to_stage(stage, wire, W, bounds)
        works = [groups.all_to_all_single(recv[W * a:W * b], src[W * a:W * b], pg) for a, b in bounds]
        step = _ShardStep(self, r, bucket, works, r.num_iterations, health)
        self.open.append(step)
        return r.comm.hook(step, wire.numel() * wire.element_size())

    def issue(self, r, bucket) -> Pending:
        return self._start(r, bucket, self.wire[bucket.index], bucket.health)

    def shadow(self, r, bucket) -> Pending:
        wire = self._wire(r, bucket)
        wire.zero_()
        return self._start(r, bucket, wire, None)

    def finish(self, step: _ShardStep) -> None:
        """Sum and all-gather every open step not yet gathered (in issue
        order), then wait for ``step``'s all-gather."""
        for s in self.open:
            if s.ag is None:
                wire, recv = self.wire[s.bucket.index], self.recv[s.bucket.index]
                W, pg = s.r.world, s.r.comm.pg
                _, bounds, stage = self.chunks[s.bucket.index]
                s.ag = []
                for (a, b), work in zip(bounds, s.a2a):
                    groups.wait(work)
                    piece = recv[W * a:W * b]
                    kernels.reduce_shards(piece, piece[:b - a], W, health=s.health)
                    # the all-to-all that read this stage piece is complete: gather into it
                    out = wire if stage is None else stage[W * a:W * b]
                    s.ag.append(groups.all_gather_into_tensor(out, piece[:b - a], pg))
        for work in step.ag:
            groups.wait(work)
        _, bounds, stage = self.chunks[step.bucket.index]
        if stage is not None:
            _from_stage(self.wire[step.bucket.index], stage, step.r.world, bounds)
        self.open.remove(step)

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        super().carry_over(old_buckets, old_locate, new_buckets)
        self.recv, self.open, self.chunks = {}, [], {}



class BlockFp8(_ResidualBook, Reduction):
    """Block-scaled fp8 (e4m3) on the wire, summed in fp32 (``fp8_compress_hook``)::

        pack      the bucket's non-exempt grads * fp32(1/W) into an fp32 stage
                  laid out like the bucket, padded to W shards of whole blocks
                  (ONE launch; exempt slots stay 0); the exempt grads (default:
                  1-D params) * fp32(1/W) into a compact fp32 buffer (one
                  launch); the stage -> fp8 bits + one power-of-two scale per
                  block, error feedback read and rewritten there (ONE launch)
        issue     all-to-all of the fp8 shards and of their scales; the exempt
                  buffer's fp32 all-reduce (all async, when the bucket is ready);
                  a big bucket in chunks of whole blocks, as Fp32Accumulate,
                  each chunk's fp8 bytes and its scales' bytes side by side in
                  ONE call per phase (:meth:`_wire_layout`)
        finish    end of backward, every bucket in flight in bucket order: wait
                  its all-to-alls; ONE launch dequantizes the W slices of this
                  rank's shard, adds them in fp32 in rank order and quantizes
                  the sum again; all-gather fp8 + scales (async)
        unpack    dequantize into the stage (ONE launch), the exempt values
                  into their slots (one launch), the stage -> .grad (ONE launch)

    Bytes: 1 per element + 4 per block of scales, + 4 per exempt element.
    The residual (error feedback) keeps this rank's quantization error; the
    re-quantization of the sum is shared by all ranks and not fed back."""

    kind = "fp8"
    scaling = Scaling.MUL

    def __init__(self, state):
        self.block = state.block_size
        self.error_feedback = state.error_feedback
        self.exempt_rule = state.exempt
        self.fused = ("fp8", torch.float8_e4m3fn)
        self.bufs: dict[int, dict] = {}
        self.residual: dict[int, torch.Tensor] = {}
        self.unfinished: set[int] = set()
        self.open: list[_ShardStep] = []
        self.carry = None  # residuals of the buckets before a rebuild, until the new ones are sized

    # ------------------------------------------------------------ buffers
    def _exempt(self, p) -> bool:
        rule = self.exempt_rule
        if rule is None:
            return p.dim() <= 1
        if callable(rule):
            return bool(rule(p))
        return any(p is q for q in rule)

    def _bufs(self, r, bucket) -> dict:
        d = self.bufs.get(bucket.index)
        if d is not None and d["world"] == r.world:
            return d
        if bucket.complex or bucket.flat.dtype != torch.float32:
            raise TypeError(f"fp8_compress_hook: bucket {bucket.index} holds {bucket.flat.dtype}"
                            f"{' complex' if bucket.complex else ''} gradients; the fp8 path reduces "
                            "float32 gradients (use bf16_fp32acc_hook, or no hook, for other dtypes)")
        W, B, N, dev = r.world, self.block, bucket.flat.numel(), bucket.flat.device
        shard = -(-N // (W * B)) * B
        ex = [k for k, p in enumerate(bucket.params) if self._exempt(p)]
        q8 = [k for k in range(len(bucket.params)) if k not in ex]
        lay = bucket.layout

        def sub(ks, offsets):
            return kernels.Layout([lay.shapes[k] for k in ks], offsets, [lay.strides[k] for k in ks])

        ex_numels = [lay.numels[k] for k in ex]
        d = {"world": W, "shard": shard, "ex": ex, "q8": q8,
             "lay8": sub(q8, [lay.offsets[k] for k in q8]),
             "lay_ex": sub(ex, kernels.reference.default_offsets(ex_numels)),
             "stage": torch.zeros(W * shard, dtype=torch.float32, device=dev),
             "q": torch.zeros(W * shard, dtype=torch.uint8, device=dev),
             "s": torch.ones(W * shard // B, dtype=torch.float32, device=dev),
             "exbuf": torch.zeros(sum(ex_numels), dtype=torch.float32, device=dev)}
        d["chunks"] = chunk_bounds(shard, W, 1, B, dev)  # fp8 pieces of whole blocks
        d["s_chunks"] = [(a // B, b // B) for a, b in d["chunks"]]  # ... and their scales
        if len(d["chunks"]) > 1:
            self._wire_layout(d)
        # the shard sum's input (every rank's slice): the all-to-all's receive
        # when in one piece, else one chunk's, reused chunk after chunk
        n = max(b - a for a, b in d["chunks"])
        d["rq"] = torch.empty(W * n, dtype=torch.uint8, device=dev)
        d["rs"] = torch.empty(W * n // B, dtype=torch.float32, device=dev)
        self.bufs[bucket.index] = d
        if self.error_feedback and (bucket.index not in self.residual
                                    or self.residual[bucket.index].numel() != W * shard):
            self.residual[bucket.index] = self._new_residual(bucket, W * shard)
        return d

    # ---------------------------------------------------------------- pack
    def pack(self, r, bucket, grads) -> None:
        d = self._bufs(r, bucket)
        res, health = self._residual_for_pack(bucket), bucket.health
        scale = 1.0 / r.divide_factor()
        plain = _plain(r, bucket, grads)
        if plain:
            src = grads
        else:  # missing grads (zeros), or grads already bucket views: through the flat bucket
            fill_flat(r, bucket, grads, Scaling.NONE, health)
            src, health = bucket.views, None  # flagged by fill_flat
        if d["q8"]:
            kernels.pack([src[k] for k in d["q8"]], d["stage"], layout=d["lay8"], scale=scale, health=health)
        if d["ex"]:
            kernels.pack([src[k] for k in d["ex"]], d["exbuf"], layout=d["lay_ex"], scale=scale, health=health)
        kernels.quantize_fp8(d["stage"], d["q"], d["s"], self.block, residual=res, health=bucket.health)
        if plain:
            _alias_views(r, bucket, grads)

    # --------------------------------------------------------- collectives
    def _start(self, r, bucket, d, health) -> Pending:
        self.open = [s for s in self.open if s.iteration == r.num_iterations and s.bucket.index < bucket.index]
        pg, W = r.comm.pg, r.world
        if len(d["chunks"]) > 1:  # one call per chunk: its fp8 bytes and scales side by side
            wire, recv = d["wire"], d["recv"]
            self._to_wire(d, W)
            works = [groups.all_to_all_single(recv[o:o + W * p], wire[o:o + W * p], pg)
                     for o, p in zip(d["w_off"], d["w_piece"])]
        else:  # one piece: the buffers themselves, values and scales in two calls
            works = [groups.all_to_all_single(d["rq"], d["q"], pg),
                     groups.all_to_all_single(d["rs"], d["s"], pg)]
        extra = [groups.all_reduce(d["exbuf"], pg, async_op=True)] if d["ex"] else []
        step = _ShardStep(self, r, bucket, works, r.num_iterations, health, extra)
        self.open.append(step)
        nbytes = d["q"].numel() + 4 * d["s"].numel() + 4 * d["exbuf"].numel()
        return r.comm.hook(step, nbytes)

    def issue(self, r, bucket) -> Pending:
        return self._start(r, bucket, self.bufs[bucket.index], bucket.health)

    def shadow(self, r, bucket) -> Pending:
        d = self._bufs(r, bucket)
        d["q"].zero_()
        d["s"].fill_(1.0)
        d["exbuf"].zero_()
        return self._start(r, bucket, d, None)

    def finish(self, step: _ShardStep) -> None:
        """Sum and all-gather every open step not yet gathered (in issue
        order), then wait for ``step``'s all-gathers and exempt all-reduce."""
        B = self.block
        for s in self.open:
            if s.ag is None:
                d, W, pg = self.bufs[s.bucket.index], s.r.world, s.r.comm.pg
                s.ag = []
                if len(d["chunks"]) == 1:
                    for w in s.a2a:
                        groups.wait(w)
                    n, nb = d["shard"], d["shard"] // B
                    rq, rs = d["rq"], d["rs"]
                    kernels.reduce_fp8_shards(rq, rs, rq[:n], rs[:nb], W, B, health=s.health)
                    s.ag = [groups.all_gather_into_tensor(d["q"], rq[:n], pg),
                            groups.all_gather_into_tensor(d["s"], rs[:nb], pg)]
                    continue
                for k, ((a, b), (sa, sb)) in enumerate(zip(d["chunks"], d["s_chunks"])):
                    groups.wait(s.a2a[k])
                    n, nb = b - a, sb - sa
                    o, p = d["w_off"][k], d["w_piece"][k]
                    got = d["recv"][o:o + W * p].view(W, p)
                    rq, rs = d["rq"][:W * n], d["rs"][:W * nb]
                    rq.view(W, n).copy_(got[:, :n])
                    rs.view(torch.uint8).view(W, 4 * nb).copy_(got[:, n:])
                    kernels.reduce_fp8_shards(rq, rs, rq[:n], rs[:nb], W, B, health=s.health)
                    mine = d["recv"][o:o + p]  # this chunk's received bytes are read: reuse
                    mine[:n].copy_(rq[:n])
                    mine[n:].copy_(rs[:nb].view(torch.uint8))
                    s.ag.append(groups.all_gather_into_tensor(d["wire"][o:o + W * p], mine, pg))
        for w in list(step.ag) + list(step.extra):
            groups.wait(w)
        d = self.bufs[step.bucket.index]
        if len(d["chunks"]) > 1:
            self._from_wire(d, step.r.world)
        self.open.remove(step)

    @staticmethod
    def _wire_layout(d: dict) -> None:
        """A chunked bucket's wire: per chunk ``[a, b)`` (``n`` fp8 values,
        ``nb`` scales), every rank's piece back to back in rank order, each
        piece its ``n`` fp8 bytes then its scales' ``4 nb`` bytes.  One call
        per chunk and phase, not two: on gloo over TCP the scales' small call
        travelled behind the values' in the same connection, so the two
        worker threads never had two chunks in flight (the all-to-all phase
        at ~65% of the link's rate, the all-gather at ~75%, in a step on the
        0.2 Gbit/s link).  ``wire``: the all-to-all's send and the
        all-gather's receive; ``recv``: the all-to-all's receive, then this
        rank's piece of the all-gather."""
        W = d["world"]
        off, piece, o = [], [], 0
        for (a, b), (sa, sb) in zip(d["chunks"], d["s_chunks"]):
            off.append(o)
            piece.append((b - a) + 4 * (sb - sa))
            o += W * piece[-1]
        d["w_off"], d["w_piece"] = off, piece
        d["wire"] = torch.empty(o, dtype=torch.uint8, device=d["q"].device)
        d["recv"] = torch.empty_like(d["wire"])

    @staticmethod
    def _wire_pairs(d: dict, W: int):
        """(piece of the wire, piece of the shard-major buffer) for every chunk
        and rank row: its fp8 bytes, then its scales' bytes; the two
        directions of staging copy along these pairs."""
        q = d["q"].view(W, -1)
        s = d["s"].view(torch.uint8).view(W, -1)
        for ((a, b), (sa, sb)), o, p in zip(zip(d["chunks"], d["s_chunks"]), d["w_off"], d["w_piece"]):
            v = d["wire"][o:o + W * p].view(W, p)
            yield v[:, :b - a], q[:, a:b]
            yield v[:, b - a:], s[:, 4 * sa:4 * sb]

    @classmethod
    def _to_wire(cls, d: dict, W: int) -> None:
        for wire, buf in cls._wire_pairs(d, W):
            wire.copy_(buf)

    @classmethod
    def _from_wire(cls, d: dict, W: int) -> None:
        for wire, buf in cls._wire_pairs(d, W):
            buf.copy_(wire)

    # -------------------------------------------------------------- unpack
    def unpack(self, r, bucket, result, track_unused: bool) -> None:
        self.unfinished.discard(bucket.index)
        d = self.bufs[bucket.index]
        stage = d["stage"]
        kernels.dequantize_fp8(d["q"], d["s"], stage, self.block)
        if d["ex"]:
            views = bucket.layout.views(stage)
            kernels.unpack(d["exbuf"], [views[k] for k in d["ex"]], layout=d["lay_ex"])
        unpack_grads(r, bucket, stage, track_unused)
        if d["ex"]:  # the stage is the next pack's destination: exempt slots must read 0 again
            views = bucket.layout.views(stage)
            for k in d["ex"]:
                views[k].zero_()

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """Residuals follow their parameters into the rebuilt buckets (a stale
        one is dropped); they are sized at each new bucket's first pack."""
        old_res = self._take_finished_residuals()
        self.bufs, self.open = {}, []
        self.carry = (old_res, old_locate, {b.index for b in new_buckets if not b.sparse}) \
            if self.error_feedback and old_res else None

    def _new_residual(self, bucket, numel: int) -> torch.Tensor:
        res = torch.zeros(numel, dtype=torch.float32, device=bucket.flat.device)
        if self.carry is not None:
            old_res, old_locate, todo = self.carry
            views = bucket.layout.views(res)
            for pos, i in enumerate(bucket.indices):
                ob, opos = old_locate[i]
                if ob.index in old_res:
                    views[pos].copy_(ob.layout.views(old_res[ob.index])[opos])
            todo.discard(bucket.index)
            if not todo:
                self.carry = None
        return res


def choose(hook, state, batched_grad_copy: bool, group_ok: bool) -> tuple[Reduction, Reduction]:
    """The bucket modes for a DDP module: ``(dense, sparse)``.

    ``hook``/``state``: the registered comm hook (None: none); a hook tagged
    by :mod:`fastddp.hooks` runs as its fused path when ``group_ok`` (its
    state's group is the module's), else as an ordinary callback."""
    if hook is None:
        return AllReduce(Scaling.DIV if batched_grad_copy else Scaling.MUL), SparseAllReduce()
    from .hooks import CompressionState, FP8CompressionState

    tag = getattr(hook, "_fastddp_fused", None)
    if isinstance(state, FP8CompressionState) and (tag is None or tag[0] != "fp8"):
        raise TypeError(f"FP8CompressionState is the state of fastddp.hooks.fp8_compress_hook; "
                        f"{getattr(hook, '__name__', hook)!r} is not it")
    error_feedback = isinstance(state, CompressionState) and state.error_feedback
    if tag is None:
        if isinstance(state, CompressionState):
            raise TypeError(f"CompressionState is the state of fastddp's compression hooks; "
                            f"{getattr(hook, '__name__', hook)!r} is not one of them")
        return PythonHook(hook, state), PythonHook(hook, state)
    kind, dtype = tag
    if kind == "fp8":
        if not group_ok:
            raise ValueError("fp8_compress_hook runs only as fastddp's fused path: its state's "
                             "process_group must be None or the DDP module's process group")
        fp8_state = state if isinstance(state, FP8CompressionState) else FP8CompressionState()
        if state is not None and not isinstance(state, FP8CompressionState):
            raise TypeError(f"fp8_compress_hook takes an FP8CompressionState (or None), got {type(state).__name__}")
        return BlockFp8(fp8_state), PythonHook(hook, state)
    if error_feedback and kind not in ("compress", "fp32acc"):
        raise ValueError("CompressionState(error_feedback=True) applies to the fp16/bf16 "
                         "compression hooks and bf16_fp32acc_hook only")
    if not group_ok:
        if error_feedback:
            raise ValueError("fastddp: CompressionState.process_group must be None or the DDP "
                             "module's process group")
        return PythonHook(hook, state), PythonHook(hook, state)
    sparse = PythonHook(hook, state)  # sparse buckets: the hook itself, as torch
    if kind == "allreduce":
        return AllReduce(Scaling.DIV, fused=True), sparse
    if kind == "noop":
        return NoOp(), sparse
    if kind == "fp32acc":
        return Fp32Accumulate(error_feedback), sparse
    return FusedCompression(dtype, error_feedback), sparse
