"""tools/rerun_check.py: verdict agreement and interval calibration across main jobs."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tools import rerun_check as rc

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "reports" / "intel-xeon-processor").glob("2026-12-05-placements*.json"))


def _t(**pairs):
    return {("", "m", w, "torch"): v for w, v in pairs.items()}


def test_verdict_classes():
    a = _t(same=(0.9, (0.85, 0.95), "faster"), und=(1.0, (0.9, 1.1), "undecided"), some=(0.9, (0.8, 0.99), "faster"),
           compat=(0.98, (0.96, 0.999), "faster"), contra=(0.95, (0.9, 0.99), "faster"))
    b = _t(same=(0.9, (0.86, 0.94), "faster"), und=(1.0, (0.9, 1.1), "undecided"), some=(0.95, (0.9, 1.01), "undecided"),
           compat=(1.0, (0.98, 1.02), "equal"), contra=(1.05, (1.01, 1.09), "slower"))
    cls = {k[2]: v for k, v in rc.verdicts([a, b]).items()}
    assert cls == {"same": "alike", "und": "undecided", "some": "some", "compat": "compatible",
                   "contra": "contradicted"}
    assert [k[2] for k in rc.disjoint([a, b])] == ["contra"]
    # a pair missing from one run is left out
    assert ("", "m", "extra", "torch") not in rc.verdicts([{**a, **_t(extra=(1, None, "undecided"))}, b])


def _runs(shift_sd: float, n: int = 400, runs: int = 3, seed: int = 0) -> list[dict]:
    """Synthetic runs: every pair's true log ratio, each run's estimate off by
    its own standard error (0.01) plus a run effect of ``shift_sd``; the
    interval is the estimate +- 1.645 standard errors (it does not see the run effect)."""
    rng = random.Random(seed)
    truth = [rng.gauss(0, 0.05) for _ in range(n)]
    out = []
    for _ in range(runs):
        t = {}
        for i, mu in enumerate(truth):
            est = mu + rng.gauss(0, 0.01) + rng.gauss(0, shift_sd)
            t[("", "m", f"w{i}", "p")] = (math.exp(est), (math.exp(est - 0.01645), math.exp(est + 0.01645)), "x")
        out.append(t)
    return out


def test_calibrated_intervals_read_as_calibrated_and_a_run_effect_does_not():
    cal = rc.calibration(_runs(0.0))
    assert abs(cal["inside"] - rc.EXPECTED_INSIDE) < 0.04 and abs(cal["z_sd"] - 1) < 0.08, cal
    assert abs(rc.EXPECTED_INSIDE - 0.755) < 0.005
    off = rc.calibration(_runs(0.01))  # a run effect as large as the interval's own error
    assert off["inside"] < 0.62 and off["z_sd"] > 1.3, off


@pytest.mark.skipif(len(RUNS) < 2, reason="the committed main jobs are not in this checkout")
def test_cli_on_the_committed_main_jobs():
    out = subprocess.run([sys.executable, "-m", "tools.rerun_check", *map(str, RUNS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "0 contradicted" in out.stdout and "calibration over 40 pairs" in out.stdout, out.stdout[-1500:]


def test_cli_refuses_a_single_run_and_a_file_that_is_not_a_report(tmp_path):
    one = subprocess.run([sys.executable, "-m", "tools.rerun_check", "a.json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert one.returncode == 2 and "at least two runs" in one.stderr
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "tools.rerun_check", str(bad), str(bad)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "not a fastddp-bench json report" in out.stderr, out.stderr[-800:]
