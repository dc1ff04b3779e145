"""Communication hooks: torch's hooks on fastddp vs on torch's DDP, and
fastddp's fused compression paths (2 gloo ranks, spawned once)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests._dist import STAND_IN, single_rank_group, torch_ddp_class, torch_reference, world2  # noqa: F401
from tests._models import loss_fn, make_batch, make_model
from tests._parity import side_by_side

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(STAND_IN, reason="fastddp hook paths (stand-in mode runs torch only)")]


def _torch_hook(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as dbg
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psh

    if name == "allreduce":
        return None, dh.allreduce_hook
    if name == "fp16":
        return None, dh.fp16_compress_hook
    if name == "fp16_wrapper":
        return None, dh.fp16_compress_wrapper(dh.allreduce_hook)
    if name == "noop":
        return None, dbg.noop_hook
    if name == "powersgd":
        return (psh.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                  start_powerSGD_iter=2, use_error_feedback=True, warm_start=True),
                psh.powerSGD_hook)
    if name == "allgather":
        import fastddp.hooks as fh
        return None, fh.allgather_then_aggregate_hook
    raise KeyError(name)


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same_hook_both(rank, world, hook_name, opts, steps=4):
    """torch's hook on torch's DDP and on fastddp, same group, same data:
    every grad bit for bit, every step (:func:`side_by_side`)."""
    from fastddp import DistributedDataParallel as F

    run = side_by_side(rank, world, "mlp", kwargs=opts, make_test=F, steps=steps, optim=dict(lr=0.05),
                       hook=lambda is_ref: _torch_hook(hook_name),
                       check_synced=hook_name != "noop")  # the no-op hook does not average
    return run.checks


HOOK_OPTS = [{}, {"gradient_as_bucket_view": True}, {"batched_grad_copy": True},
             {"bucket_cap_mb": 0.0005}]


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "fp16_wrapper", "noop", "allgather"])
@pytest.mark.parametrize("opts", HOOK_OPTS, ids=["default", "view", "batched", "tiny"])
def test_torch_hooks_match_torch_ddp(world2, hook_name, opts):
    assert world2.run(_same_hook_both, hook_name, opts) == [4, 4]


@pytest.mark.parametrize("opts", [{}, {"gradient_as_bucket_view": True}, {"batched_grad_copy": True}],
                         ids=["default", "view", "batched"])
def test_powersgd_matches_torch_ddp(world2, opts):
    # One bucket: PowerSGD issues collectives from Future callbacks, which on
    # gloo races across buckets (torch's own DDP aborts with a collective
    # mismatch at tiny bucket caps too), so keep it to a single bucket.
    assert world2.run(_same_hook_both, "powersgd", opts, 6) == [6, 6]


# ---------------------------------------------------------------- bf16 (gloo)

def _bf16_vs_emulation(rank, world, which):
    """torch refuses bf16 hooks off NCCL; fastddp runs them on gloo.  Compare
    with an emulation: each rank's grad cast/scaled, summed in bf16, upcast."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    hook = dh.bf16_compress_hook if which == "torch" else fh.bf16_compress_hook
    local = make_model("mlp")
    m = F(copy.deepcopy(local))
    m.register_comm_hook(None, hook)
    x, y = make_batch("mlp", rank, 0)
    loss_fn(m(x), y).backward()
    loss_fn(local(x), y).backward()
    out = []
    for p_local, p in zip(local.parameters(), m.parameters()):
        g = p_local.grad
        if which == "torch":
            mine = g.to(torch.bfloat16).div_(world)          # torch: cast, then divide in bf16
        else:
            mine = (g * (1.0 / world)).to(torch.bfloat16)    # fastddp: scale in fp32, then cast
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        total = parts[0].clone()
        for t in parts[1:]:
            total = total + t                                # bf16 sum, rounded per add
        out.append(torch.equal(total.float(), p.grad))
    return out


@pytest.mark.parametrize("which", ["torch", "fastddp"])
def test_bf16_hooks_on_gloo_match_emulation(world2, which):
    res = world2.run(_bf16_vs_emulation, which)
    assert all(all(r) for r in res), res


# ------------------------------------------------- fused vs exact average

