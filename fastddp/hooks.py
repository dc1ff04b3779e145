"""Communication hooks: the bucket handed to them and fastddp's own hooks.

A hook has torch's signature ``hook(state, bucket) -> torch.futures.Future``
whose value is one tensor with the bucket's numel (its dtype may differ: it is
cast back).  The bucket is NOT pre-divided by the world size (torch's rule:
the hook divides).  torch's own hooks (``default_hooks.*``, PowerSGD, ...) run
unchanged on the :class:`GradBucket` below, a duck type of
``torch.distributed.GradBucket`` (which cannot be constructed from Python).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .hook_states import STATES, AutoPrecisionState, CompressionState, FP8CompressionState, HierarchicalState, SiteState
from .reduction.kinds import Kind

__all__ = ["GradBucket"]


class GradBucket:
    """What a comm hook receives: one bucket of flattened gradients."""

    __slots__ = ("_index", "_num_buckets", "_buffer", "_params", "_layout")

    def __init__(self, index: int, num_buckets: int, buffer: torch.Tensor,
                 params: Sequence[torch.Tensor], layout):
        self._index = index
        self._num_buckets = num_buckets
        self._buffer = buffer
        self._params = list(params)
        self._layout = layout

    def index(self) -> int:
        """The bucket's index; bucket 0 holds the gradients ready first."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor of the bucket's gradients (not divided by world size)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat buffer (as torch's ``GradBucket.set_buffer``)."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer: bucket {self._index} holds {self._buffer.numel()} "
                f"elements, got a tensor of {buffer.numel()}")
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views of :meth:`buffer`, shaped like the parameters."""
        return list(self._layout.views(self._buffer))

    def get_per_parameter_tensors(self) -> list[torch.Tensor]:
        return self.gradients()

    def parameters(self) -> list[torch.Tensor]:
        """The model parameters whose gradients this bucket holds, in bucket order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (hooks count steps with it)."""
        return self._index == self._num_buckets - 1

    def is_the_last_bucket_to_allreduce(self) -> bool:  # torch's older name
        return self.is_last()

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
                f"dtype={self._buffer.dtype}, params={len(self._params)})")


# --------------------------------------------------------------------------
# fastddp's own hooks.  Each is an ordinary torch-signature hook (it works on
# torch's DDP too) AND carries a ``_fastddp_fused`` tag that fastddp's reducer
# recognises (fastddp.reduction.choose): it then skips the Python callback and
# runs the fused path (pack: scale + cast straight from the separate grads into
# the wire buffer; all-reduce on the wire; unpack: cast back + scatter), 2
# launches per bucket.
# --------------------------------------------------------------------------


def state_group(state):
    """The process group a hook's ``state`` names (None: the module's)."""
    if isinstance(state, STATES):
        return state.process_group
    return state  # torch's convention: the state is the process group (or None)


def check_registration(hook, state, *, registered: bool, mixed_precision: bool, stepped: bool,
                       sparse: bool) -> None:
    """``DistributedDataParallel.register_comm_hook``'s refusals, with torch's
    sentences where torch has one: the hook's signature (:func:`check_hook`),
    a second registration, mixed precision (its own fused reduction), a
    module that has already stepped, error feedback with sparse gradients."""
    check_hook(hook)
    if registered:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
    if mixed_precision:
        raise RuntimeError("fastddp: mixed_precision runs its own fused reduction; it cannot be "
                           "combined with register_comm_hook (torch refuses it too: its mixed "
                           "precision registers a comm hook)")
    if stepped:
        raise RuntimeError("fastddp: register_comm_hook must be called before the first forward/backward.")
    if isinstance(state, STATES) and getattr(state, "error_feedback", False) and sparse:
        raise ValueError(f"fastddp: {type(state).__name__}(error_feedback=True) does not apply to "
                         "modules with sparse gradients")


def check_hook(hook) -> None:
    """torch's checks (callable; a ``bucket`` annotation must be GradBucket; a
    return annotation must be Future[Tensor]) plus the arity, with torch's
    sentences first."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable, got {type(hook).__name__}.")
    import inspect

    try:
        sig = inspect.signature(hook, eval_str=True)
    except Exception:  # unresolvable string annotations: check what can be checked
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = getattr(hook, "__name__", hook)
    if len(params) != 2 and not any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        raise TypeError(f"Communication hook {name!r} must take exactly two arguments (state, "
                        f"bucket), got {len(params)}: {sig}.")
    bucket_ann = params[1].annotation if len(params) == 2 else inspect.Parameter.empty
    if bucket_ann is not inspect.Parameter.empty and bucket_ann not in (dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket. "
                         f"fastddp: hook {name!r} annotates its bucket argument as {bucket_ann!r}.")
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and ret != torch.futures.Future[torch.Tensor]:
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor]. "
                         f"fastddp: hook {name!r} is annotated to return {ret!r}.")


