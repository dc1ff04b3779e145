"""Short text summaries of bench/gpu_check.sh's result files.

    python tools/check_summary.py kernels kernels.json   # fastddp kernels: % of copy bandwidth
    python tools/check_summary.py bench bench.json       # fastddp-bench: step time x best peer per option
    python tools/check_summary.py pytest tests.log       # pytest's result line and its FAILED lines

Each prints a few lines (a one-screen summary is the goal) and exits 0; a
missing or unreadable file prints one line saying so.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def kernels_lines(path: Path) -> list[str]:
    res = json.loads(path.read_text())
    m = res["meta"]
    rows = res["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    out = [f"copy {m['copy_GB/s']} GB/s (read+write); backend {m['backend']}; fastddp % of copy "
           f"(x: speed-up over torch's fastest way)" + ("; TRUNCATED" if m.get("truncated") else "")]
    w = max([11] + [len(r["op"]) + 1 for r in rows])  # the low-precision rows have longer names
    out.append("  " + f"{'op':<{w}}{'wire':<5}" + "".join(f"{s:>20}" for s in shapes))
    cases = list(dict.fromkeys((r["op"], r["wire"]) for r in rows))
    for op, wire in cases:
        cells = []
        for shape in shapes:
            same = [r for r in rows if (r["op"], r["wire"], r["shape"]) == (op, wire, shape)]
            ours = next((r for r in same if r["method"] == "fastddp"), None)
            theirs = [r["device_us"] for r in same if r["method"] != "fastddp" and r["device_us"] > 0]
            if ours is None:
                cells.append("-")
                continue
            x = f" {min(theirs) / ours['device_us']:.1f}x" if theirs and ours["device_us"] > 0 else ""
            flag = "" if ours.get("bit_exact", True) else " NOT-EXACT"
            cells.append(f"{ours['pct_copy']:.0f}%{x}{flag}")
        out.append("  " + f"{op:<{w}}{wire:<5}" + "".join(f"{c:>20}" for c in cells))
    bad = [r for r in rows if r.get("bit_exact") is False]
    hb = sum(1 for r in rows if r.get("host_bound"))
    out.append(f"  bit-exact vs reference: {'all' if not bad else f'{len(bad)} NOT'}"
               + (f"; {hb} host-bound timing(s)" if hb else ""))
    return out


def bench_lines(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    out = [f"{meta.get('device', '?')}, world {meta.get('world_size')} ({meta.get('backend')}), "
           f"torch {meta.get('torch')}: step time x best peer, paired by round (< 1 is faster; "
           f"verdict < faster, > slower, = equal, ? undecided; too few: no interval, no ratio)"]
    for sec in doc["sections"]:
        rows = sec["rows"]
        fast = list(dict.fromkeys(r["wrapper"] for r in rows if r.get("family") == "fastddp"))
        models = list(dict.fromkeys(r["model"] for r in rows))
        if sec.get("bandwidth_gbps") is not None:
            out.append(f"  simulated {sec['bandwidth_gbps']:g} GB/s:")
        out.append("  " + f"{'model':<13}" + "".join(f"{w.replace('fastddp-', '').replace('fastddp', 'default'):>10}"
                                                      for w in fast))
        ratios = _ratios(sec)
        for model in models:
            cells = []
            for w in fast:
                r = next((x for x in rows if x["model"] == model and x["wrapper"] == w), None)
                if r is None:
                    cells.append("-")
                elif r.get("status", "ok") != "ok":
                    cells.append(r["status"].split(":")[0].upper())
                else:
                    v, ci, verdict = ratios.get((model, w), (None, None, None))
                    mark = {"faster": " <", "slower": " >", "equal": " =", "undecided": " ?"}.get(verdict, "")
                    cells.append("n/a" if v is None else "too few" if ci is None else f"{v:.3f}{mark}")
            out.append("  " + f"{model:<13}" + "".join(f"{c:>10}" for c in cells))
        stand_ins = sorted({r["wrapper"] for r in rows if str(r.get("note", "")).startswith("stand-in")})
        if stand_ins:
            out.append(f"  (stand-in baseline: {', '.join(stand_ins)}; see the note column)")
        bad = [f"{r['model']} {r['wrapper']}: {r['status']}" for r in rows if r.get("status", "ok") != "ok"]
        out += [f"  not ok: {b}" for b in bad[:6]]
    return out


def _ratios(sec: dict) -> dict:
    """(model, wrapper) -> (step-time ratio to the best peer, its interval,
    its verdict) as the report stored them (bench/report.py derives them
    before writing; no torch import here: this runs in a summary)."""
    verdicts = {(c["model"], c["wrapper"]): c.get("verdict") for c in sec.get("comparisons", ()) if c.get("best")}
    return {(r["model"], r["wrapper"]): (r.get("ratio"), r.get("ratio_ci"), verdicts.get((r["model"], r["wrapper"])))
            for r in sec["rows"]}


def pytest_lines(path: Path, max_failed: int = 8) -> list[str]:
    text = path.read_text(errors="replace").splitlines()
    result = [ln.strip().strip("=").strip() for ln in text
              if re.search(r"\b(passed|failed|errors?|no tests ran)\b", ln) and re.search(r" in [\d.]+s\b", ln)]
    failed = list(dict.fromkeys(ln.strip() for ln in text if ln.startswith(("FAILED ", "ERROR "))))
    out = [f"  {r}" for r in result[-4:]] or ["  (no pytest result line: killed or did not start)"]
    out += [f"  {f[:150]}" for f in failed[:max_failed]]
    if len(failed) > max_failed:
        out.append(f"  ... and {len(failed) - max_failed} more (tests.log)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("kernels", "bench", "pytest"):
        print(__doc__.split("\n\n")[1])
        return 2
    kind, path = argv[0], Path(argv[1])
    fn = {"kernels": kernels_lines, "bench": bench_lines, "pytest": pytest_lines}[kind]
    try:
        lines = fn(path)
    except FileNotFoundError:
        lines = [f"  ({path.name} not written)"]
    except Exception as exc:  # noqa: BLE001 - a summary never fails the check
        lines = [f"  ({path.name} unreadable: {type(exc).__name__}: {exc})"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
