"""The main job's statistics on synthetic step times with known answers.

Pure functions of bench/stats.py, bench/stoprule.py and bench/report.py, no processes: paired
comparison by round, its bootstrap intervals, the verdicts, Student t over
repeated runs, the stop rule, the slowest-rank merge, and the text built
from them.  Each scenario is built so that a wrong
statistic gives a wrong verdict and fails here."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from fastddp.bench import report as R
from fastddp.bench import export as E
from fastddp.bench import stats as S
from fastddp.bench import stoprule as SR


# -- synthetic rounds ------------------------------------------------------------

def rounds(n, bases, *, seed=0, shared_sd=0.15, own_sd=0.01, spikes=0.0, spike_alpha=1.2):
    """Step times of several wrappers over ``n`` rounds: ``bases[w]`` ms times
    the round's shared slowdown (the machine: lognormal, ``shared_sd``, the
    same for every wrapper in the round) times the step's own noise
    (lognormal ``own_sd``); with ``spikes`` > 0 that fraction of steps is
    also hit by a heavy-tailed disturbance (x (1 + Pareto(alpha)), mean
    infinite for alpha <= 1, huge variance for alpha < 2)."""
    rng = np.random.default_rng(seed)
    shared = np.exp(rng.normal(0, shared_sd, n))
    out = {}
    for w, base in bases.items():
        own = np.exp(rng.normal(0, own_sd, n))
        hit = rng.random(n) < spikes
        spike = np.where(hit, 1.0 + rng.pareto(spike_alpha, n), 1.0)
        out[w] = list(base * shared * own * spike)
    return out


def row(model, wrapper, steps, family=None, baselines=(), status="ok", **kw):
    family = family or ("local" if wrapper == "local" else wrapper.split("-")[0])
    return R.Row(model, wrapper, status=status, family=family, baselines=list(baselines),
                 step_ms=list(steps), exposed_ms=[0.5] * len(steps), **kw)


# -- building blocks ---------------------------------------------------------------

def test_trimmed_mean():
    assert S.trimmed_mean([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000]) == pytest.approx(5.5)  # 2 cut each side
    assert S.trimmed_mean([3.0]) == 3.0 and S.trimmed_mean([1.0, 5.0]) == 3.0
    with pytest.raises(ValueError):
        S.trimmed_mean([])


@pytest.mark.parametrize("n", [5, 7, 20, 63, 300])
def test_resampler_trimmed_means_equal_the_direct_computation(n):
    """The count-weighted trick gives, per resample, exactly the trimmed mean
    of the resampled rounds (drawn from the same generator)."""
    import torch

    x = list(np.random.default_rng(n).standard_cauchy(n))
    rs = S.Resampler(n, resamples=200, seed=3)
    fast = rs.trimmed_means(x)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, n, (200, n), generator=gen)
    direct = [S.trimmed_mean([x[i] for i in row_]) for row_ in idx.tolist()]
    assert fast.tolist() == pytest.approx(direct, rel=1e-9, abs=1e-9)
    with pytest.raises(ValueError, match="over 5 rounds got 4"):
        S.Resampler(5).trimmed_means([1.0] * 4)


@pytest.mark.parametrize("ci, verdict", [
    ((0.98, 1.02), "equal"), ((0.975, 0.995), "equal"),          # inside ±3%: equal even if below 1
    ((0.90, 0.96), "faster"), ((0.96, 0.99), "faster"),           # not inside the band, all below 1
    ((1.01, 1.05), "slower"), ((0.96, 1.02), "undecided"), ((0.5, 2.0), "undecided"),
    (None, "undecided"),
])
def test_decide(ci, verdict):
    assert S.decide(ci, 0.03) == verdict


def test_merge_ranks_takes_the_slowest_rank_and_the_mean_cpu():
    merged = S.merge_ranks([[(10.0, 1.0, 4.0), (20.0, -1.0, 8.0)],
                            [(12.0, 0.5, 6.0), (19.0, -1.0, 6.0)]])
    assert merged == [(12.0, 1.0, 5.0), (20.0, -1.0, 7.0)]
    with pytest.raises(ValueError, match="different numbers of wrappers"):
        S.merge_ranks([[(1.0, 0.0, 0.0)], []])


# -- verdicts with known answers ----------------------------------------------------

N = 200


def _cmp(data, a="fastddp", b="torch", **kw):
    return S.compare(data[a], data[b], data.get("local"), **kw)


def test_equal_wrappers_are_equal():
    data = rounds(N, {"local": 60.0, "fastddp": 100.0, "torch": 100.0}, seed=1)
    c = _cmp(data)
    assert c.verdict == "equal", c
    lo, hi = c.ratio_ci
    assert lo < 1.0 < hi and c.half_width < 0.03
    assert c.diff_ci[0] < 0 < c.diff_ci[1]
    # the overhead ratio: both 40 ms over local
    assert c.overhead_ratio == pytest.approx(1.0, abs=0.03)


def test_five_percent_faster_is_faster_with_the_truth_inside():
    data = rounds(N, {"local": 60.0, "fastddp": 95.0, "torch": 100.0}, seed=2)
    c = _cmp(data)
    assert c.verdict == "faster", c
    assert c.ratio_ci[0] < 0.95 < c.ratio_ci[1] and c.ratio == pytest.approx(0.95, abs=0.01)
    assert c.diff_ci[1] < 0 and -6.0 < c.diff_ms < -4.0
    assert c.overhead_ratio == pytest.approx(35 / 40, abs=0.05)
    # and the other way round
    back = S.compare(data["torch"], data["fastddp"])
    assert back.verdict == "slower" and back.ratio == pytest.approx(1 / 0.95, abs=0.012)


def test_pairing_removes_the_shared_round_noise():
    """The machine's noise (±30% per round) dwarfs a 5% difference; paired
    by round it cancels.  The same samples with the rounds of one wrapper
    shuffled (pairing broken) decide nothing."""
    data = rounds(120, {"fastddp": 95.0, "torch": 100.0}, seed=4, shared_sd=0.3)
    assert _cmp(data).verdict == "faster"
    shuffled = list(np.random.default_rng(0).permutation(data["fastddp"]))
    broken = S.compare(shuffled, data["torch"])
    assert broken.verdict == "undecided" and broken.half_width > 0.05, broken


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_heavy_tailed_noise_does_not_fool_the_verdict(seed):
    """10% of steps hit by Pareto(1.2) disturbances (a step 2x, 10x, 100x
    slower now and then, independently per wrapper): the trimmed statistic
    still finds 5% faster and still finds equal; the plain mean ratio is off."""
    fast = rounds(N, {"fastddp": 95.0, "torch": 100.0}, seed=seed, spikes=0.10)
    c = _cmp(fast)
    assert c.verdict == "faster" and c.ratio_ci[0] < 0.95 < c.ratio_ci[1], c
    same = rounds(N, {"fastddp": 100.0, "torch": 100.0}, seed=seed + 100, spikes=0.10)
    e = _cmp(same)
    assert e.verdict in ("equal", "undecided") and e.ratio_ci[0] < 1.0 < e.ratio_ci[1], e
    naive = [float(np.mean(d["fastddp"]) / np.mean(d["torch"])) for d in (fast, same)]
    assert abs(naive[0] - 0.95) > 0.03 or abs(naive[1] - 1.0) > 0.03, naive  # the scenario is hard


def test_a_slow_rank_decides_the_round():
    """Rank 0 sees fastddp 5% faster; rank 1 is 10% slower than torch in
    fastddp's steps.  A round is as slow as its slowest rank: slower."""
    base = rounds(N, {"f0": 95.0, "t0": 100.0, "f1": 110.0, "t1": 100.0}, seed=8)
    per_round = []
    for i in range(N):
        per_rank = [[(base["f0"][i], -1.0, 1.0), (base["t0"][i], -1.0, 1.0)],
                    [(base["f1"][i], -1.0, 1.0), (base["t1"][i], -1.0, 1.0)]]
        per_round.append(S.merge_ranks(per_rank))
    fastddp = [r[0][0] for r in per_round]
    torch_ = [r[1][0] for r in per_round]
    c = S.compare(fastddp, torch_)
    assert c.verdict == "slower" and c.ratio == pytest.approx(1.10, abs=0.02), c
    assert S.compare(base["f0"], base["t0"]).verdict == "faster"  # rank 0 alone would say the opposite


