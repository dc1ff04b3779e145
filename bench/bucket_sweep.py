"""The bucket sweep: fastddp at fixed ``bucket_cap_mb`` in {1, 5, 10, 25, 50,
100} against ``bucket_cap_mb="auto"``, paired by round, per model and network
speed; writes ``reports/<machine>/<date>-bucket-sweep.md`` (+ chart, json).

    python -m bench.bucket_sweep --models small mlp25m --speeds none netns:1

Each speed is one ``fastddp-bench`` run (``none``: the plain local link;
``netns:RATE``: two ranks in network namespaces over a veth pair shaped to
RATE Gbit/s; ``sim:GBPS``: the simulated wire) with the rows ``fastddp-capN``
and ``fastddp-auto``.  auto tunes first, its steps back to back and alone
(as a training loop runs it; ``bench.runner._tune_alone``), then every row
has the same ``--warmup`` rounds (default 3) and timed rounds, so auto's
tuning steps are not timed.  Per model and speed the verdicts are the issue's:

* auto within 3% of the best fixed cap: the 90% interval of auto / best lies
  below 1.03 (``met``), above it (``missed``), else ``undecided``;
* where the default 25 is not the best: auto / cap25's interval lies below 1
  (``met``), else ``missed`` / ``undecided``.

The tuning's cost is read from the auto row's tuner report: the slowest step
of any layout it tried against the settled row's median step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
from pathlib import Path

from . import report as R
from .wrappers import SWEEP_CAPS_MB

WITHIN = 0.03


def _cap_name(c: float) -> str:
    return f"fastddp-cap{c:g}"


def run_speed(speed: str, models: list[str], budget: float, warmup: int, out: Path) -> Path:
    """One bench run for ``speed``; returns its json report."""
    wrappers = [_cap_name(c) for c in SWEEP_CAPS_MB] + ["fastddp-auto"]
    label = "bucket-sweep-" + re.sub(r"[^a-z0-9]+", "-", speed.lower()).strip("-")
    cmd = [sys.executable, "-m", "bench", "--models", *models, "--wrappers", *wrappers,
           "--budget", str(budget), "--warmup", str(warmup), "--label", label, "--out", str(out),
           "--no-progress", "--no-charts"]
    if speed.startswith("netns:"):
        cmd += ["--link", speed]
    elif speed.startswith("sim:"):
        cmd += ["--simulate-bandwidth", speed[4:]]
    elif speed != "none":
        raise SystemExit(f"bucket_sweep: unknown speed {speed!r}: none, netns:RATE or sim:GBPS")
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True)
    sys.stdout.write(proc.stdout[-4000:])
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"bucket_sweep: the bench run for {speed} failed (exit {proc.returncode})")
    m = re.search(r"^json:\s+(\S+)", proc.stdout, re.M)
    if not m:
        raise SystemExit("bucket_sweep: the bench printed no json report path")
    return Path(m.group(1))


def _verdict(ci, limit: float) -> str:
    if ci is None:
        return "undecided"
    if ci[1] < limit:
        return "met"
    if ci[0] > limit:
        return "missed"
    return "undecided"


def analyse(speed: str, report: R.Report) -> list[dict]:
    """Per model: every cap's step time, auto / each cap, the verdicts."""
    out = []
    for sec in report.sections:
        by_model: dict[str, dict[str, R.Row]] = {}
        for row in sec.rows:
            if row.ok:
                by_model.setdefault(row.model, {})[row.wrapper] = row
        for model, rows in by_model.items():
            auto = rows.get("fastddp-auto")
            caps = {c: rows[_cap_name(c)] for c in SWEEP_CAPS_MB if _cap_name(c) in rows}
            default = rows.get("fastddp")  # bucket_cap_mb=None: torch's default layout (1 MiB first bucket)
            if auto is None or not (caps or default):
                continue
            tune = auto.autotune or {}
            tried = [t for lay in tune.get("tried", []) for t in lay.get("step_ms", []) if t is not None]
            chosen = tune.get("chosen") or tune.get("current") or {}
            res = {"speed": speed, "bandwidth_gbps": sec.bandwidth_gbps, "model": model,
                   "auto_state": tune.get("state"), "auto_settled_at_step": tune.get("settled_at_step"),
                   "auto_chose": chosen.get("torch_args"), "auto_buckets": chosen.get("buckets"),
                   "tuning_slowest_step_ms": max(tried) if tried else None,
                   "tuning_layouts_tried": len(tune.get("tried", []))}
            if caps:
                mean = {c: R.trimmed_mean(r.step_ms) for c, r in caps.items()}
                best = min(mean, key=mean.get)
                vs = {c: R.compare(auto.step_ms, r.step_ms, model=model, wrapper="fastddp-auto",
                                   peer=_cap_name(c)) for c, r in caps.items()}
                res.update({
                    "rounds": min(len(auto.step_ms), *(len(r.step_ms) for r in caps.values())),
                    "step_ms": {**{f"{c:g}": mean[c] for c in caps}, "auto": R.trimmed_mean(auto.step_ms)},
                    "p20_p80": {**{f"{c:g}": (r.step.p20, r.step.p80) for c, r in caps.items()},
                                "auto": (auto.step.p20, auto.step.p80)},  # quantiles from derive()
                    "auto_vs": {f"{c:g}": {"ratio": v.ratio, "ci": v.ratio_ci} for c, v in vs.items()},
                    "best": best, "within_3pct_of_best": _verdict(vs[best].ratio_ci, 1.0 + WITHIN),
                    "better_than_25": "n/a (25 is the best)" if best == 25 else (
                        _verdict(vs[25].ratio_ci, 1.0) if 25 in vs else "n/a (no cap 25 row)")})
            if default is not None:
                v = R.compare(auto.step_ms, default.step_ms, model=model, wrapper="fastddp-auto", peer="fastddp")
                res["auto_vs_default"] = {"ratio": v.ratio, "ci": v.ratio_ci, "rounds": v.rounds,
                                          "verdict": R.decide(v.ratio_ci, WITHIN),
                                          "default_ms": R.trimmed_mean(default.step_ms),
                                          "auto_ms": R.trimmed_mean(auto.step_ms)}
            out.append(res)
    return out


