"""``auto_precision_hook``: the wire format chosen from measured steps.

The decision (:mod:`fastddp.autotune.precision`) with synthetic timings, no
ranks: clear winners, ties to the precise format, noise, a link that slows
mid-run, bounded re-measures, no flapping.  Then on gloo ranks with a
synthetic clock per rank (``AutoPrecisionState(clock=...)``: the step window
advances by the format's cost at each clock read): rank agreement when the
ranks' own timings disagree, the residual across a format change, and the
composition with bucket_cap_mb="auto", no_sync, join, check_finite,
torch.compile, checkpoints and the configure()/environment form.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastddp.autotune.precision import MARGIN, PrecisionSearch, Watch, paired_interval, rotation
from tests._dist import STAND_IN, world2  # noqa: F401

pytestmark = [pytest.mark.timeout(600)]
ranks = pytest.mark.skipif(STAND_IN, reason="fastddp's auto precision")

F3 = ["fp32", "bf16", "fp8"]


# ------------------------------------------------------------ the decision
def _run_search(cost: dict, noise: float = 0.0, seed: int = 0, spikes=(), **kw) -> PrecisionSearch:
    rng = random.Random(seed)
    s = PrecisionSearch(list(cost), **kw)
    k = 0
    while not s.done:
        common = rng.uniform(1 - noise, 1 + noise)  # the machine: moves a round's steps alike
        spike = 3.0 if k in spikes else 1.0
        s.record({f: c * common * spike * rng.uniform(1 - noise / 4, 1 + noise / 4) for f, c in cost.items()})
        k += 1
    return s


def test_clear_winner_is_chosen_in_few_rounds():
    s = _run_search({"fp32": 0.100, "bf16": 0.070, "fp8": 0.050}, noise=0.05)
    assert s.pick() == "fp8"
    assert s.rounds == s.min_rounds  # decided as soon as allowed


def test_middle_format_wins_when_the_lowest_does_not_pay():
    s = _run_search({"fp32": 0.100, "bf16": 0.080, "fp8": 0.081}, noise=0.02)
    assert s.pick() == "bf16"


def test_ties_go_to_the_precise_format():
    for seed in range(10):
        s = _run_search({"fp32": 0.100, "bf16": 0.100, "fp8": 0.100}, noise=0.10, seed=seed)
        assert s.pick() == "fp32", s.explain()


def test_a_gain_below_the_margin_keeps_the_precise_format():
    s = _run_search({"fp32": 0.100, "bf16": 0.100 * (1 - MARGIN / 2)}, noise=0.0)
    assert s.pick() == "fp32"
    assert s.rounds == s.min_rounds  # without noise it is decided: not faster by the margin


def test_noise_that_cannot_separate_measures_to_the_limit_then_keeps_precision():
    runs = [_run_search({"fp32": 0.100, "fp8": 0.0995}, noise=0.30, seed=seed) for seed in range(20)]
    assert sum(s.pick() != "fp32" for s in runs) <= 1  # a 0.5% gain is below the margin: precision stays
    assert sum(s.rounds == s.max_rounds for s in runs) >= 5  # where the interval straddles it, measure more


def test_a_large_gain_hidden_by_noise_doubles_the_trial_once():
    from fastddp.autotune.precision import PROMISING

    runs = [_run_search({"fp32": 1.0, "fp8": 0.85}, noise=1.2, seed=seed) for seed in range(40)]
    extended = [s for s in runs if s.rounds > s.max_rounds]
    assert extended and all(s.rounds <= 2 * s.max_rounds for s in runs)
    within = sum(s.pick() == "fp8" and s.rounds <= s.max_rounds for s in runs)
    assert sum(s.pick() == "fp8" for s in runs) >= within + 5  # what the extra rounds found
    assert all(s.rounds > s.max_rounds or s.walk()[2][0]["verdict"] != "undecided"
               or s.walk()[2][0]["ratio"] >= PROMISING for s in runs if s.rounds >= s.max_rounds)
    ties = [_run_search({"fp32": 1.0, "fp8": 1.0}, noise=0.3, seed=seed) for seed in range(20)]
    assert sum(s.rounds > s.max_rounds for s in ties) <= 2  # no gain in sight: no extra rounds


def test_disturbed_rounds_do_not_move_the_verdict():
    s = _run_search({"fp32": 0.100, "bf16": 0.080}, noise=0.02, spikes=(1,), min_rounds=5)
    assert s.pick() == "bf16"


def test_paired_interval_cancels_what_moves_a_round():
    base = [0.1, 0.2, 0.4, 0.8]  # the machine's speed changes 8x across rounds
    est, lo, hi = paired_interval(base, [0.9 * b for b in base])
    assert math.isclose(math.exp(est), 0.9) and math.isclose(math.exp(lo), 0.9) and math.isclose(math.exp(hi), 0.9)
    with pytest.raises(ValueError, match="paired"):
        paired_interval([1.0], [1.0, 2.0])


def test_rounds_with_a_missing_sample_are_dropped():
    s = PrecisionSearch(F3)
    assert not s.record({"fp32": 0.1, "bf16": math.inf, "fp8": 0.1})
    assert not s.record({"fp32": 0.1, "bf16": 0.1})
    assert s.rounds == 0 and s.dropped == 2


def test_rotation_changes_who_runs_first():
    assert [rotation(F3, r)[0] for r in range(3)] == F3


def test_search_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_rounds"):
        PrecisionSearch(F3, min_rounds=4, max_rounds=2)
    with pytest.raises(ValueError, match="no formats"):
        PrecisionSearch([])


def _feed(w: Watch, values) -> list[int]:
    return [i for i, v in enumerate(values) if w.feed(v)]


def test_watch_triggers_on_a_link_that_slows_and_stays_slow():
    w = Watch(baseline_windows=2, sustain=2)
    rng = random.Random(1)
    fired = _feed(w, [0.1 * rng.uniform(0.97, 1.03) for _ in range(10)] + [0.3] * 4)
    assert fired == [11]  # the second slow window in a row


def test_watch_ignores_noise_and_single_spikes():
    w = Watch(baseline_windows=2, sustain=2)
    rng = random.Random(2)
    vals = [0.1 * rng.uniform(0.95, 1.05) for _ in range(60)]
    vals[20] = vals[40] = 0.5  # a neighbour's burst: one window each
    assert _feed(w, vals) == []


def test_watch_is_bounded_and_waits_longer_after_each_remeasure():
    w = Watch(baseline_windows=1, sustain=1, max_remeasures=3)
    fired = []
    for k in range(400):  # a link that flips between two rates every 20 windows
        v = 0.1 if (k // 20) % 2 == 0 else 0.3
        if w.feed(v):
            fired.append(k)
            w.restart()
    assert len(fired) == 3 and w.exhausted
    assert w.want == 8  # baseline windows doubled per re-measure


def test_watch_does_not_flap_on_a_link_that_flips_fast():
    w = Watch(baseline_windows=1, sustain=1, max_remeasures=10)
    fired = [k for k in range(200) if w.feed(0.1 if (k // 3) % 2 == 0 else 0.3)]
    assert len(fired) <= 3  # the longer baselines see both rates: their spread is the noise


def test_watch_rejects_bad_settings():
    with pytest.raises(ValueError, match="sustain"):
        Watch(sustain=0)


# -------------------------------------------------------------- bad states
def test_bad_states_give_clear_errors():
    from fastddp.hooks import AutoPrecisionState

    with pytest.raises(ValueError, match="lowest='fp4'.*fp32, bf16, fp8"):
        AutoPrecisionState(lowest="fp4")
    with pytest.raises(ValueError, match="max_rounds=2 is below min_rounds=3"):
        AutoPrecisionState(max_rounds=2, min_rounds=3)
    with pytest.raises(ValueError, match="watch_steps=0"):
        AutoPrecisionState(watch_steps=0)
    with pytest.raises(TypeError, match="clock must be None or a callable"):
        AutoPrecisionState(clock=3)
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        AutoPrecisionState(error_feedback="yes")
    with pytest.raises(ValueError, match="block_size"):
        AutoPrecisionState(block_size=100)
    with pytest.raises(TypeError, match="tune_buckets must be True or False"):
        AutoPrecisionState(tune_buckets="auto")


def test_configure_and_environment_reject_unknown_precisions(monkeypatch):
    import fastddp
    from fastddp import settings

    with pytest.raises(ValueError, match=r"configure\(auto_precision=...\)='fp4'"):
        fastddp.configure(auto_precision="fp4")
    monkeypatch.setenv("FASTDDP_AUTO_PRECISION", "half")
    with pytest.raises(ValueError, match="FASTDDP_AUTO_PRECISION='half'"):
        settings.reload()
    monkeypatch.setenv("FASTDDP_AUTO_PRECISION", " FP8 ")
    assert settings.reload().auto_precision == "fp8"
    monkeypatch.setenv("FASTDDP_AUTO_PRECISION", "off")
    assert settings.reload().auto_precision is None


def test_wrong_state_type_is_refused():
    import fastddp.hooks as fh
    from tests._dist import single_rank_group

    from fastddp import DistributedDataParallel as F

    with single_rank_group():
        m = F(torch.nn.Linear(4, 4))
        with pytest.raises(TypeError, match="auto_precision_hook takes an AutoPrecisionState"):
            m.register_comm_hook(fh.CompressionState(), fh.auto_precision_hook)


# ------------------------------------------------------------------ ranks
class SyntheticClock:
    """A rank's clock: each read returns the time, then advances it by the
    format's cost (a step's window spans one read per unpacked bucket)."""

    def __init__(self, cost: dict):
        self.cost, self.t = dict(cost), 0.0

    def __call__(self, fmt: str) -> float:
        t = self.t
        self.t += self.cost[fmt]
        return t


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
                               torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def _ddp(state, **opts):
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(_net(), bucket_cap_mb=0.05, **opts)
    m.register_comm_hook(state, fh.auto_precision_hook)
    return m


def _train(m, steps, rank, *, sync=lambda k: True, run=None, opt=None):
    """Trains ``steps`` synchronising steps; returns the format of each."""
    opt = opt or torch.optim.SGD(m.parameters(), lr=0.01)
    run = m if run is None else run
    seen = []
    for k in range(steps):
        g = torch.Generator().manual_seed(1000 * k + rank)
        x = torch.randn(16, 64, generator=g)
        if not sync(k):
            with m.no_sync():
                run(x).square().mean().backward()
        run(x).square().mean().backward()
        seen.append(m.stats().get("auto_precision", {}).get("current"))
        opt.step()
        opt.zero_grad()
    return seen


def _agreement(rank, world):
    import fastddp.hooks as fh

    costs = [{"fp32": 1.0, "bf16": 0.80, "fp8": 0.90}, {"fp32": 1.0, "bf16": 0.95, "fp8": 0.60}][rank]
    m = _ddp(fh.AutoPrecisionState(lowest="fp8", clock=SyntheticClock(costs)))
    seen = _train(m, 40, rank)
    st = m.stats()["auto_precision"]
    return seen, st, [p.detach().clone() for p in m.parameters()]


@ranks
def test_ranks_agree_on_one_decision_from_their_max(world2):
    (s0, st0, p0), (s1, st1, p1) = world2.run(_agreement)
    # alone, rank 0 would keep bf16 and rank 1 take fp8; MAX: fp32 1.0, bf16 0.95, fp8 0.90 -> fp8
    assert s0 == s1, "the ranks reduced in different formats at some step"
    assert st0["chosen"] == st1["chosen"] == "fp8"
    assert st0["settled_at_step"] == st1["settled_at_step"]
    d = st0["decisions"][0]  # each decision says what its trial cost
    assert d["trial_from_step"] + d["trial_steps"] == st0["settled_at_step"] and d["trial_steps"] == st0["trial_steps"]
    assert st0["decisions"][0]["costs_ms"] == st1["decisions"][0]["costs_ms"]
    assert s0[-1] == "fp8" and set(s0) == {"fp32", "bf16", "fp8"}
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


def _residual_across_changes(rank, world):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="fp8", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.9, "fp8": 0.5})))
    auto = m.reducer.mode
    bf16, fp8 = auto.candidate("bf16"), auto.candidate("fp8")
    after_bf16, at_fp8 = {}, []
    real_unpack, real_pack = bf16.unpack, fp8.pack

    def unpack(ctx, bucket, result, track):
        real_unpack(ctx, bucket, result, track)
        after_bf16[bucket.index] = bf16.residual_of(bucket.index).clone()

    def pack(ctx, bucket, grads):
        res = fp8.residual_of(bucket.index)
        at_fp8.append((ctx.iteration, bucket.index, None if res is None else res.clone(), dict(after_bf16),
                       list(auto.residuals.events)))
        real_pack(ctx, bucket, grads)

    bf16.unpack, fp8.pack = unpack, pack
    _train(m, 30, rank)
    exempt = {b.index: [k for k, p in enumerate(b.params) if p.dim() <= 1] for b in m.reducer.buckets}
    numel = {b.index: b.flat.numel() for b in m.reducer.buckets}
    views = {b.index: b.layout for b in m.reducer.buckets}
    return at_fp8, exempt, numel, views, m.stats()["auto_precision"]["residual"]


@ranks
def test_residual_is_carried_bf16_to_fp8_and_reset_by_fp32(world2):
    at_fp8, exempt, numel, layouts, events = world2.run(_residual_across_changes)[0]
    assert any("carried" in e and "bf16 -> fp8" in e for e in events), events
    assert any("dropped" in e and "-> fp32" in e for e in events), events
    checked = 0
    for it, b, res, bf16_after, ev in at_fp8:
        if not ev or res is None:
            continue
        last = ev[-1]
        if last.startswith(f"step {it}: carried") and "bf16 -> fp8" in last and b in bf16_after:
            n = numel[b]
            want = bf16_after[b].clone()
            views = layouts[b].views(want)
            for k in exempt[b]:
                views[k].zero_()
            assert torch.equal(res[:n], want), f"bucket {b}: fp8 did not start from bf16's residual"
            assert not res[n:].any()
            checked += 1
    assert checked > 0


def _residual_memory(rank, world):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="fp8", clock=SyntheticClock({"fp32": 1.0, "bf16": 1.0, "fp8": 1.0})))
    auto = m.reducer.mode
    seen, packs = [], [0]  # every residual a compressed format packed with, kept alive (no address reuse)
    for name in ("bf16", "fp8"):
        mode = auto.candidate(name)
        real = mode.pack

        def pack(ctx, bucket, grads, mode=mode, real=real):
            real(ctx, bucket, grads)
            seen.append(mode.residual_of(bucket.index))
            packs[0] += 1

        mode.pack = pack
    _train(m, 30, rank)
    return len({t.untyped_storage().data_ptr() for t in seen}), packs[0], len(m.reducer.buckets)


@ranks
def test_format_changes_in_the_trial_reuse_residual_memory(world2):
    """The trial changes format at every step: the residuals move (or their
    memory is zeroed and reused), never allocated afresh per change (on the
    CPU a fresh 100 MB residual cost ~60-90 ms, a bias against every
    compressed format in the trial)."""
    storages, packs, buckets = world2.run(_residual_memory)[0]
    assert packs >= 10 * buckets  # the trial ran (ties: to its last round)
    assert storages <= 3 * buckets, (storages, packs, buckets)


def _in_backward() -> bool:
    """A bucket of a backward is being packed or issued further up this stack."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name in ("_bucket_complete", "_finalize"):
            return True
        f = f.f_back
    return False


