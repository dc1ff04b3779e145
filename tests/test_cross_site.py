"""Cross-site training (``fastddp.CrossSite``, docs/cross-site.md) on gloo ranks,
the hosts set explicitly (``ranks_per_host``):

* the inner reduction is torch's DDP over the host's ranks (bit for bit), and
  torch's DDP over every rank during the warm-up;
* the outer steps equal a plain-torch run of the same algorithm (Nesterov and
  plain averaging), bit for bit on the fp32 wire;
* the compressed wires stay close to the fp32 one, every rank of a host alike;
* a state_dict saved mid-interval, a sync in flight, resumes bit for bit;
* settings that differ across ranks, a step count that diverges, join() and
  bad arguments are clear errors;
* torch's own post-local SGD (periodic and hierarchical averagers) runs on
  fastddp's DDP as on torch's, bit for bit.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from tests._dist import _world_fixture, fastddp_only, single_rank_group, world2  # noqa: F401

world4 = _world_fixture(4)
pytestmark = fastddp_only


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _batch(rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _loss(model, rank, t):
    x, y = _batch(rank, t)
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _cross_site(model, inner, **kw):
    import fastddp

    return fastddp.CrossSite(model, inner, **kw)


# ------------------------------------------------------------- inner reduction
def _inner_body(rank, world, warmup_wire):
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=100, warmup_steps=2,
                      wire="fp32", ranks_per_host=2, warmup_wire=warmup_wire)
    whole = torch.nn.parallel.DistributedDataParallel(_net())
    host = torch.nn.parallel.DistributedDataParallel(_net(), process_group=opt.sites.inside)
    same = []
    for t in range(1, 5):
        ref = whole if t <= 2 else host  # the warm-up: every rank; then the host's ranks
        ref.module.load_state_dict(model.module.state_dict())
        _loss(model, rank, t).backward()
        _loss(ref, rank, t).backward()
        if t <= 2 and warmup_wire == "fp32":  # the hierarchical sum: the exact average in another order
            same.append(all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
                            for p, q in zip(model.parameters(), ref.parameters())))
        else:
            same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        opt.step()
        opt.zero_grad()
        ref.zero_grad()
    return same, opt.stats()["local"], type(model.reducer.mode.warm).__name__


@pytest.mark.parametrize("warmup_wire", ["exact", "fp32"])
def test_inner_reduction_is_torch_ddp_over_the_hosts_ranks(world4, warmup_wire):
    """The warm-up: torch's DDP over every rank (its bits, or the hierarchical
    fp32 average); then torch's DDP over the host's ranks, bit for bit."""
    for same, local, warm in world4.run(_inner_body, warmup_wire):
        assert same == [True] * 4 and local, same
        assert warm == {"exact": "NoneType", "fp32": "Hierarchical"}[warmup_wire]


def _accumulate_body(rank, world):
    """Two micro-batches a step, the first under no_sync(): the host's grads
    are what torch's DDP over the host's ranks accumulates, bit for bit."""
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, ranks_per_host=2,
                      wire="fp32", delay=1)
    host = torch.nn.parallel.DistributedDataParallel(_net(), process_group=opt.sites.inside)
    same = []
    for t in range(1, 6):
        host.module.load_state_dict(model.module.state_dict())
        for ddp in (model, host):
            with ddp.no_sync():
                _loss(ddp, rank, 10 * t).backward()
            _loss(ddp, rank, 10 * t + 1).backward()
        same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), host.parameters())))
        opt.step()
        opt.zero_grad()
        host.zero_grad()
    return same, opt.stats()["syncs"]


def test_no_sync_and_accumulation_reduce_inside_the_host_as_torch(world4):
    for same, syncs in world4.run(_accumulate_body):
        assert same == [True] * 5 and syncs == 2


def _finite_body(rank, world):
    """check_finite: a NaN on rank 0 is caught on every rank (its flags are
    gathered over the module's whole group), named, before any reduced value
    reaches ``.grad``: every rank skips the step, and the step counts the
    outer sync pairs stay equal."""
    import fastddp

    model = fastddp.DistributedDataParallel(_net(), check_finite="raise")
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, ranks_per_host=2,
                      wire="fp32", delay=1)
    caught = []
    for t in range(1, 6):
        handle = model.module[0].weight.register_hook(lambda g: g * float("nan")) if (rank, t) == (0, 2) else None
        try:
            _loss(model, rank, t).backward()
            opt.step()
        except FloatingPointError as e:
            caught.append((t, str(e)))
        finally:
            if handle is not None:
                handle.remove()
            opt.zero_grad()
    return caught, opt.stats()["steps"], opt.stats()["syncs"], bool(torch.isfinite(_flat(model)).all())


def test_check_finite_catches_a_nan_on_every_rank_and_the_syncs_stay_paired(world4):
    for caught, steps, syncs, finite in world4.run(_finite_body):
        assert [t for t, _ in caught] == [2], caught
        assert "on rank 0" in caught[0][1] or "rank(s) [0]" in caught[0][1], caught  # the source, or who
        assert steps == 4 and syncs == 1 and finite  # synced after steps 2 (applied at 3) and 4 (in flight)


# ------------------------------------------------------- outer step, reference
def _reference(rank, world, steps, H, warm, delay, lr, mu):
    """The algorithm in plain torch: one rank per host, the fp32 wire."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    anchor = torch.zeros(sum(p.numel() for p in model.parameters()))
    outer = torch.optim.SGD([anchor], lr=lr, momentum=mu, nesterov=mu > 0)
    if warm == 0:
        anchor.copy_(_flat(model))
    pending = None

    def add(flat):
        with torch.no_grad():
            off = 0
            for p in model.parameters():
                p.add_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    for t in range(1, steps + 1):
        _loss(model, rank, t).backward()
        if t <= warm:
            for p in model.parameters():
                p.grad.mul_(1.0 / world)
                dist.all_reduce(p.grad)
        inner.step()
        inner.zero_grad()
        if pending is not None and t == pending[0]:
            add(pending[1])
            pending = None
        if t == warm:
            anchor.copy_(_flat(model))
        elif t > warm and (t - warm) % H == 0:
            p0 = _flat(model)
            delta = anchor - p0
            dist.all_reduce(delta)
            anchor.grad = delta.div_(world)
            outer.step()
            pending = (t + delay, anchor.detach() - p0)
    return _flat(model)


def _run_cross_site(rank, steps, model=None, opt=None, start=0, **kw):
    import fastddp

    if model is None:
        model = fastddp.DistributedDataParallel(_net())
        opt = _cross_site(model, torch.optim.AdamW(model.parameters(), lr=0.02), ranks_per_host=1, **kw)
    for t in range(start + 1, steps + 1):
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _outer_body(rank, world, lr, mu, warm, delay):
    model, opt = _run_cross_site(rank, 14, sync_every=3, warmup_steps=warm, wire="fp32", delay=delay,
                                 outer_lr=lr, outer_momentum=mu)
    ref = _reference(rank, world, 14, 3, warm, delay, lr, mu)
    return torch.equal(_flat(model), ref), opt.stats()


@pytest.mark.parametrize("lr,mu,warm,delay", [(0.7, 0.9, 2, 1), (0.7, 0.9, 0, 3), (1.0, 0.0, 1, 2)],
                         ids=["nesterov", "nesterov-no-warmup", "averaging"])
def test_outer_steps_match_a_plain_torch_reference(world2, lr, mu, warm, delay):
    for same, stats in world2.run(_outer_body, lr, mu, warm, delay):
        assert same, stats
        assert stats["syncs"] == sum(1 for k in range(1, 6) if warm + 3 * k + delay <= 14), stats


def _wires_body(rank, world, wire):
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, wire=wire,
                      ranks_per_host=2, delay=1)
    for t in range(1, 12):
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
    flat = _flat(model)
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return everyone, opt.stats()


