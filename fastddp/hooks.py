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

__all__ = ["GradBucket"]


class GradBucket:
    """What a comm hook receives: one bucket of flattened gradients."""

    __slots__ = ("_index", "_num_buckets", "_buffer", "_params", "_layout")

    def __init__(self, index: int, num_buckets: int, buffer: torch.Tensor,
                 params: Sequence[torch.Tensor], views: Sequence[torch.Tensor] | None, layout):
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
