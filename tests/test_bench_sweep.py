"""The bucket sweep's verdicts on synthetic step times with known answers."""

from __future__ import annotations

import random

from bench import bucket_sweep as S
from bench import report as R


def _rows(model: str, means: dict[str, float], rounds: int = 60, noise: float = 0.01, seed: int = 0,
          autotune: dict | None = None) -> list[R.Row]:
    rng = random.Random(seed)
    shared = [rng.gauss(0, noise) for _ in range(rounds)]  # a round's load hits every setting
    rows = []
    for name, mean in means.items():
        wrapper = "fastddp-auto" if name == "auto" else f"fastddp-cap{name}"
        row = R.Row(model, wrapper, family="fastddp",
                    step_ms=[mean * (1 + s + rng.gauss(0, noise / 4)) for s in shared])
        if name == "auto":
            row.autotune = autotune
        rows.append(row)
    return rows


def _report(rows) -> R.Report:
    return R.Report({"device": "test"}, [R.derive(R.Section(None, rows))])


CAPS = {"1": 130.0, "5": 110.0, "10": 100.0, "25": 120.0, "50": 125.0, "100": 128.0}


def test_auto_at_the_best_cap_meets_both_verdicts():
    tune = {"state": "settled", "settled_at_step": 21,
            "chosen": {"torch_args": {"bucket_cap_mb": 10}, "buckets": 4},
            "tried": [{"step_ms": [150.0, 140.0]}, {"step_ms": [101.0]}]}
    (res,) = S.analyse("none", _report(_rows("m", {**CAPS, "auto": 100.5}, autotune=tune)))
    assert res["best"] == 10
    assert res["within_3pct_of_best"] == "met"
    assert res["better_than_25"] == "met"
    assert res["tuning_slowest_step_ms"] == 150.0 and res["tuning_layouts_tried"] == 2
    assert res["auto_chose"] == {"bucket_cap_mb": 10}


def test_auto_10pct_off_the_best_misses():
    (res,) = S.analyse("none", _report(_rows("m", {**CAPS, "auto": 110.0})))
    assert res["within_3pct_of_best"] == "missed"
    assert res["better_than_25"] == "met"  # 110 < 120


def test_auto_stuck_at_the_default_misses_beating_it():
    (res,) = S.analyse("none", _report(_rows("m", {**CAPS, "auto": 120.0})))
    assert res["within_3pct_of_best"] == "missed"
    assert res["better_than_25"] != "met"


def test_default_best_is_not_a_target():
    caps = dict(CAPS, **{"25": 95.0})
    (res,) = S.analyse("none", _report(_rows("m", {**caps, "auto": 95.2})))
    assert res["best"] == 25 and res["better_than_25"].startswith("n/a")
    assert res["within_3pct_of_best"] == "met"


def test_heavy_noise_is_undecided_not_met():
    (res,) = S.analyse("none", _report(_rows("m", {**CAPS, "auto": 102.5}, rounds=12, noise=0.3)))
    assert res["within_3pct_of_best"] in ("undecided", "missed")


def test_markdown_names_every_setting_and_the_tally():
    tune = {"state": "settled", "settled_at_step": 9, "chosen": {"torch_args": {"bucket_cap_mb": None},
                                                                  "buckets": 2}, "tried": []}
    results = S.analyse("netns:1", _report(_rows("m", {**CAPS, "auto": 100.0}, autotune=tune)))
    md = S.to_markdown(results, {"device": "test"}, {"netns:1": "x.json"})
    for c in ("cap 1", "cap 5", "cap 10", "cap 25", "cap 50", "cap 100", "| auto |"):
        assert c in md
    assert "auto within 3% of the best fixed cap: 1 of 1" in md


def test_auto_against_torchs_default_layout():
    """A run of its own with the ``fastddp`` (bucket_cap_mb=None) row: auto
    against torch's default layout, with a verdict; no cap rows needed."""
    rows = _rows("m", {"auto": 80.0}) + [
        R.Row("m", "fastddp", family="fastddp", step_ms=list(_rows("m", {"auto": 100.0})[0].step_ms))]
    (res,) = S.analyse("netns:1", _report(rows))
    assert "best" not in res
    v = res["auto_vs_default"]
    assert 0.78 < v["ratio"] < 0.82 and v["verdict"] == "faster"
    md = S.to_markdown([res], {"device": "test"}, {"netns:1": "x.json"})
    assert "auto / default" in md and "faster" in md
