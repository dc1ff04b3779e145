"""The states of fastddp's own hooks (re-exported by :mod:`fastddp.hooks`).

Each is a frozen dataclass of its own (none inherits from another, so an
``isinstance`` check sees exactly one hook's state), checked when it is made:
a bad value is a ``ValueError``/``TypeError`` that names the state and the
field.  ``register_comm_hook(state, fastddp.hooks.X)`` takes them as torch's
API takes any state.  :data:`STATES` is every one of them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["AUTO_LOWEST", "AutoPrecisionState", "CompressionState", "FP8CompressionState", "HierarchicalState",
           "SiteState", "STATES"]


def _check_chunk_bytes(value, owner: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{owner}: chunk_bytes={value!r} must be None or a whole number of bytes >= 0 "
                         "(0: one collective call per phase)")
    return value


def _check_block(block_size, owner: str) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 16 <= block_size <= 4096 \
            or block_size & (block_size - 1):
        raise ValueError(f"{owner}: block_size={block_size!r} must be a power of two "
                         "from 16 to 4096 (e.g. 128 or 256)")
    return block_size


def _check_exempt(exempt, owner: str):
    if exempt is not None and not callable(exempt):
        try:
            exempt = tuple(exempt)
        except TypeError:
            raise TypeError(f"{owner}: exempt must be None, a callable param -> bool, or "
                            f"a collection of parameters, got {type(exempt).__name__}") from None
        if not all(isinstance(p, torch.Tensor) for p in exempt):
            raise TypeError(f"{owner}: exempt must hold parameters (tensors)")
    return exempt


def _set(state, **values) -> None:
    """A frozen state's normalised fields, set once in ``__post_init__``."""
    for k, v in values.items():
        object.__setattr__(state, k, v)


