"""Where a self-tuning part stands: one enum for the bucket tuner and the
measured choices (auto precision, the in-place rule).  ``stats()`` reports
its value and whether the part is still measuring, which is what callers
(the bench) read."""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(enum.Enum):
    WAITING = "waiting"
    """Not measuring yet: waiting for torch's bucket rebuild, or for another part."""
    PROBE = "probe"
    """The bucket tuner: timing the ready marks and collectives."""
    TRIAL = "trial"
    """Paired trial steps of the candidates."""
    SETTLED = "settled"
    """Decided; runs the pick (a watch may start another trial)."""
    FROZEN = "frozen"
    """join(): decided for good, no collectives of its own."""

    @property
    def measuring(self) -> bool:
        return self in (Phase.WAITING, Phase.PROBE, Phase.TRIAL)