def _slowing_link(rank, world):
    import torch.distributed as dist

    import fastddp.hooks as fh
    from fastddp import groups

    clock = SyntheticClock({"fp32": 1.0, "bf16": 2.0, "fp8": 3.0})  # a fast link: fp32
    m = _ddp(fh.AutoPrecisionState(lowest="fp8", clock=clock))
    calls, real = [], groups.all_reduce

    def all_reduce(t, pg, op=dist.ReduceOp.SUM, async_op=False):
        if op == dist.ReduceOp.MAX:  # the mode's decisions (the buckets' are SUMs)
            calls.append((m.reducer.mode.phase.value, async_op, _in_backward()))
        return real(t, pg, op, async_op=async_op)

    groups.all_reduce = all_reduce
    try:
        seen = _train(m, 40, rank)
        settled = m.stats()["auto_precision"]["settled_at_step"]
        clock.cost.update({"fp32": 8.0, "bf16": 5.0, "fp8": 2.0})  # the link slows 8x and stays slow
        seen += _train(m, 60, rank)
    finally:
        groups.all_reduce = real
    return seen, settled, m.stats()["auto_precision"], calls


@ranks
def test_a_link_that_slows_is_re_measured_and_the_watch_never_waits(world2):
    """The watch (settled) MAX-reduces each window without waiting, reads
    it at the next iteration, and re-measures when the link slows: on every
    rank at the same step, to the format the new link favours."""
    (s0, settled, st0, calls0), (s1, _, st1, _) = world2.run(_slowing_link)
    assert s0 == s1, "the ranks reduced in different formats at some step"
    assert s0[settled + 1] == "fp32" and s0[-1] == "fp8"
    d = st0["decisions"]
    assert [x["chosen"] for x in d] == ["fp32", "fp8"] and d[1]["trigger"].startswith("re-measure 1")
    assert d == st1["decisions"]
    assert d[1]["trial_from_step"] - 40 <= 5 * 4 + 2, "the re-measure came later than its windows allow"
    watch = [a for phase, a, _ in calls0 if phase == "settled"]
    assert watch and all(watch), f"a settled window was all-reduced and waited for mid-backward: {calls0}"
    assert not any(a for phase, a, _ in calls0 if phase == "trial")  # the trial's rounds: one wait each
    # every decision at the forward boundary, where the bucket tuner decides: none inside a backward
    assert not any(inside for _, _, inside in calls0), calls0


