"""The ``bucket_cap_mb`` option: ``"auto"``, a number of MiB, or None."""

from __future__ import annotations

import math
import numbers
import os

__all__ = ["parse_cap", "resolve_cap"]


def parse_cap(value, what: str = "bucket_cap_mb"):
    """``"auto"`` (any case), a number of MiB >= 0, or None; else a clear error."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number of MiB or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of MiB or 'auto', got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of MiB >= 0 or 'auto', got {value!r}")
    return value


def resolve_cap(bucket_cap_mb, bucket_cap_mb_list, configured=None) -> tuple:
    """The constructor's ``bucket_cap_mb`` -> ``(cap or None, auto)``.

    Explicit arguments win; with neither ``bucket_cap_mb`` nor
    ``bucket_cap_mb_list``, ``configured`` (``fastddp.configure``'s value),
    else ``FASTDDP_BUCKET_CAP_MB`` (``auto`` or MiB)."""
    value = parse_cap(bucket_cap_mb)
    if value == "auto" and bucket_cap_mb_list:
        raise ValueError("fastddp: bucket_cap_mb='auto' and bucket_cap_mb_list were both given; "
                         "'auto' tunes the caps itself: pass one or the other")
    if value is None and not bucket_cap_mb_list:
        value = configured
        if value is None:
            env = os.environ.get("FASTDDP_BUCKET_CAP_MB", "").strip()
            value = parse_cap(env, "FASTDDP_BUCKET_CAP_MB") if env else None
    if value == "auto":
        return None, True
    return value, False
