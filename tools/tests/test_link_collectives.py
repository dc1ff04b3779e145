"""tools/link_collectives.py --paired on loopback: every candidate of both
comparisons reports its rate, its CPU time and its paired time against the
first; ``local`` without ``--paired`` is refused (its rates would not be a
link's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LINE = re.compile(r"^    (.+?)\s+([\d.]+) MB/s each way  cpu\s+([\d.]+) ms  time / first ([\d.]+) \(([\d.]+)-([\d.]+)\)$",
                  re.M)


def test_paired_comparisons_on_loopback():
    run = subprocess.run([sys.executable, "-m", "tools.link_collectives", "local", "--paired", "--mb", "1",
                          "--reps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    rows = {m.group(1): m.groups()[1:] for m in LINE.finditer(run.stdout)}
    assert set(rows) == {"all_gather", "as all_to_all, piece twice", "8 pieces", "4 pieces", "16 pieces",
                         "32 pieces"}, run.stdout
    assert all(float(v) > 0 for r in rows.values() for v in r), rows
    assert rows["all_gather"][2] == rows["8 pieces"][2] == "1.000"  # each comparison's first is its base
    assert "all-gather, 8 pieces (3 alternations):" in run.stdout and "all-to-all (3 alternations):" in run.stdout


def test_local_needs_paired():
    run = subprocess.run([sys.executable, "-m", "tools.link_collectives", "local"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--paired" in run.stderr


def test_bad_counts_are_refused():
    run = subprocess.run([sys.executable, "-m", "tools.link_collectives", "local", "--paired", "--reps", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--reps 0" in run.stderr
