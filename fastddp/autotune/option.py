"""The ``bucket_cap_mb`` option: ``"auto"``, a number of MiB, or None."""

from __future__ import annotations

from ..settings import parse_bucket_cap as parse_cap

__all__ = ["parse_cap", "resolve_cap"]


def resolve_cap(bucket_cap_mb, bucket_cap_mb_list, configured=None) -> tuple:
    """The constructor's ``bucket_cap_mb`` -> ``(cap or None, auto)``.

    Explicit arguments win; with neither ``bucket_cap_mb`` nor
    ``bucket_cap_mb_list``, ``configured``: the value
    :func:`fastddp.settings.default` gives (``fastddp.configure``'s, else
    ``FASTDDP_BUCKET_CAP_MB``'s)."""
    value = parse_cap(bucket_cap_mb)
    if value == "auto" and bucket_cap_mb_list:
        raise ValueError("fastddp: bucket_cap_mb='auto' and bucket_cap_mb_list were both given; "
                         "'auto' tunes the caps itself: pass one or the other")
    if value is None and not bucket_cap_mb_list:
        value = configured
    if value == "auto":
        return None, True
    return value, False