def test_compressed_wires_stay_close_to_fp32_and_hosts_agree_inside(world4):
    got = {w: world4.run(_wires_body, w) for w in ("fp32", "bf16", "fp8")}
    for wire, runs in got.items():
        everyone, stats = runs[0]
        assert torch.equal(everyone[0], everyone[1]) and torch.equal(everyone[2], everyone[3]), wire
        assert not torch.equal(everyone[0], everyone[2]), wire  # hosts differ between syncs (step 11 is local)
        assert stats["syncs"] == 5 and stats["bytes_between_hosts"] > 0, stats
    ref = got["fp32"][0][0][0]
    for wire, tol in (("bf16", 1e-2), ("fp8", 5e-2)):
        err = (got[wire][0][0][0] - ref).abs().max().item()
        assert 0 < err < tol, (wire, err)
    fp32_bytes = got["fp32"][0][1]["bytes_between_hosts"]
    assert got["bf16"][0][1]["bytes_between_hosts"] * 2 <= fp32_bytes
    assert got["fp8"][0][1]["bytes_between_hosts"] * 3 <= fp32_bytes


def _finish_body(rank, world):
    import fastddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24), torch.nn.Linear(24, 5))
    model = fastddp.DistributedDataParallel(net)
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, ranks_per_host=2)
    for t in range(1, 6):  # a sync after step 3, in flight or applied; steps 4-5 local
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()

    def everyone():
        flat = torch.cat([_flat(model), net[1].running_mean])
        out = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(out, flat)
        return out

    model.eval()  # BatchNorm leaves its statistics alone: what the forward's broadcast set stays
    with torch.no_grad():
        model(_batch(rank, 99)[0])
    model.train()
    before = everyone()
    opt.finish()
    after = everyone()
    return before, after, opt.stats()


