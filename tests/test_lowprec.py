"""bf16 transport with fp32 accumulation (``fastddp.hooks.bf16_fp32acc_hook``)
on gloo ranks: the fused path against a numpy oracle of its rule, against
the same hook on torch's DDP, and against an fp64 exact average; error
feedback, no_sync, join, static_graph, bucket views, check_finite and the
bytes it reports.

The rule (the oracle below recomputes it with numpy, independently of the
package): ``x_k = bf16(fp32(g_k) * fp32(1/W))`` on rank k (nearest even);
``sum = ((x_0 + x_1) + x_2) + ...`` in fp32, rank order; result
``bf16(sum)``, then widened back to the fp32 ``.grad``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastddp import kernels
from tests._dist import STAND_IN, _world_fixture, torch_reference, world2, world3  # noqa: F401
from tests._models import loss_fn, make_batch, make_model
from tests._parity import side_by_side

#: the Triton interpreter serves the kernels (tests/run.sh's second session)
INTERPRET = kernels.backend() == "interpret"

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(STAND_IN, reason="fastddp's fused low-precision paths")]

world4 = _world_fixture(4)


# ------------------------------------------------------------------ oracle
def bf16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (nearest even) -> fp32, on the bits (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def oracle(local_grads: list[np.ndarray], world: int) -> np.ndarray:
    """The averaged gradient under bf16_fp32acc's rule, from every rank's fp32 grad."""
    inv = np.float32(1.0 / world)
    parts = [bf16_rne(g.astype(np.float32) * inv) for g in local_grads]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    return bf16_rne(acc)


def _gather(t: torch.Tensor, world: int) -> list[np.ndarray]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return [o.numpy() for o in out]


def _fused(model, state=None, **opts):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(model, **opts)
    m.register_comm_hook(state, fh.bf16_fp32acc_hook)
    return m


def _two_phase(m):
    """The wrapper's two-phase mode: at two ranks one of the candidates the
    hook's run measures (:func:`fastddp.reduction.choices.two_rank_choice`),
    the one it starts with and its trial begins with."""
    mode = m.reducer.mode
    return mode.candidate("two-phase") if hasattr(mode, "candidate") else mode


# ----------------------------------------------------------- oracle parity
def _oracle_parity(rank, world, model_name, opts, steps=3):
    """Every grad of every step equals the numpy oracle bit for bit, and
    stays within the rule's error bound of the exact (fp64) average."""
    local = make_model(model_name)
    m = _fused(copy.deepcopy(local), **opts)
    assert m.reducer.fused_path == ("fp32acc", torch.bfloat16)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    bad, worst = [], 0.0
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        x, y = make_batch(model_name, rank, step)
        loss_fn(m(x), y).backward()
        loss_fn(local(x), y).backward()
        for i, (pl, pm) in enumerate(zip(local.parameters(), m.parameters())):
            gs = _gather(pl.grad.detach(), world)
            want = oracle(gs, world)
            got = pm.grad.detach().numpy()
            if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                bad.append((step, i, int((got != want).sum())))
            exact = np.mean(np.stack([g.astype(np.float64) for g in gs]), axis=0)
            # each input rounded once to bf16 (2^-9 relative), the fp32 sum of
            # W terms, one final rounding: |err| <= 2^-8 (sum |x_k|) + 2^-8 |exact|
            bound = 2.0 ** -8 * (np.sum(np.stack([np.abs(g.astype(np.float64)) / world for g in gs]), 0)
                                 + np.abs(exact)) * (1 + 1e-3) + 1e-30
            excess = np.abs(got.astype(np.float64) - exact) / bound
            worst = max(worst, float(excess.max()))
        opt.step()
        local.load_state_dict(m.module.state_dict())  # the local copy follows the wrapped one
    return bad, worst


OPTS = [{}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 0.0005}, {"static_graph": True}]
OPT_IDS = ["default", "view", "tiny", "static"]


@pytest.mark.parametrize("opts", OPTS, ids=OPT_IDS)
def test_matches_oracle_w2(world2, opts):
    for bad, worst in world2.run(_oracle_parity, "mlp", opts):
        assert bad == [] and worst <= 1.0, (bad, worst)