def test_too_few_rounds_decide_nothing():
    data = rounds(4, {"fastddp": 50.0, "torch": 100.0}, seed=9)
    c = _cmp(data)
    assert c.ratio == pytest.approx(0.5, abs=0.02) and c.ratio_ci is None and c.verdict == "undecided"


def test_compare_rejects_bad_samples():
    with pytest.raises(ValueError, match="no rounds"):
        S.compare([], [1.0])
    with pytest.raises(ValueError, match="> 0 ms"):
        S.compare([1.0, 0.0], [1.0, 1.0])


# -- overhead ratio: only where it means something -----------------------------------------

def test_overhead_ratio_needs_a_clearly_positive_peer_overhead():
    # torch adds nothing measurable over local: no overhead ratio, however the point falls
    data = rounds(N, {"local": 100.0, "torch": 100.0, "fastddp": 102.0}, seed=10, own_sd=0.02)
    c = _cmp(data)
    assert c.overhead_ratio is None and c.overhead_ratio_ci is None
    # fastddp faster than local (noise) against a clear torch overhead: clipped at 0, never negative
    data = rounds(N, {"local": 100.0, "torch": 110.0, "fastddp": 99.5}, seed=11)
    c = _cmp(data)
    assert c.overhead_ratio == 0.0 and c.overhead_ratio_ci[0] >= 0.0, c


