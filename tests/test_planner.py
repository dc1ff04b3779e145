"""Golden tests for fastddp.planner: no process group, no CUDA.

Two kinds of expectation, kept apart on purpose:

* hand-computed buckets for small cases (the rules written out in the test);
* torch's own ``torch.distributed._compute_bucket_assignment_by_size`` (the
  C++ function DDP calls), on many cases and on random ones (hypothesis).

The end-to-end claim -- these plans are the buckets torch 2.13 DDP really
uses, before and after its rebuild -- was checked once outside this file
(world-size-1 gloo DDP, a comm hook recording ``bucket.parameters()`` each
iteration, 22 option sets incl. static_graph, mixed dtypes, sparse embedding
and DDP_SET_LAST_BUCKET_CAP=1); this file uses no process group.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastddp.planner import (
    DEFAULT_FIRST_BUCKET_BYTES,
    MIB,
    NO_SIZE_LIMIT,
    BucketSpec,
    BucketConfig,
    BucketPlan,
    assign,
    assign_with_limits,
    initial_plan,
    rebuilt_plan,
)

HAS_DIST = dist.is_available()
needs_dist = pytest.mark.skipif(not HAS_DIST, reason="torch.distributed is not available")

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16


def T(numel: int, dtype: torch.dtype = F32, device: str = "cpu") -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


# -- torch's side ----------------------------------------------------------


def torch_assign(params, limits, *, order=None, sparse=None):
    """torch's C++ assignment, called the way DDP calls it."""
    sparse = list(sparse) if sparse is not None else []
    if order is None:
        idx, lim = dist._compute_bucket_assignment_by_size(list(params), list(limits), sparse)
    else:
        tensors = [params[i] for i in order]
        idx, lim = dist._compute_bucket_assignment_by_size(
            tensors, list(limits), sparse, list(order)
        )
    return [list(b) for b in idx], list(lim)


def torch_initial(params, config, sparse=None):
    """What DDP hands its Reducer at construction: torch's buckets, reversed."""
    idx, lim = torch_assign(params, config.initial_limits(), sparse=sparse)
    return idx[::-1], lim[::-1]


def plan_lists(plan: BucketPlan):
    return plan.bucket_indices, [b.size_limit_bytes for b in plan.buckets]


def check_plan_invariants(plan: BucketPlan, params) -> None:
    """Every param exactly once; offsets back to back; one dtype/device per bucket."""
    seen = sorted(i for b in plan for i in b.param_indices)
    assert seen == list(range(len(params)))
    for position, b in enumerate(plan):
        assert b.index == position
        expect, off = [], 0
        for i in b.param_indices:
            expect.append(off)
            off += params[i].numel()
            assert params[i].dtype == b.dtype and params[i].device == b.device
        assert list(b.offsets) == expect
        assert b.numel == off
        assert b.nbytes == off * params[b.param_indices[0]].element_size()
        assert list(b.numels) == [params[i].numel() for i in b.param_indices]
        for slot, i in enumerate(b.param_indices):
            assert plan.locate(i) == (position, slot)


# ==========================================================================
# Hand-computed expectations
# ==========================================================================