def _ci(ci) -> str:
    return "-" if ci is None else f"{ci[0]:.3f}..{ci[1]:.3f}"


def to_markdown(results: list[dict], meta: dict, runs: dict[str, str]) -> str:
    caps = [f"{c:g}" for c in SWEEP_CAPS_MB]
    lines = ["# Bucket sweep: fixed bucket_cap_mb against \"auto\"", "",
             "How to read it: every setting runs one step per round, in rotated order, on the same "
             "ranks; a round's time is the slowest rank's. Step times are trimmed means over rounds "
             "(ms); `auto / best` is the paired ratio of auto's step to the best fixed cap's, with "
             "its 90% bootstrap interval. Verdicts: auto within 3% of the best (interval below "
             "1.03), and faster than the default 25 where 25 is not the best (interval below 1).", "",
             f"Machine: {meta.get('device')}, {meta.get('cores')}; world {meta.get('world_size')} "
             f"({meta.get('backend')}); torch {meta.get('torch')}; git `{meta.get('git')}`; "
             f"load {meta.get('load')}.", "",
             "Runs: " + "; ".join(f"{k}: `{v}`" for k, v in runs.items()), "",
             "| speed | model | rounds | " + " | ".join(f"cap {c}" for c in caps) +
             " | auto | best | auto / best | 90% | within 3% | auto / 25 | 90% | better than 25 | auto chose |",
             "|---|---|---:|" + "---:|" * len(caps) + "---:|---:|---:|---:|---|---:|---:|---|---|"]
    for r in (r for r in results if "best" in r):
        b = f"{r['best']:g}"
        cells = [r["speed"], r["model"], str(r["rounds"])]
        cells += [f"{r['step_ms'][c]:.1f}" if c in r["step_ms"] else "-" for c in caps]
        cells += [f"{r['step_ms']['auto']:.1f}", b, f"{r['auto_vs'][b]['ratio']:.3f}",
                  _ci(r["auto_vs"][b]["ci"]), r["within_3pct_of_best"]]
        v25 = r["auto_vs"].get("25")
        cells += [f"{v25['ratio']:.3f}" if v25 else "-", _ci(v25["ci"]) if v25 else "-", r["better_than_25"]]
        chose = r["auto_chose"]
        cells.append("-" if chose is None else ", ".join(f"{k}={v}" for k, v in chose.items()) +
                     f" ({r['auto_buckets']} buckets)")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Tuning cost (auto's own first steps, run alone before the rounds above and not timed):", "",
              "| speed | model | layouts tried | settled at step | slowest trial step ms | settled step ms | x |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if "best" in r):
        slow, settled = r["tuning_slowest_step_ms"], r["step_ms"]["auto"]
        x = "-" if slow is None else f"{slow / settled:.2f}"
        lines.append(f"| {r['speed']} | {r['model']} | {r['tuning_layouts_tried']} | "
                     f"{r['auto_settled_at_step'] if r['auto_settled_at_step'] is not None else '-'} | "
                     f"{'-' if slow is None else f'{slow:.1f}'} | {settled:.1f} | {x} |")
    swept = [r for r in results if "best" in r]
    met = sum(r["within_3pct_of_best"] == "met" for r in swept)
    lines += ["", f"auto within 3% of the best fixed cap: {met} of {len(swept)} (model, speed) pairs; "
              f"better than an explicit 25 where 25 is not the best: "
              f"{sum(r['better_than_25'] == 'met' for r in swept)} of "
              f"{sum(not r['better_than_25'].startswith('n/a') for r in swept)}.", ""]
    vd = [r for r in results if "auto_vs_default" in r]
    if vd:
        lines += ["An explicit `bucket_cap_mb=N` makes the first bucket N MiB too (torch's rule); torch's "
                  "default (`bucket_cap_mb=None`: 25 MiB, first bucket 1 MiB) is its own layout. auto against "
                  "it, paired by round in a run of its own (`fastddp` = default):", "",
                  "| speed | model | rounds | default ms | auto ms | auto / default | 90% | verdict |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in vd:
            v = r["auto_vs_default"]
            lines.append(f"| {r['speed']} | {r['model']} | {v['rounds']} | {v['default_ms']:.1f} | "
                         f"{v['auto_ms']:.1f} | {v['ratio']:.3f} | {_ci(v['ci'])} | "
                         f"{R.verdict_text(v['verdict'], WITHIN)} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    results = [r for r in results if "best" in r]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = len(results)
    if not n:
        return False
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.2 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        names = [k for k in r["step_ms"]]
        vals = [r["step_ms"][k] for k in names]
        lo = [v - r["p20_p80"][k][0] for k, v in zip(names, vals)]
        hi = [r["p20_p80"][k][1] - v for k, v in zip(names, vals)]
        colors = ["#d62728" if k == "auto" else ("#2ca02c" if k == f"{r['best']:g}" else "#1f77b4")
                  for k in names]
        ax.bar(range(len(names)), vals, yerr=[[max(0, x) for x in lo], [max(0, x) for x in hi]],
               color=colors, capsize=3)
        ax.set_xticks(range(len(names)), [k if k == "auto" else f"{k} MiB" for k in names], fontsize=8)
        ax.set_ylabel("step ms (trimmed mean, p20-p80)")
        ratio = r["auto_vs"][f"{r['best']:g}"]["ratio"]
        ax.set_title(f"{r['model']} @ {r['speed']}: auto / best {ratio:.3f}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("bucket_cap_mb sweep (green: best fixed, red: auto)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bucket_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small", "transformer", "convnet", "mlp25m"])
    ap.add_argument("--speeds", nargs="+", default=["none", "netns:1"],
                    help="none (the local link), netns:RATE (Gbit/s, real shaped link; root), sim:GBPS")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per model and speed (bench --budget)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed rounds of every row (auto has tuned alone before them)")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--from-json", nargs="*", default=None, metavar="SPEED=PATH",
                    help="analyse existing bench reports instead of running (a later report of the "
                         "same speed and model replaces an earlier one's rows)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    paths: list[tuple[str, Path]] = []
    if args.from_json:
        for item in args.from_json:
            speed, _, p = item.partition("=")
            paths.append((speed, Path(p)))
    else:
        for speed in args.speeds:
            paths.append((speed, run_speed(speed, args.models, args.budget, args.warmup, out)))
    merged: dict[tuple[str, str], dict] = {}  # a later run of the same model and speed replaces an earlier
    meta, runs = {}, {}
    for speed, p in paths:
        rep = R.from_json(p.read_text())
        meta = meta or rep.meta
        runs.setdefault(speed, []).append(str(p))
        for r in analyse(speed, rep):
            merged.setdefault((speed, r["model"]), {}).update(r)
    results = list(merged.values())
    runs = {k: ", ".join(v) for k, v in runs.items()}
    folder = paths[0][1].parent
    stem = f"{datetime.date.today().isoformat()}-bucket-sweep"
    md = to_markdown(results, meta, runs)
    chart = folder / f"{stem}.png"
    if plot(results, chart):
        md += f"\n![step time per setting]({chart.name})\n"
    (folder / f"{stem}.md").write_text(md)
    (folder / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": runs, "results": results}, indent=1))
    print(md)
    print(f"report: {folder / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