def _world(group) -> int:
    return (group if group is not None else dist.group.WORLD).size()


def _tag(fn, kind: Kind, dtype: torch.dtype | None):
    fn._fastddp_fused = (kind, dtype)
    return fn


def allreduce_hook(process_group, bucket):
    """torch's ``default_hooks.allreduce_hook``: divide by W, SUM-all-reduce.
    Fused: exactly the batched_grad_copy path (one pack, one unpack)."""
    group = state_group(process_group)
    tensor = bucket.buffer()
    tensor.div_(_world(group))
    return (dist.all_reduce(tensor, group=group if group is not None else dist.group.WORLD, async_op=True)
            .get_future().then(lambda fut: fut.value()[0]))


def _compress(dtype: torch.dtype, state, bucket):
    group = state_group(state)
    buffer = bucket.buffer()
    # Scale in fp32 BEFORE the cast (torch casts first and divides the 16-bit
    # value, which overflows where the average does not).
    compressed = torch.mul(buffer, 1.0 / _world(group)).to(dtype)
    fut = dist.all_reduce(compressed, group=group if group is not None else dist.group.WORLD,
                          async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(process_group, bucket):
    """All-reduce the bucket in float16, averaged in fp32 before the cast.
    Fused in fastddp: 2 launches per bucket, 16-bit wire allocated once."""
    return _compress(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """All-reduce the bucket in bfloat16 (round to nearest even), averaged in
    fp32 before the cast.  Runs on gloo too (torch refuses it off NCCL)."""
    return _compress(torch.bfloat16, process_group, bucket)


def bf16_fp32acc_hook(state, bucket):
    """bf16 on the wire, summed in fp32: each rank's bucket scaled by fp32(1/W)
    and rounded to bf16, reduce-scattered as an all-to-all of W shards, each
    shard summed in fp32 in rank order and rounded once, all-gathered (bf16).
    Same bytes as a bf16 all-reduce; the sum is rounded once, not at every
    hop of a ring.  ``state``: None, a process group, or a
    :class:`CompressionState` (``error_feedback`` on fastddp's fused path).

    Fused in fastddp (3 launches per bucket: pack, shard sum, unpack; the
    all-to-all starts as soon as the bucket is ready).  As a plain hook (on
    torch's DDP, or on another group) the same arithmetic runs with torch ops
    and the all-to-all is waited for inside the hook: a Future callback must
    not issue the all-gather (ranks could issue collectives in different
    orders)."""
    from . import groups, kernels

    group = state_group(state)
    group = group if group is not None else dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    if buffer.layout != torch.strided or buffer.is_complex():
        raise TypeError(f"bf16_fp32acc_hook reduces dense real gradients; bucket {bucket.index()} holds a "
                        f"{'sparse' if buffer.layout != torch.strided else 'complex'} one. Use the default "
                        "reduction (no hook) for sparse or complex parameters.")
    n = buffer.numel()
    shard = -(-n // world)
    wire = torch.zeros(shard * world, dtype=torch.bfloat16, device=buffer.device)
    wire[:n] = torch.mul(buffer.reshape(-1), 1.0 / world)  # fp32 scale, then one bf16 rounding
    recv = torch.empty_like(wire)
    groups.wait(groups.all_to_all_single(recv, wire, group))
    kernels.reference.reduce_shards(recv, recv[:shard], world)
    fut = groups.all_gather_into_tensor(wire, recv[:shard], group).get_future()

    def decompress(fut):
        buffer.copy_(wire[:n])
        return buffer

    return fut.then(decompress)


def fp8_compress_hook(state, bucket):
    """Block-scaled fp8 (e4m3) on the wire with fp32 accumulation and error
    feedback, 1-D parameters exempted (in fp32): see
    :class:`FP8CompressionState` and docs/low-precision.md.  A fused path of
    fastddp.DistributedDataParallel only (pack, quantize and shard-sum
    launches around an all-to-all and an all-gather); called as a plain hook
    (on torch's DDP) it raises."""
    raise RuntimeError("fastddp.hooks.fp8_compress_hook runs only as the fused path of "
                       "fastddp.DistributedDataParallel (register it there, with the module's process "
                       "group); torch's DDP cannot run it")


def hierarchical_hook(state, bucket):
    """The hierarchical reduction (see :class:`HierarchicalState`): fp32
    reduce-scatter inside each host, the host's shard reduced across the
    hosts in the state's ``wire``, all-gathered inside the host.  A fused
    path of fastddp.DistributedDataParallel only; called as a plain hook (on
    torch's DDP) it raises."""
    raise RuntimeError("fastddp.hooks.hierarchical_hook runs only as the fused path of "
                       "fastddp.DistributedDataParallel (register it there with a HierarchicalState); "
                       "torch's DDP cannot run it")


def auto_precision_hook(state, bucket):
    """The wire format chosen from measurement (see :class:`AutoPrecisionState`
    and docs/auto-precision.md).  Fused in fastddp: the allowed formats' own
    fused paths, one at a time, switched between steps by every rank alike.
    Called as a plain hook (on torch's DDP) it is the fp32 all-reduce."""
    return allreduce_hook(state_group(state), bucket)


def noop_hook(_, bucket):
    """No communication: grads stay local (measures what comm costs)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def allgather_then_aggregate_hook(process_group, bucket):
    """All-gather every rank's bucket, then average: the pattern of torch's
    tests (slower than all-reduce; deterministic rank order in the sum)."""
    group = state_group(process_group)
    group = group if group is not None else dist.group.WORLD
    world = group.size()
    tensor = bucket.buffer()
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    fut = dist.all_gather(gathered, tensor, group=group, async_op=True).get_future()

    def aggregate(fut):
        fut.wait()
        total = gathered[0].clone()  # rank order: the same sum on every rank
        for t in gathered[1:]:
            total.add_(t)
        return total.div_(world)

    return fut.then(aggregate)


def _is_plain_allreduce(hook) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return hook is allreduce_hook or hook is default_hooks.allreduce_hook


def _compress_wrapper(dtype: torch.dtype, hook, name: str):
    def wrapper_hook(hook_state, bucket):
        bucket.set_buffer(bucket.buffer().to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(fut):
            decompressed = bucket.buffer()
            decompressed.copy_(fut.value())
            return decompressed

        return fut.then(decompress)

    wrapper_hook.__name__ = name
    wrapper_hook.__qualname__ = name
    if _is_plain_allreduce(hook):
        _tag(wrapper_hook, Kind.COMPRESS, dtype)
    return wrapper_hook


def fp16_compress_wrapper(hook):
    """Cast the bucket to float16 around ``hook`` (torch's wrapper); around an
    all-reduce hook fastddp runs it as the fused fp16 path."""
    return _compress_wrapper(torch.float16, hook, "fp16_compress_wrapper_hook")


def bf16_compress_wrapper(hook):
    """Cast the bucket to bfloat16 around ``hook`` (torch's wrapper); around an
    all-reduce hook fastddp runs it as the fused bf16 path."""
    return _compress_wrapper(torch.bfloat16, hook, "bf16_compress_wrapper_hook")


_tag(allreduce_hook, Kind.ALLREDUCE, None)
_tag(fp16_compress_hook, Kind.COMPRESS, torch.float16)
_tag(bf16_compress_hook, Kind.COMPRESS, torch.bfloat16)
_tag(noop_hook, Kind.NOOP, None)
_tag(bf16_fp32acc_hook, Kind.FP32ACC, torch.bfloat16)
_tag(fp8_compress_hook, Kind.FP8, torch.float8_e4m3fn)
_tag(hierarchical_hook, Kind.HIER, None)
_tag(auto_precision_hook, Kind.AUTO, None)

__all__ += ["AutoPrecisionState", "auto_precision_hook", "HierarchicalState", "hierarchical_hook", "FP8CompressionState", "fp8_compress_hook", "CompressionState", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
            "noop_hook", "bf16_fp32acc_hook", "allgather_then_aggregate_hook", "fp16_compress_wrapper",
            "bf16_compress_wrapper", "check_hook", "state_group"]
