"""What a bucket mode sees of a step: :class:`StepContext`.

A mode (:mod:`fastddp.reduction`) packs, issues, finishes and unpacks one
bucket with what this object carries and nothing else: it never sees the
reducer.  The reducer owns one context for its life and updates the few
per-iteration fields in place (no allocation per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["StepContext"]


def _never(_index: int) -> bool:
    return False


@dataclass(eq=False)
class StepContext:
    """The step a bucket is reduced in."""

    __slots__ = ("comm", "world", "rank", "view_mode", "names", "index_of", "divisor",
                 "globally_unused", "early_filled", "pre_unpack", "iteration", "num_buckets",
                 "layout_settled", "rebuilt", "keeps_unused", "forward_at", "native")

    comm: Any
    """:class:`~fastddp.comm.Comm`: collectives, streams, ``release``/``hand_over``."""
    world: int
    """Ranks in the process group."""
    rank: int
    """This rank (for error messages)."""
    view_mode: bool
    """``gradient_as_bucket_view``: ``.grad`` become views of the bucket."""
    names: Sequence[str]
    """Parameter names, by reducer index."""
    index_of: dict
    """``id(param)`` -> reducer index."""
    divisor: Callable[[], int]
    """torch's div_factor_ for this iteration: W, or the ranks not joined
    (lazy: under join it waits for the forward's count the first time)."""
    globally_unused: Callable[[int], bool]
    """find_unused_parameters: parameter ``i`` was unused on every rank."""
    early_filled: Callable[[Any], bytes]
    """Per bucket position: the native hooks copied that grad in early."""
    pre_unpack: Callable | None
    """Called with ``(bucket, comm)`` before any reduced value reaches ``.grad``
    (mixed precision puts the full-precision params and grads back)."""
    iteration: int
    """The synced forward this backward belongs to (stale steps are told by it)."""
    num_buckets: int
    """Buckets in the current plan."""
    layout_settled: bool
    """No bucket change is pending: torch's one rebuild is done (or never
    comes) and ``bucket_cap_mb="auto"`` has settled (set before each
    synchronising forward); a mode that watches its steps waits for it."""
    rebuilt: bool
    """torch's one rebuild is done (or never comes): a mode may measure
    (``bucket_cap_mb="auto"`` waits for a measuring mode, not the reverse)."""
    keeps_unused: bool
    """find_unused_parameters or static_graph: a globally unused parameter's
    ``.grad`` is left as it was (torch's rule), so a mode must not change a
    gradient before it knows the parameter was used."""
    forward_at: float
    """``time.perf_counter()`` at the synced forward of :attr:`iteration`
    (a mode that times whole steps starts there)."""
    native: Any
    """The native countdown (``fastddp/csrc/countdown.cpp``) where it packs
    and unpacks some of the plan's buckets (the CPU ones it holds slots for),
    else None (set with each plan)."""

    @classmethod
    def of(cls, comm, world: int, rank: int, view_mode: bool, names: Sequence[str], index_of: dict,
           divisor: Callable[[], int], globally_unused: Callable[[int], bool] = _never,
           early_filled: Callable[[Any], bytes] = lambda b: b"", pre_unpack: Callable | None = None,
           keeps_unused: bool = False):
        return cls(comm, world, rank, view_mode, names, index_of, divisor, globally_unused,
                   early_filled, pre_unpack, 0, 0, False, False, keeps_unused, 0.0, None)

    def name(self, p) -> str:
        """The parameter's name (``module.path.weight``)."""
        return self.names[self.index_of[id(p)]]

    def before_unpack(self, bucket) -> None:
        if self.pre_unpack is not None:
            self.pre_unpack(bucket, self.comm)