def _with_autocap(rank, world, caps):
    """Trains with the auto setting over ``caps`` ("auto": bucket_cap_mb="auto";
    "default": nothing given, which the setting tunes; "fixed": a cap the user
    set; "off": the default caps and ``tune_buckets=False``); per step the
    format, the bucket tuner's state and the watch's last window."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    m = F(_net(), **({"bucket_cap_mb": "auto"} if caps == "auto" else
                     {"bucket_cap_mb": 0.05} if caps == "fixed" else {}))
    m.register_comm_hook(fh.AutoPrecisionState(lowest="fp8", tune_buckets=caps != "off", clock=SyntheticClock(
        {"fp32": 1.0, "bf16": 0.7, "fp8": 0.4})), fh.auto_precision_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    seen = []
    for k in range(80):
        seen += _train(m, 1, rank + 2 * k, opt=opt)
        st = m.stats()
        seen[-1] = (seen[-1], st.get("autotune", {}).get("state"),
                    (st["auto_precision"]["watch"] or {}).get("last_window_ms"))
    st = m.stats()
    return seen, st["auto_precision"], st.get("autotune")


@ranks
@pytest.mark.parametrize("caps", ["auto", "default"])
def test_precision_first_then_the_buckets_for_the_chosen_format(world2, caps):
    """The format is chosen on torch's default layout, then the bucket tuner
    (asked for, or turned on where the caps are torch's default) tunes the
    layout for it; the watch takes no window while layouts are tried."""
    (s0, ap0, tune0), (s1, ap1, tune1) = world2.run(_with_autocap, caps)
    assert s0 == s1 and ap0["decisions"] == ap1["decisions"]
    assert ap0["chosen"] == "fp8" and tune0["state"] == "settled"
    tuner = [t for _, t, _ in s0]
    started = next(k for k, t in enumerate(tuner) if t != "waiting")  # step k is iteration k + 1
    assert started + 1 >= ap0["settled_at_step"], "the bucket tuner tried layouts during the precision trial"
    assert {f for f, _, _ in s0[started:]} == {"fp8"}, "the layout was tuned for another format"
    assert all(w is None for _, t, w in s0 if t != "settled"), "the watch read a window while layouts changed"
    assert s0[-1][2] is not None, "the watch did not start again once the layout settled"


def _retune(rank, world):
    """Default caps: the format, then its layout; then the link slows, the
    watch re-measures, another format wins, and its layout is tuned again."""
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    clock = SyntheticClock({"fp32": 1.0, "bf16": 2.0, "fp8": 3.0})  # a fast link: fp32
    m = F(_net())
    m.register_comm_hook(fh.AutoPrecisionState(lowest="fp8", clock=clock), fh.auto_precision_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    states, k = [], 0
    while k < 120 and (m.stats()["autotune"]["state"] != "settled"
                       or m.stats()["auto_precision"]["watch"]["baseline_ms"] is None):
        _train(m, 1, rank + 2 * k, opt=opt)  # the format, its layout, then the watch's baseline
        k += 1
    clock.cost.update({"fp32": 8.0, "bf16": 5.0, "fp8": 2.0})  # the link slows 8x and stays slow
    for j in range(100):
        _train(m, 1, rank + 2 * (k + j), opt=opt)
        st = m.stats()
        states.append((st["auto_precision"]["current"], st["autotune"]["state"], st["autotune"]["retunes"]))
    st = m.stats()
    return states, st["auto_precision"]["decisions"], st["autotune"]


@ranks
def test_a_new_format_after_a_re_measure_gets_its_layout_tuned_again(world2):
    (s0, d0, t0), (s1, d1, _) = world2.run(_retune)
    assert s0 == s1 and d0 == d1
    assert [x["chosen"] for x in d0] == ["fp32", "fp8"]
    assert t0["retunes"] == 1 and t0["state"] == "settled", t0["reason"]
    first = next(k for k, (_, _, n) in enumerate(s0) if n == 1)
    assert s0[first][0] == "fp8"  # tuned again from the step fp8 took over
    assert all(f == "fp8" for f, t, _ in s0[first:]), "the layout was tuned again for another format"


@ranks
@pytest.mark.parametrize("caps", ["fixed", "off"])
def test_caps_the_user_set_or_tune_buckets_false_are_kept(world2, caps):
    (s0, ap0, tune0), _ = world2.run(_with_autocap, caps)
    assert tune0 is None and ap0["chosen"] == "fp8"
    assert s0[-1][2] is not None  # the watch runs from the choice on


def _no_sync(rank, world, accumulate):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
    _train(m, 25, rank, sync=(lambda k: k % 2 == 0) if accumulate else (lambda k: True))
    return m.stats()["auto_precision"]


@ranks
def test_no_sync_micro_batches_are_not_samples(world2):
    plain = world2.run(_no_sync, False)[0]
    accum = world2.run(_no_sync, True)[0]
    assert plain["chosen"] == accum["chosen"] == "bf16"
    assert plain["settled_at_step"] == accum["settled_at_step"]  # counted in synchronising steps
    assert plain["decisions"][0]["costs_ms"] == accum["decisions"][0]["costs_ms"]


def _join(rank, world, settle_first):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    if settle_first:
        _train(m, 20, rank, opt=opt)
    with m.join():
        for k in range(6 + 3 * rank):  # uneven inputs
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(k))
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return m.stats()["auto_precision"], [p.detach().clone() for p in m.parameters()]


@ranks
@pytest.mark.parametrize("settle_first", [True, False])
def test_join_freezes_the_choice(world2, settle_first):
    (a, p0), (b, p1) = world2.run(_join, settle_first)
    assert a["state"] == b["state"] == "frozen"
    assert a["chosen"] == b["chosen"] == ("bf16" if settle_first else "fp32")
    for x, y in zip(p0, p1):
        assert torch.equal(x, y)


def _check_finite(rank, world):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="fp8", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.9, "fp8": 0.5})),
             check_finite="raise")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    raised = 0
    for k in range(40):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(k))
        if k in (4, 9, 15) and rank == 0:
            x[0, 0] = float("nan")
        try:
            m(x).square().mean().backward()
        except FloatingPointError as e:
            assert "non-finite" in str(e)
            raised += 1
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return raised, m.stats()["auto_precision"]


@ranks
def test_check_finite_errors_are_not_samples(world2):
    (r0, a), (r1, b) = world2.run(_check_finite)
    assert r0 == r1 == 3
    assert a["chosen"] == b["chosen"] == "fp8"
    assert a["settled_at_step"] == b["settled_at_step"]


def _compiled(rank, world):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
    run = torch.compile(m, backend="aot_eager")
    seen = _train(m, 20, rank, run=run)
    return seen, [p.detach().clone() for p in m.parameters()]


@ranks
def test_torch_compile(world2):
    (s0, p0), (s1, p1) = world2.run(_compiled)
    assert s0 == s1 and s0[-1] == "bf16"
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


def _checkpoint(rank, world):
    import fastddp.hooks as fh

    m = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
    _train(m, 20, rank)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = _ddp(fh.AutoPrecisionState(lowest="bf16", clock=SyntheticClock({"fp32": 1.0, "bf16": 0.5})))
    m2.load_state_dict(sd)
    fresh = m2.stats()["auto_precision"]["state"]
    _train(m2, 20, rank)
    same = all(torch.equal(a, b) for a, b in zip(m.module.state_dict().values(), sd.values()))
    return sorted(sd) == sorted(m.module.state_dict() if False else m.state_dict()), same, fresh, \
        m2.stats()["auto_precision"]["chosen"]


@ranks
def test_checkpoint_holds_only_the_model_and_a_resumed_run_measures_again(world2):
    keys_ok, same, fresh, chosen = world2.run(_checkpoint)[0]
    assert keys_ok and same
    assert fresh == "waiting" and chosen == "bf16"


def _configured(rank, world, explicit_hook):
    import fastddp
    import fastddp.hooks as fh
    from fastddp import DistributedDataParallel as F

    fastddp.configure(auto_precision="fp8")
    try:
        m = F(_net())
        if explicit_hook:
            m.register_comm_hook(None, fh.bf16_fp32acc_hook)
        _train(m, 3, rank)
        st = m.stats()
        return st["fused_path"][0], st.get("auto_precision", {}).get("candidates"), "autotune" in st
    finally:
        fastddp.configure(auto_precision=None)


@ranks
def test_configure_form_and_a_user_hook_replacing_it(world2):
    kind, cands, tunes = world2.run(_configured, False)[0]
    assert kind == "auto-precision" and cands == ["fp32", "bf16", "fp8"]
    assert tunes  # torch's default caps: tuned after the format, as with the hook
    kind, cands, tunes = world2.run(_configured, True)[0]
    assert kind == "fp32acc" and cands is None
    assert not tunes  # the user's hook replaced the setting, and its bucket tuning with it
