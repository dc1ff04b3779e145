"""bucket_cap_mb="auto": the option, the cost model, and at W=2 the tuner's
contract: every trial step's gradients are the correct average (bit for bit
against torch's DDP: at W=2 fp32 the average does not depend on the bucket
layout), the settled layout is exactly the one the fixed setting it reports
builds, every rank decides the same, one log line on rank 0; and the
compatibility list (no_sync, find_unused_parameters, static_graph, a fused
fp16 hook, join)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from fastddp import autotune, planner
from tests._dist import fastddp_only, torch_ddp_class, world2  # noqa: F401 (fixture)

pytestmark = fastddp_only

WIDTH = 512  # 1 MiB fp32 weights: the grid's caps give different buckets
STEPS = 40


class Stack(nn.Module):
    def __init__(self, depth=6, branch=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.branch = nn.Linear(WIDTH, WIDTH) if branch else None

    def forward(self, x, step=0):
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == 1 and self.branch is not None and step % 2:
                x = self.branch(x)
        return x


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(rank * 10_007 + step * 101 + micro)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


# ----------------------------------------------------------------- the option
def test_parse_and_resolve(monkeypatch):
    import fastddp

    assert autotune.parse_cap("AUTO") == "auto" and autotune.parse_cap(" auto ") == "auto"
    assert autotune.parse_cap("5") == 5.0 and autotune.parse_cap(2.5) == 2.5 and autotune.parse_cap(None) is None
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB or 'auto', got 'fast'"):
        autotune.parse_cap("fast")
    with pytest.raises(ValueError, match=">= 0"):
        autotune.parse_cap(-1)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        autotune.parse_cap([1])
    with pytest.raises(ValueError, match="both given"):
        autotune.resolve_cap("auto", [1, 5])
    from fastddp import settings

    monkeypatch.delenv("FASTDDP_BUCKET_CAP_MB", raising=False)
    settings.reload()
    assert autotune.resolve_cap("auto", None) == (None, True)
    assert autotune.resolve_cap(None, None) == (None, False)
    assert autotune.resolve_cap(None, None, settings.default("bucket_cap_mb")) == (None, False)
    monkeypatch.setenv("FASTDDP_BUCKET_CAP_MB", "auto")
    settings.reload()
    assert autotune.resolve_cap(None, None, settings.default("bucket_cap_mb")) == (None, True)
    assert autotune.resolve_cap(5, None, "auto") == (5, False)          # the argument wins
    assert autotune.resolve_cap(None, [1, 2], "auto") == (None, False)  # so does a list
    monkeypatch.setenv("FASTDDP_BUCKET_CAP_MB", "nope")
    with pytest.raises(ValueError, match="FASTDDP_BUCKET_CAP_MB"):
        settings.reload()
    monkeypatch.setenv("FASTDDP_BUCKET_CAP_MB", "10")
    settings.reload()
    try:
        fastddp.configure(bucket_cap_mb="auto")  # configure wins over the environment
        assert autotune.resolve_cap(None, None, settings.default("bucket_cap_mb")) == (None, True)
        fastddp.configure(check_finite="warn")   # other options leave it alone
        assert autotune.resolve_cap(None, None, settings.default("bucket_cap_mb")) == (None, True)
        with pytest.raises(ValueError, match="configure"):
            fastddp.configure(bucket_cap_mb="x")
    finally:
        fastddp.configure(bucket_cap_mb=None, check_finite=None)
    assert autotune.resolve_cap(None, None, settings.default("bucket_cap_mb")) == (10, False)


def test_predict_serial_wire():
    # three 1000-element fp32 params ready at t = 0, 1, 4 ms; per collective
    # alpha 1 ms + 4000 bytes * beta (beta = 0.5 us/byte -> 2 ms)
    P = [torch.empty(1000) for _ in range(3)]
    one = planner.rebuilt_plan(P, [0, 1, 2], planner.BucketConfig(bucket_cap_mb_list=(1e-9, 1e-9)))
    assert [b.param_indices for b in one.buckets] == [(0,), (1,), (2,)]
    ready = [0.0, 1e-3, 4e-3]
    # b0: 0 -> 3 ms; b1: ready 1, starts 3 -> 6; b2: ready 4, starts 6 -> 9: exposed 9 - 4 = 5 ms
    assert autotune.predict(one, ready, 1e-3, 0.5e-6, 0.0) == pytest.approx(5e-3)
    # 0.1 ms host time per bucket hides behind the wire here (b2 still ends at 9 ms) ...
    assert autotune.predict(one, ready, 1e-3, 0.5e-6, 1e-4) == pytest.approx(5e-3)
    # ... and is the whole cost on a free wire: 3 buckets delay backward's end by 0.3 ms
    assert autotune.predict(one, ready, 0.0, 0.0, 1e-4) == pytest.approx(3e-4)
    whole = planner.rebuilt_plan(P, [0, 1, 2], planner.BucketConfig(bucket_cap_mb=1))
    assert len(whole.buckets) == 1  # one collective of 12000 bytes after the last grad: 1 + 6 ms
    assert autotune.predict(whole, ready, 1e-3, 0.5e-6, 0.0) == pytest.approx(7e-3)
    # a 2-byte wire (fused fp16) halves the bytes
    assert autotune.predict(whole, ready, 1e-3, 0.5e-6, 0.0, itemsize=2) == pytest.approx(4e-3)


# ------------------------------------------------------------- W=2 contract
def _records(rank):
    logger = logging.getLogger("fastddp.autotune")
    got = []

    class H(logging.Handler):
        def emit(self, rec):
            got.append(rec.getMessage())
    h = H(level=logging.INFO)
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    return got, lambda: logger.removeHandler(h)


def _grads(m):
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def _same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _auto_body(rank, world_size, mode):
    from fastddp import DistributedDataParallel as DDP
    from fastddp import hooks

    got, done = _records(rank)
    try:
        branch = mode == "find_unused"
        base = Stack(branch=branch)
        kw = {"find_unused_parameters": True} if branch else {}
        if mode == "static":
            kw = {"static_graph": True}
        if mode == "view":
            kw = {"gradient_as_bucket_view": True}
        auto = DDP(copy.deepcopy(base), bucket_cap_mb="auto", **kw)
        if mode == "fp16":  # the reference: fastddp's fixed default with the same fused hook
            ref = DDP(copy.deepcopy(base), **kw)
            for d in (auto, ref):
                d.register_comm_hook(None, hooks.fp16_compress_hook)
        else:
            ref = torch_ddp_class()(copy.deepcopy(base), **kw)
        opts = [torch.optim.SGD(d.parameters(), lr=0.01) for d in (auto, ref)]
        equal, settled_at, fixed, fixed_opt = [], None, None, None
        n = STEPS + 3
        for step in range(n):
            for d, o in zip((auto, ref), opts):
                o.zero_grad(set_to_none=True)
                if mode == "no_sync":
                    with d.no_sync():
                        x, y = _batch(rank, step, 1)
                        ((d(x, step) - y) ** 2).mean().backward()
                x, y = _batch(rank, step)
                ((d(x, step) - y) ** 2).mean().backward()
            equal.append(_same(_grads(auto), _grads(ref)))
            for o in opts:
                o.step()
            rep = auto.stats()["autotune"]
            if settled_at is None and rep["state"] == "settled":
                settled_at = step
                # the fixed setting it reports, from the same weights now
                fixed = DDP(copy.deepcopy(auto.module), **rep["chosen"]["torch_args"], **kw)
                if mode == "fp16":
                    fixed.register_comm_hook(None, hooks.fp16_compress_hook)
                fixed_opt = torch.optim.SGD(fixed.parameters(), lr=0.01)
                fixed_steps = []
            elif fixed is not None:
                fixed_opt.zero_grad(set_to_none=True)
                if mode == "no_sync":
                    with fixed.no_sync():
                        x, y = _batch(rank, step, 1)
                        ((fixed(x, step) - y) ** 2).mean().backward()
                x, y = _batch(rank, step)
                ((fixed(x, step) - y) ** 2).mean().backward()
                fixed_steps.append(_same(_grads(auto), _grads(fixed)))
                fixed_opt.step()
        stats = auto.stats()
        same_buckets = fixed is not None and (
            [b["params"] for b in stats["buckets"]] == [b["params"] for b in fixed.stats()["buckets"]])
        return {"equal": equal, "settled_at": settled_at, "report": stats["autotune"],
                "fixed_equal": fixed_steps if fixed is not None else [], "same_buckets": same_buckets,
                "logs": list(got), "params_equal": all(torch.equal(a, b) for a, b in
                                                       zip(auto.parameters(), ref.parameters()))}
    finally:
        done()


@pytest.mark.parametrize("mode", ["default", "no_sync", "find_unused", "static", "fp16", "view"])
def test_auto_tunes_with_exact_gradients(world2, mode):
    res = world2.run(_auto_body, mode, timeout=600)
    r0, r1 = res
    for r in res:
        assert all(r["equal"]), r["equal"]           # every step, trial steps included
        assert r["params_equal"]
        assert r["settled_at"] is not None and r["settled_at"] < STEPS, r["report"]
        rep = r["report"]
        assert rep["state"] == "settled" and rep["steps"] <= STEPS
        assert rep["steps"] == r["settled_at"] + 1  # no_sync forwards are not steps
        # torch's default is measured first; the model's best and its neighbours follow
        # unless the model puts them >15% above it (then the default is all there is to try:
        # seen on a machine whose measured latency made every other layout look bad)
        assert rep["tried"] and (rep["tried"][0]["first_mb"], rep["tried"][0]["rest_mb"]) == (1, 25), rep
        assert rep["chosen"] in rep["tried"], rep
        assert r["same_buckets"], rep["chosen"]
        assert r["fixed_equal"] and all(r["fixed_equal"]), r["fixed_equal"]
        assert rep["candidates"] <= len(autotune.REST_CAPS_MB) * 3
        assert rep["tried"][0]["torch_args"] == {"bucket_cap_mb": None}
    # every rank decided from the same (MAX-reduced) measurements
    assert r0["report"]["tried"] == r1["report"]["tried"]
    assert r0["report"]["chosen"] == r1["report"]["chosen"]
    assert len(r0["logs"]) == 1 and "chose first" in r0["logs"][0] and not r1["logs"], (r0["logs"], r1["logs"])
    if mode == "fp16":
        assert r0["report"]["model"]["wire_itemsize"] == 2


def _join_body(rank, world_size, when):
    from fastddp import DistributedDataParallel as DDP

    base = Stack()
    auto = DDP(copy.deepcopy(base), bucket_cap_mb="auto")
    ref = torch_ddp_class()(copy.deepcopy(base))
    opts = [torch.optim.SGD(d.parameters(), lr=0.01) for d in (auto, ref)]

    def step(d, o, s):
        o.zero_grad(set_to_none=True)
        x, y = _batch(rank, s)
        ((d(x) - y) ** 2).mean().backward()
        o.step()

    for s in range(when):  # some tuning steps first
        for d, o in zip((auto, ref), opts):
            step(d, o, s)
    before = auto.stats()["autotune"]["state"]
    n = 4 + rank  # uneven inputs
    for d, o in zip((auto, ref), opts):
        with d.join():
            for s in range(when, when + n):
                step(d, o, s)
    rep = auto.stats()["autotune"]
    return {"before": before, "rep": rep,
            "params_equal": all(torch.equal(a, b) for a, b in zip(auto.parameters(), ref.parameters()))}


@pytest.mark.parametrize("when", [0, 4])
def test_join_freezes_tuning(world2, when):
    # 4 steps: the rebuild, the probe and 2 of the first layout's 3 measured
    # steps, so tuning is still under way whatever the timings (at 9 steps a
    # tuner whose second layout gains nothing within noise has settled already)
    res = world2.run(_join_body, when, timeout=300)
    for r in res:
        assert r["params_equal"]
        assert r["rep"]["state"] == "settled", r["rep"]
        assert "join()" in r["rep"]["reason"], r["rep"]["reason"]
        if when:
            assert r["before"] in ("probe", "trial"), r["before"]
    assert res[0]["rep"] == res[1]["rep"]


def test_constructor_configure_and_env(monkeypatch, tmp_path):
    import fastddp
    from fastddp import DistributedDataParallel as DDP
    from tests._dist import single_rank_group

    from fastddp import settings

    monkeypatch.delenv("FASTDDP_BUCKET_CAP_MB", raising=False)
    settings.reload()
    with single_rank_group(tmp_path):
        m = nn.Linear(4, 4)
        assert "autotune" not in DDP(m).stats()
        assert DDP(m, bucket_cap_mb="auto").stats()["autotune"]["state"] == "waiting"
        with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB or 'auto'"):
            DDP(m, bucket_cap_mb="big")
        with pytest.raises(ValueError, match="both given"):
            DDP(m, bucket_cap_mb="auto", bucket_cap_mb_list=[1, 5])
        try:
            fastddp.configure(bucket_cap_mb="auto")
            assert DDP(m).stats()["autotune"]["state"] == "waiting"
            assert "autotune" not in DDP(m, bucket_cap_mb=5).stats()
        finally:
            fastddp.configure(bucket_cap_mb=None)
        monkeypatch.setenv("FASTDDP_BUCKET_CAP_MB", "auto")
        settings.reload()
        d = DDP(m)
        assert d.stats()["autotune"]["state"] == "waiting"
        # one rank: it tunes too (no collectives needed), settles, grads untouched
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        for step in range(30):
            opt.zero_grad()
            x = torch.randn(2, 4)
            local = copy.deepcopy(m)
            d(x).sum().backward()
            local(x).sum().backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(d.parameters(), local.parameters()))
            opt.step()
        assert d.stats()["autotune"]["state"] == "settled"


# ----------------------------------------------- the search, on a fake clock
class _FakeReducer:
    """The tuner's host interface (autotune.TunerHost) and nothing else of a
    reducer (slots: the tuner can write no field of it), with a clock the
    test drives."""

    __slots__ = ("params", "pg", "world", "rank", "device", "base_config", "steps_reduced",
                 "has_rebuilt_buckets", "wire_itemsize", "mode_measuring", "mode_epoch",
                 "rebuild_order", "config", "installs")

    def __init__(self, n=16, numel=256 * 1024):
        self.params = [torch.empty(numel) for _ in range(n)]
        self.base_config = planner.BucketConfig()
        self.pg, self.world, self.rank, self.device = None, 1, 0, torch.device("cpu")
        self.rebuild_order = list(range(n))[::-1]
        self.has_rebuilt_buckets, self.steps_reduced, self.wire_itemsize = True, 1, None
        self.mode_measuring, self.mode_epoch = False, 0
        self.config = self.base_config
        self.installs = 0

    def plan_for(self, cfg):
        return planner.rebuilt_plan(self.params, self.rebuild_order, cfg)

    def set_bucket_config(self, cfg):
        self.installs += 1
        self.config = cfg
        return True


def _drive(monkeypatch, true_cost, steps=40, alpha=1e-4, beta=1e-9):
    """Run the tuner over ``steps`` fake steps; ``true_cost(plan)`` is a step's
    duration (s). Returns the tuner, the reducer and the true cost of every
    layout in the grid."""
    clock = [0.0]
    monkeypatch.setattr(autotune.driver.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(autotune.Tuner, "_microbench", lambda self: (alpha, beta))
    r = _FakeReducer()
    t = autotune.Tuner(r)
    for _ in range(steps):
        t.boundary()
        if not t.active:
            break
        plan = r.plan_for(r.config)
        start = clock[0]
        if t.wants_ready_marks:  # backward: param k of the ready order at k ms
            for k, i in enumerate(r.rebuild_order):
                clock[0] = start + 1e-3 * (k + 1)
                t.on_ready(i)
        clock[0] = start + true_cost(plan) - 1e-3
        t.on_all_issued()
        clock[0] = start + true_cost(plan)
        t.on_finalized()
        r.steps_reduced += 1
    truth = {(l.first_mb, l.rest_mb): true_cost(r.plan_for(l.config)) for l in t.search.layouts}
    return t, r, truth


def _landscape(alpha, beta, host=30e-6, base=0.05):
    ready = [0.0] * 16
    for k, i in enumerate(list(range(16))[::-1]):
        ready[i] = 1e-3 * (k + 1)
    return lambda plan: base + autotune.predict(plan, ready, alpha, beta, host)


def test_search_finds_the_minimum_the_model_misjudges(monkeypatch):
    # the model believes collectives are cheap (0.1 ms, 1 GB/s); really each
    # costs 4 ms + 1 ms/MiB: fewer, larger buckets win
    t, r, truth = _drive(monkeypatch, _landscape(4e-3, 1e-3 / 2**20))
    rep = t.report()
    assert rep["state"] == "settled" and rep["settled_at_step"] <= 30, rep
    chosen = (rep["chosen"]["first_mb"], rep["chosen"]["rest_mb"])
    assert truth[chosen] <= 1.03 * min(truth.values()), (chosen, truth)
    assert len(rep["tried"]) <= autotune.MAX_LAYOUTS
    assert rep["tried"][0]["torch_args"] == {"bucket_cap_mb": None}
    # a 1 GB/s link on the CPU is at copy speed: the model's best, then the fewest buckets
    fewest = min(t.search.layouts, key=lambda l: (l.buckets, l.predicted_s))
    model_best = min(t.search.layouts, key=lambda l: l.predicted_s)
    assert (rep["tried"][1]["first_mb"], rep["tried"][1]["rest_mb"]) == (model_best.first_mb, model_best.rest_mb)
    assert (rep["tried"][2]["first_mb"], rep["tried"][2]["rest_mb"]) == (fewest.first_mb, fewest.rest_mb)


def test_on_a_wire_the_models_best_comes_second(monkeypatch):
    """Over a slower wire (0.1 GB/s) the model's best is the second trial and
    the fewest-buckets layout has no place of its own (at copy speed it is
    the third trial)."""
    t, r, truth = _drive(monkeypatch, _landscape(4e-3, 1e-3 / 2**20), beta=1e-8)
    rep = t.report()
    model_best = min(t.search.layouts, key=lambda l: l.predicted_s)
    assert (rep["tried"][1]["first_mb"], rep["tried"][1]["rest_mb"]) == (model_best.first_mb, model_best.rest_mb)
    t2, _, _ = _drive(monkeypatch, _landscape(4e-3, 1e-3 / 2**20), beta=1e-9)
    third = [(l["first_mb"], l["rest_mb"]) for l in t2.report()["tried"][2:3]]
    fewest = min(t2.search.layouts, key=lambda l: (l.buckets, l.predicted_s))
    assert third == [(fewest.first_mb, fewest.rest_mb)]  # at copy speed it is


def test_search_never_tries_a_layout_known_to_be_bad(monkeypatch):
    # model and reality agree (alpha 2 ms): tiny buckets are predicted far
    # worse than the best measured and must not be tried
    t, r, truth = _drive(monkeypatch, _landscape(2e-3, 1e-3 / 2**20, base=0.01), alpha=2e-3, beta=1e-3 / 2**20)
    rep = t.report()
    best = min(truth.values())
    for lay in rep["tried"]:
        assert truth[(lay["first_mb"], lay["rest_mb"])] <= best * 1.15 or lay["torch_args"] == {
            "bucket_cap_mb": None}, (lay, best)
    never = [l for l in t.search.layouts if truth[(l.first_mb, l.rest_mb)] > 1.5 * best]
    assert never, "the grid should hold clearly bad layouts"
    tried = {(l["first_mb"], l["rest_mb"]) for l in rep["tried"]}
    assert not tried & {(l.first_mb, l.rest_mb) for l in never}


def _ties_run(monkeypatch, beta):
    """Every layout 0.5% faster than torch's default: within the 1% noise floor."""
    default_key = [b.param_indices for b in _FakeReducer().plan_for(planner.BucketConfig()).buckets]
    cost = _landscape(4e-3, 1e-3 / 2**20)(_FakeReducer().plan_for(planner.BucketConfig()))
    return _drive(monkeypatch, lambda plan: cost * (
        1.0 if [b.param_indices for b in plan.buckets] == default_key else 0.995), beta=beta)