def _fused_accuracy(rank, world, dtype_name, opts):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    hook = {"fp16": fh.fp16_compress_hook, "bf16": fh.bf16_compress_hook}[dtype_name]
    eps = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype_name]
    tiny = {"fp16": 2.0 ** -24, "bf16": 0.0}[dtype_name]  # fp16 subnormal spacing
    local = make_model("deep")
    m = F(copy.deepcopy(local), **opts)
    m.register_comm_hook(None, hook)
    worst = 0.0
    for step in range(3):
        x, y = make_batch("deep", rank, step)
        for p in list(local.parameters()) + list(m.parameters()):
            p.grad = None
        loss_fn(m(x), y).backward()
        loss_fn(local(x), y).backward()
        for p_local, p in zip(local.parameters(), m.parameters()):
            exact = p_local.grad.double() / world
            dist.all_reduce(exact)
            # per-rank rounding of g/W (<= eps/2 relative each) + the 16-bit sum's rounding
            bound = (world * eps / 2 + eps / 2) * dist_max_abs(p_local.grad.double() / world, world) + 2 * tiny + 1e-30
            err = (p.grad.double() - exact).abs()
            worst = max(worst, (err / bound).max().item())
    return worst


def dist_max_abs(t, world):
    s = t.abs()
    dist.all_reduce(s)
    return s


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("opts", [{}, {"gradient_as_bucket_view": True}, {"batched_grad_copy": True,
                                                                          "bucket_cap_mb": 0.001}],
                         ids=["default", "view", "batched-tiny"])
def test_fused_compression_within_rounding_of_exact_average(world2, dtype_name, opts):
    worst = world2.run(_fused_accuracy, dtype_name, opts)
    assert max(worst) <= 1.0, worst


def _overflow(rank, world, which):
    """Rank 0's gradient is 80000 (above fp16's 65504), rank 1's is 0: the
    average 40000 is exact in fp16.  torch casts before scaling and overflows;
    fastddp scales in fp32 first."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    if which == "torch":
        m = torch_ddp_class()(lin)
        m.register_comm_hook(None, dh.fp16_compress_hook)
    else:
        m = F(lin)
        m.register_comm_hook(None, fh.fp16_compress_hook)
    x = torch.full((1, 1), 80000.0 if rank == 0 else 0.0)
    m(x).sum().backward()
    return m.module.weight.grad.item()


def test_fused_fp16_does_not_overflow_where_torch_does(world2):
    assert world2.run(_overflow, "fastddp") == [40000.0, 40000.0]
    assert all(v == float("inf") for v in world2.run(_overflow, "torch"))


# --------------------------------- fused == the same hook as a plain callback

def _fused_vs_callback(rank, world, hook_name, opts, no_sync):
    """A fused hook gives exactly what the same hook gives when run as an
    ordinary Python callback (hidden from the reducer behind a lambda)."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    hook = getattr(fh, hook_name)
    name = opts.pop("model", "mlp")
    base = make_model(name)
    a, b = F(copy.deepcopy(base), **opts), F(copy.deepcopy(base), **opts)
    a.register_comm_hook(None, hook)
    b.register_comm_hook(None, lambda s, bucket: hook(s, bucket))
    assert a.stats()["fused_path"] is not None and b.stats()["fused_path"] is None
    oa = torch.optim.SGD(a.parameters(), lr=0.05)
    ob = torch.optim.SGD(b.parameters(), lr=0.05)
    bad = []
    for step in range(4):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=True)
            if no_sync:
                with m.no_sync():
                    x, y = make_batch(name, rank, step, micro=1)
                    loss_fn(m(x, step=step, rank=rank), y).backward()
            x, y = make_batch(name, rank, step)
            loss_fn(m(x, step=step, rank=rank), y).backward()
        for i, (ga, gb) in enumerate(zip(_grads(a), _grads(b))):
            if (ga is None) != (gb is None) or (ga is not None and not torch.equal(ga, gb)):
                bad.append((step, i))
        oa.step()
        ob.step()
    return bad


@pytest.mark.parametrize("hook_name", ["fp16_compress_hook", "bf16_compress_hook", "allreduce_hook"])
@pytest.mark.parametrize("opts,no_sync", [
    ({}, False),
    ({"batched_grad_copy": True, "bucket_cap_mb": 0.001}, False),
    ({"gradient_as_bucket_view": True}, False),
    ({}, True),
    ({"find_unused_parameters": True, "model": "branch_rank"}, False),
    ({"static_graph": True}, False),
], ids=["default", "batched-tiny", "view", "no_sync", "find_unused", "static"])
def test_fused_hook_equals_callback(world2, hook_name, opts, no_sync):
    assert world2.run(_fused_vs_callback, hook_name, dict(opts), no_sync) == [[], []]


# ------------------------------------------------------------ launch budget