def test_derive_overheads_and_the_best_peer():
    data = rounds(60, {"local": 50.0, "torch": 80.0, "replicate": 70.0, "fastddp": 72.0}, seed=12)
    rows = [row("m", "local", data["local"]), row("m", "torch", data["torch"]),
            row("m", "replicate", data["replicate"], family="replicate"),
            row("m", "fastddp", data["fastddp"], baselines=("torch", "replicate"))]
    s = R.derive(R.Section(None, rows))
    by = {r.wrapper: r for r in s.rows}
    assert by["local"].overhead_ms == 0.0
    assert by["torch"].overhead_ms == pytest.approx(30.0, rel=0.05)
    lo, hi = by["torch"].overhead_ci
    assert lo < by["torch"].overhead_ms < hi
    # both peers compared; the best (fastest) peer first, and it is the row's headline
    assert [(c.peer, c.best) for c in s.comparisons] == [("replicate", True), ("torch", False)]
    assert by["fastddp"].ratio_baseline == "replicate"
    assert by["fastddp"].ratio == pytest.approx(72 / 70, abs=0.01)
    assert {c.peer: c.verdict for c in s.comparisons}["torch"] == "faster"
    cells = R.comparison_table(s)
    assert [c[2] for c in cells] == ["*replicate", "torch"]  # * marks the best of several peers


def test_pairs_skip_missing_and_failed_peers():
    rows = [row("m", "torch", [10.0] * 6), row("m", "torch-view", [], status="failed: boom"),
            row("m", "fastddp", [9.0] * 6, baselines=("torch", "replicate")),
            row("m", "fastddp-view", [9.0] * 6, baselines=("torch-view",)),
            row("m", "comm-floor", [8.0] * 6, family="floor", baselines=("torch",))]
    assert [(a.wrapper, b.wrapper) for a, b in R.pairs(rows)] == [("fastddp", "torch")]