def test_ties_at_copy_speed_take_the_fewest_buckets(monkeypatch):
    """No layout beats torch's default by the noise, and the link moves bytes
    at copy speed (1 GB/s, loopback-like): among the layouts within noise the
    fewest buckets (a CPU collective there costs CPU time the ranks cannot
    overlap), never one measured outside the noise."""
    t, r, truth = _ties_run(monkeypatch, beta=1e-9)
    rep = t.report()
    ties = [l for l in t.search.order]  # all within 0.5% of each other
    assert rep["chosen"]["buckets"] == min(l.buckets for l in ties), rep["reason"]
    assert rep["chosen"]["buckets"] < t.search.default.buckets or t.search.default.buckets == 1
    assert "copy speed" in rep["reason"] and "fewest buckets" in rep["reason"], rep["reason"]


def test_ties_on_a_wire_that_the_trials_show_flat_keep_the_incumbent(monkeypatch):
    """The same ties over a wire (0.1 GB/s): the model predicts more buckets
    gain, the quiet trials measure every layout the same.  The per-bucket
    cost fitted to the trials cancels the model's gain, so torch's default
    stays (before the fit: the model's pick, a layout the trials never showed
    faster)."""
    t, r, truth = _ties_run(monkeypatch, beta=1e-8)
    rep = t.report()
    s = t.search
    assert s.per_bucket_s() > 0
    model_pick = min(s.order, key=lambda l: (l.predicted_s, l.cost))
    assert model_pick is not s.default and model_pick.buckets > s.default.buckets
    assert rep["chosen"]["torch_args"] == {"bucket_cap_mb": None}, rep["reason"]
    assert "fitted to the trials" in rep["reason"] and "kept the incumbent" in rep["reason"], rep["reason"]


