"""Run one pytest selection as N parallel pytest processes (bench/gpu_check.sh).

    python tools/pytest_shards.py --shards 4 --logdir DIR -- tests/test_kernels.py -m "interpret or gpu" ...

Why: on a fresh GPU machine most of the kernel suite's time is Triton
compiling one kernel variant after another on one core; N processes compile
N at a time (Triton's on-disk cache is shared, so later stages reuse them).
pytest-xdist is not installed there, so this does the minimum by hand:
collect the test ids once, deal them round-robin into N shards, run each
shard as its own ``python -m pytest <ids> <args>`` with its output in
``DIR/shard-<i>.log``, then print one summary line per shard and the totals.

Exit status: 0 when every shard passed; 5 when no test was selected; else the
first non-zero shard status (1 failures, 2 interrupted, ...).  The logs are
written while the shards run, so a caller that kills this runner (a stage
timeout) still has them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

_RESULT = re.compile(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b")
_ELAPSED = re.compile(r" in [\d.]+s\b")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)")


def collect(pytest_args: list[str]) -> list[str]:
    """Node ids pytest would run for ``pytest_args``."""
    quiet = {"-q", "-qq", "--quiet", "-v", "-vv", "--verbose"}  # one -q lists ids; two lists files
    args = [a for a in pytest_args if a not in quiet]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                         capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5):
        sys.stdout.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(out.returncode)
    return ids


def summary_line(log: Path) -> str:
    """pytest's final ``N passed, M failed`` line of a shard's log ('' if none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip().strip("=").strip()
        if _RESULT.search(line) and _ELAPSED.search(line):
            return line
    return ""


def counts(line: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for n, what in _COUNT.findall(line):
        key = {"error": "errors", "warning": "warnings"}.get(what, what)
        out[key] = out.get(key, 0) + int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest arguments")
    args = ap.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    # The ids carry the paths; the selection options (-m, -k) already did their work.
    files = [a for a in pytest_args if not a.startswith("-") and (a.endswith(".py") or "/" in a)]
    options = [a for a in pytest_args if a not in files]
    if args.shards <= 1:  # no collection pass: one pytest, as given
        n, shards, options = 1, [pytest_args], []
        print("pytest_shards: 1 shard (the selection as given)", flush=True)
    else:
        ids = collect(pytest_args)
        if not ids:
            print("pytest_shards: no test selected")
            return 5
        n = max(1, min(args.shards, len(ids)))
        shards = [ids[i::n] for i in range(n)]
        print(f"pytest_shards: {len(ids)} tests in {n} shard(s), collected in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    # -m / -k stay: they are no-ops on the ids they selected, and keep pytest's skips the same.
    procs = []
    for i, shard in enumerate(shards):
        log = logdir / f"shard-{i}.log"
        fh = open(log, "w")
        procs.append((i, log, fh, subprocess.Popen([sys.executable, "-m", "pytest", *shard, *options],
                                                   stdout=fh, stderr=subprocess.STDOUT)))
    rcs = []
    for i, log, fh, p in procs:
        rcs.append(p.wait())
        fh.close()
    total: dict[str, int] = {}
    for (i, log, _, _), rc in zip(procs, rcs):
        line = summary_line(log)
        for k, v in counts(line).items():
            total[k] = total.get(k, 0) + v
        print(f"pytest_shards: shard {i}: rc={rc} {line or '(no pytest summary: killed?)'}")
    order = ["passed", "failed", "errors", "skipped", "xfailed", "xpassed", "deselected"]
    text = ", ".join(f"{total[k]} {k}" for k in order if total.get(k))
    print(f"===== {text or 'no result'} in {time.perf_counter() - t0:.2f}s ({n} shards) =====")
    failing = [rc for rc in rcs if rc not in (0, 5)]
    if failing:
        return failing[0]
    return 5 if all(rc == 5 for rc in rcs) else 0  # an empty shard alone is fine


if __name__ == "__main__":
    sys.exit(main())
