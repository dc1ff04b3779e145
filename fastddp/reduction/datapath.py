"""The data path every bucket mode shares: the grads into the flat bucket
under torch's scaling rules (:func:`fill_flat`), the reduced values back into
``.grad`` (:func:`unpack_grads`), bucket views, sparse buckets, check_finite
flags where no pack launch reads the values.  ``ctx`` is the step's
:class:`~fastddp.reduction.context.StepContext`."""

from __future__ import annotations

import enum

import torch

from .. import kernels

#: check_finite bit for a comm hook's result (beside kernels.Health's bits)
REDUCED_NONFINITE = 8


class Scaling(enum.IntEnum):
    """What the pack applies (torch's rules, bit for bit)."""

    NONE = 0  #: a hook divides: the bucket reaches it undivided (torch's rule)
    MUL = 1   #: torch's default path: ``grad * fp32(1/W)`` (its ``mul_out``)
    DIV = 2   #: ``batched_grad_copy`` / ``allreduce_hook``: ``grad / W``


def plain_grads(ctx, bucket, grads) -> bool:
    """Every grad exists and none aliases the bucket yet: one fused pack
    serves them straight from the separate tensors."""
    if any(g is None for g in grads):
        return False
    if ctx.view_mode:
        return not any(g is v for g, v in zip(grads, bucket.grad_views))
    return True


def pack_sources(ctx, bucket, grads) -> tuple:
    """``(sources, plain)``: what a mode's own staging pack reads.  Plain
    grads (see :func:`plain_grads`) are read where they are; else (missing
    grads, grads already bucket views) they go through the flat bucket
    first and its views are read.  ``plain``: call :func:`alias_views`
    after the pack."""
    if plain_grads(ctx, bucket, grads):
        return grads, True
    fill_flat(ctx, bucket, grads, Scaling.NONE)
    return bucket.views, False


def alias_views(ctx, bucket, grads) -> None:
    """gradient_as_bucket_view: the grads become views of the bucket.  The
    grads they replace were just read by a pack queued on the comm stream, so
    the allocator is told (``release``), or it hands their blocks to later
    backward kernels before the pack has read them."""
    if ctx.view_mode:
        release = ctx.comm.release
        for p, g, v in zip(bucket.params, grads, bucket.grad_views):
            if g is not None and g is not v:
                release(g)
            p.grad = v


def flag_nonfinite(health, t: torch.Tensor, bit: int) -> None:
    """check_finite where no pack launch reads the values and they are not
    the flat bucket (sparse values, a hook's result): one device-side
    reduction, no host sync.  The flat bucket: :func:`check_flat`."""
    health.bitwise_or_((~torch.isfinite(t)).any().to(torch.int32) * bit)


def check_flat(bucket, health, divide=None) -> None:
    """check_finite over the filled flat bucket in ONE launch: an in-place pack
    (the bucket is its own source, element for element), dividing by
    ``divide`` on the way (the same IEEE division as ``flat.div_``, so the
    same bits) and ORing ``SOURCE_NONFINITE`` into ``health``.  No
    temporaries; ``flag_nonfinite`` over a flat bucket costs ~7 launches and
    ~7 bytes per element of them."""
    kernels.pack([bucket.flat], bucket.flat, layout=bucket.flat_layout, divide=divide, health=health)


def fill_flat(ctx, bucket, grads, scaling: Scaling, health=None, divisor: int | None = None) -> None:
    """Write ``grads`` into ``bucket.flat`` under ``scaling`` (torch's
    mark_variable_ready_dense + flush_deferred_copies, one launch).
    ``health``: the bucket's check_finite flag, set by that same launch (or,
    where no pack reads the grads, by one in-place pack of the bucket).  A
    caller whose own next launch reads the whole bucket with ``health=``
    passes None here: that launch flags the same values.  ``divisor``: W
    where the mode averages over other ranks than the module group's."""
    W = ctx.divisor() if divisor is None else divisor
    done = bucket.prefilled
    if done:  # the native early copy put (some of) the grads in their slots, scaled
        bucket.prefilled = 0
        if done < bucket.size:
            fill_flat_mixed(ctx, bucket, grads, scaling, W, ctx.early_filled(bucket))
        if health is not None:
            check_flat(bucket, health)
        return
    if plain_grads(ctx, bucket, grads):
        src = bucket.kernel_grads(grads)
        if scaling is Scaling.MUL:
            kernels.pack(src, bucket.flat, layout=bucket.layout, scale=1.0 / W, health=health)
        elif scaling is Scaling.DIV:
            kernels.pack(src, bucket.flat, layout=bucket.layout, divide=W, health=health)
        else:
            kernels.pack(src, bucket.flat, layout=bucket.layout, health=health)
        alias_views(ctx, bucket, grads)
        return
    if ctx.view_mode and all(g is v for g, v in zip(grads, bucket.grad_views)):
        # torch: per-view div_ (aliased) / flat div_ (batched); with the flag,
        # both in the one launch that reads each value once
        divide = None if scaling is Scaling.NONE else W
        if health is not None:
            check_flat(bucket, health, divide)
        elif divide is not None:
            bucket.flat.div_(divide)
        return
    fill_flat_mixed(ctx, bucket, grads, scaling, W)
    if health is not None:
        check_flat(bucket, health)