def _tuner_with(order_costs, device="cpu", gbps=1.0):
    lays = []
    for k, (first, rest, buckets, samples) in enumerate(order_costs):
        cfg = planner.BucketConfig() if k == 0 else planner.BucketConfig(bucket_cap_mb_list=(first, rest))
        lay = autotune.Candidate(first, rest, cfg, key=(k,), buckets=buckets, predicted_s=float(k))
        lay.samples = list(samples)
        lays.append(lay)
    t = autotune.Search(lays, lays[0], cpu=device == "cpu", link_gbps=gbps)
    t.order, t.best = lays, lays[0]
    return t, lays


def test_ties_never_take_a_layout_outside_the_noise():
    """A one-bucket layout measured clearly slower than the incumbent is not
    a tie: copy speed or not, it is never picked."""
    t, (default, one) = _tuner_with([(1, 25, 2, [10.0, 10.1, 10.0]), (25, 25, 1, [13.0, 13.1, 13.0])])
    assert t.final_best() is default and t.tie_rule == ""


def test_ties_on_cuda_keep_torchs_default():
    """On CUDA (steps stable: the trials separate what matters) a gain within
    noise keeps torch's default, as before."""
    t, (default, one) = _tuner_with([(1, 25, 2, [10.0, 10.1, 10.0]), (25, 25, 1, [9.99, 10.0, 10.05])],
                                    device="cuda")
    assert t.final_best() is default
    t, (default, one) = _tuner_with([(1, 25, 2, [10.0, 10.1, 10.0]), (25, 25, 1, [9.99, 10.0, 10.05])])
    assert t.final_best() is one and "fewest buckets" in t.tie_rule  # the same on the CPU


