"""The interface every bucket mode answers, and nothing else.

The reducer calls a mode with the step's
:class:`~fastddp.reduction.context.StepContext` (never the reducer):

* ``pack(ctx, bucket, grads)``  -- the bucket's grads into what goes on the
  wire (ONE fused launch where the grads are separate tensors), scaled by the
  mode's rule;
* ``issue(ctx, bucket)``        -- start the collective, return its ``Pending``;
* ``unpack(ctx, bucket, result, track_unused)`` -- the reduced values into
  ``.grad`` (ONE launch, or none where the grads are bucket views);
* ``shadow(ctx, bucket)``       -- join(): the same collectives on zeros.

Those four are abstract: a mode says what it does with the bucket, so a
mode that forgets one cannot be built (there is no default that would
quietly all-reduce the flat bucket).  The rest are optional and their
defaults do nothing: a mode with no residuals, no measuring, nothing to
carry over a rebuild states it by not overriding them.

* ``boundary(ctx)``             -- the step's one decision point (the
  synchronising forward);
* ``pack_native(ctx, bucket)``  -- the pack done by the native data path;
* ``early_copy(world)``, ``in_place(ctx, bucket)`` -- the CPU's early copy
  and the positions reduced where they are;
* ``carry_over(...)``           -- a rebuild replaced the buckets;
* ``residual_of(b)``, ``adopt_residual(...)``, ``book`` -- error feedback
  (:class:`~fastddp.reduction.compression.ResidualBook`, a part a mode holds);
* ``freeze(why)``               -- join(): stop anything that needs collectives.
"""

from __future__ import annotations

import abc

import torch

from ..comm import Pending
from .datapath import Scaling
from .kinds import Kind

__all__ = ["Reduction"]


class Reduction(abc.ABC):
    """One bucket mode (see the module docstring).  One base at most: a mode
    that reuses another's work holds it (the two-phase engine, a codec, the
    residual book) instead of inheriting it."""

    kind: Kind
    scaling: Scaling = Scaling.NONE
    fused: bool = False
    """A fastddp hook run as this fused path (not as a Python callback)."""
    wire_dtype: torch.dtype | None = None
    """The dtype on the wire where the mode fixes it (None: the bucket's)."""
    measuring: bool = False
    """The mode is timing steps to decide something (the bucket tuner waits
    until it is done: one measured change at a time)."""
    tunes_buckets: bool = False
    """The mode asks for ``bucket_cap_mb="auto"`` where the user left torch's
    default caps (after its own measuring)."""
    layout_epoch: int = 0
    """Bumped when the mode's wire changes after it was first chosen (a
    re-measure picked another format): a layout tuned for the old one is
    tuned again."""
    views_key = None
    """What :meth:`in_place` depends on besides the plan (a mode that changes
    it between iterations changes this too: the early copy's views are found
    again)."""
    book = None
    """The mode's error-feedback residuals
    (:class:`~fastddp.reduction.compression.ResidualBook`; None: it keeps none)."""

    @abc.abstractmethod
    def pack(self, ctx, bucket, grads) -> None:
        """The bucket's grads into what goes on the wire."""

    @abc.abstractmethod
    def issue(self, ctx, bucket) -> Pending:
        """Start the bucket's collectives."""

    @abc.abstractmethod
    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        """The reduced values into ``.grad``."""

    @abc.abstractmethod
    def shadow(self, ctx, bucket) -> Pending:
        """join(): the bucket's collectives on zeros."""

    def boundary(self, ctx) -> None:
        """The synchronising forward of ``ctx.iteration`` (the step's one
        decision point: a mode that measures decides here)."""

    def pack_native(self, ctx, bucket) -> bool:
        """The pack done by the native data path, without the grads gathered
        in Python (True), or not taken (False: :meth:`pack` follows)."""
        return False

    def check_result(self, bucket, result) -> None:
        """check_finite, after the collective: modes whose packs set the flag need nothing."""

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """A rebuild replaced the buckets: move per-parameter state along."""

    def residual_of(self, bucket_index: int) -> torch.Tensor | None:
        """Bucket ``bucket_index``'s error-feedback residual laid out like the
        bucket: its book's (None: the mode keeps none of that layout)."""
        return None if self.book is None else self.book.residual_of(bucket_index)

    def adopt_residual(self, ctx, bucket, values: torch.Tensor | None) -> bool:
        """Start ``bucket``'s residual from another mode's (laid out like the
        bucket) or from zeros (``values`` None); False: this mode keeps no
        residual of that layout (nothing adopted)."""
        return False

    def freeze(self, why: str) -> None:
        """join() is starting (every rank at the same step): from now on the
        mode issues no collective of its own beyond the buckets'."""

    def early_copy(self, world: int) -> tuple[float, float] | None:
        """On the CPU the native hooks may copy each grad into its bucket slot
        as it arrives, scaled as this mode's pack would: ``(scale, divide)``
        (scale 0: a plain copy, else multiply by it; divide > 0: divide by it
        instead), or None where the mode's pack must see the grads itself."""
        return None

    def in_place(self, ctx, bucket) -> frozenset:
        """Positions in ``bucket`` whose grads this mode reduces where they
        are (the early copy leaves them alone)."""
        return frozenset()