def _launch_budget(rank, world, hook_name, backend):
    """Per step: (buckets, pack calls, unpack calls, Triton launches, reference calls)."""
    import fastddp.hooks as fh
    import fastddp.kernels as K
    from fastddp import DistributedDataParallel as F

    assert K.backend("cpu") == backend
    m = F(make_model("deep"), batched_grad_copy=True, bucket_cap_mb=0.001)
    if hook_name:
        m.register_comm_hook(None, getattr(fh, hook_name))
    out = []
    for step in range(3):
        m.zero_grad(set_to_none=True)
        x, y = make_batch("deep", rank, step)
        K.reset_launch_count()
        loss_fn(m(x), y).backward()
        s = K.stats()
        out.append((m.reducer.num_buckets, s["pack_calls"], s["unpack_calls"], s["launches"],
                    s["reference_calls"]))
    return out


@pytest.mark.parametrize("hook_name", [None, "fp16_compress_hook", "bf16_compress_hook"])
def test_pack_and_unpack_calls_per_bucket_not_per_param(world2, hook_name):
    """CPU reference path: a bounded number of pack/unpack calls per bucket,
    whatever the number of params (the fused compress path packs the fp32
    bucket in place, then casts it: 2 calls).  The one-launch budget of the
    Triton path is asserted by test_one_launch_each_way_per_bucket (interpreter)
    and tests/test_gpu_reducer.py (CUDA)."""
    per_bucket_packs = 1 if hook_name is None else 2
    for per_rank in world2.run(_launch_budget, hook_name, "reference"):
        for nb, packs, unpacks, _, _ in per_rank:
            assert packs == per_bucket_packs * nb and unpacks == nb, (nb, packs, unpacks)
        assert per_rank[-1][0] > 1  # after the rebuild: many buckets


@pytest.mark.interpret
@pytest.mark.parametrize("hook_name", [None, "fp16_compress_hook", "bf16_compress_hook"])
def test_one_launch_each_way_per_bucket(world2, hook_name):
    """The Triton kernels in the reducer's loop (interpreter): exactly one pack
    and one unpack launch per bucket, fused compression included."""
    for per_rank in world2.run(_launch_budget, hook_name, "interpret"):
        for nb, _, _, launches, ref_calls in per_rank:
            assert launches == 2 * nb and ref_calls == 0, (nb, launches, ref_calls)
        assert per_rank[-1][0] > 1


# ------------------------------------------------------------ error feedback

