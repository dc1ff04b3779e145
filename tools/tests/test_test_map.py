"""tools/test_map.py: tests/README.md maps every library module and every
test file, and its time column is what tests/durations.json says."""

from __future__ import annotations

import json

from tools import test_map as M


def test_the_map_is_complete_and_current():
    text = M.README.read_text()
    new, problems = M.render(text, json.loads(M.DURATIONS.read_text()))
    assert problems == []
    assert new == text, "stale time column: run python tools/test_map.py"


def test_a_module_without_a_row_and_a_missing_file_are_named():
    text = M.README.read_text()
    first_row = next(line for line in text.splitlines() if line.startswith("| `fastddp/__init__.py`, `fastddp/ddp.py`"))
    broken = text.replace(first_row, first_row.replace("`fastddp/surface.py`, ", "")
                          .replace("`test_dropin.py`", "`test_nowhere.py`"))
    _, problems = M.render(broken, {})
    assert "library module fastddp/surface.py has no row" in problems
    assert any("test_nowhere.py, which tests/ does not have" in p for p in problems)


def test_times_are_summed_per_file_and_rendered():
    durations = {"tests/test_planner.py::a": 1.25, "tests/test_planner.py::b[x]": 2.0,
                 "tests/test_settings.py::c": 0.2}
    assert M.file_seconds(durations) == {"test_planner.py": 3.25, "test_settings.py": 0.2}
    new, _ = M.render(M.README.read_text(), durations)
    row = next(line for line in new.splitlines() if line.startswith("| `fastddp/settings.py`"))
    assert row.endswith("| < 1 s |")
    row = next(line for line in new.splitlines() if line.startswith("| `fastddp/planner.py`"))
    assert row.endswith("| 3 s |")
