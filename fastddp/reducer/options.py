"""What the reducer is told at construction: :class:`ReducerOptions` (resolved
from the DDP constructor's arguments) and :class:`Collaborators` (what the
front brings: mixed precision, the module watch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import planner
from ..options import Options

__all__ = ["ReducerOptions", "Collaborators"]


@dataclass(frozen=True)
class ReducerOptions:
    """What the reducer does; resolved from the DDP constructor arguments."""

    bucket: planner.BucketConfig
    """Bucket sizing (caps, first-bucket rule, rebuild policy)."""
    gradient_as_bucket_view: bool = False
    """``.grad`` become views of the flat buckets (no copy in or out)."""
    batched_grad_copy: bool = False
    """torch's batched rule: divide by W (instead of multiplying by fp32(1/W))."""
    find_unused_parameters: bool = False
    """Walk the autograd graph from the outputs each step; unused params count as ready."""
    static_graph: bool = False
    """The set of used params is fixed: learnt in the first iteration."""
    skip_all_reduce_unused_params: bool = False
    """Do not reduce a bucket whose params were all unused on this rank."""
    reduce_dtype: torch.dtype | None = None
    """mixed_precision: the buckets' (wire) dtype; None: the params' dtype."""
    check_finite: str | None = None
    """``"raise"`` / ``"warn"``: gradient health flags set by the packs (:mod:`fastddp.health`)."""
    auto_bucket_cap: bool = False
    """``bucket_cap_mb="auto"``: :mod:`fastddp.autotune` changes ``bucket`` in the first steps."""
    options: Options | None = None
    """fastddp's resolved options (:class:`fastddp.Options`): the modes read
    the in-place threshold, the chunk bytes and the ranks per host here
    (None: :func:`fastddp.settings.effective`'s, when a mode is chosen)."""
    default_caps: bool = False
    """No ``bucket_cap_mb`` / ``bucket_cap_mb_list`` was given or configured:
    torch's default caps, which a bucket mode that tunes them may tune
    (``auto_precision_hook``, :attr:`fastddp.reduction.Reduction.tunes_buckets`)."""


@dataclass(frozen=True)
class Collaborators:
    """What the DDP front hands the reducer; each is optional."""

    pre_unpack: Callable[[Any, Any], None] | None = None
    """``(bucket, comm)``, before a bucket's reduced values reach ``.grad``
    (mixed precision: the full-precision params and grads back first)."""
    after_finalize: Callable[[], None] | None = None
    """After every bucket is unpacked (mixed precision: frozen params back)."""
    refuse_extra_backward: Callable[[], str | None] | None = None
    """Why a second backward through one forward cannot be averaged, or None."""
    module_watch: Any = None
    """:class:`fastddp.verify.ModuleWatch`, for what the find_unused walk meets."""