# -- the stop rule ------------------------------------------------------------------------

def _feed(data, rule, round_s=1.0):
    """Rounds one by one into rows, as the runner does; returns (reason,
    rounds, elapsed, rows)."""
    rows = [row("m", "local", []), row("m", "torch", []), row("m", "fastddp", [], baselines=("torch",))]
    stopper = SR.Stopper(rule)
    n = len(data["torch"])
    for i in range(n):
        for r in rows:
            r.step_ms.append(data[r.wrapper][i])
        elapsed = (i + 1) * round_s
        reason = stopper.update(rows, i + 1, elapsed, round_s)
        if reason:
            return reason, i + 1, elapsed, rows
    return None, n, n * round_s, rows


def test_stop_rule_precision_then_the_report_agrees():
    data = rounds(2000, {"local": 60.0, "torch": 100.0, "fastddp": 97.0}, seed=13, shared_sd=0.1, own_sd=0.03)
    reason, n, _, rows = _feed(data, SR.StopRule(half_width=0.01, budget_s=10_000))
    assert reason == "precision" and SR.MIN_ROUNDS <= n < 2000
    s = R.derive(R.Section(None, rows, half_width=0.01))
    (c,) = s.comparisons
    assert c.half_width <= 0.01 and c.rounds == n  # the report's interval is the one the rule saw
    assert c.verdict == "faster" and c.ratio_ci[0] < 0.97 < c.ratio_ci[1]


def test_precision_finer_than_the_margin_decides_equal():
    """A pair 1% slower than its peer: measured to the margin (±3%) its interval
    straddles 1 and reaches past 1.03 -- undecided, or slower one run in a few;
    measured to ±1.5% (``--precision 1.5``) with the same ±3% margin it is
    equal, and the report says which goal the rounds ran to."""
    data = rounds(4000, {"local": 60.0, "torch": 100.0, "fastddp": 101.0}, seed=21, own_sd=0.12)
    coarse = _feed(data, SR.StopRule(half_width=0.03, budget_s=10_000))
    fine = _feed(data, SR.StopRule(half_width=0.015, budget_s=10_000))
    assert coarse[0] == fine[0] == "precision" and fine[1] > 2 * coarse[1]
    c = R.derive(R.Section(None, coarse[3], half_width=0.03)).comparisons[0]
    assert c.verdict != "equal", c
    sec = R.derive(R.Section(None, fine[3], half_width=0.03, precision=0.015))
    (f,) = sec.comparisons
    assert f.verdict == "equal" and f.half_width <= 0.015 and 0.98 < f.ratio < 1.03, f
    assert sec.goal == 0.015 and R.Section(None, [], half_width=0.03).goal == 0.03
    back = R.from_json(R.to_json(R.Report({}, [sec]))).sections[0]
    assert back.precision == 0.015 and back.half_width == 0.03


def test_stop_rule_waits_for_min_rounds():
    exact = {"local": [50.0] * 100, "torch": [100.0] * 100, "fastddp": [90.0] * 100}
    reason, n, _, _ = _feed(exact, SR.StopRule())
    assert (reason, n) == ("precision", SR.MIN_ROUNDS)


def test_stop_rule_budget_when_noise_wins():
    data = rounds(500, {"local": 60.0, "torch": 100.0, "fastddp": 100.0}, seed=14, own_sd=0.5)
    reason, n, elapsed, rows = _feed(data, SR.StopRule(half_width=0.01, budget_s=60.0), round_s=1.0)
    # the next round plus the post-round work (POST_ROUNDS rounds) no longer fit 60 s
    post = 1.0 * (1 + SR.POST_ROUNDS)
    assert reason == "budget" and elapsed + post > 60.0 >= elapsed - 1.0 + post
    s = R.derive(R.Section(None, rows, half_width=0.01))
    assert s.comparisons[0].half_width > 0.01


