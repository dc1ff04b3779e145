"""bench/gpu_check.sh and the CI helpers it runs by path (tools/pytest_shards.py,
tools/check_summary.py): the script parses, the helpers read pytest's and
the bench's result files."""

from __future__ import annotations

import json

from fastddp.bench import report as R


def _section():
    """m: fastddp 15 ms against torch 20 ms over ten rounds; fastddp-view unavailable."""
    wobble = [0.0, 0.1, -0.1, 0.05, -0.05, 0.02, -0.02, 0.0, 0.1, -0.1]

    def row(wrapper, ms, baselines=(), status="ok"):
        steps = [ms + w for w in wobble] if status == "ok" else []
        return R.Row("m", wrapper, status=status, family=wrapper.split("-")[0], baselines=list(baselines),
                     step_ms=steps, exposed_ms=[0.5] * len(steps))

    rows = [row("local", 10), row("torch", 20), row("fastddp", 15, ("torch",)),
            row("fastddp-view", 0, ("torch-view",), status="unavailable: not built")]
    return R.derive(R.Section(None, rows))


def test_gpu_check_script_parses_and_documents_its_stages():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for word in ("--dry-run", "OUT", "PYTHON", "summary.md", "env.txt", "tests.log", "kernels.json",
                 "bench.json", "gpu_check.log"):
        assert word in out.stdout, word
    assert subprocess.run(["bash", str(script), "--bogus"], capture_output=True).returncode == 2


def test_pytest_shards_reads_pytest_result_lines(tmp_path):
    from tools import pytest_shards as S

    log = tmp_path / "shard-0.log"
    log.write_text("....F\nFAILED tests/x.py::t[a] - AssertionError: boom\n"
                   "1 failed, 20 passed, 3 skipped, 2 warnings in 3.21s\n")
    line = S.summary_line(log)
    assert line == "1 failed, 20 passed, 3 skipped, 2 warnings in 3.21s"
    assert S.counts(line) == {"failed": 1, "passed": 20, "skipped": 3, "warnings": 2}
    log.write_text("========== 5 passed, 1 error in 0.50s ==========\n")
    assert S.counts(S.summary_line(log)) == {"passed": 5, "errors": 1}
    assert S.summary_line(tmp_path / "missing.log") == ""


def test_check_summary_lines(tmp_path):
    from tools import check_summary as C

    log = tmp_path / "tests.log"
    log.write_text("x\nFAILED tests/a.py::t1 - AssertionError\nERROR tests/b.py::t2 - RuntimeError\n"
                   "===== 1 failed, 7 passed, 1 error in 2.00s =====\n")
    lines = C.pytest_lines(log)
    assert lines[0].strip() == "1 failed, 7 passed, 1 error in 2.00s"
    assert any("FAILED tests/a.py::t1" in ln for ln in lines) and any("ERROR tests/b.py::t2" in ln for ln in lines)

    kern = {"meta": {"copy_GB/s": 4000.0, "backend": "triton", "truncated": True},
            "rows": [{"op": "pack", "wire": "bf16", "shape": "few_large", "method": "fastddp",
                      "device_us": 50.0, "pct_copy": 80.0, "bit_exact": True},
                     {"op": "pack", "wire": "bf16", "shape": "few_large", "method": "foreach",
                      "device_us": 100.0, "pct_copy": 40.0}]}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(kern))
    text = "\n".join(C.kernels_lines(path))
    assert "80% 2.0x" in text and "TRUNCATED" in text and "bit-exact vs reference: all" in text

    rep = R.Report({"label": "t", "device": "Unit GPU", "date": "2026-01-04", "world_size": 1,
                    "backend": "nccl", "torch": "2.11"}, [_section()])
    path = tmp_path / "bench.json"
    path.write_text(R.to_json(rep))
    text = "\n".join(C.bench_lines(path))
    assert "0.750 <" in text       # m / fastddp against torch: 15 / 20 ms, faster
    assert "UNAVAILABLE" in text   # m / fastddp-view
    assert "not ok: m fastddp-view: unavailable: not built" in text
    assert C.main(["kernels", str(tmp_path / "nope.json")]) == 0
    # three rounds carry no interval: no ratio, "too few"
    few = _section()
    for r in few.rows:
        r.step_ms, r.exposed_ms = r.step_ms[:3], r.exposed_ms[:3]
    rep.sections = [R.derive(few)]
    path.write_text(R.to_json(rep))
    text = "\n".join(C.bench_lines(path))
    assert "too few" in text and "0.750" not in text