@pytest.mark.parametrize("opts", OPTS[:3], ids=OPT_IDS[:3])
def test_matches_oracle_w3(world3, opts):
    for bad, worst in world3.run(_oracle_parity, "mlp", opts):
        assert bad == [] and worst <= 1.0, (bad, worst)


@pytest.mark.parametrize("opts", [{}, {"bucket_cap_mb": 0.0005}], ids=["default", "tiny"])
def test_matches_oracle_w4(world4, opts):
    for bad, worst in world4.run(_oracle_parity, "deep", opts):
        assert bad == [] and worst <= 1.0, (bad, worst)


# ------------------------------------------------- the hook on torch's DDP
def _fused_vs_torch_ddp(rank, world, opts, steps=3):
    """The plain hook on torch's DDP and the fused path: the same bits
    (:func:`side_by_side`, bit for bit at W=3 too)."""
    import fastddp.hooks as fh

    run = side_by_side(rank, world, "mlp", kwargs=opts, make_test=_fused, steps=steps, optim=dict(lr=0.05),
                       hook=lambda is_ref: (None, fh.bf16_fp32acc_hook) if is_ref else None)
    return run.checks


@pytest.mark.parametrize("opts", [{}, {"gradient_as_bucket_view": True}], ids=["default", "view"])
def test_fused_equals_hook_on_torch_ddp(world3, opts):
    assert world3.run(_fused_vs_torch_ddp, opts) == [3] * 3


def _fused_vs_callback(rank, world):
    """On another (equal) group the hook runs as a plain callback: same bits."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    base = make_model("mlp")
    a = _fused(copy.deepcopy(base))
    b = F(copy.deepcopy(base))
    b.register_comm_hook(fh.CompressionState(process_group=dist.new_group(list(range(world)))),
                         fh.bf16_fp32acc_hook)
    assert b.reducer.fused_path is None and a.reducer.fused_path is not None
    x, y = make_batch("mlp", rank, 0)
    for m in (a, b):
        loss_fn(m(x), y).backward()
    return [torch.equal(pa.grad, pb.grad) for pa, pb in zip(a.parameters(), b.parameters())]


def test_fused_equals_plain_callback(world2):
    for r in world2.run(_fused_vs_callback):
        assert all(r), r


# ----------------------------------------------------------- error feedback
def _error_feedback(rank, world, opts):
    """The residual after each step is exactly x - bf16(x), x = g/W + r_prev
    (per parameter, across the rebuild after step 0), and the grads are the
    oracle's of the x's."""
    import fastddp.hooks as fh

    local = make_model("mlp")
    m = _fused(copy.deepcopy(local), fh.CompressionState(error_feedback=True), **opts)
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
            r[i] = xval - xval.to(torch.bfloat16).float()
            ok.append(torch.equal(m.reducer.error_feedback_residual(i), r[i]))
            # x is bf16-exact after the cast, so the oracle of x*W... take the wire values directly
            wires = _gather(xval.to(torch.bfloat16).float(), world)
            acc = wires[0].copy()
            for w in wires[1:]:
                acc = (acc + w).astype(np.float32)
            ok.append(np.array_equal(pm.grad.numpy().view(np.uint32), bf16_rne(acc).view(np.uint32)))
    return ok


@pytest.mark.parametrize("opts", [{}, {"gradient_as_bucket_view": True}], ids=["default", "view"])
def test_error_feedback_is_exactly_the_recurrence(world2, opts):
    for r in world2.run(_error_feedback, opts):
        assert all(r), r


# ------------------------------------------- two ranks: one all-reduce or two phases
def _two_ranks(rank, world, costs, error_feedback, steps=16):
    """bf16_fp32acc_hook at two ranks, each rank's trial timed by a
    synthetic clock of ``costs[rank]``: at every step (the trial's, which
    alternates the two, included) each grad is the oracle's bit for bit and,
    with error feedback, each residual the recurrence's.  Returns the bad
    steps, the choice, the trial's length and the candidate of each step."""
    import fastddp.hooks as fh
    from tests.test_auto_precision import SyntheticClock

    local = make_model("mlp")
    m = _fused(copy.deepcopy(local), fh.CompressionState(error_feedback=error_feedback))
    m.reducer.mode.clock.synthetic = SyntheticClock(costs[rank])
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    lp, mp_ = list(local.parameters()), list(m.parameters())
    r = [torch.zeros_like(p) for p in lp]
    bad, seen = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        x, y = make_batch("mlp", rank, step)
        loss_fn(m(x), y).backward()
        seen.append(m.reducer.mode.cur_name)
        loss_fn(local(x), y).backward()
        for i, (pl, pm) in enumerate(zip(lp, mp_)):
            xval = pl.grad * (1.0 / world) + r[i]
            if error_feedback:
                r[i] = xval - xval.to(torch.bfloat16).float()
                if not torch.equal(m.reducer.error_feedback_residual(i), r[i]):
                    bad.append((step, i, "residual"))
            wires = _gather(xval.to(torch.bfloat16).float(), world)
            want = bf16_rne((wires[0] + wires[1]).astype(np.float32))
            if not np.array_equal(pm.grad.numpy().view(np.uint32), want.view(np.uint32)):
                bad.append((step, i, "grad"))
        opt.step()
        local.load_state_dict(m.module.state_dict())
    got = m.stats()["two_ranks"]
    return bad, got["chosen"], got["trial_steps"], seen


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error_feedback"])
def test_two_ranks_take_one_all_reduce_where_measured_faster_same_bits(world2, error_feedback):
    # rank 1 measures the all-reduce barely faster, rank 0 clearly: the MAX over the ranks decides
    costs = [{"two-phase": 1.0, "all-reduce": 0.5}, {"two-phase": 1.0, "all-reduce": 0.9}]
    for bad, chosen, trial, seen in world2.run(_two_ranks, costs, error_feedback):
        assert bad == [] and chosen == "all-reduce" and trial > 0, (bad, chosen, trial)
        assert seen[0] == "two-phase" and seen[-1] == "all-reduce", seen


