"""tools/autoprec_study.py's arithmetic (the runs themselves need the netns rig
and minutes: they are the study, not a test)."""

import math

import pytest

from tools.autoprec_study import moved_after, paired_ratio, summarise_drop, summarise_train


def test_paired_ratio_cancels_what_moves_a_round():
    base = [0.1, 0.4, 0.2, 0.8]
    g, lo, hi = paired_ratio([0.95 * b for b in base], base)
    assert math.isclose(g, 0.95) and math.isclose(lo, 0.95) and math.isclose(hi, 0.95)
    g, lo, hi = paired_ratio([1.0, 1.1, 0.9, 1.0], [1.0] * 4)
    assert lo < g < hi and lo < 1 < hi
    with pytest.raises(ValueError):
        paired_ratio([], [])


def test_moved_after_counts_steps_until_the_format_stays():
    assert moved_after(["fp32", "fp32", "bf16", "fp8", "fp32", "fp8", "fp8"]) == 5
    assert moved_after(["fp8"] * 3) == 0
    assert moved_after([]) is None


def test_drop_summary_compares_after_the_second_settling():
    n = 10
    fmts = ["fp32"] * 5 + ["bf16", "fp8", "fp32"] + ["fp8"] * (n - 8 + 4)
    t = {"auto": [1.0] * 8 + [0.5] * 6, "fastddp": [1.0] * 14, "bf16acc": [0.7] * 14, "fp8": [0.5] * 14,
         "torch": [1.0] * 14}
    r = {"before": {"format": "fp32"}, "drop_round": 3, "settled_round": 8, "formats": fmts, "times": t,
         "stats": {"decisions": []}}
    s = summarise_drop(r)
    assert s["fixed_best"] == "fp8" and s["vs"]["fp8"]["ratio"] == 1.0 and s["vs"]["fastddp"]["ratio"] == 0.5
    assert s["after_format"] == "fp8" and s["steps_to_move"] == 5 and s["timed_rounds"] == 6


def test_train_summary_reports_the_final_gap():
    r = {"loss": {"torch": [1.0, 0.5], "auto": [1.0, 0.51]}, "times": {"torch": [0.1, 0.1], "auto": [0.05, 0.05]},
         "stats": {"chosen": "fp8", "settled_at_step": 1, "trial_steps": 1}}
    s = summarise_train(r)
    assert math.isclose(s["final_rel_diff"], 0.02) and s["chosen"] == "fp8" and math.isclose(s["max_rel_dev"], 0.02)


def test_tuning_cost_per_trial():
    from tools.autoprec_study import tuning

    times = [1.0] * 5 + [1.0, 3.0, 2.0] + [0.5] * 30
    got = tuning([{"step": 8, "chosen": "fp8", "trial_from_step": 5, "trial_steps": 3}], times)
    assert got == [{"step": 8, "chosen": "fp8", "trial_steps": 3, "slowest_trial_step_ms": 3000.0,
                    "median_after_ms": 500.0}]
