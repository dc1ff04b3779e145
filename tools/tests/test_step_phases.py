"""tools/step_phases.py: the per-phase probe on loopback (two gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import step_phases

pytestmark = pytest.mark.timeout(300)


def test_paired_ratio_is_the_geometric_mean_with_an_interval():
    g, lo, hi = step_phases.paired([10.0, 10.0, 10.0, 10.0], [9.0, 11.0, 9.0, 11.0])
    assert lo < g < hi
    assert g == pytest.approx((0.9 * 1.1) ** 0.5)


def test_two_rows_on_loopback(tmp_path):
    out = tmp_path / "s.json"
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows", "torch,fastddp", "--model", "tiny",
                          "--steps", "3", "--json", str(out), "--port", "29531"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fastddp / torch step:" in run.stdout and "fastddp / torch cpu:" in run.stdout
    samples = json.loads(out.read_text())
    assert set(samples) == {"torch", "fastddp"}
    assert all(len(samples[r][p]) == 3 and min(samples[r][p]) > 0 for r in samples for p in step_phases.PHASES
               if p != "cpu")


def test_unknown_rows_are_refused():
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows", "torch,fastdp"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown ['fastdp']" in run.stderr