def test_noise_shrinks_with_the_steps_measured():
    """The threshold a gain must beat scales with sqrt(1/n_a + 1/n_b), the steps
    each layout was measured on: small at 1 Gbit/s measured torch's default and
    first 0.5 / rest 0.5 MiB on 9 noisy steps each (65.1 / 58.6 ms, steps spread
    ~9%); with the count fixed at 3 the 10% gain was "within noise" and auto kept
    the default, 1.067x the best fixed cap.  Counted, it is taken."""
    default = autotune.Candidate(1, 25, planner.BucketConfig(), key=("d",))
    other = autotune.Candidate(0.5, 0.5, planner.BucketConfig(bucket_cap_mb=0.5), key=("o",))
    default.samples = [100.7, 62.5, 63.9, 67.8, 77.4, 65.1, 69.1, 72.8, 73.9]  # ms, as measured
    other.samples = [56.6, 59.6, 67.6, 56.9, 70.1, 78.4, 70.9, 58.6, 65.9]
    third = autotune.Candidate(0.25, 5, planner.BucketConfig(bucket_cap_mb_list=(0.25, 5)), key=("t",))
    third.samples = [77.8, 79.5, 70.6, 83.7, 70.2, 71.7, 95.6, 72.5, 68.3]
    t = autotune.Search([default, other, third], default, cpu=True, link_gbps=None)
    t.order, t.best = [default, other, third], default  # the three trials of that run, in order
    gain = default.cost - other.cost
    assert 6.0 < gain < 7.0
    counted = t.noise(default, other)
    fixed3 = t.noise(default)  # another layout measured on TRIAL_STEPS only
    assert counted < gain < fixed3, (counted, gain, fixed3)
    assert t.final_best() is other  # taken once every trial is in
    short = autotune.Candidate(0.5, 0.5, planner.BucketConfig(bucket_cap_mb=0.5), key=("s",))
    short.samples = other.samples[:3]
    assert t.noise(default, short) > counted  # fewer steps: a larger gain needed
    assert t.noise(default, other) >= autotune.REL_NOISE * default.cost