def test_buffers_stay_in_the_host_and_finish_makes_every_rank_alike(world4):
    for before, after, stats in world4.run(_finish_body):
        # the forward's buffer broadcast: inside each host only (hosts' BatchNorm statistics differ)
        assert torch.equal(before[0], before[1]) and torch.equal(before[2], before[3])
        assert not torch.equal(before[0][-24:], before[2][-24:])  # the running means: each host's own
        assert all(torch.equal(after[0], a) for a in after[1:])
        assert stats["syncs"] == 1 and not stats["in_flight"], stats


# ----------------------------------------------------------------------- resume
def _resume_body(rank, world, wire):
    import fastddp

    kw = dict(sync_every=3, warmup_steps=2, wire=wire, delay=2)
    straight, _ = _run_cross_site(rank, 12, **kw)
    model, opt = _run_cross_site(rank, 6, **kw)  # the sync started after step 5 applies at 7: in flight
    in_flight = opt.stats()["in_flight"]
    saved = (model.module.state_dict(), opt.state_dict())
    model2 = fastddp.DistributedDataParallel(_net(seed=5))
    opt2 = _cross_site(model2, torch.optim.AdamW(model2.parameters(), lr=0.02), ranks_per_host=1, **kw)
    model2.module.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _run_cross_site(rank, 12, model2, opt2, start=6)
    return in_flight, torch.equal(_flat(straight), _flat(model2))


@pytest.mark.parametrize("wire", ["fp32", "fp8"])
def test_resume_mid_interval_is_bit_for_bit(world2, wire):
    for in_flight, same in world2.run(_resume_body, wire):
        assert in_flight and same


# ----------------------------------------------------------------------- errors
def _differ_body(rank, world):
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    try:
        _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4 + rank, ranks_per_host=1)
    except ValueError as e:
        return str(e)
    return None


def test_settings_that_differ_across_ranks_are_refused(world2):
    for msg in world2.run(_differ_body):
        assert msg and "different settings" in msg and "sync_every (from 4 to 5)" in msg


def _diverge_body(rank, world):
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, ranks_per_host=1,
                      wire="fp32")
    if rank == 1:  # as if it resumed another step's checkpoint
        sd = opt.state_dict()
        sd["cross_site"]["steps"] = 3
        opt.load_state_dict(sd)
    try:
        _run_cross_site(rank, 6, model, opt)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_diverged_step_count_is_a_clear_error(world2):
    for msg in world2.run(_diverge_body):
        assert msg and "different steps" in msg and "step() the same number of times" in msg


