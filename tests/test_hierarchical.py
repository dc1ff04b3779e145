"""The hierarchical reduction (``hierarchical_hook``): fp32 inside each host,
fp32 / bf16 / fp8 between hosts, on local gloo ranks whose "hosts" come from
the explicit topology (``ranks_per_host``): 2x2, 2x3 and 3x2.

* the fp32 path equals the exact average (an fp64 oracle of every rank's
  gradient) within fp32 rounding, and torch's DDP's result within the same;
* the compressed formats' error is no worse than the same format flat at
  the same world size (fp8: ``fp8_compress_hook``; bf16: ``bf16_fp32acc_hook``);
* no_sync, join, check_finite, static_graph, bucket views, ``"auto"`` caps,
  checkpoints and a rebuild compose as with the flat modes;
* the fallbacks (one host, one rank per host, a subset group) log why and
  run flat; a topology that cannot be honoured is an error naming it.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fastddp import kernels
from tests._dist import _world_fixture, fastddp_only

pytestmark = [fastddp_only, pytest.mark.timeout(600)]


world4 = _world_fixture(4)
world6 = _world_fixture(6)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(33, 70), nn.LayerNorm(70), nn.ReLU(), nn.Linear(70, 17))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 33, generator=g), torch.randn(8, 17, generator=g)


def _local_grads(rank: int, world: int, step: int) -> list:
    """Every rank's gradient of step ``step`` (computed locally: the oracle's input)."""
    out = []
    for r in range(world):
        m = _model()
        x, y = _batch(r, step)
        nn.functional.mse_loss(m(x), y).backward()
        out.append([p.grad.double() for p in m.parameters()])
    return out


def _state(wire: str, per_host, **kw):
    from fastddp.hooks import HierarchicalState

    return HierarchicalState(wire=wire, ranks_per_host=per_host, **kw)


def _one_step(rank, world, wire, per_host, cap_mb=0.002):
    """One backward with the hierarchical hook: (grads, exact fp64 average, stats)."""
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    ddp = DDP(_model(), bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(_state(wire, per_host), hierarchical_hook)
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    local = _local_grads(rank, world, 0)
    exact = [sum(g) / world for g in zip(*local)]
    _one_step.magnitude = [sum(x.abs() for x in g) / world for g in zip(*local)]  # for the rounding bound
    return [p.grad.clone() for p in ddp.parameters()], exact, ddp.stats()


def _rel_err(grads, exact) -> float:
    num = sum(float((g.double() - e).pow(2).sum()) for g, e in zip(grads, exact))
    den = sum(float(e.pow(2).sum()) for e in exact)
    return (num / den) ** 0.5


def _fp32_body(rank, world, per_host):
    grads, exact, stats = _one_step(rank, world, "fp32", per_host)
    # the scaling, the sum inside a host (fp32, rank order) and across the
    # hosts (fp32): each element within W+1 fp32 roundings of the mean of
    # the |terms| (the standard bound of a recursive sum; cancellation makes
    # an error relative to the average itself meaningless)
    worst = max(float(((g.double() - e).abs() / (m + 1e-30)).max())
                for g, e, m in zip(grads, exact, _one_step.magnitude))
    return worst, _rel_err(grads, exact), stats["hierarchy"], stats["fused_path"]


@pytest.mark.parametrize("per_host", [2, 3])
def test_fp32_equals_the_exact_average(world6, per_host):
    """2x3 and 3x2 (6 ranks), several buckets: each element within fp32
    rounding of the fp64 average; every rank holds the same bits."""
    res = world6.run(_fp32_body, per_host)
    for worst, rel, hier, fused in res:
        assert fused[0] == "hierarchical"
        assert hier["hosts"] == 6 // per_host and hier["ranks_per_host"] == per_host
        assert rel < 2e-7, rel
        assert worst < (6 + 1) * 2 ** -24, worst


def test_fp32_equals_the_exact_average_2x2(world4):
    for worst, rel, hier, fused in world4.run(_fp32_body, 2):
        assert fused[0] == "hierarchical" and hier["hosts"] == 2 and hier["ranks_per_host"] == 2
        assert rel < 2e-7, rel
        assert worst < (4 + 1) * 2 ** -24, worst


def _same_on_all(rank, world, wire):
    grads, _, _ = _one_step(rank, world, wire, 2)
    flat = torch.cat([g.reshape(-1) for g in grads])
    got = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], t) for t in got)


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp8"])
def test_every_rank_holds_the_same_gradient(world4, wire):
    assert all(world4.run(_same_on_all, wire))


def _error_body(rank, world, wire, per_host):
    """(hierarchical error, flat error) of the same format against the exact average."""
    from fastddp import DistributedDataParallel as DDP
    from fastddp import hooks

    hier, exact, _ = _one_step(rank, world, wire, per_host)
    ddp = DDP(_model(), bucket_cap_mb=0.002)
    if wire == "fp8":
        ddp.register_comm_hook(hooks.FP8CompressionState(), hooks.fp8_compress_hook)
    else:
        ddp.register_comm_hook(None, hooks.bf16_fp32acc_hook)
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    return _rel_err(hier, exact), _rel_err([p.grad for p in ddp.parameters()], exact)


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_compressed_error_no_worse_than_flat(world4, wire):
    """One rounding per host instead of one per rank: the hierarchical error
    is at most the flat format's (10% slack: one step of one model)."""
    hier, flat = world4.run(_error_body, wire, 2)[0]
    assert hier <= flat * 1.1, (hier, flat)
    assert hier < (0.01 if wire == "bf16" else 0.08), hier


