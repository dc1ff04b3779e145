"""The import swap's verdicts over the model zoo and several links, from
bench reports: one table of fastddp against torch's twin (default,
``batched_grad_copy``, ``gradient_as_bucket_view``) per model and link.

    python -m tools.zoo_verdicts reports/.../zoo-netns.json reports/.../zoo-netns-10.json ...

Each JSON is one ``fastddp-bench`` report (``--link netns:RATE --models ...
--wrappers torch fastddp torch-batched fastddp-batched torch-view
fastddp-view``).  Where a (model, pair, link) appears in several reports
(repeated runs), their ratios are combined with
:func:`fastddp.bench.stats.ratio_over_runs` (the geometric mean, a t interval
over the runs) and the verdict is that interval's: a single run keeps its own
paired-round interval.  Prints a markdown table and the counts the question
asks for: pairs decided slower (the whole interval above 1), pairs decided
faster, on which links the wire does not bind (unshaped and 10 Gbit/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from fastddp.bench.stats import ratio_over_runs

PAIRS = (("fastddp", "torch"), ("fastddp-batched", "torch-batched"), ("fastddp-view", "torch-view"))
FAST_LINKS = ("unshaped", "10")
"""Links where the wire does not bind on these 2-core VMs."""


def link_name(section: dict) -> str:
    wire = section.get("wire") or {}
    gbit = wire.get("gbit")
    if wire.get("kind") == "netns":
        return "unshaped" if gbit is None else f"{gbit:g}"
    return "loopback"


def collect(reports: list[dict]) -> dict:
    """``(model, wrapper, link) -> [(ratio, lo, hi), ...]``, one per report."""
    got = defaultdict(list)
    for rep in reports:
        for sec in rep["sections"]:
            link = link_name(sec)
            for c in sec.get("comparisons", []):
                if (c["wrapper"], c["peer"]) in PAIRS and c.get("ratio") is not None:
                    lo, hi = c.get("ratio_ci") or (None, None)
                    got[(c["model"], c["wrapper"], link)].append((c["ratio"], lo, hi))
    return got


def verdict(runs: list[tuple]) -> tuple[float, float | None, float | None, str]:
    """The combined ratio, its interval and the verdict: ``slower`` / ``faster``
    where the whole interval lies above / below 1, else ``undecided``."""
    if len(runs) == 1:
        r, lo, hi = runs[0]
    else:
        r, ci = ratio_over_runs([x[0] for x in runs])
        lo, hi = ci if ci is not None else (None, None)
    if lo is None or hi is None:
        return r, lo, hi, "undecided"
    return r, lo, hi, "slower" if lo > 1.0 else "faster" if hi < 1.0 else "undecided"


def table(got: dict) -> tuple[list[str], dict]:
    links = sorted({k[2] for k in got}, key=lambda s: (s != "unshaped", -float(s) if s[0].isdigit() else 0))
    models = list(dict.fromkeys(k[0] for k in got))
    lines = ["| model | pair | " + " | ".join(f"{l} Gbit/s" if l[0].isdigit() else l for l in links) + " |",
             "|---|---|" + "---|" * len(links)]
    counts = {"slower": [], "faster_fast": 0, "pairs_fast": 0}
    for m in models:
        for w, peer in PAIRS:
            cells = []
            for l in links:
                runs = got.get((m, w, l))
                if not runs:
                    cells.append("-")
                    continue
                r, lo, hi, v = verdict(runs)
                ci = f" ({lo:.3f}-{hi:.3f})" if lo is not None else ""
                runs_note = f", {len(runs)} runs" if len(runs) > 1 else ""
                cells.append(f"{r:.3f}{ci} {v}{runs_note}")
                if v == "slower":
                    counts["slower"].append(f"{m} {w} at {l}")
                if l in FAST_LINKS:
                    counts["pairs_fast"] += 1
                    counts["faster_fast"] += v == "faster"
            lines.append(f"| {m} | {w} / {peer} | " + " | ".join(cells) + " |")
    return lines, counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.zoo_verdicts", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="fastddp-bench report JSONs")
    args = p.parse_args(argv)
    reports = [json.load(open(f)) for f in args.reports]
    lines, counts = table(collect(reports))
    print("\n".join(lines))
    print()
    print(f"decided slower: {len(counts['slower'])} ({'; '.join(counts['slower']) or 'none'})")
    print(f"decided faster where the wire does not bind (unshaped, 10 Gbit/s): {counts['faster_fast']} of "
          f"{counts['pairs_fast']} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