def fill_native(ctx, bucket, scaling: Scaling) -> bool:
    """:func:`fill_flat`'s common cases without the grads gathered in Python:
    a bucket the native early copy filled whole, or one native call
    (``Countdown.pack``: the same ATen ops as the plain-torch pack, so the
    same bits) where the native module holds the bucket's slots.  False: the
    caller gathers the grads and calls :func:`fill_flat` (anything unusual:
    check_finite, a missing grad, another dtype or shape, a graph)."""
    native = ctx.native
    if native is None or bucket.health is not None:
        return False
    if bucket.prefilled:
        if bucket.prefilled < bucket.size:
            return False
        bucket.prefilled = 0  # every grad is in its slot, scaled
        return True
    W = ctx.divisor()
    code = native.pack(bucket.index, int(scaling), float(W), ctx.view_mode)
    if code == NATIVE_PACKED:
        kernels.count_served("pack")
        return True
    if code == NATIVE_ALL_VIEWS:  # the grads are the bucket already (torch: one flat div_)
        if scaling is not Scaling.NONE:
            bucket.flat.div_(W)
        return True
    return False


#: ``Countdown.pack``'s answers (fastddp/csrc/countdown.cpp: PackCode)
NATIVE_PACKED, NATIVE_PYTHON, NATIVE_ALL_VIEWS = 0, 1, 2


def fill_flat_mixed(ctx, bucket, grads, scaling: Scaling, W: int, filled=()) -> None:
    """Some grads missing or already aliased: torch's per-parameter rules.
    ``filled``: per bucket position, the slot needs nothing (the native
    early copy put the grad there, already scaled, or the mode reduces that
    grad where it is)."""
    view_mode, batched, release = ctx.view_mode, scaling is Scaling.DIV, ctx.comm.release
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
                    f"fastddp: parameter {ctx.name(p)!r} has a {g.layout} gradient but its module "
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


def _not_its_view(ctx, p) -> RuntimeError:
    return RuntimeError(f"fastddp: the gradient of {ctx.name(p)!r} is not the expected bucket view "
                        "with gradient_as_bucket_view=True (was .grad replaced during backward?)")


def unpack_grads(ctx, bucket, src: torch.Tensor, track_unused: bool, skip=None) -> None:
    """Write the reduced ``src`` back into .grad (torch's finalize_bucket_dense).
    ``skip``: per bucket position, that ``.grad`` was reduced where it is and
    holds its result already (never with bucket views)."""
    ctx.before_unpack(bucket)
    native = ctx.native if not track_unused and skip is None else None
    if ctx.view_mode:
        if src is not bucket.flat:
            kernels.unpack(src, [bucket.flat], layout=bucket.flat_layout)  # one launch, casts back
        if native is not None:
            bad = native.unpack(bucket.index, True)  # a missing grad becomes its view
            if bad == -1:
                return
            if bad >= 0:
                raise _not_its_view(ctx, bucket.params[bad])
        for i, p, v in zip(bucket.indices, bucket.params, bucket.grad_views):
            if track_unused and ctx.globally_unused(i):
                continue
            g = p.grad
            if g is None:
                p.grad = v
            elif g is not v:
                raise _not_its_view(ctx, p)
        return
    if native is not None and src is bucket.flat and native.unpack(bucket.index, False) == -1:
        kernels.count_served("unpack")  # one _foreach_copy_ into the grads
        return
    grads = [p.grad for p in bucket.params]
    unused = any(ctx.globally_unused(i) for i in bucket.indices) if track_unused else False
    if skip is None and not unused and all(g is not None for g in grads):
        kernels.unpack(src, bucket.kernel_grads(grads), layout=bucket.layout)
        return
    for k, (i, p, g, v) in enumerate(zip(bucket.indices, bucket.params, grads, bucket.layout.views(src))):
        if skip is not None and skip[k]:
            continue
        if track_unused and ctx.globally_unused(i):
            continue  # globally unused: .grad untouched, as torch
        if bucket.complex:
            v = torch.view_as_complex(v)
        if g is None:
            p.grad = ctx.comm.hand_over(torch.empty_like(p, memory_format=torch.preserve_format).copy_(v))
        else:
            g.copy_(v)


def take_sparse_grad(ctx, bucket):
    """A sparse bucket's gradient (checked), flagged for check_finite."""
    p = bucket.params[0]
    g = p.grad
    if g is None or g.layout != torch.sparse_coo:
        raise RuntimeError(
            ("Expected sparse gradient to be defined." if g is None else
             "Expected variable to have sparse gradient.") +
            f" fastddp: parameter {ctx.name(p)!r} belongs to a module with sparse gradients "
            f"(sparse=True) but its .grad is {'None' if g is None else g.layout} on rank {ctx.rank}. "
            "Sparse parameters must get a gradient in every iteration.")
    if bucket.health is not None:
        flag_nonfinite(bucket.health, g._values(), kernels.Health.SOURCE_NONFINITE)
    bucket.sparse_grad = g
    return g


def sparse_zeros(bucket):
    p = bucket.params[0]
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                   p.shape)


def unpack_sparse(bucket, result) -> None:
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