def test_stop_rule_runs_a_few_rounds_even_over_budget():
    data = rounds(10, {"local": 1.0, "torch": 2.0, "fastddp": 2.0}, seed=15)
    reason, n, _, _ = _feed(data, SR.StopRule(budget_s=1.0), round_s=5.0)
    assert (reason, n) == ("budget", SR.MIN_TIMED_ROUNDS)


def test_unused_budget_goes_to_the_next_models():
    rule = SR.StopRule(budget_s=100.0)
    assert rule.model_budget(0, 0.0) == 100.0
    assert rule.model_budget(1, 40.0) == 160.0      # the first stopped at 40 s
    assert rule.model_budget(3, 40.0 + 160.0 + 90.0) == 110.0
    assert rule.model_budget(1, 130.0) == 70.0      # an overrun is paid back
    # the Stopper applies the model's budget, not the rule's
    data = rounds(400, {"local": 60.0, "torch": 100.0, "fastddp": 100.0}, seed=17, own_sd=0.5)
    rows = [row("m", w, data[w][:50], baselines=("torch",) if w == "fastddp" else ()) for w in data]
    stop = SR.Stopper(rule, budget_s=160.0)
    assert stop.update(rows, 50, 150.0, 1.0) is None and stop.update(rows, 51, 157.5, 1.0) == "budget"


def test_stop_rule_without_pairs_runs_to_the_budget():
    rule = SR.StopRule(budget_s=30.0)
    rows = [row("m", "local", [1.0] * 40), row("m", "torch", [2.0] * 40)]
    assert rule.widest(rows) is None
    assert SR.Stopper(rule).update(rows, 40, 10.0, 1.0) is None
    assert SR.Stopper(rule).update(rows, 40, 28.0, 1.0) == "budget"


@pytest.mark.parametrize("kw, msg", [({"half_width": 0.0}, "half-width"), ({"half_width": 1.5}, "half-width"),
                                     ({"budget_s": 0}, "budget"), ({"min_rounds": 2}, "min_rounds")])
def test_stop_rule_rejects_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SR.StopRule(**kw)


# -- what the user reads ----------------------------------------------------------------

def _wide_section(verdicts=True):
    """A worst case for the terminal: long names, second-long steps, several
    peers, a failed row with a long reason, a long note."""
    data = rounds(40, {"local": 900.0, "torch-batched": 1500.0, "replicate-bf16": 1400.0,
                       "fastddp-batched": 1450.0, "fastddp-compile": 1499.0}, seed=16)
    rows = [row("transformer", "local", data["local"], note="no DDP"),
            row("transformer", "torch-batched", data["torch-batched"],
                note="stand-in: torch 2.11 has no batched_grad_copy; DDP + builtin ALLREDUCE hook (divides by W)"),
            row("transformer", "replicate-bf16", data["replicate-bf16"], family="replicate"),
            row("transformer", "fastddp-batched", data["fastddp-batched"],
                baselines=("torch-batched", "replicate-bf16"), ops_per_step=123456, wire_bytes=10 ** 9,
                resident_bytes=5 * 2 ** 30, step_peak_bytes=2 ** 30),
            row("transformer", "fastddp-compile", data["fastddp-compile"], baselines=("torch-batched",)),
            row("transformer", "fastddp-view", [], baselines=("torch-view",),
                status="failed: RuntimeError: " + "a very long reason " * 10)]
    for r in rows:
        r.cpu_ms = [x / 2 for x in r.step_ms]
    s = R.Section(None, rows, verdicts=verdicts,
                  runs={"transformer": {"rounds": 40, "stopped": "budget", "elapsed_s": 140.2, "budget_s": 140.0}})
    return R.derive(s)