def _compile_body(rank, world_size):
    import torch._dynamo

    from fastddp import DistributedDataParallel as DDP
    from tests.test_compile import _fresh_dynamo

    _fresh_dynamo()
    base = Stack(depth=4)
    auto = DDP(copy.deepcopy(base), bucket_cap_mb="auto")
    ref = torch_ddp_class()(copy.deepcopy(base))
    run = torch.compile(auto, backend="aot_eager")
    caps, equal = set(), []
    opts = [torch.optim.SGD(d.parameters(), lr=0.01) for d in (auto, ref)]
    for step in range(STEPS):
        x, y = _batch(rank, step)
        for fwd, o in zip((run, ref), opts):
            o.zero_grad(set_to_none=True)
            ((fwd(x) - y) ** 2).mean().backward()
        equal.append(_same(_grads(auto), _grads(ref)))
        caps.add(auto.bucket_bytes_cap)
        for o in opts:
            o.step()
    return {"equal": equal, "report": auto.stats()["autotune"], "caps": sorted(caps)}


def test_compile_aot_eager(world2):
    """torch.compile: no crash, the same gradients as torch's eager DDP at
    every step while the caps change under the compiled module."""
    for r in world2.run(_compile_body, timeout=600):
        assert all(r["equal"]), r["equal"]
        assert r["report"]["state"] == "settled", r["report"]


