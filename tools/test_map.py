"""tests/README.md's map: library module -> the test files that cover it ->
their time.

The rows (which modules, which test files) are written by hand in
tests/README.md between the ``<!-- map -->`` and ``<!-- /map -->`` lines;
this tool fills each row's time from tests/durations.json (each test's
seconds, written by ``bash tests/run.sh --record-durations
$PWD/tests/durations.json``) and checks that every library module and every
test file has a row.

    python tools/test_map.py           # rewrite the time column in place
    python tools/test_map.py --check   # exit 1 if the map is stale or incomplete
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "tests" / "README.md"
DURATIONS = REPO / "tests" / "durations.json"
BEGIN, END = "<!-- map -->", "<!-- /map -->"
#: the library: every module here needs a row
LIBRARY = ("fastddp", "kernels")


def library_modules(repo: Path = REPO) -> list[str]:
    out = []
    for top in LIBRARY:
        out += [p.relative_to(repo).as_posix() for p in sorted((repo / top).rglob("*.py"))]
    return out


def test_files(repo: Path = REPO) -> list[str]:
    return sorted(p.name for p in (repo / "tests").glob("test_*.py"))


def file_seconds(durations: dict) -> dict[str, float]:
    """Seconds per test file (``tests/test_x.py``), summed over its tests."""
    out: dict[str, float] = {}
    for nodeid, s in durations.items():
        f = nodeid.split("::")[0].rsplit("/", 1)[-1]
        out[f] = out.get(f, 0.0) + s
    return out


def _cell_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _expand(modules_cell: str, modules: list[str]) -> set[str]:
    """The library modules a row names: a path, or a folder ending in ``/``."""
    got = set()
    for name in _cell_names(modules_cell):
        got |= {m for m in modules if m == name or (name.endswith("/") and m.startswith(name))}
    return got


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 1 else "< 1 s"


def render(text: str, durations: dict) -> tuple[str, list[str]]:
    """The README with every row's time filled in, and the problems found."""
    head, sep, rest = text.partition(BEGIN)
    table, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        return text, [f"tests/README.md has no {BEGIN} ... {END} block"]
    per_file = file_seconds(durations)
    modules, tests = library_modules(), test_files()
    mapped_modules: set[str] = set()
    mapped_tests: set[str] = set()
    problems = []
    lines = []
    for line in table.strip("\n").split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            lines.append(line)  # header, rule
            continue
        named = _expand(cells[0], modules)
        if not named:
            problems.append(f"row {cells[0]!r} names no library module")
        mapped_modules |= named
        files = [n for n in _cell_names(cells[1]) if n.startswith("test_")]
        for f in files:
            if f not in tests:
                problems.append(f"row {cells[0]!r} names {f}, which tests/ does not have")
        mapped_tests.update(files)
        cells[2] = _fmt(sum(per_file.get(f, 0.0) for f in files))
        lines.append("| " + " | ".join(cells) + " |")
    problems += [f"library module {m} has no row" for m in modules if m not in mapped_modules]
    problems += [f"test file {t} is in no row" for t in tests if t not in mapped_tests]
    return head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where the map is stale or incomplete")
    args = ap.parse_args(argv)
    text = README.read_text()
    new, problems = render(text, json.loads(DURATIONS.read_text()))
    for p in problems:
        print(f"test_map: {p}")
    if args.check:
        if new != text:
            print("test_map: the time column is stale: run python tools/test_map.py")
        return 1 if problems or new != text else 0
    README.write_text(new)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