def test_two_ranks_keep_two_phases_where_the_trial_cannot_tell(world2):
    costs = [{"two-phase": 1.0, "all-reduce": 1.0}, {"two-phase": 1.0, "all-reduce": 1.2}]
    for bad, chosen, trial, seen in world2.run(_two_ranks, costs, True):
        assert bad == [] and chosen == "two-phase" and trial > 0, (bad, chosen, trial)
        assert "all-reduce" in seen and seen[-1] == "two-phase", seen


def test_the_two_rank_choice_times_a_cuda_device_with_its_events():
    # built for a CUDA module (nothing launched here): its trial reads CUDA events, not the host clock
    from fastddp import reduction
    from fastddp.reduction.choices import two_rank_choice

    dev = torch.device("cuda")
    mode = two_rank_choice(reduction.Fp32Accumulate(False), reduction.FusedCompression(torch.bfloat16, False),
                           False, dev, None)
    assert mode.clock.cuda and mode.kind is reduction.Kind.FP32ACC and mode.formats == ["two-phase", "all-reduce"]
    assert not two_rank_choice(reduction.Fp32Accumulate(False), reduction.FusedCompression(torch.bfloat16, False),
                               False).clock.cuda


def _modes_by_world(rank, world):
    import fastddp.hooks as fh
    from fastddp import reduction

    from fastddp import DistributedDataParallel as F

    m = _fused(make_model("mlp"))
    auto = F(make_model("mlp"))  # auto precision's bf16 candidate: the two phases, not a choice of its own
    auto.register_comm_hook(fh.AutoPrecisionState(), fh.auto_precision_hook)
    return (type(m.reducer.mode).__name__, m.reducer.fused_path == ("fp32acc", torch.bfloat16),
            isinstance(auto.reducer.mode.candidate("bf16"), reduction.Fp32Accumulate))


def test_only_two_ranks_measure_one_all_reduce(world2, world3):
    # at three ranks the all-reduce's per-hop rounding differs from the fp32 shard sum: no candidate
    assert world2.run(_modes_by_world) == [("AutoPrecision", True, True)] * 2
    assert world3.run(_modes_by_world) == [("Fp32Accumulate", True, True)] * 3