def test_search_is_not_pruned_by_one_misjudged_layout(monkeypatch):
    # the model (0.1 ms, 1 GB/s) predicts tiny buckets fastest; really each
    # collective costs 2 ms + 0.5 ms/MiB.  The model's pick measures 25%
    # slower than torch's default: calibrating by the median of the two gaps
    # then priced every other layout out and kept the default (59.5 ms)
    # against a best of 54.6 ms (first 0.25 / rest 5 MiB)
    t, r, truth = _drive(monkeypatch, _landscape(2e-3, 0.5e-3 / 2**20))
    rep = t.report()
    chosen = (rep["chosen"]["first_mb"], rep["chosen"]["rest_mb"])
    assert truth[chosen] <= 1.03 * min(truth.values()), (chosen, truth, rep["reason"])


@pytest.mark.parametrize("alpha, beta, base", [(2e-3, 0.5e-3 / 2**20, 0.05), (1e-3, 0.3e-3 / 2**20, 0.05),
                                               (3e-3, 1e-3 / 2**20, 0.1)])
def test_noisy_steps_are_measured_longer_and_ranked_by_their_fast_half(monkeypatch, alpha, beta, base):
    """One-sided noise, as a shared machine adds it (a third of the steps
    20-60% slower), on 24 fixed seeds: the tuner measures noisy layouts in
    more rounds (up to MAX_TRIAL_STEPS) and ranks by the faster half.
    Measured with these seeds: 4-5 of 24 runs miss the best by more than 3%,
    none by more than 9%; with 3 steps per layout, their median and the
    median-calibrated pruning: 6-21 of 24 missed, by up to 12%."""
    import random

    land = _landscape(alpha, beta, base=base)
    ratios = []
    for seed in range(24):
        rng = random.Random(seed)

        def noisy(plan, rng=rng):
            return land(plan) * (1.0 + (rng.uniform(0.2, 0.6) if rng.random() < 1 / 3 else 0.0))

        t, r, _ = _drive(monkeypatch, noisy, steps=150)
        truth = {(l.first_mb, l.rest_mb): land(r.plan_for(l.config)) for l in t.search.layouts}
        rep = t.report()
        assert rep["state"] == "settled" and "faster half" in rep["reason"], rep
        ratios.append(truth[(rep["chosen"]["first_mb"], rep["chosen"]["rest_mb"])] / min(truth.values()))
        counts = [len(l["step_ms"]) for l in rep["tried"]]
        assert all(3 <= c <= autotune.MAX_TRIAL_STEPS and c % autotune.TRIAL_STEPS == 0 for c in counts), counts
    misses = sum(x > 1.03 for x in ratios)
    assert misses <= 6 and max(ratios) <= 1.10, sorted(ratios)


