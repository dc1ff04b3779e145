"""Gradient parity: the class under test against torch's own DDP, every
option, through the one side-by-side harness (:func:`tests._parity.side_by_side`).

Inside every rank of ONE gloo process group: the same model is built twice
(same seed, ``copy.deepcopy``), one copy wrapped in torch's DDP, the other in
the class under test with the same options; both see the same per-rank data
(different on each rank).  The two steps are interleaved (torch's forward +
backward, then ours), so both wrappers issue their collectives in the same
order on every rank.  After EVERY backward each parameter's ``.grad`` is
compared (None-ness, dtype, shape, and values: bit for bit at W=2, with a
small tolerance at W=3 where gloo's sum order depends on the element's
position in the bucket); after several SGD(momentum) steps the parameters and
buffers are compared the same way.

Run the suite against torch itself with ``FASTDDP_TEST_IMPL=torch``.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import (EMULATED_ARGS, STAND_IN, ddp_class, fastddp_only,  # noqa: F401
                         torch_ddp_accepts, torch_reference, world2, world3)
from tests._models import loss_fn, make_batch, make_model
from tests._parity import side_by_side

pytestmark = pytest.mark.timeout(300)

#: tolerance at world size >= 3 (see DESIGN.md "Contracts" 1)
W3_TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# W = 2: bit for bit
# --------------------------------------------------------------------------

TINY = dict(bucket_cap_mb=0.001)  # ~1 KiB buckets: many buckets

CASES_W2 = {
    # name: (model, ddp kwargs, side_by_side arguments)
    "default": ("mlp", {}, {}),
    "default_deep": ("deep", {}, {}),
    "tiny_buckets": ("deep", TINY, {}),
    "bucket_view_set_to_none": ("deep", dict(gradient_as_bucket_view=True), dict(set_to_none=True)),
    "bucket_view_zero": ("deep", dict(gradient_as_bucket_view=True), dict(set_to_none=False)),
    "bucket_view_tiny": ("deep", dict(gradient_as_bucket_view=True, **TINY), dict(set_to_none=False)),
    "batched": ("deep", dict(batched_grad_copy=True), {}),
    "batched_tiny": ("deep", dict(batched_grad_copy=True, **TINY), {}),
    "static_graph": ("deep", dict(static_graph=True), {}),
    "static_graph_tiny": ("deep", dict(static_graph=True, **TINY), {}),
    "bucket_cap_mb_list": ("deep", dict(bucket_cap_mb_list=[0.002, 0.004, 0.008, 25]), {}),
    "find_unused_odd": ("branch_odd", dict(find_unused_parameters=True), dict(steps=5)),
    "find_unused_odd_zero": ("branch_odd", dict(find_unused_parameters=True), dict(steps=5, set_to_none=False)),
    "find_unused_per_rank": ("branch_rank", dict(find_unused_parameters=True), dict(steps=4)),
    "find_unused_tiny_batched": ("branch_odd", dict(find_unused_parameters=True, batched_grad_copy=True, **TINY),
                                 dict(steps=5)),
    "find_unused_view": ("branch_odd", dict(find_unused_parameters=True, gradient_as_bucket_view=True),
                         dict(steps=5, set_to_none=False)),
    "find_unused_never_used": ("branch_never", dict(find_unused_parameters=True), dict(steps=3)),
    "skip_all_reduce_unused": ("branch_never", dict(find_unused_parameters=True,
                                                    skip_all_reduce_unused_params=True), dict(steps=3)),
    "no_sync": ("mlp", {}, dict(no_sync_micro=2)),
    "no_sync_deep_tiny": ("deep", TINY, dict(no_sync_micro=2)),
    "tied": ("tied", {}, {}),
    "tied_tiny_batched": ("tied", dict(batched_grad_copy=True, **TINY), {}),
    "frozen": ("frozen", {}, {}),
    "frozen_view": ("frozen", dict(gradient_as_bucket_view=True), dict(set_to_none=False)),
    "mixed_dtype": ("mixed", {}, {}),
    "mixed_dtype_tiny_batched": ("mixed", dict(batched_grad_copy=True, **TINY), {}),
    "mixed_dtype_view": ("mixed", dict(gradient_as_bucket_view=True), dict(set_to_none=False)),
    "bn_broadcast": ("bn", {}, dict(perturb_buffers=True)),
    "bn_broadcast_buffers_false": ("bn", dict(broadcast_buffers=False), dict(perturb_buffers=True)),
    "bn_forward_sync_buffers_false": ("bn", dict(forward_sync_buffers=False), dict(perturb_buffers=True)),
    "init_sync_params": ("mlp", {}, dict(perturb_params=True)),
    "checkpoint": ("ckpt", {}, {}),
    "checkpoint_static_batched": ("ckpt", dict(static_graph=True, batched_grad_copy=True), {}),
    "reuse": ("reuse", {}, {}),
    "reuse_tiny_view": ("reuse", dict(gradient_as_bucket_view=True, **TINY), dict(set_to_none=False)),
    "view_batched": ("deep", dict(gradient_as_bucket_view=True, batched_grad_copy=True), {}),
    "view_batched_zero": ("deep", dict(gradient_as_bucket_view=True, batched_grad_copy=True),
                          dict(set_to_none=False)),
    "static_view": ("deep", dict(static_graph=True, gradient_as_bucket_view=True), dict(set_to_none=False)),
    "tiny_batched_no_sync": ("deep", dict(batched_grad_copy=True, **TINY), dict(no_sync_micro=2)),
    "view_no_sync": ("deep", dict(gradient_as_bucket_view=True), dict(no_sync_micro=2, set_to_none=False)),
}


@pytest.mark.parametrize("case", list(CASES_W2))
def test_parity_w2(world2, case):
    model, kwargs, run_kwargs = CASES_W2[case]
    checks = world2.run(_parity_case, model, kwargs, run_kwargs)
    assert all(c > 0 for c in checks)


def _parity_case(rank, world_size, model, kwargs, run_kwargs):
    return side_by_side(rank, world_size, model, kwargs=kwargs, **run_kwargs).checks


# --------------------------------------------------------------------------
# W = 3: with a tolerance
# --------------------------------------------------------------------------

CASES_W3 = {
    "default": ("deep", {}, {}),
    "tiny_batched": ("deep", dict(batched_grad_copy=True, **TINY), {}),
    "bucket_view": ("deep", dict(gradient_as_bucket_view=True), dict(set_to_none=False)),
    "find_unused_per_rank": ("branch_rank", dict(find_unused_parameters=True), dict(steps=4)),
    "no_sync_mixed": ("mixed", {}, dict(no_sync_micro=2)),
}


@pytest.mark.parametrize("case", list(CASES_W3))
def test_parity_w3(world3, case):
    model, kwargs, run_kwargs = CASES_W3[case]
    run_kwargs = dict(run_kwargs, tol=W3_TOL)
    world3.run(_parity_case, model, kwargs, run_kwargs)


# --------------------------------------------------------------------------
# the harness's control: a wrapper that gets it wrong fails side_by_side
# --------------------------------------------------------------------------

def _harness_control(rank, world_size, fault):
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

    hook, make_test = None, None
    if fault == "unreduced":  # the test's grads are the rank's own, not the average
        hook = lambda is_ref: None if is_ref else (None, debugging_hooks.noop_hook)  # noqa: E731
    elif fault == "no_sync_ignored":  # the test reduces in its no_sync micro-steps too
        def make_test(module, **kwargs):
            ddp = ddp_class()(module, **kwargs)
            ddp.no_sync = contextlib.nullcontext
            return ddp
    try:
        side_by_side(rank, world_size, "mlp", hook=hook, make_test=make_test, steps=2,
                     no_sync_micro=1 if fault == "no_sync_ignored" else 0)
    except AssertionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("fault,where", [("unreduced", "step 0 after backward"),
                                         ("no_sync_ignored", "step 0 no_sync micro-step 0")])
def test_the_harness_catches_a_wrong_gradient(world2, fault, where):
    for rank, msg in enumerate(world2.run(_harness_control, fault)):
        assert msg is not None, f"rank {rank}: side_by_side passed a wrapper with fault {fault!r}"
        assert f"rank {rank} {where}: .grad differs from torch DDP's" in msg, msg
        assert "elements differ, first at" in msg, msg


# --------------------------------------------------------------------------
# the reference on a torch without some argument: the emulation is exact
# --------------------------------------------------------------------------

def _emulated_reference(module, **kwargs):
    return torch_reference(module, emulate=EMULATED_ARGS, **kwargs)


def _emulation_case(rank, world_size, model, kwargs, run_kwargs):
    """torch's DDP with the argument (reference) against torch's DDP with the
    emulation :func:`torch_reference` uses where torch lacks it."""
    return side_by_side(rank, world_size, model, kwargs=kwargs, make_test=_emulated_reference,
                        **run_kwargs).checks


def _emulated(cases):
    return [name for name, (_, kwargs, _) in cases.items() if any(a in kwargs for a in EMULATED_ARGS)]


needs_torch_with_the_args = pytest.mark.skipif(
    not all(torch_ddp_accepts(a) for a in EMULATED_ARGS),
    reason="this torch's DDP lacks the arguments: nothing to check the emulation against "
           "(test_parity_w2/w3 still run fastddp with them, against the emulation)")


@needs_torch_with_the_args
@pytest.mark.parametrize("case", _emulated(CASES_W2))
def test_torch_reference_emulation_w2(world2, case):
    """What tests compare fastddp with on a torch without ``batched_grad_copy``
    / ``forward_sync_buffers`` is, bit for bit, what torch 2.13's DDP computes
    with them."""
    model, kwargs, run_kwargs = CASES_W2[case]
    assert all(c > 0 for c in world2.run(_emulation_case, model, kwargs, run_kwargs))


@needs_torch_with_the_args
@pytest.mark.parametrize("case", _emulated(CASES_W3))
def test_torch_reference_emulation_w3(world3, case):
    """Bit for bit at W=3 too: the hook divides by W as torch's batched rule
    does, and the bucket layout (so gloo's sum order) is the same."""
    model, kwargs, run_kwargs = CASES_W3[case]
    assert all(c > 0 for c in world3.run(_emulation_case, model, kwargs, dict(run_kwargs, tol=None)))


# --------------------------------------------------------------------------
# launch budget (fastddp only): one pack + one unpack per bucket per backward
# --------------------------------------------------------------------------

def n_buckets(ddp_model) -> int:
    """Number of buckets of the class under test (its public ``stats()``)."""
    return len(ddp_model.stats()["buckets"])


def expected_launches(ddp_model, grads_are_views: bool) -> dict:
    """Expected ``fastddp.kernels.stats()`` deltas for ONE backward with
    ``batched_grad_copy=True`` (DESIGN.md "Contracts" 4)."""
    nb = n_buckets(ddp_model)
    if grads_are_views:
        return {"pack_calls": ("<=", nb), "unpack_calls": ("<=", nb)}
    return {"pack_calls": ("==", nb), "unpack_calls": ("==", nb)}


def _launch_budget(rank, world_size, model_name, kwargs, set_to_none):
    import fastddp.kernels as K
    m = make_model(model_name, seed=3)
    ddp = ddp_class()(m, batched_grad_copy=True, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    report = []
    for step in range(3):  # step 0 may rebuild buckets; measure steps 1, 2
        x, y = make_batch(model_name, rank, step)
        loss = loss_fn(ddp(x, step=step, rank=rank), y)
        K.reset_launch_count()
        loss.backward()
        stats = K.stats()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if step == 0:
            continue
        views = bool(kwargs.get("gradient_as_bucket_view")) and not set_to_none
        for key, (op, n) in expected_launches(ddp, views).items():
            ok = stats[key] == n if op == "==" else stats[key] <= n
            assert ok, (f"rank {rank} step {step}: {key}={stats[key]}, expected {op} {n} "
                        f"(buckets={n_buckets(ddp)}, stats={stats})")
        report.append(stats)
    return report


@fastddp_only
@pytest.mark.parametrize("kwargs,set_to_none", [
    ({}, True),
    (TINY, True),
    (dict(gradient_as_bucket_view=True, **TINY), False),
], ids=["default_buckets", "tiny_buckets", "tiny_view_zero"])
def test_launch_budget_batched(world2, kwargs, set_to_none):
    world2.run(_launch_budget, "deep", kwargs, set_to_none)