class TestAssignByHand:
    def test_closes_when_size_reaches_limit(self):
        # 4 x 40 bytes against 80: 40, 80 (>= 80: close), 40, 80 (close)
        ps = [T(10)] * 4
        assert assign_with_limits(ps, [80]) == ([[0, 1], [2, 3]], [80, 80])

    def test_size_straddling_the_limit_stays_in_the_bucket(self):
        # 40, 80 < 100, 120 >= 100 -> close after the third; the 4th is left open
        ps = [T(10)] * 4
        assert assign(ps, [100]) == [[0, 1, 2], [3]]

    def test_one_param_bigger_than_the_cap(self):
        ps = [T(5), T(1000), T(5), T(5)]  # 20, 4000, 20, 20 bytes; cap 30
        # 20 < 30, +4000 -> close [0, 1]; 20, 40 -> close [2, 3]
        assert assign(ps, [30]) == [[0, 1], [2, 3]]
        ps = [T(1000), T(5)]
        assert assign(ps, [30]) == [[0], [1]]

    def test_limit_list_advances_then_last_repeats(self):
        # limits 40, 100, 60: buckets close at >=40, then >=100, then >=60 forever
        ps = [T(10)] * 10  # 40 bytes each
        idx, lim = assign_with_limits(ps, [40, 100, 60])
        assert idx == [[0], [1, 2, 3], [4, 5], [6, 7], [8, 9]]
        assert lim == [40, 100, 60, 60, 60]

    def test_limits_advance_per_dtype_device_key(self):
        # fp32 (40 B) and fp64 (80 B) interleaved; limits [80, 1000]
        ps = [T(10, F32), T(10, F64), T(10, F32), T(10, F64), T(10, F32)]
        # fp64: p1 alone reaches 80 -> [1] closes, its next limit is 1000 -> [3] open
        # fp32: p0 40, p2 80 -> [0, 2] closes; p4 open against 1000
        idx, lim = assign_with_limits(ps, [80, 1000])
        assert idx == [[0, 2], [1], [3], [4]]  # sorted by smallest index
        assert lim == [80, 80, 1000, 1000]

    def test_mixed_dtypes_never_share_a_bucket(self):
        ps = [T(1, F32), T(1, F16), T(1, F32), T(1, BF16), T(1, F16)]
        assert assign(ps, [sys.maxsize]) == [[0, 2], [1, 4], [3]]

    def test_sorted_by_smallest_index_without_order(self):
        # fp64 bucket closes first in the walk but holds index 1 > 0
        ps = [T(1, F32), T(100, F64), T(1, F32)]
        idx, lim = assign_with_limits(ps, [100])
        assert idx == [[0, 2], [1]]
        assert lim == [100, 100]

    def test_ready_order_is_kept(self):
        ps = [T(10)] * 5  # 40 B each, cap 80
        assert assign(ps, [80], order=[4, 2, 0, 3, 1]) == [[4, 2], [0, 3], [1]]

    def test_ready_order_open_buckets_follow_the_unordered_map(self):
        # Two keys both left open: torch appends them in std::unordered_map
        # iteration order, here the most recently inserted key (fp64) first.
        ps = [T(1, F32), T(1, F64)]
        assert assign(ps, [1000], order=[0, 1]) == [[1], [0]]
        assert assign(ps, [1000], order=[1, 0]) == [[0], [1]]
        # closed buckets keep their place in the walk, before the open ones
        ps = [T(1, F32), T(100, F64), T(1, F32)]
        assert assign(ps, [100], order=[2, 1, 0]) == [[1], [2, 0]]

    def test_sparse_gets_its_own_bucket_without_limit(self):
        ps = [T(10), T(10), T(10)]
        idx, lim = assign_with_limits(ps, [1000], sparse=[False, True, False])
        assert idx == [[0, 2], [1]]
        assert lim == [1000, NO_SIZE_LIMIT]
        plan = initial_plan(ps, BucketConfig(), sparse=[False, True, False])
        assert [b.sparse for b in plan] == [True, False]
        assert plan[0].size_limit_bytes == NO_SIZE_LIMIT

    def test_zero_numel_and_zero_limit(self):
        ps = [T(0), T(3), T(0)]
        assert assign(ps, [0]) == [[0], [1], [2]]
        assert assign(ps, [1]) == [[0, 1], [2]]

    def test_empty_params(self):
        assert assign_with_limits([], [MIB]) == ([], [])
        plan = initial_plan([], BucketConfig())
        assert len(plan) == 0 and plan.num_params == 0 and plan.param_order == ()
        assert len(rebuilt_plan([], [], BucketConfig())) == 0

    def test_duck_typed_params(self):
        # anything with dtype/device and numel()/shape
        ps = [
            SimpleNamespace(shape=(2, 5), dtype=F32, device="cpu"),
            SimpleNamespace(numel=lambda: 10, dtype=F32, device=torch.device("cpu")),
            SimpleNamespace(shape=(), dtype=F64, device="cpu"),
        ]
        plan = initial_plan(ps, BucketConfig(find_unused_parameters=True, bucket_cap_mb=0))
        assert plan.bucket_indices == [[2], [1], [0]]
        assert [b.numel for b in plan] == [1, 10, 10]
        assert plan[0].nbytes == 8