def _error_feedback_recurrence(rank, world):
    """The residual after each step is exactly x - upcast(cast(x)) with
    x = g/W + r_prev, recomputed here per parameter from the local
    gradients (across the bucket rebuild after step 0, too)."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    local = make_model("mlp")
    m = F(copy.deepcopy(local))
    m.register_comm_hook(fh.CompressionState(error_feedback=True), fh.bf16_compress_hook)
    lp, mp_ = list(local.parameters()), list(m.parameters())
    r = [torch.zeros_like(p) for p in lp]
    ok = []
    for step in range(3):
        for p in lp + mp_:
            p.grad = None
        x, y = make_batch("mlp", rank, step)
        loss_fn(m(x), y).backward()
        loss_fn(local(x), y).backward()
        for i, (pl, pm) in enumerate(zip(lp, mp_)):
            xval = pl.grad * (1.0 / world) + r[i]
            wire = xval.to(torch.bfloat16)
            r[i] = xval - wire.float()
            ok.append(torch.equal(m.reducer.error_feedback_residual(i), r[i]))
            # the reduced gradient is the sum of the ranks' wire values
            parts = [torch.empty_like(wire) for _ in range(world)]
            dist.all_gather(parts, wire)
            total = parts[0].clone()
            for t in parts[1:]:
                total = total + t
            ok.append(torch.equal(pm.grad, total.float()))
    return ok


def test_error_feedback_is_exactly_the_recurrence(world2):
    res = world2.run(_error_feedback_recurrence)
    assert all(all(r) for r in res), res


def _regression(rank, world, mode):
    """Gradients that nearly cancel across ranks (rank 0 ~ +1000 + d, rank 1
    ~ -1000 + d', per element): the average is the small d-part.  In bf16
    (8-bit mantissa) g/W ~ 500 has an ulp of 2, so plain compression rounds
    the d-part away every step; error feedback carries it into later steps
    (the 16-bit sum itself is then small and nearly exact)."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    g = torch.Generator().manual_seed(1234 + rank)
    x = (1000.0 if rank % 2 == 0 else -1000.0) + 0.37 * torch.randn(1, 64, generator=g)
    lin = torch.nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
    m = F(lin)
    if mode == "bf16":
        m.register_comm_hook(None, fh.bf16_compress_hook)
    elif mode == "bf16_ef":
        m.register_comm_hook(fh.CompressionState(error_feedback=True), fh.bf16_compress_hook)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    for _ in range(50):
        opt.zero_grad(set_to_none=True)
        m(x).sum().backward()
        opt.step()
    return m.module.weight.detach().clone()


def test_error_feedback_tracks_fp32_better_than_plain_bf16(world2):
    w32 = world2.run(_regression, "fp32")[0]
    wbf = world2.run(_regression, "bf16")[0]
    wef = world2.run(_regression, "bf16_ef")[0]
    err_plain = (wbf - w32).norm().item()
    err_ef = (wef - w32).norm().item()
    assert err_ef < 0.2 * err_plain, (err_ef, err_plain)


# ------------------------------------------------------------------ errors

def _errors(rank, world, case):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(make_model("mlp"))
    if case == "twice":
        m.register_comm_hook(None, fh.allreduce_hook)
        m.register_comm_hook(None, fh.allreduce_hook)
    elif case == "after_forward":
        x, y = make_batch("mlp", rank, 0)
        loss_fn(m(x), y).backward()
        m.register_comm_hook(None, fh.allreduce_hook)
    elif case == "not_callable":
        m.register_comm_hook(None, 42)
    elif case == "arity":
        m.register_comm_hook(None, lambda bucket: bucket)
    elif case == "not_future":
        m.register_comm_hook(None, lambda s, bucket: bucket.buffer())
        x, y = make_batch("mlp", rank, 0)
        loss_fn(m(x), y).backward()
    elif case == "numel":
        def half(s, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer()[:1])
            return fut
        m.register_comm_hook(None, half)
        x, y = make_batch("mlp", rank, 0)
        loss_fn(m(x), y).backward()
    elif case == "state":
        m.register_comm_hook(fh.CompressionState(error_feedback=True), lambda s, b: fh.allreduce_hook(None, b))


@pytest.mark.parametrize("case,exc,words", [
    ("twice", RuntimeError, "only be called once"),
    ("after_forward", RuntimeError, "before the first"),
    ("not_callable", TypeError, "callable"),
    ("arity", TypeError, "two arguments"),
    ("not_future", TypeError, "Future"),
    ("numel", ValueError, "numel"),
    ("state", TypeError, "CompressionState"),
])
def test_hook_errors_are_clear(case, exc, words, tmp_path):
    with single_rank_group(tmp_path):
        with pytest.raises(exc, match=words):
            _errors(0, 1, case)


def test_each_state_belongs_to_its_hook_and_is_frozen():
    """A fastddp hook state given to another hook is a clear error naming both
    (no state is another's subclass, so none is taken for another); states
    are frozen: a changed field after registration cannot drift from what the
    mode was built with."""
    import dataclasses

    import fastddp.hooks as fh
    from fastddp import reduction

    for hook, state, want in [
            (fh.fp16_compress_hook, fh.HierarchicalState(wire="bf16"), "takes a CompressionState"),
            (fh.bf16_fp32acc_hook, fh.AutoPrecisionState(), "takes a CompressionState"),
            (fh.hierarchical_hook, fh.CompressionState(), "takes a HierarchicalState"),
            (fh.auto_precision_hook, fh.FP8CompressionState(), "takes an AutoPrecisionState")]:
        with pytest.raises(TypeError, match=want) as e:
            reduction.choose(hook, state, False, True)
        assert type(state).__name__ in str(e.value), e.value
    with pytest.raises(TypeError, match="HierarchicalState is the state of fastddp.hooks.hierarchical_hook"):
        reduction.choose(lambda s, b: None, fh.HierarchicalState(), False, True)
    st = fh.CompressionState(error_feedback=1)
    assert st.error_feedback is True and repr(st) == "CompressionState(error_feedback=True)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.error_feedback = False
    assert fh.HierarchicalState(wire="fp8").error_feedback is True  # derived where unset
    assert fh.HierarchicalState(None, "bf16", 2).ranks_per_host == 2  # positional order kept


@pytest.mark.parametrize("state", ["CompressionState", "FP8CompressionState", "HierarchicalState"])
def test_error_feedback_with_sparse_gradients_is_refused_naming_the_state(state, tmp_path):
    """Any fastddp state with error feedback on a module with sparse
    gradients: refused at registration, naming the state (the residuals are
    laid out like dense buckets)."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as DDP

    st = {"CompressionState": lambda: fh.CompressionState(error_feedback=True),
          "FP8CompressionState": lambda: fh.FP8CompressionState(),
          "HierarchicalState": lambda: fh.HierarchicalState(wire="fp8")}[state]()
    with single_rank_group(tmp_path):
        m = DDP(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)))
        with pytest.raises(ValueError, match=rf"{state}\(error_feedback=True\) does not apply to modules "
                                             "with sparse gradients"):
            m.register_comm_hook(st, fh.fp8_compress_hook)
        m.register_comm_hook(fh.CompressionState(), fh.fp16_compress_hook)  # no error feedback: taken