def test_quiet_steps_take_three_per_layout(monkeypatch):
    t, r, truth = _drive(monkeypatch, _landscape(4e-3, 1e-3 / 2**20))
    assert {len(l["step_ms"]) for l in t.report()["tried"]} == {autotune.TRIAL_STEPS}


def test_ready_marks_are_wanted_only_while_probing(monkeypatch):
    """The reducer routes ready marks to the tuner only while
    ``wants_ready_marks`` (the probe step); a mark routed at arming that
    arrives once the probe is over (a second backward through an old
    forward) is ignored."""
    monkeypatch.setattr(autotune.Tuner, "_microbench", lambda self: (1e-4, 1e-9))
    r = _FakeReducer()
    t = autotune.Tuner(r)
    assert not t.wants_ready_marks           # waiting for torch's rebuild
    t.boundary()
    assert t.wants_ready_marks and t.report()["state"] == "probe"
    for i in r.rebuild_order:
        t.on_ready(i)
    t.on_all_issued()
    t.on_finalized()
    r.steps_reduced += 1
    t.boundary()
    assert t.report()["state"] == "trial" and not t.wants_ready_marks
    t.on_ready(0)                            # late: ignored, the trial goes on
    assert t.report()["state"] == "trial" and t.report()["model"]["backward_ms"] >= 0