def test_terminal_and_markdown_list_the_same_comparisons():
    s = _wide_section()
    text = R.format_table(s)
    md = E.to_markdown(R.Report({}, [s]))
    term = re.findall(r"^  (fastddp-\S+)\s+(\*?\S+)\s+(\d\.\d{3})", text, re.M)
    mark = re.findall(r"^\| transformer \| (fastddp-\S+) \| (\*?\S+) \| (\d\.\d{3}) \|", md, re.M)
    cells = [tuple(c[1:4]) for c in R.comparison_table(s)]
    assert term == mark == cells and len(cells) == 3
    verdicts = [c[-1] for c in R.comparison_table(s)]
    assert all(v in ("faster", "slower", "equal ±3%", "undecided") for v in verdicts)
    for v in verdicts:
        assert v in text and v in md


def test_quick_gives_no_verdicts():
    s = _wide_section(verdicts=False)
    assert all(c.verdict is None for c in s.comparisons)
    text = R.summary_text(R.Report({}, [s]))
    assert "no verdicts" in text
    for word in ("faster", "slower", "equal ±", "undecided"):
        assert word not in text
    md = E.to_markdown(R.Report({}, [s]))
    assert "Smoke run" in md and "undecided" not in md


def test_too_few_rounds_print_no_ratio_in_the_table_the_markdown_or_the_chart(tmp_path):
    """3 rounds carry no interval: the terminal, the markdown and the charts
    say "too few rounds to compare" and print no ratio; a model with rounds
    enough beside it keeps its table."""
    few = rounds(3, {"local": 900.0, "torch": 1500.0, "fastddp": 1000.0}, seed=3)
    enough = rounds(12, {"local": 90.0, "torch": 150.0, "fastddp": 100.0}, seed=4)
    rows = [row("a", "local", few["local"]), row("a", "torch", few["torch"]),
            row("a", "fastddp", few["fastddp"], baselines=("torch",)),
            row("b", "local", enough["local"]), row("b", "torch", enough["torch"]),
            row("b", "fastddp", enough["fastddp"], baselines=("torch",))]
    for verdicts in (True, False):
        s = R.derive(R.Section(None, [dataclasses.replace(r) for r in rows], verdicts=verdicts))
        a, b = s.comparisons
        assert R.too_few(a) and not R.too_few(b)
        text = R.format_table(s)
        assert "  paired by round, fastddp / peer: too few rounds to compare (3 rounds; an interval needs 5)" in text
        assert f"{a.ratio:.3f}" not in text and f"{b.ratio:.3f}" in text
        md = E.to_markdown(R.Report({}, [s]))
        assert f"{a.ratio:.3f}" not in md and f"{b.ratio:.3f}" in md
        assert "| a | fastddp | torch | - | - | - | - | - | - | too few rounds to compare |" in md
        if verdicts:
            assert R.tally(s) == "verdicts (2 pairs, 90% intervals): 1 faster, 1 too few rounds to compare"
    only_few = R.derive(R.Section(None, [dataclasses.replace(r) for r in rows[:3]], verdicts=False))
    md = E.to_markdown(R.Report({}, [only_few]))
    assert "Too few rounds to compare (3 rounds; an interval needs 5): no ratio is given. For figures: the full " \
           "run, fastddp-bench" in md
    assert "| a | fastddp | torch |" not in md and "x peer" not in md  # no table of dashes, no legend for one
    paths = E.write_report(R.Report({"label": "few", "device": "Unit CPU", "date": "2026-01-03"}, [only_few]),
                           tmp_path)
    assert [p.name for p in paths["charts"]] == ["2026-01-03-few-step.png"]  # no ratio chart


def test_json_roundtrip_keeps_the_decision():
    s = _wide_section()
    back = R.from_json(R.to_json(R.Report({"label": "t"}, [s]))).sections[0]
    assert back.runs == s.runs and back.half_width == s.half_width and back.verdicts
    assert [(c.wrapper, c.peer, c.verdict, c.ratio_ci) for c in back.comparisons] == \
           [(c.wrapper, c.peer, c.verdict, c.ratio_ci) for c in s.comparisons]
    assert not math.isnan(back.comparisons[0].ratio)




