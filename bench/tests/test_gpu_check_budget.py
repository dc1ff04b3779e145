"""bench/gpu_check.sh fits a short GPU window: its whole run is bounded by the
sum of its stage budgets, that sum stays under 8 minutes, and nothing in it
runs without a bound (the environment stage, nvidia-smi, the native build).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_check.sh"
WINDOW_S = 8 * 60


def _budget(*args: str) -> tuple[int, dict[str, int]]:
    out = subprocess.run(["bash", str(SCRIPT), *args, "--budget"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(r"\[gpu_check\] budget (\d+) s in all \((.*)\)\n", out.stdout)
    assert m, out.stdout
    parts = {name: int(v) for name, v in re.findall(r"([a-z-]+) (\d+)", m.group(2))}
    return int(m.group(1)), parts


def test_the_gpu_run_is_bounded_under_eight_minutes():
    total, parts = _budget()
    assert set(parts) == {"env", "kernels", "reducer", "kernels-bw", "bench", "summary"}
    assert total == sum(parts.values())
    assert total < WINDOW_S, f"gpu_check's budget is {total} s: over the {WINDOW_S} s window"
    header = SCRIPT.read_text().split("set -uo pipefail", 1)[0]
    said = re.search(r"GPU budgets sum to (\d+) s", header)
    assert said and int(said.group(1)) == total, "the header's sum of the GPU budgets is out of date"


def test_the_dry_run_prints_its_own_budget():
    total, parts = _budget("--dry-run")
    assert total == sum(parts.values()) and total > _budget()[0]  # a busy CPU gets more time


def test_every_stage_runs_to_a_deadline_and_nothing_runs_unbounded():
    text = SCRIPT.read_text()
    body = text.split("set -uo pipefail", 1)[1]
    # every stage runs until its cumulative deadline (budget + the budgets before it), never a raw budget
    code = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
    calls = re.findall(r"run_stage ([\w-]+) (\S+) ", code)
    assert {name for name, _ in calls} >= {"kernels", "reducer", "kernels-bw", "bench", "bench-w1", "bench-w2"}
    for name, deadline in calls:
        assert deadline.startswith(("$D_", "$((D_")), f"stage {name} runs to {deadline}, not a deadline"
    assert re.search(r'timeout -k \d+ "\$\(left \$D_ENV\)" bash -c stage_env', body), "env stage unbounded"
    for line in body.splitlines():
        if re.search(r"^\s*[^#]*\bnvidia-smi --", line):
            assert "timeout" in line, f"nvidia-smi without a timeout: {line.strip()}"
    # the kernel stage runs without native code, so no shard waits for its build
    assert re.search(r"FASTDDP_NATIVE=0 run_stage kernels ", body)
    # the builder leads its own process group, and stopping it stops the group
    assert "setsid" in body and 'kill -TERM -- "-$NATIVE_PID"' in body and 'kill -KILL -- "-$NATIVE_PID"' in body