# ------------------------------------------------------- against torch's DDP
def _hier_hook(wire, per_host=2):
    def spec(is_ref):
        from fastddp.hooks import hierarchical_hook

        return None if is_ref else (_state(wire, per_host), hierarchical_hook)
    return spec


def _vs_torch(rank, world, opts, no_sync_micro):
    from tests._parity import side_by_side

    side_by_side(rank, world, _model, kwargs=opts, hook=_hier_hook("fp32"), steps=3,
                 no_sync_micro=no_sync_micro, batch=lambda step, micro: _batch(rank, 10 * step + micro),
                 step_fn=lambda ddp, x, y, step, is_ref: nn.functional.mse_loss(ddp(x), y).backward(),
                 tol=dict(rtol=1e-5, atol=1e-7))
    return True


@pytest.mark.parametrize("opts,micro", [
    ({}, 0), ({"gradient_as_bucket_view": True}, 0), ({"bucket_cap_mb": 0.001}, 0),
    ({"static_graph": True}, 0), ({}, 1), ({"find_unused_parameters": True, "bucket_cap_mb": 0.001}, 0),
], ids=["default", "view", "small-cap", "static-graph", "no-sync", "find-unused"])
def test_fp32_trains_as_torch_ddp(world4, opts, micro):
    """3 SGD steps at 2x2 against torch's DDP (no hook) in the same group:
    losses, parameters and grads within fp32 rounding (the sums run in
    another order, so not bit for bit)."""
    assert all(world4.run(_vs_torch, opts, micro))