class TestConfigByHand:
    def test_defaults(self):
        c = BucketConfig()
        assert c.uses_default_cap
        assert c.bucket_bytes_cap == 25 * MIB
        assert c.first_bucket_bytes_cap == DEFAULT_FIRST_BUCKET_BYTES == MIB
        assert c.should_rebuild
        assert c.initial_limits() == (sys.maxsize,)
        assert c.rebuild_limits() == (MIB, 25 * MIB)

    def test_find_unused_default_uses_small_first_bucket(self):
        c = BucketConfig(find_unused_parameters=True)
        assert not c.should_rebuild
        assert c.initial_limits() == (MIB, 25 * MIB)

    def test_explicit_cap_disables_small_first_bucket(self):
        for mb in (25, 10, 0.5):
            c = BucketConfig(bucket_cap_mb=mb)
            cap = int(mb * MIB)
            assert c.bucket_bytes_cap == cap and c.first_bucket_bytes_cap == cap
            assert c.rebuild_limits() == (cap, cap)
            unused = BucketConfig(bucket_cap_mb=mb, find_unused_parameters=True)
            assert unused.initial_limits() == (cap,)

    def test_tiny_cap(self):
        c = BucketConfig(bucket_cap_mb=0.0001)
        assert c.bucket_bytes_cap == 104  # int(0.0001 * 1048576)
        assert c.rebuild_limits() == (104, 104)

    def test_cap_list(self):
        c = BucketConfig(bucket_cap_mb=7, bucket_cap_mb_list=[0.5, 2, 1])
        assert c.bucket_cap_mb_list == (0.5, 2, 1)
        assert c.per_bucket_bytes_caps == (MIB // 2, 2 * MIB, MIB)
        assert c.bucket_bytes_cap == 2 * MIB  # max of the list; bucket_cap_mb ignored
        assert c.first_bucket_bytes_cap == 2 * MIB
        assert not c.uses_default_cap
        assert c.initial_limits() == c.rebuild_limits() == (MIB // 2, 2 * MIB, MIB)
        assert c.should_rebuild

    def test_static_graph(self):
        c = BucketConfig(static_graph=True, find_unused_parameters=True)
        assert c.should_rebuild
        assert c.initial_limits() == (sys.maxsize,)

    def test_empty_list_means_not_given(self):
        c = BucketConfig(bucket_cap_mb_list=[])
        assert c.bucket_cap_mb_list is None and c.uses_default_cap
        assert c == BucketConfig()

    def test_never_mutates_user_input_and_is_frozen(self):
        caps = [1, 2]
        c = BucketConfig(bucket_cap_mb_list=caps)
        assert caps == [1, 2] and isinstance(c.bucket_cap_mb_list, tuple)
        caps.append(3)
        assert c.bucket_cap_mb_list == (1, 2)
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.bucket_cap_mb = 3  # type: ignore[misc]
        assert hash(c) == hash(BucketConfig(bucket_cap_mb_list=(1, 2)))

    @pytest.mark.parametrize(
        "kwargs, exc, match",
        [
            (dict(bucket_cap_mb=-1), ValueError, "bucket_cap_mb must be >= 0"),
            (dict(bucket_cap_mb=float("nan")), ValueError, "finite"),
            (dict(bucket_cap_mb=float("inf")), ValueError, "finite"),
            (dict(bucket_cap_mb="25"), TypeError, "bucket_cap_mb must be a number"),
            (dict(bucket_cap_mb=True), TypeError, "bucket_cap_mb must be a number"),
            (dict(bucket_cap_mb=1e30), ValueError, "too large"),
            (dict(bucket_cap_mb_list=5), TypeError, "list or tuple"),
            (dict(bucket_cap_mb_list="1,2"), TypeError, "list or tuple"),
            (dict(bucket_cap_mb_list={1, 2}), TypeError, "list or tuple"),
            (dict(bucket_cap_mb_list=(x for x in [1])), TypeError, "list or tuple"),
            (dict(bucket_cap_mb_list=[1, -2]), ValueError, r"bucket_cap_mb_list\[1\] must be >="),
            (dict(bucket_cap_mb_list=[1, None]), TypeError, r"bucket_cap_mb_list\[1\]"),
            (dict(static_graph="yes"), TypeError, "static_graph must be a bool"),
            (dict(find_unused_parameters=2), TypeError, "find_unused_parameters must be a bool"),
        ],
    )
    def test_validation_errors(self, kwargs, exc, match):
        with pytest.raises(exc, match=match):
            BucketConfig(**kwargs)

    def test_zero_cap_is_accepted_like_torch(self):
        c = BucketConfig(bucket_cap_mb=0)
        assert c.rebuild_limits() == (0, 0)
        ps = [T(3)] * 3
        assert rebuilt_plan(ps, [2, 1, 0], c).bucket_indices == [[2], [1], [0]]


class TestPlansByHand:
    def mlp(self):
        # registration order: w0, b0, w1, b1, w2, b2 (fp32)
        sizes = [512 * 256, 512, 512 * 512, 512, 10 * 512, 10]
        return [T(n) for n in sizes]

    def test_initial_default_is_one_bucket_in_registration_order(self):
        ps = self.mlp()
        plan = initial_plan(ps, BucketConfig())
        assert plan.bucket_indices == [[0, 1, 2, 3, 4, 5]]
        assert plan[0].size_limit_bytes == sys.maxsize
        assert plan[0].offsets == (0, 131072, 131584, 393728, 394240, 399360)
        assert plan[0].numel == 399370 and plan[0].nbytes == 4 * 399370
        check_plan_invariants(plan, ps)

    def test_initial_find_unused_reversed(self):
        ps = self.mlp()  # bytes: 524288, 2048, 1048576, 2048, 20480, 40
        plan = initial_plan(ps, BucketConfig(find_unused_parameters=True, bucket_cap_mb=1))
        # walk 0..5 against 1 MiB: 524288, +2048, +1048576 -> close [0, 1, 2];
        # 2048, 22528, 22568 -> [3, 4, 5] open. Torch reverses the list.
        assert plan.bucket_indices == [[3, 4, 5], [0, 1, 2]]
        check_plan_invariants(plan, ps)

    def test_initial_find_unused_first_bucket_1mib(self):
        ps = [T(MIB // 8) for _ in range(8)]  # 0.5 MiB each
        plan = initial_plan(ps, BucketConfig(find_unused_parameters=True))
        # first bucket against 1 MiB: [0, 1]; then 25 MiB: [2..7] open (3 MiB)
        assert plan.bucket_indices == [[2, 3, 4, 5, 6, 7], [0, 1]]
        assert [b.size_limit_bytes for b in plan] == [25 * MIB, MIB]

    def test_rebuild_first_bucket_1mib_only_with_default_cap(self):
        ps = [T(MIB // 8) for _ in range(8)]  # 0.5 MiB each
        order = list(range(7, -1, -1))
        plan = rebuilt_plan(ps, order, BucketConfig())
        assert plan.bucket_indices == [[7, 6], [5, 4, 3, 2, 1, 0]]
        assert [b.size_limit_bytes for b in plan] == [MIB, 25 * MIB]
        # explicit 25 MiB: no small first bucket
        plan = rebuilt_plan(ps, order, BucketConfig(bucket_cap_mb=25))
        assert plan.bucket_indices == [order]
        # explicit 1 MiB: every bucket 1 MiB
        plan = rebuilt_plan(ps, order, BucketConfig(bucket_cap_mb=1))
        assert plan.bucket_indices == [[7, 6], [5, 4], [3, 2], [1, 0]]

    def test_rebuild_with_cap_list(self):
        ps = [T(MIB // 8) for _ in range(6)]  # 0.5 MiB each
        c = BucketConfig(bucket_cap_mb_list=[0.5, 1.5])
        plan = rebuilt_plan(ps, [5, 4, 3, 2, 1, 0], c)
        assert plan.bucket_indices == [[5], [4, 3, 2], [1, 0]]
        assert [b.size_limit_bytes for b in plan] == [MIB // 2, 3 * MIB // 2, 3 * MIB // 2]
        # the list also shapes the construction-time buckets (then reversed)
        assert initial_plan(ps, c).bucket_indices == [[4, 5], [1, 2, 3], [0]]

    def test_rebuild_set_last_bucket_as_small(self):
        ps = [T(MIB // 8) for _ in range(6)]  # 0.5 MiB each
        c = BucketConfig(set_last_bucket_as_small=True)
        # walk the reversed ready order 0..5 against 1 MiB, 25 MiB, then reverse
        plan = rebuilt_plan(ps, [5, 4, 3, 2, 1, 0], c)
        assert plan.bucket_indices == [[2, 3, 4, 5], [0, 1]]
        assert [b.size_limit_bytes for b in plan] == [25 * MIB, MIB]

    def test_no_rebuild_with_find_unused(self):
        ps = self.mlp()
        c = BucketConfig(find_unused_parameters=True, bucket_cap_mb=1)
        assert rebuilt_plan(ps, [5, 4, 3, 2, 1, 0], c) == initial_plan(ps, c)

    def test_rebuild_order_validation(self):
        ps = [T(1)] * 3
        c = BucketConfig()
        with pytest.raises(ValueError, match="missing: 1"):
            rebuilt_plan(ps, [2, 0], c)
        with pytest.raises(ValueError, match="parameter 2 appears twice"):
            rebuilt_plan(ps, [2, 0, 2], c)
        with pytest.raises(ValueError, match="not a parameter index"):
            rebuilt_plan(ps, [0, 1, 3], c)
        with pytest.raises(TypeError):
            rebuilt_plan(ps, [0, 1, 2.0], c)

    def test_assign_validation(self):
        ps = [T(1)] * 2
        with pytest.raises(ValueError, match="at least one size limit"):
            assign(ps, [])
        with pytest.raises(ValueError, match=r"limits\[0\]"):
            assign(ps, [-1])
        with pytest.raises(TypeError, match=r"limits\[0\]"):
            assign(ps, [1.5])
        with pytest.raises(ValueError, match="sparse has 1 entries for 2"):
            assign(ps, [10], sparse=[True])
        with pytest.raises(TypeError, match="parameter 1"):
            assign([T(1), object()], [10])
        with pytest.raises(ValueError, match="sparse tensor"):
            assign([torch.zeros(2, 2).to_sparse()], [10])

    def test_locate_and_describe(self):
        ps = self.mlp()
        plan = initial_plan(ps, BucketConfig(find_unused_parameters=True, bucket_cap_mb=1))
        assert plan.locate(4) == (0, 1)
        assert plan.locate(0) == (1, 0)
        with pytest.raises(KeyError, match="parameter 9 is in no bucket"):
            plan.locate(9)
        names = ["w0", "b0", "w1", "b1", "w2", "b2"]
        text = plan.describe(names)
        lines = text.splitlines()
        assert lines[0].split()[:3] == ["bucket", "dtype", "device"]
        assert "b1, w2, b2" in lines[1] and "w0, b0, w1" in lines[2]
        assert "float32" in lines[1] and "1.00 MiB" in lines[1]
        assert lines[-1] == "2 bucket(s), 6 parameter(s), 1.52 MiB in all"
        assert "3, 4, 5" in plan.describe()
        assert "none" in str(initial_plan(ps, BucketConfig()))  # sys.maxsize limit
        many = initial_plan([T(1)] * 20, BucketConfig())
        assert "... (+12)" in many.describe(max_members=8)
        with pytest.raises(ValueError, match="2 names for a plan of 6"):
            plan.describe(["a", "b"])

    def test_plan_rejects_inconsistent_buckets(self):
        b0 = BucketSpec(0, (0,), (0,), 1, F32, torch.device("cpu"), 8)
        b1 = BucketSpec(1, (0,), (0,), 1, F32, torch.device("cpu"), 8)
        with pytest.raises(ValueError, match="parameter 0 is in bucket 0 and again"):
            BucketPlan((b0, b1))
        with pytest.raises(ValueError, match="indices must be 0..len-1"):
            BucketPlan((b1,))
        with pytest.raises(ValueError, match="2 param indices but 1 offsets"):
            BucketSpec(0, (0, 1), (0,), 2, F32, torch.device("cpu"), 8)


# ==========================================================================
# Against torch's own function
# ==========================================================================

CASES = {
    "fp32-straddle": ([T(10)] * 7, [100]),
    "fp32-exact": ([T(25)] * 8, [200]),
    "mixed-dtypes": ([T(30, d) for d in (F32, F64, F16, F32, F16, F64, BF16, F32)], [120]),
    "bigger-than-cap": ([T(5), T(4000), T(5), T(3), T(4000, F64)], [64]),
    "limit-list": ([T(16 * (i % 5 + 1)) for i in range(20)], [64, 256, 128]),
    "limit-list-mixed": ([T(16, (F32, F16, F64)[i % 3]) for i in range(24)], [32, 96]),
    "first-1mib-rule": ([T(MIB // 16) for _ in range(12)], [MIB, 25 * MIB]),
    "maxsize": ([T(i + 1, (F32, F64)[i % 2]) for i in range(9)], [sys.maxsize]),
    "tiny-cap": ([T(i + 1) for i in range(30)], [int(0.0001 * MIB)]),
    "zero-cap": ([T(i) for i in range(5)], [0]),
    "single": ([T(3)], [1]),
    "meta-and-cpu": ([T(8, F32, dev) for dev in ("cpu", "meta", "meta", "cpu")], [64]),
}


@needs_dist
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["initial", "reversed-order", "shuffled-order", "sparse"])
def test_matches_torch(name, mode):
    params, limits = CASES[name]
    n = len(params)
    order, sparse = None, None
    if mode == "reversed-order":
        order = list(range(n - 1, -1, -1))
    elif mode == "shuffled-order":
        order = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
    elif mode == "sparse":
        sparse = [i % 3 == 1 for i in range(n)]
    got = assign_with_limits(params, limits, order=order, sparse=sparse)
    assert got == torch_assign(params, limits, order=order, sparse=sparse)


@needs_dist
def test_empty_list_differs_from_torch_on_purpose():
    # torch asserts a non-empty list; the planner returns no buckets
    with pytest.raises(RuntimeError):
        dist._compute_bucket_assignment_by_size([], [MIB], [])
    assert assign([], [MIB]) == []


CONFIGS = [
    BucketConfig(),
    BucketConfig(find_unused_parameters=True),
    BucketConfig(find_unused_parameters=True, bucket_cap_mb=0.3),
    BucketConfig(find_unused_parameters=True, bucket_cap_mb=0.0001),
    BucketConfig(static_graph=True, find_unused_parameters=True),
    BucketConfig(bucket_cap_mb=0.5),
    BucketConfig(bucket_cap_mb=0),
    BucketConfig(bucket_cap_mb_list=[0.25, 1, 0.5]),
    BucketConfig(bucket_cap_mb_list=[0.25, 1, 0.5], find_unused_parameters=True),
]


def model_params():
    """Transformer-ish parameter list: fp32 body, an fp16 and an fp64 head."""
    ps = [T(1000 * 64)]  # embedding
    for _ in range(3):
        ps += [T(64), T(64), T(64 * 192), T(192), T(64 * 64), T(64), T(64), T(64)]
        ps += [T(64 * 256), T(256), T(256 * 64), T(64)]
    ps += [T(64 * 100, F16), T(100, F16), T(64, F64), T(1, F64)]
    return ps


@needs_dist
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_plans_match_torch_ddp_calls(config):
    ps = model_params()
    n = len(ps)
    sparse = [i == 0 for i in range(n)]  # a sparse embedding
    for sp in (None, sparse):
        plan = initial_plan(ps, config, sp)
        assert plan_lists(plan) == torch_initial(ps, config, sp)
        check_plan_invariants(plan, ps)
        # backward runs roughly in reverse, with the heads interleaved
        ready = list(range(n - 1, -1, -1))
        ready[0], ready[3] = ready[3], ready[0]
        plan = rebuilt_plan(ps, ready, config, sp)
        if config.should_rebuild:
            assert plan_lists(plan) == torch_assign(
                ps, config.rebuild_limits(), order=ready, sparse=sp
            )
        else:
            assert plan == initial_plan(ps, config, sp)
        check_plan_invariants(plan, ps)


ALL_DTYPES = [
    d for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.complex32, torch.uint8, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64,
        getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2fnuz", None), getattr(torch, "float8_e4m3fnuz", None),
    ) if d is not None
]


@needs_dist
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("seed", range(40))
def test_open_bucket_order_matches_torch_with_many_keys(seed):
    """Rebuild with many dtype/device pairs left open: the order of torch's
    std::unordered_map, including its rehashes (13 -> 29 -> 59 buckets)."""
    g = torch.Generator().manual_seed(seed)
    keys = [(d, dev) for d in ALL_DTYPES for dev in ("cpu", "meta")]
    pick = torch.randperm(len(keys), generator=g)[: 1 + seed % len(keys)].tolist()
    ps = []
    for k in pick:
        d, dev = keys[k]
        ps += [T(int(torch.randint(0, 6, (1,), generator=g)), d, dev) for _ in range(1 + k % 3)]
    order = torch.randperm(len(ps), generator=g).tolist()
    limits = [int(torch.randint(1, 40, (1,), generator=g)), 10**9]
    assert assign_with_limits(ps, limits, order=order) == torch_assign(ps, limits, order=order)


# ==========================================================================
# Property test
# ==========================================================================

DTYPES = [F32, F64, F16, BF16]


@st.composite
def planner_inputs(draw):
    n = draw(st.integers(1, 24))
    params = [
        T(draw(st.integers(0, 300)), draw(st.sampled_from(DTYPES)),
          draw(st.sampled_from(["cpu", "cpu", "meta"])))
        for _ in range(n)
    ]
    limits = draw(st.lists(st.integers(0, 1500), min_size=1, max_size=4))
    if draw(st.booleans()):
        limits.append(sys.maxsize)
    order = draw(st.none() | st.permutations(range(n)))
    sparse = draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n))
    return params, limits, order, sparse


@needs_dist
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs())
def test_property_equals_torch(inputs):
    params, limits, order, sparse = inputs
    got = assign_with_limits(params, limits, order=order, sparse=sparse)
    assert got == torch_assign(params, limits, order=order, sparse=sparse)
    flat = sorted(i for b in got[0] for i in b)
    assert flat == sorted(order if order is not None else range(len(params)))


@settings(max_examples=150, deadline=None)
@given(
    planner_inputs(),
    st.one_of(st.none(), st.floats(0, 0.002)),
    st.one_of(st.none(), st.lists(st.floats(0, 0.002), min_size=1, max_size=3)),
    st.booleans(),
    st.booleans(),
)
def test_property_plan_invariants(inputs, cap_mb, cap_list, static_graph, find_unused):
    params, _, order, sparse = inputs
    config = BucketConfig(cap_mb, cap_list, static_graph, find_unused)
    plan = initial_plan(params, config, sparse)
    check_plan_invariants(plan, params)
    ready = order if order is not None else list(range(len(params)))
    plan = rebuilt_plan(params, ready, config, sparse)
    check_plan_invariants(plan, params)
    if HAS_DIST and config.should_rebuild:
        assert plan_lists(plan) == torch_assign(
            params, config.rebuild_limits(), order=ready, sparse=sparse
        )
