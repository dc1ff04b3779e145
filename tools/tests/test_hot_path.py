"""tools/hot_path.py on a real one-rank gloo step: the chains it counts
stay as short as docs/architecture.md says (a new frame on the hot path
shows up here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _counts(*args) -> list[int]:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "hot_path.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return [int(n) for n in re.findall(r": (\d+) calls in \d+ files", out.stdout)]


@pytest.mark.parametrize("args, most", [((), (0, 5, 0)), (("--view",), (0, 5, 0)), (("--hook", "fp8"), (18, 8))],
                         ids=["default", "view", "fp8"])
def test_the_hot_path_is_short(args, most):
    counts = _counts(*args)
    # default: packed, issued, waited for and unpacked by the native issue chain (no Python
    # before the collective or before .grad), then its hand-over once a step; fp8: fewer than 19 calls from the hook to the collective (22
    # before the modes were composed)
    assert len(counts) == len(most) and all(c <= m for c, m in zip(counts, most)), (counts, most)
