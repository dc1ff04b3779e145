"""torch's ``div_factor_``: what a step's gradients are divided by."""

from __future__ import annotations

from .. import groups

__all__ = ["Divisor"]


class Divisor:
    """W, or under ``join(divide_by_initial_world_size=False)`` the ranks not
    joined, known once the forward's count completes (waited for at the
    first pack that needs it, then kept until the iteration is finalized)."""

    __slots__ = ("world", "_work", "_static", "_value")

    def __init__(self, world: int):
        self.world = world
        self._work, self._static, self._value = None, True, None

    def set_work(self, work, use_static_world_size: bool = True) -> None:
        """join(): the all-reduce counting the ranks still training (None: none)."""
        self._work, self._static = work, use_static_world_size

    @property
    def pending(self) -> bool:
        """Inside join(): this forward's count of training ranks is in flight."""
        return self._work is not None

    def get(self) -> int:
        if self._value is None:
            d = self.world
            if self._work is not None and not self._static:
                groups.wait(self._work)
                d = int(self._work.result()[0].item())
            self._value = d
        return self._value

    def forget(self) -> None:
        """The iteration is finalized: join may change the divisor."""
        self._value = None