# ------------------------------------------------- no_sync, join, bytes, stats
def _no_sync_and_bytes(rank, world):
    """no_sync accumulates locally; the synced step reduces the sum by the
    rule; stats() counts the padded bf16 wire of every bucket."""
    local = make_model("mlp")
    m = _fused(copy.deepcopy(local), bucket_cap_mb=0.0005)
    with m.no_sync():
        x, y = make_batch("mlp", rank, 0)
        loss_fn(m(x), y).backward()
    before = m.stats()["bytes_on_wire"]
    x2, y2 = make_batch("mlp", rank, 1)
    loss_fn(m(x2), y2).backward()
    loss_fn(local(x), y).backward()
    loss_fn(local(x2), y2).backward()
    ok = [np.array_equal(pm.grad.numpy().view(np.uint32),
                         oracle(_gather(pl.grad, world), world).view(np.uint32))
          for pl, pm in zip(local.parameters(), m.parameters())]
    mid = m.stats()["bytes_on_wire"]
    x3, y3 = make_batch("mlp", rank, 2)
    loss_fn(m(x3), y3).backward()  # after the rebuild: several tiny buckets
    per_step = m.stats()["bytes_on_wire"] - mid
    numels = [b["numel"] for b in m.stats()["buckets"]]
    # W shards of S elements, S = ceil(N / W) rounded up to a multiple of 64, 2 bytes each
    want = sum(-(-(-(-n // world)) // 64) * 64 * world * 2 for n in numels)
    return ok, before, per_step, want, len(numels)


def test_no_sync_and_bytes_on_the_wire(world3):
    for ok, before, per_step, want, nb in world3.run(_no_sync_and_bytes):
        assert all(ok) and before == 0 and nb > 1
        assert per_step == want, (per_step, want)


def _shard_layout(rank, world, opts):
    """Each bucket's wire after a step: its size, its pieces, its padded tail."""
    local = make_model("deep")
    m = _fused(copy.deepcopy(local), **opts)
    x, y = make_batch("deep", rank, 0)
    loss_fn(m(x), y).backward()
    red = m.reducer.buckets[0].reduction
    out = []
    for b in m.reducer.buckets:
        w = red.engine.wires[b.index]
        n = b.flat.numel()
        out.append((n, w.wire.numel(), list(w.bounds), bool((w.wire[n:] == 0).all())))
    return out


@pytest.mark.parametrize("opts", [{}, {"bucket_cap_mb": 0.0005}], ids=["default", "tiny"])
def test_shards_are_padded_to_64_elements(world3, opts):
    """The wire is W shards of S elements, S the least multiple of 64 that
    holds ceil(N / W); the tail past N is 0 (packed as 0, summed as 0);
    the pieces cut the shard whole, at multiples of 64.  (The oracle tests
    above check the values are unchanged.)"""
    results = world3.run(_shard_layout, opts)
    assert results[0] == results[1] == results[2]
    for n, numel, bounds, tail_zero in results[0]:
        per = -(-n // 3)
        S = numel // 3
        assert numel == 3 * S and S % 64 == 0 and per <= S < per + 64, (n, numel)
        assert tail_zero, n
        assert bounds[0][0] == 0 and bounds[-1][1] == S and all(a % 64 == 0 for a, _ in bounds), bounds
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:])), bounds


def test_shard_numel_rule():
    from fastddp.reduction.fp32acc import SHARD_ALIGN, shard_numel

    assert SHARD_ALIGN == 64
    for n, w, s in [(1, 1, 64), (64, 1, 64), (65, 1, 128), (128, 2, 64), (129, 2, 128), (1000, 3, 384),
                    (10**6, 8, 125_056), (7, 300, 64)]:
        assert shard_numel(n, w) == s, (n, w)


def _join(rank, world):
    """Rank 1 runs out of data one step early; rank 0's last step reduces with
    rank 1's zeros (divided by the initial world size)."""
    local = make_model("mlp")
    m = _fused(copy.deepcopy(local))
    steps = 3 if rank == 0 else 2
    with m.join():
        for step in range(steps):
            m.zero_grad(set_to_none=True)
            x, y = make_batch("mlp", rank, step)
            loss_fn(m(x), y).backward()
    if rank != 0:
        return True
    local.zero_grad(set_to_none=True)
    loss_fn(local(x), y).backward()
    return all(np.array_equal(pm.grad.numpy().view(np.uint32),
                              oracle([pl.grad.numpy(), np.zeros(pl.shape, np.float32)], 2).view(np.uint32))
               for pl, pm in zip(local.parameters(), m.parameters()))


def test_join(world2):
    assert world2.run(_join) == [True, True]


# ------------------------------------------------------------ check_finite
def _check_finite(rank, world):
    """A NaN gradient on rank 1 raises on both ranks before .grad changes;
    the residual that step wrote is not carried into the next step."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    local = make_model("mlp")
    m = F(copy.deepcopy(local), check_finite="raise")
    m.register_comm_hook(fh.CompressionState(error_feedback=True), fh.bf16_fp32acc_hook)
    out = {}
    x, y = make_batch("mlp", rank, 0)
    loss_fn(m(x), y).backward()  # step 0: residuals now hold real errors
    x, y = make_batch("mlp", rank, 1)
    m.zero_grad(set_to_none=True)
    try:
        loss = loss_fn(m(x), y) * (float("nan") if rank == 1 else 1.0)
        loss.backward()
        out["raised"] = None
    except FloatingPointError as e:
        out["raised"] = str(e)
    # next step: the residual must be x - bf16(x) of x = g/W alone (the
    # abandoned step's residual was dropped)
    m.zero_grad(set_to_none=True)
    x, y = make_batch("mlp", rank, 2)
    loss_fn(m(x), y).backward()
    local.load_state_dict(m.module.state_dict())
    local.zero_grad(set_to_none=True)
    loss_fn(local(x), y).backward()
    res_ok = []
    for i, pl in enumerate(local.parameters()):
        xval = pl.grad * (1.0 / world)
        res_ok.append(torch.equal(m.reducer.error_feedback_residual(i), xval - xval.to(torch.bfloat16).float()))
    out["residual_fresh"] = all(res_ok)
    return out


def test_check_finite_raises_and_drops_the_stale_residual(world2):
    for out in world2.run(_check_finite):
        assert out["raised"] is not None and "non-finite" in out["raised"], out
        assert out["residual_fresh"], out


def _overflow_flagged(rank, world):
    """Finite bf16 inputs whose fp32 sum rounds to inf: the shard sum flags it."""
    from fastddp import DistributedDataParallel as F
    import fastddp.hooks as fh

    p = torch.nn.Linear(1, 1, bias=False)
    m = F(p, check_finite="raise")
    m.register_comm_hook(None, fh.bf16_fp32acc_hook)
    with torch.no_grad():
        p.weight.fill_(1.0)
    assert world == 2
    # g/W ~ 1.7e38 per rank: finite in bf16; the fp32 sum ~3.4e38 is finite,
    # its bf16 rounding is not (bf16's largest is 3.39e38)
    x = torch.full((1, 1), 3.4e38)
    try:
        m(x).sum().backward()
    except FloatingPointError as e:
        return str(e)
    return None


def test_sum_overflow_is_flagged(world2):
    for msg in world2.run(_overflow_flagged):
        assert msg is not None and "check_finite" in msg, msg


# ------------------------------------------------------------- bad configs
def test_error_feedback_needs_a_fused_hook():
    from fastddp import reduction
    import fastddp.hooks as fh

    with pytest.raises(ValueError, match="bf16_fp32acc_hook"):
        reduction.choose(fh.noop_hook, fh.CompressionState(error_feedback=True), False, True)
    dense, _ = reduction.choose(fh.bf16_fp32acc_hook, fh.CompressionState(error_feedback=True), False, True)
    assert isinstance(dense, reduction.Fp32Accumulate) and dense.book.error_feedback


def _sparse_refused(rank, world):
    """A sparse bucket reaches the hook as a plain callback: a clear error."""
    model = make_model("sparse_emb")
    m = _fused(model)
    x, y = make_batch("sparse_emb", rank, 0)
    try:
        loss_fn(m(x), y).backward()
    except TypeError as e:
        return str(e)
    return None


def test_sparse_gradients_are_refused_clearly(world2):
    for msg in world2.run(_sparse_refused):
        assert msg is not None and "sparse" in msg and "bf16_fp32acc_hook" in msg, msg


# --------------------------------------------------------------- overlap
def _order_of_events(rank, world, eager=False, thread=False):
    """Every bucket's all-to-all is issued during backward, as its bucket is
    ready (before the last bucket's pack), and the shard sums and
    all-gathers run after the last bucket is issued, in bucket order
    (``eager``: phase 2 queued at issue, CUDA's schedule; ``thread``: the
    phase-2 thread, else the end-of-backward schedule).  Each event with the
    name of the thread it ran on."""
    import threading

    from fastddp import groups, kernels

    events = []
    real_a2a, real_ag, real_sum, real_pack = (groups.all_to_all_single, groups.all_gather_into_tensor,
                                              kernels.reduce_shards, kernels.pack)

    def note(kind, n):
        events.append((kind, n, threading.current_thread().name))

    def a2a(out, t, pg):
        note("a2a", t.numel())
        return real_a2a(out, t, pg)

    def ag(out, t, pg):
        note("ag", out.numel())
        return real_ag(out, t, pg)

    def rsum(*a, **k):
        note("sum", None)
        return real_sum(*a, **k)

    def pack(srcs, dst, *a, **k):
        if dst.dtype == torch.bfloat16:
            note("pack", dst.numel())
        return real_pack(srcs, dst, *a, **k)

    m = _fused(make_model("deep"), bucket_cap_mb=0.001)
    engine = _two_phase(m).engine
    engine.eager = eager
    assert (engine.phase_two is not None) == (kernels.backend() != "interpret")
    if not thread:
        engine.phase_two = None
    for step in range(2):  # the second step runs in the rebuilt buckets
        m.zero_grad(set_to_none=True)
        x, y = make_batch("deep", rank, step)
        groups.all_to_all_single, groups.all_gather_into_tensor = a2a, ag
        kernels.reduce_shards, kernels.pack = rsum, pack
        events.clear()
        try:
            loss_fn(m(x), y).backward()
        finally:
            groups.all_to_all_single, groups.all_gather_into_tensor = real_a2a, real_ag
            kernels.reduce_shards, kernels.pack = real_sum, real_pack
    return events, m.reducer.num_buckets


def test_all_to_all_overlaps_backward(world2):
    for events, nb in world2.run(_order_of_events):
        kinds = [k for k, _, _ in events]
        assert nb > 2 and kinds.count("a2a") == nb and kinds.count("ag") == nb and kinds.count("sum") == nb
        last_pack = max(i for i, k in enumerate(kinds) if k == "pack")
        first_sum = kinds.index("sum")
        assert kinds.index("a2a") < last_pack < first_sum, kinds  # a2a of bucket 0 while backward runs
        assert all(k in ("pack", "a2a") for k in kinds[:first_sum]), kinds
        assert kinds[first_sum:] == ["sum", "ag"] * nb, kinds


def _order_of_events_eager(rank, world):
    """With phase 2 queued at issue (CUDA's schedule, forced here on gloo):
    every bucket's shard sum and all-gather follow its own all-to-all
    straight away, before the next bucket is packed."""
    return _order_of_events(rank, world, eager=True)


def test_phase2_at_issue_runs_during_backward(world2):
    for events, nb in world2.run(_order_of_events_eager):
        kinds = [k for k, _, _ in events]
        assert nb > 2 and kinds.count("a2a") == nb and kinds.count("ag") == nb and kinds.count("sum") == nb
        last_pack = max(i for i, k in enumerate(kinds) if k == "pack")
        assert kinds.index("sum") < last_pack, kinds  # bucket 0's phase 2 while backward runs
        assert [k for k in kinds if k != "pack"] == ["a2a", "sum", "ag"] * nb, kinds


@pytest.mark.skipif(INTERPRET, reason="the Triton interpreter is not thread-safe: phase 2 stays at the end of "
                                       "backward there")
def test_phase2_thread_runs_every_later_round_in_bucket_order(world2):
    # gloo: the backward thread packs and issues the all-to-alls; the
    # phase-2 thread alone sums and all-gathers, bucket by bucket, in the
    # order the all-to-alls were issued
    for events, nb in world2.run(_order_of_events, False, True):
        main = [(k, n) for k, n, t in events if t != "fastddp-phase2"]
        side = [(k, n) for k, n, t in events if t == "fastddp-phase2"]
        assert nb > 2 and {k for k, _ in main} == {"pack", "a2a"}, main
        assert [k for k, _ in side] == ["sum", "ag"] * nb, side
        a2a = [n for k, n in main if k == "a2a"]
        assert [n for k, n in side if k == "ag"] == a2a  # a shard's all-to-all and all-gather move as many


class _Gate(torch.autograd.Function):
    """Identity whose backward waits (at most ``timeout`` s) for ``event``:
    the layers before it are reduced only after it."""

    @staticmethod
    def forward(ctx, x, event, timeout, seen):
        ctx.event, ctx.timeout, ctx.seen = event, timeout, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(ctx.event.wait(ctx.timeout))
        return g, None, None, None


def _phase2_while_backward_waits(rank, world):
    """The backward stops at a gate between the last layers (reduced first)
    and the first ones until an all-gather is issued: only phase 2 running
    during backward opens it."""
    import threading

    from fastddp import groups

    event, seen = threading.Event(), []
    torch.manual_seed(0)
    head, tail = torch.nn.Linear(32, 64), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                                              torch.nn.ReLU(), torch.nn.Linear(64, 8))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.tail = head, tail

        def forward(self, x):
            return self.tail(_Gate.apply(self.head(x), event, self.timeout, seen))

    real_ag = groups.all_gather_into_tensor

    def ag(out, t, pg):
        event.set()
        return real_ag(out, t, pg)

    net = Net()
    m = _fused(net, bucket_cap_mb=0.001)
    for step in range(3):
        # the first step's buckets are torch's first bucket (1 MiB: the whole model), ready only after
        # the gate; the rebuilt ones (the small cap) reduce the tail's grads first
        net.timeout = 0.0 if step == 0 else 30.0
        event.clear()
        m.zero_grad(set_to_none=True)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * rank + step))
        groups.all_gather_into_tensor = ag
        try:
            m(x).square().mean().backward()
        finally:
            groups.all_gather_into_tensor = real_ag
    return seen


@pytest.mark.skipif(INTERPRET, reason="the Triton interpreter is not thread-safe: phase 2 stays at the end of "
                                       "backward there")
def test_phase2_runs_while_backward_still_computes(world2):
    for seen in world2.run(_phase2_while_backward_waits):
        assert seen[1:] == [True] * 2  # an all-gather was issued before backward got past the gate


def _eager_matches_deferred(rank, world, hook_name):
    """Phase 2 at issue and at the end of backward: the same collectives in
    the same order per bucket, so the same bits."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    from tests._compare import mismatch

    hook = getattr(fh, hook_name)
    base = make_model("deep")
    out = []
    for eager in (False, True):
        m = F(copy.deepcopy(base), bucket_cap_mb=0.001)
        m.register_comm_hook(None, hook)
        for mode in getattr(m.reducer.mode, "modes", {None: m.reducer.mode}).values():  # fp8's: both candidates
            if hasattr(mode, "engine"):
                mode.engine.eager = eager
        grads = []
        for step in range(3):
            m.zero_grad(set_to_none=True)
            x, y = make_batch("deep", rank, step)
            loss_fn(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        out.append(grads)
    return [mismatch(a, b) for ga, gb in zip(*out) for a, b in zip(ga, gb) if mismatch(a, b)]


@pytest.mark.skipif(STAND_IN, reason="fastddp's fused path")
@pytest.mark.parametrize("hook_name", ["bf16_fp32acc_hook", "fp8_compress_hook"])
def test_phase2_at_issue_gives_the_same_bits(world2, hook_name):
    assert world2.run(_eager_matches_deferred, hook_name) == [[], []]


# ------------------------------------------------------- chunked phases
def _with_chunk_bytes(rank, world, chunk_bytes, body, *args):
    """Run ``body`` with FASTDDP_CHUNK_BYTES set in this worker (restored after)."""
    import os

    from tests._dist import _restore_env

    from fastddp import settings

    old = os.environ.get("FASTDDP_CHUNK_BYTES")
    os.environ["FASTDDP_CHUNK_BYTES"] = str(chunk_bytes)
    settings.reload()
    try:
        return body(rank, world, *args)
    finally:
        _restore_env("FASTDDP_CHUNK_BYTES", old)
        settings.reload()


def _chunk_counts(rank, world, chunk_bytes):
    """How many all-to-alls each bucket's first phase issues (the pieces its shard is cut into)."""
    def body(rank, world):
        m = _fused(make_model("mlp"))
        x, y = make_batch("mlp", rank, 0)
        loss_fn(m(x), y).backward()
        return [_two_phase(m).engine.pieces(b.index) for b in m.reducer.buckets]
    return _with_chunk_bytes(rank, world, chunk_bytes, body)


@pytest.mark.parametrize("chunk_bytes", [64, 1000])
def test_chunked_phases_match_oracle_w3(world3, chunk_bytes):
    """Both phases cut into many pieces (down to 64 bytes each way per call,
    uneven last pieces at W=3): still the oracle's bits (the same elements meet
    in the same order), and every rank cut its shards the same way."""
    for bad, worst in world3.run(_with_chunk_bytes, chunk_bytes, _oracle_parity, "mlp", {}):
        assert bad == [] and worst <= 1.0, (bad, worst)
    counts = world3.run(_chunk_counts, chunk_bytes)
    assert counts[0] == counts[1] == counts[2] and max(counts[0]) > 1, counts


def test_chunking_follows_the_setting(world2):
    off = world2.run(_chunk_counts, 0)[0]
    assert set(off) == {1}, off
    fine = world2.run(_chunk_counts, 256)[0]
    assert max(fine) > 1 and all(c <= 32 for c in fine), fine  # MAX_CHUNKS


def test_chunk_bounds_rule():
    from fastddp.reduction import MAX_CHUNKS, chunk_bounds

    assert chunk_bounds(1000, 1, 2, 1) == [(0, 1000)]            # world 1: nothing to cut
    assert chunk_bounds(100, 2, 2, 1) == [(0, 100)]              # under CHUNK_BYTES each way
    b = chunk_bounds(6_500_000, 2, 1, 256)                       # an fp8 shard of 6.5M elements
    assert b[0][0] == 0 and b[-1][1] == 6_500_000 and all(x % 256 == 0 for x, _ in b)
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(b, b[1:])) and 2 <= len(b) <= MAX_CHUNKS
    assert len(chunk_bounds(10**9, 8, 4, 1)) == MAX_CHUNKS


def test_chunking_is_for_gloo_only(monkeypatch):
    """CUDA buckets (NCCL pipelines its own chunks) keep one call per phase unless asked."""
    from fastddp import settings
    from fastddp.reduction import chunk_bounds

    big = 10**8
    monkeypatch.delenv("FASTDDP_CHUNK_BYTES", raising=False)
    settings.reload()
    assert len(chunk_bounds(big, 2, 2, 1, torch.device("cpu"))) > 1
    assert chunk_bounds(big, 2, 2, 1, torch.device("cuda", 0)) == [(0, big)]
    monkeypatch.setenv("FASTDDP_CHUNK_BYTES", str(1 << 20))
    settings.reload()
    assert len(chunk_bounds(big, 2, 2, 1, torch.device("cuda", 0))) > 1
    assert len(chunk_bounds(big, 2, 2, 1, torch.device("cuda", 0), target=0)) == 1  # a state's 0 wins
    monkeypatch.setenv("FASTDDP_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="FASTDDP_CHUNK_BYTES"):
        settings.reload()
