"""Stride arithmetic shared by the op layer (:class:`~fastddp.kernels.Layout`)
and the launchers' tables; below both, so neither imports the other for it."""

from __future__ import annotations

from typing import Sequence


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def same_memory_order(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Strides ``a`` and ``b`` lay a tensor of ``shape`` out identically (dims of
    size 1 do not count; an empty tensor has no layout)."""
    if 0 in shape:
        return True
    return len(a) == len(b) == len(shape) and all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` lay a tensor of ``shape`` out without overlap or gap
    (torch's ``is_non_overlapping_and_dense``; dims of size 1 do not count)."""
    if len(shape) != len(strides):
        return False
    if 0 in shape:
        return True
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True