def _same_bits_with(rank, world, wire, opts):
    """The module's grads after 2 steps with ``opts`` and without: the same bits."""
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    out = []
    for kw in ({}, opts):
        ddp = DDP(_model(), bucket_cap_mb=0.002, **kw)
        ddp.register_comm_hook(_state(wire, 2), hierarchical_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
    return torch.equal(out[0], out[1])


# static_graph keeps the first iteration's buckets (no rebuild): other
# buckets, so other fp8 blocks and scales, on the flat fp8 path as here; the
# bf16 wire rounds element by element, so its bits do not depend on them
@pytest.mark.parametrize("wire,opts", [
    ("bf16", {"gradient_as_bucket_view": True}), ("fp8", {"gradient_as_bucket_view": True}),
    ("bf16", {"static_graph": True}),
], ids=["view-bf16", "view-fp8", "static-graph-bf16"])
def test_compressed_options_change_no_bit(world4, wire, opts):
    assert all(world4.run(_same_bits_with, wire, opts))


# --------------------------------------------------------------------- join
def _join(rank, world, wire):
    """Rank 0 has one batch more: its last step reduces with the others'
    zeros, divided by the initial world size (torch's join default)."""
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    ddp = DDP(_model(), bucket_cap_mb=0.002)
    ddp.register_comm_hook(_state(wire, 2), hierarchical_hook)
    steps = 3 if rank == 0 else 2
    with ddp.join():
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            x, y = _batch(rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
    if rank != 0:
        return 0.0
    m = _model()
    nn.functional.mse_loss(m(x), y).backward()
    return _rel_err([p.grad for p in ddp.parameters()], [p.grad.double() / world for p in m.parameters()])


@pytest.mark.parametrize("wire", ["fp32", "fp8"])
def test_join(world4, wire):
    err = world4.run(_join, wire)[0]
    assert err < (1e-6 if wire == "fp32" else 0.08), err


# -------------------------------------------------------------- check_finite
def _check_finite(rank, world):
    """A NaN on rank 3 raises on every rank; the residual the abandoned step
    wrote is dropped: the next step equals a fresh module's."""
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    def make():
        # static_graph: no rebuild after the first step, so both modules keep the same buckets
        ddp = DDP(_model(), bucket_cap_mb=0.002, check_finite="raise", static_graph=True)
        ddp.register_comm_hook(_state("fp8", 2), hierarchical_hook)
        return ddp

    a, raised = make(), None
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(a(x), y).backward()
    a.zero_grad(set_to_none=True)
    x, y = _batch(rank, 1)
    try:
        (nn.functional.mse_loss(a(x), y) * (float("nan") if rank == 3 else 1.0)).backward()
    except FloatingPointError as e:
        raised = str(e)
    a.zero_grad(set_to_none=True)
    b = make()
    x, y = _batch(rank, 2)
    for m in (a, b):
        nn.functional.mse_loss(m(x), y).backward()
    return raised, all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_check_finite_raises_and_drops_the_stale_residual(world4):
    for raised, fresh in world4.run(_check_finite):
        assert raised is not None and "non-finite" in raised, raised
        assert fresh


# ------------------------------------------------------ fallbacks and errors
def _fallback(rank, world, per_host, sub):
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import HierarchicalState, hierarchical_hook

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("fastddp.topology")
    log.addHandler(handler)
    try:
        pg = dist.new_group([0, 1]) if sub else None
        if sub and rank > 1:
            return None
        ddp = DDP(_model(), process_group=pg)
        ddp.register_comm_hook(HierarchicalState(wire="fp8", ranks_per_host=per_host), hierarchical_hook)
        x, y = _batch(rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        return ddp.stats()["fused_path"][0], [r.getMessage() for r in records]
    except ValueError as e:
        return "error", str(e)
    finally:
        log.removeHandler(handler)


def test_one_host_runs_flat_and_says_why(world4):
    res = world4.run(_fallback, 4, False)
    assert res[0][0] == "fp8" and any("runs flat: all 4 ranks are on one host" in m for m in res[0][1]), res[0]
    assert all(r[0] == "fp8" and not r[1] for r in res[1:])  # one log line, on rank 0


def test_one_rank_per_host_runs_flat(world4):
    res = world4.run(_fallback, 1, False)
    assert res[0][0] == "fp8" and any("one rank per host" in m for m in res[0][1]), res[0]


def test_subset_group_with_an_explicit_topology_is_an_error(world4):
    res = world4.run(_fallback, 1, True)
    assert res[0][0] == "error" and "2 of the world's 4 ranks" in res[0][1], res[0]


def test_topology_that_does_not_divide_is_an_error(world6):
    res = world6.run(_fallback, 4, False)
    assert res[0][0] == "error" and "6 ranks, not a multiple of it" in res[0][1], res[0]


def _detected(rank, world):
    """No explicit setting: every rank's host key is gathered (here all one host)."""
    from fastddp import topology

    return topology.resolve(dist.group.WORLD)


def test_detection_gathers_host_keys(world4):
    for got in world4.run(_detected):
        assert got.why == "all 4 ranks are on one host", got


def test_topology_from_keys(monkeypatch):
    """Unequal hosts run flat; equal hosts order by their lowest rank."""
    from fastddp import topology

    class PG:
        def size(self):
            return 6

    monkeypatch.setattr(topology.groups, "is_registered", lambda pg: True)
    monkeypatch.setattr(topology.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 6)
    keys = [("b", None), ("a", None), ("b", None), ("a", None), ("c", None), ("c", None)]
    monkeypatch.setattr(topology, "_gathered", lambda pg, world: keys)
    t = topology.resolve(PG())
    assert t.hosts == ((0, 2), (1, 3), (4, 5)) and t.ranks_per_host == 2
    keys[5] = ("a", None)
    assert "unequal numbers of ranks" in topology.resolve(PG()).why
    keys[:] = [("node 0", 3)] * 2 + [("node 1", 3)] * 2 + [("node 2", 3)] * 2
    assert "LOCAL_WORLD_SIZE says [3]" in topology.resolve(PG()).why


def test_bad_states():
    from fastddp.hooks import HierarchicalState, hierarchical_hook

    with pytest.raises(ValueError, match="wire='fp4'"):
        HierarchicalState(wire="fp4")
    with pytest.raises(ValueError, match="ranks_per_host=0"):
        HierarchicalState(ranks_per_host=0)
    with pytest.raises(ValueError, match="fp32 has no compression error"):
        HierarchicalState(wire="fp32", error_feedback=True)
    with pytest.raises(RuntimeError, match="only as the fused path"):
        hierarchical_hook(None, None)


# ------------------------------------------------------------------ overlap
def _rounds_order(rank, world, thread):
    """The order of the engine's rounds, each with the thread it ran on.
    Without the phase-2 thread (``thread`` False): round 1 of bucket b (the
    inside hop's sum and the between-hosts collective) runs before bucket
    b+1 is issued, i.e. during backward, not at its end."""
    import threading

    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook
    from fastddp.reduction import twophase

    events = []
    advance = twophase.ShardStep.advance

    def spy(self):
        events.append((self.bucket.index, len(self.works), threading.current_thread().name))
        advance(self)

    twophase.ShardStep.advance = spy
    try:
        ddp = DDP(_model(), bucket_cap_mb=0.0005)
        ddp.register_comm_hook(_state("fp8", 2), hierarchical_hook)
        mode = ddp.reducer.mode
        assert (mode.engine.phase_two is not None) == (kernels.backend() != "interpret")
        if not thread:
            mode.engine.phase_two = None
        for step in range(2):  # the second: rebuilt buckets
            events.clear()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
    finally:
        twophase.ShardStep.advance = advance
    return events, len(ddp.stats()["buckets"])


def test_between_hosts_hop_starts_during_backward(world4):
    for events, nb in world4.run(_rounds_order, False):
        assert nb >= 3, nb
        order = [(b, r) for b, r, _ in events]
        for b in range(nb - 1):
            assert order.index((b, 1)) < order.index((b + 1, 0)), order
        assert sorted(order) == [(b, r) for b in range(nb) for r in range(4)]


@pytest.mark.skipif(kernels.backend() == "interpret", reason="the Triton interpreter is not thread-safe: no "
                                                              "phase-2 thread there")
def test_phase2_thread_runs_every_round_after_the_first(world4):
    # the backward thread issues each bucket's inside all-to-all; the thread
    # every later round (between hosts, then the gather inside the host on
    # its own inside group), bucket after bucket, round after round
    for events, nb in world4.run(_rounds_order, True):
        main = [(b, r) for b, r, t in events if t != "fastddp-phase2"]
        side = [(b, r) for b, r, t in events if t == "fastddp-phase2"]
        assert nb >= 3 and main == [(b, 0) for b in range(nb)], main
        assert side == [(b, r) for b in range(nb) for r in (1, 2, 3)], side


# ----------------------------------------------- compile, auto caps, checkpoints
def _train(rank, wire, steps=3, compiled=False, **kw):
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    ddp = DDP(_model(), **kw)
    ddp.register_comm_hook(_state(wire, 2), hierarchical_hook)
    run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return ddp, losses


def _compiled(rank, world, wire):
    a, la = _train(rank, wire)
    b, lb = _train(rank, wire, compiled=True)
    return la == lb and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# fp8 is left out: compiled, the flat fp8_compress_hook's parameters already
# differ from eager's after 3 steps (same losses); the cause is not found yet
@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_torch_compile_gives_the_same_bits(world4, wire):
    assert all(world4.run(_compiled, wire))


def _auto(rank, world):
    ddp, losses = _train(rank, "fp8", steps=6, bucket_cap_mb="auto")
    return ddp.stats()["fused_path"][0], torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def test_auto_bucket_cap(world4):
    """The bucket tuner's trial plans rebuild the buckets (and the wires)
    mid-training: every rank keeps the same parameters."""
    res = world4.run(_auto)
    assert all(r[0] == "hierarchical" for r in res)
    assert all(torch.equal(r[1], res[0][1]) for r in res)


def _checkpoint(rank, world, tmp):
    """state_dict keys are the module's; saving after 2 steps and resuming in
    a new module trains on as the uninterrupted one (fp32: no residual)."""
    ref, _ = _train(rank, "fp32", steps=3)
    a, _ = _train(rank, "fp32", steps=2)
    keys_ok = list(a.state_dict()) == ["module." + k for k in a.module.state_dict()]
    path = f"{tmp}/ckpt-{rank}.pt"
    torch.save(a.state_dict(), path)
    from fastddp import DistributedDataParallel as DDP
    from fastddp.hooks import hierarchical_hook

    b = DDP(_model())
    b.register_comm_hook(_state("fp32", 2), hierarchical_hook)
    b.load_state_dict(torch.load(path, weights_only=True))
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    x, y = _batch(rank, 2)
    nn.functional.mse_loss(b(x), y).backward()
    opt.step()
    return keys_ok and all(torch.equal(p, q) for p, q in zip(ref.parameters(), b.parameters()))


def test_checkpoint_resume(world4, tmp_path):
    assert all(world4.run(_checkpoint, str(tmp_path)))


# ------------------------------------------- the Triton kernels in the loop
def _interpreted(rank, world, wire):
    import fastddp.kernels as K

    assert K.backend("cpu") == "interpret", K.backend("cpu")
    K.reset_launch_count()
    grads, exact, _ = _one_step(rank, world, wire, 2)
    return _rel_err(grads, exact), K.launch_count(), K.stats()["reference_calls"]


@pytest.mark.interpret
@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp8"])
def test_triton_kernels_in_the_loop(world4, wire):
    for err, launches, ref_calls in world4.run(_interpreted, wire):
        assert launches > 0 and ref_calls == 0
        assert err < {"fp32": 2e-7, "bf16": 0.01, "fp8": 0.08}[wire], err
