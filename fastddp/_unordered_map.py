"""The order of the still-open buckets after a rebuild (private to the planner).

compute_bucket_assignment_by_size appends the buckets still open at the end
by iterating a std::unordered_map<BucketKey, ...> keyed by (ScalarType,
Device). With a ready order nothing sorts them afterwards, so with two or
more dtypes/devices the order of the last buckets is that map's iteration
order: c10::get_hash(type, device) and libstdc++'s hashtable (the Linux
wheels). Simulated here; tests check it against torch's function on hundreds
of random key sets. Other C++ standard libraries (macOS, Windows) iterate
differently, and so does torch there.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["open_bucket_order"]


# c10::ScalarType (torch/headeronly/core/ScalarType.h): enum value by dtype name.
_SCALAR_TYPE_NAMES = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex32", "complex64", "complex128", "bool", "qint8", "quint8", "qint32",
    "bfloat16", "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8",
    "bits16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
    "uint16", "uint32", "uint64", "uint1", "uint2", "uint3", "uint4", "uint5",
    "uint6", "uint7", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "float8_e8m0fnu", "float4_e2m1fn_x2",
)
# c10::DeviceType (torch/headeronly/core/DeviceType.h).
_DEVICE_TYPES = {
    "cpu": 0, "cuda": 1, "mkldnn": 2, "opengl": 3, "opencl": 4, "ideep": 5, "hip": 6,
    "fpga": 7, "maia": 8, "xla": 9, "vulkan": 10, "metal": 11, "xpu": 12, "mps": 13,
    "meta": 14, "hpu": 15, "ve": 16, "lazy": 17, "ipu": 18, "mtia": 19,
}
_PRIVATEUSE1 = 20
_M64 = (1 << 64) - 1
# libstdc++ _Prime_rehash_policy: small bucket counts, then the next prime.
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_scalar_type_cache: dict[torch.dtype, int] | None = None


def _scalar_type(dtype: torch.dtype) -> int | None:
    global _scalar_type_cache
    if _scalar_type_cache is None:
        _scalar_type_cache = {}
        for value, name in enumerate(_SCALAR_TYPE_NAMES):
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                _scalar_type_cache[dt] = value
    return _scalar_type_cache.get(dtype)


def _device_type(device: torch.device) -> int | None:
    value = _DEVICE_TYPES.get(device.type)
    if value is None:
        try:
            if device.type == torch._C._get_privateuse1_backend_name():
                value = _PRIVATEUSE1
        except AttributeError:  # pragma: no cover - older torch
            pass
    return value


def _key_hash(dtype: torch.dtype, device: torch.device) -> int | None:
    """``c10::get_hash(ScalarType, Device)`` = hash_combine(hash(device), hash(type))."""
    st, dt = _scalar_type(dtype), _device_type(device)
    if st is None or dt is None:
        return None
    index = -1 if device.index is None else device.index
    seed = ((dt & 0xFF) << 16) | (index & 0xFF)  # std::hash<c10::Device>
    value = st  # std::hash<int8_t> of the enum: the value itself
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


def _next_prime_at_least(n: int) -> int:
    # libstdc++'s __prime_list holds every prime from 17 to 97 (and 127, 257);
    # the counts reachable with real dtype/device pairs are 13, 29, 59, 127.
    c = max(n, 2)
    while any(c % p == 0 for p in range(2, math.isqrt(c) + 1)):
        c += 1
    return c


def _next_bucket_count(n: int) -> int:
    if n < len(_FAST_BUCKETS):
        return 1 if n == 0 else _FAST_BUCKETS[n]
    return _next_prime_at_least(n)


def _unordered_map_order(hashes: Sequence[int]) -> list[int]:
    """Iteration order of a libstdc++ ``std::unordered_map`` after inserting
    distinct keys with these hashes in this order (max load factor 1)."""
    nodes: list[int] = []  # the singly linked node list, as key positions
    bucket_count, next_resize = 1, 0

    def insert(i: int) -> None:
        # _M_insert_bucket_begin: at the front of its bucket's run, or at the
        # front of the whole list when the bucket is empty.
        b = hashes[i] % bucket_count
        for pos, j in enumerate(nodes):
            if hashes[j] % bucket_count == b:
                nodes.insert(pos, i)
                return
        nodes.insert(0, i)

    for i in range(len(hashes)):
        n_elt = len(nodes)
        if n_elt + 1 > next_resize:  # _M_need_rehash
            min_buckets = max(n_elt + 1, 0 if next_resize else 11)
            if min_buckets >= bucket_count:
                bucket_count = _next_bucket_count(max(min_buckets + 1, bucket_count * 2))
                next_resize = bucket_count
                old, nodes = nodes, []
                for j in old:  # _M_rehash_aux walks the old list front to back
                    insert(j)
            else:
                next_resize = bucket_count
        insert(i)
    return nodes


def open_bucket_order(keys: Sequence[tuple[torch.dtype, torch.device]]) -> list[int]:
    """Order in which torch appends the still-open buckets, given their keys in
    order of first appearance."""
    if len(keys) < 2:
        return list(range(len(keys)))
    hashes = [_key_hash(dtype, device) for dtype, device in keys]
    if any(h is None for h in hashes):
        # A dtype or device type this table does not know: without collisions
        # libstdc++ iterates most recent first, the best guess left.
        return list(reversed(range(len(keys))))
    return _unordered_map_order(hashes)  # type: ignore[arg-type]


