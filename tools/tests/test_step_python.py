"""tools/step_python.py on a real one-rank gloo step: it times each piece of
both wrappers' per-step Python, fastddp's end-of-backward hand-over included
(the chain runs on the default path: its one Python call a step is there)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_python_times_every_piece():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "step_python.py"), "--model", "small", "--steps", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (torch|fastddp): (.*)$", out.stdout, re.M)}
    assert set(rows) == {"torch", "fastddp"}, out.stdout
    assert "pre_forward" in rows["torch"] and "end of backward" not in rows["torch"], rows
    for piece in ("pre_forward", "post_forward", "end of backward", "total"):
        m = re.search(re.escape(piece) + r" ([\d.]+)", rows["fastddp"])
        assert m and float(m.group(1)) > 0, (piece, rows["fastddp"])
