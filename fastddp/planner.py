"""Bucket planning: which parameters share a flat gradient bucket, and in what order.

PURE: parameters (anything with ``dtype``, ``device``, ``numel()`` or ``shape``)
in, a :class:`BucketPlan` out. No process group, no CUDA, no allocation; the
reducer allocates the flat buffers from the plan.

The plan reproduces torch 2.13's ``DistributedDataParallel`` bucket assignment
exactly, so that comm hooks see the same bucket indices and contents as with
torch (PowerSGD keys its state by bucket index). Where torch decides what:

* ``torch/nn/parallel/distributed.py``: ``_BucketCapacityConfig`` resolves the
  caps (25 MiB default; the 1 MiB first bucket only when ``bucket_cap_mb`` is
  left at ``None``; ``bucket_cap_mb_list`` wins over ``bucket_cap_mb``) and
  ``compute_bucket_size_limits`` picks the limits; ``_ddp_init_helper`` calls
  ``dist._compute_bucket_assignment_by_size(parameters, limits, sparse)`` and
  hands ``list(reversed(bucket_indices))`` to the C++ ``Reducer``.
* ``torch/csrc/distributed/c10d/reducer.cpp``:
  ``compute_bucket_assignment_by_size`` (mirrored by :func:`assign`) and
  ``Reducer::rebuild_buckets`` (mirrored by :func:`rebuilt_plan`).

When the reducer should call what (torch's timing, for ``fastddp.reducer``)::

    construction            initial_plan(params, config)      (limits: config.initial_limits())
    backward 1 (non-static) record the order grads become ready
    forward 2 (grad mode)   rebuilt_plan(params, order_of_rank0, config), once,
                            only if config.should_rebuild
    static_graph=True       backward 1 is delayed and records nothing: record
                            backward 2 instead, rebuild before forward 3
    a rank that joined      (Join) pushes 0..n-1, i.e. registration order

The ready order must be rank 0's (torch broadcasts rank 0's rebuilt buckets,
``Reducer::sync_bucket_indices``); syncing it is the caller's job.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._unordered_map import open_bucket_order

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MIB",
    "NO_SIZE_LIMIT",
    "BucketSpec",
    "BucketConfig",
    "BucketPlan",
    "assign",
    "assign_with_limits",
    "initial_plan",
    "rebuilt_plan",
]

MIB = 1024 * 1024
"""torch's ``_MB_TO_BYTES``: DDP's "MB" are MiB."""

DEFAULT_BUCKET_CAP_MB = 25
"""torch's ``_DEFAULT_BUCKET_CAP_MB``."""

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (C++ ``kDefaultFirstBucketBytes``)."""

NO_SIZE_LIMIT = 0
"""The size limit torch reports for a sparse-gradient bucket (C++ ``kNoSizeLimit``)."""

_SIZE_T_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------
# Plan objects
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    """One flat gradient bucket: same dtype, same device, params back to back."""

    index: int
    """Position in :attr:`BucketPlan.buckets` (0 = expected ready first)."""
    param_indices: tuple[int, ...]
    """Indices into the planner's parameter list, in flat-layout order."""
    offsets: tuple[int, ...]
    """Element offset of each parameter in the flat bucket (no padding, like torch)."""
    numel: int
    """Total number of elements in the bucket."""
    dtype: torch.dtype
    """Element type of every parameter (and of the flat buffer)."""
    device: torch.device
    """Device of every parameter (and of the flat buffer)."""
    size_limit_bytes: int
    """The limit this bucket was filled against (``sys.maxsize`` for torch's
    one-bucket first iteration, :data:`NO_SIZE_LIMIT` for a sparse bucket)."""
    sparse: bool = False
    """True for a bucket holding one parameter that expects a sparse gradient
    (torch never groups those; the reducer must not flatten it)."""

    def __post_init__(self) -> None:
        if len(self.param_indices) != len(self.offsets):
            raise ValueError(
                f"Bucket {self.index}: {len(self.param_indices)} param indices but "
                f"{len(self.offsets)} offsets"
            )
        if not self.param_indices:
            raise ValueError(f"Bucket {self.index}: a bucket needs at least one parameter")

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Size of the flat bucket in bytes."""
        return self.numel * self.dtype.itemsize

    @property
    def numels(self) -> tuple[int, ...]:
        """Number of elements of each parameter, in :attr:`param_indices` order."""
        ends = self.offsets[1:] + (self.numel,)
        return tuple(e - o for o, e in zip(self.offsets, ends))

    def __len__(self) -> int:
        return len(self.param_indices)


@dataclass(frozen=True)
class BucketPlan:
    """An ordered tuple of :class:`BucketSpec`; ``buckets[0]`` is expected ready first."""

    buckets: tuple[BucketSpec, ...]
    """The buckets, in the order the reducer numbers them (``GradBucket.index()``)."""
    _locator: dict[int, tuple[int, int]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        buckets = tuple(self.buckets)
        object.__setattr__(self, "buckets", buckets)
        locator: dict[int, tuple[int, int]] = {}
        for position, bucket in enumerate(buckets):
            if bucket.index != position:
                raise ValueError(
                    f"bucket at position {position} has index {bucket.index}: "
                    "indices must be 0..len-1 in order"
                )
            for slot, param_index in enumerate(bucket.param_indices):
                if param_index in locator:
                    raise ValueError(
                        f"parameter {param_index} is in bucket {locator[param_index][0]} "
                        f"and again in bucket {position}"
                    )
                locator[param_index] = (position, slot)
        object.__setattr__(self, "_locator", locator)

    def locate(self, param_index: int) -> tuple[int, int]:
        """``(bucket index, position inside the bucket)`` of a parameter."""
        try:
            return self._locator[param_index]
        except KeyError:
            raise KeyError(
                f"parameter {param_index} is in no bucket of this plan "
                f"({self.num_params} parameters planned)"
            ) from None

    @property
    def num_params(self) -> int:
        """Number of parameters the plan covers."""
        return len(self._locator)

    @property
    def param_order(self) -> tuple[int, ...]:
        """All parameter indices, bucket by bucket, in flat-layout order."""
        return tuple(i for b in self.buckets for i in b.param_indices)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The plan as torch's ``Reducer`` holds it: a list of index lists."""
        return [list(b.param_indices) for b in self.buckets]

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self) -> Iterator[BucketSpec]:
        return iter(self.buckets)

    def __getitem__(self, index: int) -> BucketSpec:
        return self.buckets[index]

    def describe(self, names: Sequence[str] | None = None, *, max_members: int = 8) -> str:
        """A human-readable table of the plan, one line per bucket.

        ``names[i]`` labels parameter ``i`` (e.g. from ``named_parameters``);
        without names, parameters are shown by index.
        """
        if names is not None and len(names) < self.num_params:
            raise ValueError(
                f"describe() got {len(names)} names for a plan of {self.num_params} parameters"
            )

        def label(i: int) -> str:
            return str(i) if names is None else str(names[i])

        def limit_text(limit: int, sparse: bool) -> str:
            if sparse:
                return "sparse"
            if limit >= sys.maxsize:
                return "none"
            return _format_bytes(limit)

        header = ("bucket", "dtype", "device", "params", "numel", "size", "limit", "members")
        rows = []
        for b in self.buckets:
            members = [label(i) for i in b.param_indices[:max_members]]
            if len(b) > max_members:
                members.append(f"... (+{len(b) - max_members})")
            rows.append((
                str(b.index),
                str(b.dtype).removeprefix("torch."),
                str(b.device),
                str(len(b)),
                f"{b.numel:,}",
                _format_bytes(b.nbytes),
                limit_text(b.size_limit_bytes, b.sparse),
                ", ".join(members),
            ))
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
        lines = []
        for r in [header, *rows]:
            cells = [r[c].ljust(widths[c]) for c in range(len(widths))]
            lines.append("  ".join(cells + [r[-1]]).rstrip())
        total = sum(b.nbytes for b in self.buckets)
        lines.append(
            f"{len(self.buckets)} bucket(s), {self.num_params} parameter(s), "
            f"{_format_bytes(total)} in all"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _format_bytes(n: int) -> str:
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.2f} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def _check_cap_mb(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of MiB, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0 MiB, got {value!r}")
    if int(value * MIB) > _INT64_MAX:
        raise ValueError(
            f"{what} = {value!r} MiB is too large: torch's reducer holds caps as int64 bytes"
        )
    return value


def _check_flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{what} must be a bool, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class BucketConfig:
    """The bucketing options of torch's ``DistributedDataParallel``, validated.

    Never mutated, never written back into what the user passed: the resolved
    values are properties. Build it from the DDP constructor's arguments.
    """

    bucket_cap_mb: float | None = None
    """Bucket size cap in MiB, as DDP's ``bucket_cap_mb``. ``None`` means torch's
    default of 25 MiB *and* enables the 1 MiB first bucket; any explicit value
    (even 25) disables it. ``0`` is accepted (torch accepts it): every
    parameter then gets its own bucket once buckets are rebuilt."""
    bucket_cap_mb_list: tuple[float, ...] | None = None
    """Per-bucket caps in MiB, as DDP's ``bucket_cap_mb_list`` (a list or tuple;
    stored as a tuple). Bucket ``k`` of each dtype/device group is filled
    against entry ``k``; the last entry repeats. Used both at construction and
    on rebuild; overrides ``bucket_cap_mb`` (whose value is then ignored, as in
    torch). An empty list means "not given", as in torch."""
    static_graph: bool = False
    """DDP's ``static_graph``: one bucket per dtype/device at construction, and
    the rebuild uses the ready order of the *second* backward."""
    find_unused_parameters: bool = False
    """DDP's ``find_unused_parameters``: when True (and not ``static_graph``),
    torch buckets by size at construction and never rebuilds."""
    set_last_bucket_as_small: bool = False
    """torch's ``DDP_SET_LAST_BUCKET_CAP=1`` environment switch (read by the
    C++ reducer at rebuild time): fill rebuilt buckets from the *last* ready
    gradient backwards, so the small first cap lands on the last bucket. The
    planner reads no environment; ``fastddp.ddp`` sets this from
    :mod:`fastddp.settings`."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None:
            _check_cap_mb(self.bucket_cap_mb, "bucket_cap_mb")
        caps = self.bucket_cap_mb_list
        if caps is not None:
            if not isinstance(caps, (list, tuple)):
                raise TypeError(
                    "bucket_cap_mb_list must be a list or tuple of MiB values, got "
                    f"{type(caps).__name__}"
                )
            checked = tuple(
                _check_cap_mb(c, f"bucket_cap_mb_list[{k}]") for k, c in enumerate(caps)
            )
            object.__setattr__(self, "bucket_cap_mb_list", checked or None)
        for name in ("static_graph", "find_unused_parameters", "set_last_bucket_as_small"):
            object.__setattr__(self, name, _check_flag(getattr(self, name), name))

    # -- resolved values (torch's _BucketCapacityConfig) ---------------------

    @property
    def uses_default_cap(self) -> bool:
        """True when neither ``bucket_cap_mb`` nor ``bucket_cap_mb_list`` is set."""
        return self.bucket_cap_mb is None and self.bucket_cap_mb_list is None

    @property
    def per_bucket_bytes_caps(self) -> tuple[int, ...]:
        """``bucket_cap_mb_list`` in bytes (``int(mb * MiB)`` each), or ``()``."""
        if self.bucket_cap_mb_list is None:
            return ()
        return tuple(int(mb * MIB) for mb in self.bucket_cap_mb_list)

    @property
    def bucket_bytes_cap(self) -> int:
        """The cap in bytes: ``max(bucket_cap_mb_list)``, else ``bucket_cap_mb``, else 25 MiB."""
        if self.bucket_cap_mb_list is not None:
            return int(max(self.bucket_cap_mb_list) * MIB)
        mb = DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb
        return int(mb * MIB)

    @property
    def first_bucket_bytes_cap(self) -> int:
        """1 MiB with the default cap, else :attr:`bucket_bytes_cap` (no small first bucket)."""
        return DEFAULT_FIRST_BUCKET_BYTES if self.uses_default_cap else self.bucket_bytes_cap

    @property
    def should_rebuild(self) -> bool:
        """Whether torch rebuilds buckets (once) from the observed ready order."""
        return self.static_graph or not self.find_unused_parameters

    def initial_limits(self) -> tuple[int, ...]:
        """Size limits (bytes) torch uses at construction.

        ``bucket_cap_mb_list`` if given; else ``(sys.maxsize,)`` (one bucket per
        dtype/device) when buckets will be rebuilt; else ``(first, cap)``, or
        ``(cap,)`` when the first cap is not smaller.
        """
        if self.bucket_cap_mb_list is not None:
            return self.per_bucket_bytes_caps
        if self.should_rebuild:
            return (sys.maxsize,)
        if self.first_bucket_bytes_cap < self.bucket_bytes_cap:
            return (self.first_bucket_bytes_cap, self.bucket_bytes_cap)
        return (self.bucket_bytes_cap,)

    def rebuild_limits(self) -> tuple[int, ...]:
        """Size limits (bytes) the C++ reducer uses when it rebuilds:
        ``bucket_cap_mb_list`` if given, else ``(first, cap)``."""
        if self.bucket_cap_mb_list is not None:
            return self.per_bucket_bytes_caps
        return (self.first_bucket_bytes_cap, self.bucket_bytes_cap)


# --------------------------------------------------------------------------
# torch's compute_bucket_assignment_by_size
# --------------------------------------------------------------------------


def _param_meta(p: Any, i: int) -> tuple[int, torch.dtype, torch.device, int]:
    """``(numel, dtype, device, element_size)`` of a tensor-like parameter."""
    try:
        dtype = p.dtype
        device = torch.device(p.device)
    except AttributeError as e:
        raise TypeError(
            f"parameter {i} ({type(p).__name__}) needs .dtype and .device attributes"
        ) from e
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"parameter {i}: .dtype must be a torch.dtype, got {dtype!r}")
    numel_attr = getattr(p, "numel", None)
    if callable(numel_attr):
        numel = int(numel_attr())
    elif numel_attr is not None:
        numel = int(numel_attr)
    elif hasattr(p, "shape"):
        numel = math.prod(int(s) for s in p.shape)
    else:
        raise TypeError(f"parameter {i} ({type(p).__name__}) needs .numel() or .shape")
    if getattr(p, "is_sparse", False) is True:
        raise ValueError(
            f"parameter {i} is a sparse tensor: torch DDP has no support for sparse "
            "parameters (sparse *gradients* are declared with sparse=...)"
        )
    size_attr = getattr(p, "element_size", None)
    element_size = int(size_attr()) if callable(size_attr) else dtype.itemsize
    return numel, dtype, device, element_size


def _check_limits(limits: Sequence[int]) -> tuple[int, ...]:
    if isinstance(limits, (str, bytes)) or not isinstance(limits, Sequence):
        raise TypeError(f"limits must be a sequence of byte counts, got {type(limits).__name__}")
    out = []
    for k, limit in enumerate(limits):
        try:
            value = operator.index(limit)
        except TypeError:
            raise TypeError(
                f"limits[{k}] must be an integer number of bytes, got {limit!r}"
            ) from None
        if not 0 <= value <= _SIZE_T_MAX:
            raise ValueError(f"limits[{k}] must be in [0, 2**64), got {value}")
        out.append(value)
    if not out:
        raise ValueError("limits must hold at least one size limit")
    return tuple(out)


def _check_sparse(sparse: Sequence[bool] | None, n: int) -> tuple[bool, ...]:
    if sparse is None or len(sparse) == 0:
        return (False,) * n
    if len(sparse) != n:
        raise ValueError(f"sparse has {len(sparse)} entries for {n} parameters")
    return tuple(bool(s) for s in sparse)


def _check_order(order: Sequence[int], n: int, *, full: bool) -> tuple[int, ...]:
    seen: set[int] = set()
    out = []
    for k, raw in enumerate(order):
        i = operator.index(raw)
        if not 0 <= i < n:
            raise ValueError(f"order[{k}] = {i} is not a parameter index (0..{n - 1})")
        if i in seen:
            raise ValueError(f"parameter {i} appears twice in the ready order (order[{k}])")
        seen.add(i)
        out.append(i)
    if full and len(out) != n:
        missing = sorted(set(range(n)) - seen)
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ValueError(
            f"the ready order names {len(out)} of {n} parameters; missing: {shown}. "
            "torch rebuilds only from a backward where every parameter got a gradient"
        )
    return tuple(out)


def assign_with_limits(
    params: Sequence[Any],
    limits: Sequence[int],
    *,
    order: Sequence[int] | None = None,
    sparse: Sequence[bool] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """torch's ``compute_bucket_assignment_by_size``: ``(bucket_indices, per_bucket_limits)``.

    ``params[i]`` is parameter ``i``. Walk the parameters in ``order`` (default
    ``0..n-1``); each dtype/device pair fills its own open bucket, which closes
    as soon as its byte size reaches the current limit; each pair then moves to
    the next entry of ``limits`` (the last repeats). A parameter flagged in
    ``sparse`` gets a bucket of its own (limit :data:`NO_SIZE_LIMIT`).

    Without ``order`` the buckets are sorted by their smallest index. With an
    ``order`` (the rebuild) closed buckets stay in the order they closed and
    the still-open ones follow in the iteration order of the C++
    ``std::unordered_map`` that holds them (see :func:`fastddp._unordered_map.open_bucket_order`).

    Unlike torch's function, an empty ``params`` gives ``([], [])``.
    """
    n = len(params)
    limits = _check_limits(limits)
    sparse_flags = _check_sparse(sparse, n)
    walk = range(n) if order is None else _check_order(order, n, full=False)

    result: list[tuple[list[int], int]] = []
    # (dtype, device) -> [indices, bytes, limit]; a dict keeps first-insertion
    # order, which is what the unordered_map simulation needs.
    open_buckets: dict[tuple[torch.dtype, torch.device], list[Any]] = {}
    limit_pos: dict[tuple[torch.dtype, torch.device], int] = {}
    for i in walk:
        if sparse_flags[i]:
            result.append(([i], NO_SIZE_LIMIT))
            continue
        numel, dtype, device, element_size = _param_meta(params[i], i)
        key = (dtype, device)
        acc = open_buckets.setdefault(key, [[], 0, 0])
        acc[0].append(i)
        acc[1] += numel * element_size
        pos = limit_pos.setdefault(key, 0)
        acc[2] = limits[pos]
        if acc[1] >= acc[2]:
            result.append((acc[0], acc[2]))
            open_buckets[key] = [[], 0, 0]  # same key: dict order unchanged
            if pos + 1 < len(limits):
                limit_pos[key] = pos + 1

    keys = list(open_buckets)
    for k in open_bucket_order(keys) if order is not None else range(len(keys)):
        indices, _, limit = open_buckets[keys[k]]
        if indices:
            result.append((indices, limit))

    if order is None:
        result.sort(key=lambda r: min(r[0]))
    return [r[0] for r in result], [r[1] for r in result]


def assign(
    params: Sequence[Any],
    limits: Sequence[int],
    *,
    order: Sequence[int] | None = None,
    sparse: Sequence[bool] | None = None,
) -> list[list[int]]:
    """The bucket index lists of :func:`assign_with_limits` (torch's first result)."""
    return assign_with_limits(params, limits, order=order, sparse=sparse)[0]


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------


def _build_plan(
    params: Sequence[Any],
    bucket_indices: Sequence[Sequence[int]],
    limits: Sequence[int],
    sparse_flags: Sequence[bool],
) -> BucketPlan:
    buckets = []
    for position, (indices, limit) in enumerate(zip(bucket_indices, limits)):
        offsets, total = [], 0
        dtype = device = None
        for i in indices:
            numel, dtype, device, _ = _param_meta(params[i], i)
            offsets.append(total)
            total += numel
        buckets.append(BucketSpec(
            index=position,
            param_indices=tuple(indices),
            offsets=tuple(offsets),
            numel=total,
            dtype=dtype,  # type: ignore[arg-type]
            device=device,  # type: ignore[arg-type]
            size_limit_bytes=int(limit),
            sparse=len(indices) == 1 and sparse_flags[indices[0]],
        ))
    return BucketPlan(tuple(buckets))


def initial_plan(
    params: Sequence[Any],
    config: BucketConfig,
    sparse: Sequence[bool] | None = None,
) -> BucketPlan:
    """The buckets torch DDP builds at construction.

    ``params``: the module's parameters that require grad, in registration
    order, shared ones once (torch's ``_build_params_for_reducer``).
    ``sparse[i]``: parameter ``i`` expects a sparse gradient
    (``nn.Embedding(sparse=True)``). Buckets come reversed, as torch hands
    them to its reducer: the last-registered parameters, whose gradients are
    expected first, are in bucket 0.
    """
    sparse_flags = _check_sparse(sparse, len(params))
    indices, limits = assign_with_limits(params, config.initial_limits(), sparse=sparse_flags)
    return _build_plan(params, indices[::-1], limits[::-1], sparse_flags)


def rebuilt_plan(
    params: Sequence[Any],
    ready_order: Sequence[int],
    config: BucketConfig,
    sparse: Sequence[bool] | None = None,
) -> BucketPlan:
    """The buckets torch DDP rebuilds once from the order gradients became ready.

    ``ready_order``: every parameter index exactly once, in the order its
    gradient was ready in the observed backward, as seen on rank 0 (torch
    broadcasts rank 0's result). The buckets stay in ready order, not reversed.
    When ``config.should_rebuild`` is False torch never rebuilds: the initial
    plan is returned (after the same checks).
    """
    n = len(params)
    order = _check_order(ready_order, n, full=True)
    sparse_flags = _check_sparse(sparse, n)
    if not config.should_rebuild:
        return initial_plan(params, config, sparse_flags)
    if config.set_last_bucket_as_small:
        indices, limits = assign_with_limits(
            params, config.rebuild_limits(), order=order[::-1], sparse=sparse_flags
        )
        indices, limits = indices[::-1], limits[::-1]
    else:
        indices, limits = assign_with_limits(
            params, config.rebuild_limits(), order=order, sparse=sparse_flags
        )
    return _build_plan(params, indices, limits, sparse_flags)