# -- repeated runs: Student t ----------------------------------------------------------

@pytest.mark.parametrize("dof, t90, t95", [(1, 6.314, 12.706), (2, 2.920, 4.303), (3, 2.353, 3.182),
                                           (4, 2.132, 2.776), (5, 2.015, 2.571), (9, 1.833, 2.262),
                                           (10, 1.812, 2.228), (30, 1.697, 2.042), (120, 1.658, 1.980)])
def test_t_quantile_matches_the_printed_table(dof, t90, t95):
    assert S.t_quantile(0.90, dof) == pytest.approx(t90, abs=5e-4)
    assert S.t_quantile(0.95, dof) == pytest.approx(t95, abs=5e-4)


def test_t_quantile_tends_to_the_normal_and_rejects_bad_input():
    assert S.t_quantile(0.90, 100_000) == pytest.approx(1.6449, abs=1e-3)
    assert S.t_quantile(0.90, 1) == pytest.approx(math.tan(0.45 * math.pi), rel=1e-9)  # Cauchy: exact
    for level, dof in ((0.0, 3), (1.0, 3), (0.9, 0), (0.9, 2.5), (0.9, True)):
        with pytest.raises(ValueError):
            S.t_quantile(level, dof)


def test_ratio_over_runs_is_the_t_interval_of_the_log_ratios():
    ratios = [0.95, 1.01, 0.98, 1.04, 0.97]
    point, (lo, hi) = S.ratio_over_runs(ratios)
    logs = [math.log(q) for q in ratios]
    m = sum(logs) / 5
    h = 2.132 * math.sqrt(sum((x - m) ** 2 for x in logs) / 4) / math.sqrt(5)  # t(0.90, 4 dof)
    assert point == pytest.approx(math.exp(m)) and point == pytest.approx(S.geo_mean(ratios))
    assert (lo, hi) == pytest.approx((math.exp(m - h), math.exp(m + h)), rel=1e-4)
    assert S.ratio_over_runs([1.02]) == (pytest.approx(1.02), None)  # one run: no spread, no interval
    with pytest.raises(ValueError):
        S.ratio_over_runs([])
    with pytest.raises(ValueError, match="> 0"):
        S.ratio_over_runs([1.0, 0.0])


# -- placements (the row effect) ----------------------------------------------------

def test_block_ids_map_rounds_to_their_placement():
    assert S.block_ids(7, [0, 3, 5]) == [0, 0, 0, 1, 1, 2, 2]
    assert S.block_ids(4, None) is None and S.block_ids(4, []) is None
    assert S.block_ids(3, [0, 10]) == [0, 0, 0]  # a build after the last round counts for nothing
    for bad in ([1, 3], [0, 3, 3], [0, 5, 2]):
        with pytest.raises(ValueError, match="placement starts"):
            S.block_ids(6, bad)


def test_resampler_over_placements_weighs_each_round_by_its_placements_draws():
    """With unequal placements (a short last one) the per-resample totals
    differ; each resample's value is still the trimmed mean of exactly the
    rounds its drawn placements hold."""
    import torch

    n, starts = 23, [0, 10, 20]
    x = list(np.random.default_rng(4).standard_cauchy(n))
    ids = S.block_ids(n, starts)
    rs = S.Resampler(n, resamples=100, seed=5, blocks=ids)
    assert rs.blocks == 3
    got = rs.trimmed_means(x, rs.block_counts).tolist()
    for r in range(100):
        counts = rs.block_counts[r].tolist()
        drawn = [x[i] for i in range(n) for _ in range(int(counts[i]))]
        assert got[r] == pytest.approx(S.trimmed_mean(drawn), rel=1e-9, abs=1e-9)
    # every round of a placement has the same weight in every resample
    for b in range(3):
        cols = [i for i in range(n) if ids[i] == b]
        assert torch.equal(rs.block_counts[:, cols].min(1).values, rs.block_counts[:, cols].max(1).values)
    with pytest.raises(ValueError, match="placements for 22"):
        S.Resampler(n, blocks=ids[:-1])