def test_the_tuner_waits_while_the_bucket_mode_measures(monkeypatch):
    """auto_precision_hook's trial times steps of its own: the tuner neither
    probes nor tries a layout until it is over (one measured change at a
    time), then starts at the next step boundary."""
    monkeypatch.setattr(autotune.Tuner, "_microbench", lambda self: (1e-4, 1e-9))
    r = _FakeReducer()
    r.mode_measuring = True
    t = autotune.Tuner(r)
    for _ in range(5):
        t.boundary()
        r.steps_reduced += 1
        assert t.report()["state"] == "waiting" and not t.wants_ready_marks and r.installs == 0
    r.mode_measuring = False
    t.boundary()
    assert t.report()["state"] == "probe" and t.wants_ready_marks


def test_a_settled_tuner_tunes_again_when_the_modes_wire_changes(monkeypatch):
    """auto_precision_hook re-measured and chose another format (its
    layout_epoch moved): the layout tuned for the old wire is tuned again,
    from the probe, once; a join freezes that too."""
    tuner, r, _ = _drive(monkeypatch, lambda plan: 0.05 + 0.001 * len(plan.buckets))
    assert tuner.report()["state"] == "settled" and not tuner.active
    installs = r.installs
    r.mode_epoch = 1
    assert tuner.active and tuner.report()["state"] == "waiting"  # seen before the next boundary
    tuner.boundary()
    rep = tuner.report()
    assert rep["state"] == "probe" and rep["retunes"] == 1 and rep["settled_at_step"] is None
    r.mode_epoch = 2
    tuner.freeze("join")
    assert not tuner.active and tuner.report()["state"] == "settled" and r.installs >= installs
