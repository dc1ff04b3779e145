"""The kernel counters: how tests prove "one launch per bucket" on any backend.

Below every other module of ``fastddp.kernels``: the op layer and the
launchers both bump them, and ``fastddp.kernels`` re-exports the readers.
"""

from __future__ import annotations

import threading
import weakref

_lock = threading.Lock()
_counts = {"launches": 0, "pack_calls": 0, "unpack_calls": 0, "reference_calls": 0,
           "fallback_tensors": 0, "table_uploads": 0, "table_waits": 0}


def bump(key: str, n: int = 1) -> None:
    """Add ``n`` to counter ``key`` (thread-safe: launches can come from the backward thread)."""
    with _lock:
        _counts[key] += n


def bump_all(*keys: str) -> None:
    """Add 1 to each counter in ``keys`` under one lock."""
    with _lock:
        for key in keys:
            _counts[key] += 1


def count_served(op: str) -> None:
    """A caller did ``op`` ("pack" or "unpack") with the plain-torch path's
    own ops, outside the op layer (fastddp's native CPU data path): counted
    as that call on the reference backend, so the counters tell the truth."""
    bump_all(f"{op}_calls", "reference_calls")


# id(source) -> [weak reference, packs, unpacks at the last reset]; by id, not a weak-keyed dict: the
# garbage collector clears a cycle's weak references before its __del__ runs retire_served_source
_sources: dict = {}


def add_served_source(source) -> None:
    """``source.served_calls()``: the (packs, unpacks) it served with the
    plain-torch ops since it was made (the native issue chain counts in C++,
    no Python call a step); the counters add what it served since the last
    reset, as :func:`count_served` calls.  Its ``__del__`` calls
    :func:`retire_served_source`."""
    with _lock:
        _sources[id(source)] = [weakref.ref(source), *source.served_calls()]


def retire_served_source(source) -> None:
    """``source`` is going away (its ``__del__``): what it served since the
    last reset stays counted."""
    with _lock:
        entry = _sources.pop(id(source), None)
        if entry is not None:
            p, u = source.served_calls()
            _counts["pack_calls"] += p - entry[1]
            _counts["unpack_calls"] += u - entry[2]
            _counts["reference_calls"] += p - entry[1] + u - entry[2]


def _served() -> tuple[int, int]:
    packs = unpacks = 0
    for ref, p0, u0 in list(_sources.values()):
        src = ref()
        if src is not None:
            p, u = src.served_calls()
            packs, unpacks = packs + p - p0, unpacks + u - u0
    return packs, unpacks


def launch_count() -> int:
    """Triton kernel launches (compiled or interpreted) since the last reset."""
    return _counts["launches"]


def reset_launch_count() -> None:
    """Zero every counter (tests call this before the step they measure)."""
    with _lock:
        for k in _counts:
            _counts[k] = 0
        for entry in _sources.values():
            src = entry[0]()
            if src is not None:
                entry[1:] = src.served_calls()


def stats() -> dict[str, int]:
    """A copy of all counters: Triton ``launches``, ``pack_calls`` and
    ``unpack_calls`` (one per public call, any backend),
    ``reference_calls`` (whole calls served by the plain-torch twin),
    ``fallback_tensors`` (tensors of a kernel call copied with torch, alone,
    because their memory order is not their layout slot's),
    ``table_uploads`` (pointer tables written: a steady-state step writes
    none) and ``table_waits`` (times the host waited for a pointer-table
    slot still in use by the GPU)."""
    with _lock:
        out = dict(_counts)
        packs, unpacks = _served()
    out["pack_calls"] += packs
    out["unpack_calls"] += unpacks
    out["reference_calls"] += packs + unpacks
    return out