def _placement_effect(n_blocks, per_block, offsets, seed=0, sd=0.01):
    """Log ratios: each placement shifted by its offset (the row effect), rounds noisy around it."""
    rng = np.random.default_rng(seed)
    logs = [math.log(1.0 + offsets[b]) + rng.normal(0, sd) for b in range(n_blocks) for _ in range(per_block)]
    return logs, [b * per_block for b in range(n_blocks)]


def test_a_placement_effect_widens_the_interval_past_a_false_verdict():
    """Three placements at +8%, +5%, 0%: the rounds alone decide 'slower'
    (a narrow interval around +4%); over placements the interval covers
    what another placement would give, and the verdict is undecided."""
    logs, starts = _placement_effect(3, 20, [0.08, 0.05, 0.0])
    n = len(logs)
    point = S.trimmed_mean(logs)
    rounds_only = S.interval(S.Resampler(n).trimmed_means(logs))
    placed = S.Resampler(n, blocks=S.block_ids(n, starts)).interval(logs, point)
    assert S.decide(tuple(math.exp(v) for v in rounds_only), 0.03) == "slower"
    assert S.decide(tuple(math.exp(v) for v in placed), 0.03) == "undecided"
    assert placed[0] < rounds_only[0] and placed[1] > rounds_only[1]


def test_without_a_placement_effect_the_interval_stays_decisive():
    """Placements that agree (+5% each): the interval over placements is
    no wider than a few t/z factors and the verdict stays decided; it is
    never narrower than the one over rounds (the union)."""
    logs, starts = _placement_effect(6, 10, [0.05] * 6, seed=2)
    n = len(logs)
    point = S.trimmed_mean(logs)
    rs = S.Resampler(n, blocks=S.block_ids(n, starts))
    lo, hi = rs.interval(logs, point)
    rlo, rhi = S.interval(rs.trimmed_means(logs))
    assert lo <= rlo and hi >= rhi
    assert S.decide((math.exp(lo), math.exp(hi)), 0.03) == "slower"
    assert rs.widen == pytest.approx(S.t_quantile(0.90, 5) / 1.6448536269514722 * math.sqrt(6 / 5))


def test_two_placements_are_not_enough_to_stop_or_to_resample():
    logs, starts = _placement_effect(2, 20, [0.0, 0.0])
    n = len(logs)
    assert S.Resampler(n, blocks=S.block_ids(n, starts)).blocks == 0  # rounds only
    rows = [row("m", "torch", [100.0] * n), row("m", "fastddp", [100.0 * math.exp(v) for v in logs],
                                                 baselines=("torch",))]
    rule = SR.StopRule()
    assert rule.widest(rows, starts) == math.inf  # rebuilt rows: wait for a third placement
    assert rule.widest(rows) < 0.03  # a run without rebuilds: rounds only, as before
    assert rule.widest(rows, starts + [40]) == math.inf  # a build after the last round is no placement


def test_derive_reads_the_placements_from_the_section():
    logs, starts = _placement_effect(3, 20, [0.08, 0.05, 0.0])
    n = len(logs)
    rows = [row("m", "local", [50.0] * n), row("m", "torch", [100.0] * n),
            row("m", "fastddp", [100.0 * math.exp(v) for v in logs], baselines=("torch",))]
    plain = R.derive(R.Section(None, [dataclasses.replace(r) for r in rows]))
    placed = R.derive(R.Section(None, [dataclasses.replace(r) for r in rows],
                                runs={"m": {"rounds": n, "placements": starts}}))
    assert plain.comparisons[0].verdict == "slower" and placed.comparisons[0].verdict == "undecided"
    back = R.from_json(R.to_json(R.Report({}, [placed]))).sections[0]
    assert R.derive(back).comparisons[0].ratio_ci == placed.comparisons[0].ratio_ci