def _join_body(rank, world):
    import fastddp

    model = fastddp.DistributedDataParallel(_net())
    _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.1), ranks_per_host=1)
    try:
        with model.join():
            pass
    except RuntimeError as e:
        return str(e)
    return None


def test_join_is_refused_with_the_reason(world2):
    for msg in world2.run(_join_body):
        assert msg and "join() is not supported with fastddp.CrossSite" in msg


@pytest.mark.parametrize("kw,names", [
    (dict(sync_every=0), "sync_every=0"), (dict(outer_lr=0.0), "outer_lr=0.0"),
    (dict(outer_lr=-1), "outer_lr=-1"), (dict(wire="fp16"), "wire='fp16'"),
    (dict(delay=0), "delay=0"), (dict(delay=9, sync_every=8), "delay=9"),
    (dict(warmup_steps=-1), "warmup_steps=-1"), (dict(outer_momentum=1.0), "outer_momentum=1.0"),
    (dict(ranks_per_host=3), "ranks_per_host=3"), (dict(), "on one host"),
    (dict(warmup_wire="fp16"), "warmup_wire='fp16'"),
])
def test_bad_arguments_name_the_argument(tmp_path, kw, names):
    import fastddp

    with single_rank_group(tmp_path):
        model = fastddp.DistributedDataParallel(_net())
        with pytest.raises(ValueError, match=names.replace("(", r"\(").replace("[", r"\[")):
            fastddp.CrossSite(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def test_torch_ddp_is_refused_with_the_fix(tmp_path):
    import fastddp

    with single_rank_group(tmp_path):
        model = torch.nn.parallel.DistributedDataParallel(_net())
        with pytest.raises(TypeError, match="PostLocalSGDOptimizer, or swap the import"):
            fastddp.CrossSite(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ------------------------------------------------ torch's post-local SGD, kept
def _post_local_body(rank, world, hierarchical):
    import fastddp
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                               post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager)
    from torch.distributed.optim import PostLocalSGDOptimizer

    sub, _ = dist.new_subgroups(group_size=2 if world == 4 else 1)
    out = {}
    for name, cls in (("torch", torch.nn.parallel.DistributedDataParallel),
                      ("fastddp", fastddp.DistributedDataParallel)):
        model = cls(_net())
        model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=sub, start_localSGD_iter=3),
                                 post_localSGD_hook)
        if hierarchical:
            averager = HierarchicalModelAverager(collections.OrderedDict([(2, 2), (4, world)]), warmup_steps=3)
        else:
            averager = averagers.PeriodicModelAverager(period=2, warmup_steps=3)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), averager)
        for t in range(1, 11):
            _loss(model, rank, t).backward()
            opt.step()
            opt.zero_grad()
        out[name] = _flat(model)
    return torch.equal(out["torch"], out["fastddp"])


@pytest.mark.parametrize("hierarchical", [False, True], ids=["periodic", "hierarchical"])
def test_torch_post_local_sgd_runs_on_fastddp_as_on_torch_w2(world2, hierarchical):
    assert all(world2.run(_post_local_body, hierarchical))


@pytest.mark.parametrize("hierarchical", [False, True], ids=["periodic", "hierarchical"])
def test_torch_post_local_sgd_runs_on_fastddp_as_on_torch_w4(world4, hierarchical):
    assert all(world4.run(_post_local_body, hierarchical))


# ------------------------------------------------------ the Triton interpreter
def _interpret_body(rank, world):
    import fastddp
    from fastddp import kernels

    model = fastddp.DistributedDataParallel(_net())
    opt = _cross_site(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=2, wire="fp8",
                      ranks_per_host=1, delay=1)
    for t in range(1, 8):
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
    return kernels.backend(torch.device("cpu")), opt._threaded, opt.stats()


@pytest.mark.interpret
def test_fp8_outer_sync_runs_on_the_main_thread_under_the_interpreter(world2):
    """The interpreter is not thread-safe: the sync runs at its start, on the
    main thread, with the Triton kernels' fp8 codec."""
    for backend, threaded, stats in world2.run(_interpret_body):
        assert backend == "interpret" and not threaded
        assert stats["syncs"] == 3 and stats["bytes_between_hosts"] > 0, stats