def _check_bool(value, owner: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class CompressionState:
    """State for fastddp's fused compression hooks.

    ``process_group``: the group to reduce over (None: the DDP module's group).
    ``error_feedback``: keep, per bucket, the fp32 residual
    ``r <- x - decompress(compress(x))`` of ``x = g / W + r`` and add it to
    the next step's gradient, inside the same pack launch.  Compression
    error then accumulates into later steps instead of being lost.
    ``chunk_bytes``: the two-phase reductions (``bf16_fp32acc_hook``) move a
    big bucket in collective calls of about this many bytes each way (None:
    FASTDDP_CHUNK_BYTES, else 1 MiB on the CPU and one call on CUDA; 0: one
    call per phase).
    """

    process_group: Any = None
    error_feedback: bool = False
    chunk_bytes: int | None = None

    def __post_init__(self):
        _set(self, error_feedback=bool(self.error_feedback),
             chunk_bytes=_check_chunk_bytes(self.chunk_bytes, "CompressionState"))

    def __repr__(self) -> str:
        return f"CompressionState(error_feedback={self.error_feedback})"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FP8CompressionState:
    """State of :func:`fp8_compress_hook`.

    ``block_size``: elements per fp8 scale (a power of two, 16 to 4096; 256:
    4 bytes of scale per 256 bytes of fp8, 1.6 %).  ``error_feedback``
    (default True): this rank's quantization error is added to its next
    step's gradient, inside the quantize launch.  ``exempt``: which
    parameters travel in fp32 instead: None (default) exempts 1-D parameters
    (norm weights, biases: few bytes, most sensitive), or a callable
    ``param -> bool``, or a collection of parameters (empty: none).
    ``chunk_bytes``: as :class:`CompressionState`'s.  ``tune_buckets``
    (default True): where the DDP module was built with torch's default caps
    (no ``bucket_cap_mb`` / ``bucket_cap_mb_list``, nothing configured),
    tune them as ``bucket_cap_mb="auto"`` does, once the two-rank choice (if
    any) is made: torch's caps are sized for an fp32 all-reduce, and a wire
    a quarter of its bytes long pipelines best with other buckets (measured:
    the bench transformer at 1 Gbit/s, 0.72 instead of 0.79 x torch's fp16
    hook).  Caps the user set are kept; one rank has no wire to tune for."""

    process_group: Any = None
    block_size: int = 256
    error_feedback: bool = True
    exempt: Any = None
    chunk_bytes: int | None = None
    tune_buckets: bool = True

    def __post_init__(self):
        owner = "FP8CompressionState"
        _check_bool(self.tune_buckets, owner, "tune_buckets")
        _set(self, error_feedback=bool(self.error_feedback), chunk_bytes=_check_chunk_bytes(self.chunk_bytes, owner),
             block_size=_check_block(self.block_size, owner), exempt=_check_exempt(self.exempt, owner))

    def __repr__(self) -> str:
        return (f"FP8CompressionState(block_size={self.block_size}, error_feedback={self.error_feedback}, "
                f"exempt={'1-D params' if self.exempt is None else self.exempt!r})")


#: the formats the hierarchical reduction can send between hosts
HIERARCHICAL_WIRES = ("fp32", "bf16", "fp8")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class HierarchicalState:
    """State of :func:`fastddp.hooks.hierarchical_hook`: a reduction that
    knows hosts from ranks.  Inside a host the gradients are reduce-scattered
    in fp32; each host's shard is reduced across the hosts in ``wire``; the
    result is all-gathered inside the host.

    ``wire``: what crosses between hosts: ``"fp32"`` (exact: the sum of
    an fp32 all-reduce), ``"bf16"`` (each host's shard rounded once to bf16,
    summed in fp32 across the hosts) or ``"fp8"`` (block-scaled e4m3, summed
    in fp32, 1-D parameters exempted: as :class:`FP8CompressionState`).
    ``ranks_per_host``: None (default) detects the hosts (torchrun's
    environment, else the host's name and network namespace; see
    :mod:`fastddp.topology`); a number says that many consecutive ranks
    share a host, and makes a topology that cannot be honoured an error.
    ``error_feedback``: the host shard's compression error is added to the
    next step's (default: on for fp8, off for bf16; fp32 has none).
    ``block_size``, ``exempt``: the fp8 wire's, as :class:`FP8CompressionState`.
    ``chunk_bytes``: as :class:`CompressionState`'s (the between-hosts hop).
    Where the hierarchy cannot apply (one host, one rank per host, unequal
    hosts, a group smaller than the world) the same format runs flat: fp32
    as ``allreduce_hook``, bf16 as ``bf16_fp32acc_hook``, fp8 as
    ``fp8_compress_hook``, with one log line saying why."""

    process_group: Any = None
    wire: str = "fp32"
    ranks_per_host: int | None = None
    error_feedback: bool | None = None
    block_size: int = 256
    exempt: Any = None
    chunk_bytes: int | None = None

    def __post_init__(self):
        owner, wire, L = "HierarchicalState", self.wire, self.ranks_per_host
        if wire not in HIERARCHICAL_WIRES:
            raise ValueError(f"{owner}: wire={wire!r}; choose one of {', '.join(HIERARCHICAL_WIRES)}")
        if L is not None and (not isinstance(L, int) or isinstance(L, bool) or L < 1):
            raise ValueError(f"{owner}: ranks_per_host={L!r} must be None (detect) or a whole number >= 1")
        ef = wire == "fp8" if self.error_feedback is None else bool(self.error_feedback)
        if ef and wire == "fp32":
            raise ValueError(f"{owner}: error_feedback applies to the compressed wires "
                             "(bf16, fp8); fp32 has no compression error")
        _set(self, error_feedback=ef, chunk_bytes=_check_chunk_bytes(self.chunk_bytes, owner),
             block_size=_check_block(self.block_size, owner), exempt=_check_exempt(self.exempt, owner))

    def __repr__(self) -> str:
        return (f"HierarchicalState(wire={self.wire!r}, ranks_per_host={self.ranks_per_host}, "
                f"error_feedback={self.error_feedback})")


#: the lowest precisions :class:`AutoPrecisionState` accepts, most precise first
AUTO_LOWEST = ("fp32", "bf16", "fp8")


def _whole(value, owner: str, name: str, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}: {name}={value!r} must be a whole number >= {least}")
    return value


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class AutoPrecisionState:
    """State of :func:`fastddp.hooks.auto_precision_hook`: the wire format
    chosen from measurement (docs/auto-precision.md).

    ``lowest``: the lowest precision accepted: ``"fp32"`` (the fp32
    all-reduce only; on several hosts also its hierarchical form),
    ``"bf16"`` (default; adds bf16 on the wire summed in fp32, as
    ``bf16_fp32acc_hook``) or ``"fp8"`` (adds block-scaled e4m3 with the
    1-D parameters in fp32, as ``fp8_compress_hook``).  Where the world spans
    several hosts (:mod:`fastddp.topology`) each allowed format's
    hierarchical form is a candidate too.
    ``error_feedback`` (default True): the compressed formats keep their
    error-feedback residuals; carried between bf16 and fp8 when the format
    changes, dropped (and said) when it changes to fp32.
    ``min_rounds`` / ``max_rounds``: paired trial rounds (one step of every
    format each) before deciding, at least / at most.
    ``watch``: once settled, re-measure (a bounded number of times) when the
    step time moves beyond the noise for a sustained window of
    ``watch_steps`` steps.
    ``tune_buckets`` (default True): where the DDP module was built with
    torch's default caps (no ``bucket_cap_mb`` / ``bucket_cap_mb_list``,
    nothing configured), tune them too, as ``bucket_cap_mb="auto"``, for the
    chosen format, once it is chosen; caps the user set are kept.
    ``clock``: None (the host clock on the CPU, CUDA events on CUDA) or a
    callable ``clock(format_name) -> seconds`` that replaces it (tests give
    each rank a synthetic one).
    ``ranks_per_host``, ``block_size``, ``chunk_bytes``: as
    :class:`HierarchicalState`'s and :class:`FP8CompressionState`'s."""

    process_group: Any = None
    lowest: str = "bf16"
    error_feedback: bool = True
    min_rounds: int = 4
    max_rounds: int = 8
    watch: bool = True
    watch_steps: int = 5
    clock: Callable[[str], float] | None = None
    ranks_per_host: int | None = None
    block_size: int = 256
    chunk_bytes: int | None = None
    tune_buckets: bool = True

    def __post_init__(self):
        owner = "AutoPrecisionState"
        if self.lowest not in AUTO_LOWEST:
            raise ValueError(f"{owner}: lowest={self.lowest!r}; choose one of {', '.join(AUTO_LOWEST)} "
                             "(the lowest precision the reduction may use)")
        _check_bool(self.error_feedback, owner, "error_feedback")
        _whole(self.min_rounds, owner, "min_rounds", 1)
        _whole(self.max_rounds, owner, "max_rounds", 1)
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"{owner}: max_rounds={self.max_rounds} is below min_rounds={self.min_rounds}")
        _check_bool(self.watch, owner, "watch")
        _check_bool(self.tune_buckets, owner, "tune_buckets")
        _whole(self.watch_steps, owner, "watch_steps", 1)
        if self.clock is not None and not callable(self.clock):
            raise TypeError(f"{owner}: clock must be None or a callable format_name -> seconds, "
                            f"got {type(self.clock).__name__}")
        if self.ranks_per_host is not None:
            _whole(self.ranks_per_host, owner, "ranks_per_host", 1)
        _set(self, chunk_bytes=_check_chunk_bytes(self.chunk_bytes, owner),
             block_size=_check_block(self.block_size, owner))

    def __repr__(self) -> str:
        return f"AutoPrecisionState(lowest={self.lowest!r}, error_feedback={self.error_feedback})"


class SiteState:
    """The inner reduction's state: the host's group and whether the warm-up
    is over (set by CrossSite; read by the mode at each bucket)."""

    def __init__(self, inside, ranks_per_host: int, warmup_wire: str = "exact"):
        self.inside, self.ranks_per_host = inside, ranks_per_host
        self.warmup_wire = warmup_wire
        self.local = False
        self.process_group = None  # the module's own group (fastddp.hooks.state_group)


#: every fastddp hook state (a state that names its own process group)
STATES = (CompressionState, FP8CompressionState, HierarchicalState, AutoPrecisionState, SiteState)
