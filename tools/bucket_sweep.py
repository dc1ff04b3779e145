"""The bucket sweep: fastddp at fixed ``bucket_cap_mb`` in {1, 5, 10, 25, 50,
100} against ``bucket_cap_mb="auto"``, paired by round, per model and network
speed; writes ``reports/<machine>/<date>-bucket-sweep.md`` (+ chart, json).

    python -m tools.bucket_sweep --models small mlp25m --speeds none netns:1

Each speed is one ``fastddp-bench`` run (``none``: the plain local link;
``netns:RATE``: two ranks in network namespaces over a veth pair shaped to
RATE Gbit/s; ``sim:GBPS``: the simulated wire) with the rows ``fastddp-capN``,
``fastddp`` (torch's default, ``bucket_cap_mb=None``: 25 MiB with a 1 MiB first
bucket, a layout of its own where an explicit 25 puts 25 MiB in the first
bucket) and ``fastddp-auto``.  auto tunes first, its steps back to back and alone
(as a training loop runs it; ``fastddp.bench.rounds._tune_alone``), then every row
has the same ``--warmup`` rounds (default 3) and timed rounds, so auto's
tuning steps are not timed.  Per model and speed the verdicts are the issue's:

* auto within 3% of the best fixed layout (caps that gave the same buckets
  pooled): the 90% interval of auto / best lies below 1.03 (``met``), above
  it (``missed``), else ``undecided``;
* where cap 25's layout is measurably slower than the best: auto / cap 25's
  layout's interval lies below 1 (``met``), else ``missed`` / ``undecided``;
  the same against torch's default's layout (reports that ran its row).

``--repeats K`` runs the bench K times in fresh processes: a row keeps its
memory placement for a whole run, and rows of one program were measured up
to 4% apart in one run, so one run's bootstrap over rounds understates the
uncertainty; with K runs the interval is Student's t over the runs' ratios.

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

from fastddp.bench import report as R
from fastddp.bench import stats as S
from fastddp.bench.wrappers import SWEEP_CAPS_MB

WITHIN = 0.03


DEFAULT = "default"
"""The setting torch gives without ``bucket_cap_mb`` (25 MiB, first bucket 1
MiB): the ``fastddp`` row.  An explicit ``bucket_cap_mb=25`` makes the first
bucket 25 MiB too (torch's rule), so cap 25 is another layout where the first
bucket matters."""


SETTINGS = (*SWEEP_CAPS_MB, DEFAULT)
"""Every fixed setting the sweep runs (the analysis takes those a report has)."""


def _cap_name(c) -> str:
    return "fastddp" if c == DEFAULT else f"fastddp-cap{c:g}"


def _name(c) -> str:
    return DEFAULT if c == DEFAULT else f"{c:g}"


def run_speed(speed: str, models: list[str], budget: float, warmup: int, out: Path, tag: str = "") -> Path:
    """One bench run for ``speed`` (``tag``: appended to its label); returns its json report."""
    wrappers = [_cap_name(c) for c in SWEEP_CAPS_MB] + [_cap_name(DEFAULT), "fastddp-auto"]
    label = "bucket-sweep-" + re.sub(r"[^a-z0-9]+", "-", speed.lower()).strip("-") + (f"-{tag}" if tag else "")
    cmd = [sys.executable, "-m", "fastddp.bench", "--models", *models, "--wrappers", *wrappers,
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


def _layout_key(row: R.Row, cap):
    """Rows with the same buckets ran the same program; without the record
    (reports before it) every cap is its own layout."""
    return tuple(map(tuple, row.buckets)) if row.buckets else ("cap", cap)


def _pooled(rows: list[R.Row]) -> list[float]:
    """Per round, the mean of rows that ran the same buckets."""
    n = min(len(r.step_ms) for r in rows)
    return [math.fsum(r.step_ms[i] for r in rows) / len(rows) for i in range(n)]


def _versus(a_runs: list[list[R.Row]], b_runs: list[list[R.Row]], model: str, what: str, peer: str):
    """Rows ``a`` / rows ``b``, each pooled per round (a layout's rows): one
    run, the paired bootstrap over rounds; several runs (fresh processes, so
    fresh memory placement), the t interval over the runs' ratios of trimmed
    means."""
    if len(a_runs) == 1:
        v = S.compare(_pooled(a_runs[0]), _pooled(b_runs[0]), model=model, wrapper=what, peer=peer)
        return {"ratio": v.ratio, "ci": v.ratio_ci, "per_run": [v.ratio]}
    per = [S.trimmed_mean(_pooled(a)) / S.trimmed_mean(_pooled(b)) for a, b in zip(a_runs, b_runs)]
    ratio, ci = S.ratio_over_runs(per)
    return {"ratio": ratio, "ci": ci, "per_run": per}


def _row_floor(groups: dict, tm_runs: list[dict]) -> tuple[float | None, int]:
    """The spread of rows that ran the same buckets in the same run: the
    robust relative sd of each row's trimmed mean about its layout's mean
    (pooled over layouts and runs; None without such rows).  The bootstrap
    over rounds does not see it: a row keeps its memory placement.
    ``tm_runs``: per run, each cap's trimmed mean."""
    devs, dof = [], 0
    for tm in tm_runs:
        for members in groups.values():
            if len(members) < 2:
                continue
            logs = [math.log(tm[c]) for c in members]
            m = math.fsum(logs) / len(logs)
            devs += [(x - m) ** 2 for x in logs]
            dof += len(logs) - 1
    return (math.sqrt(math.fsum(devs) / dof) if dof else None), dof


def analyse(speed: str, report: R.Report) -> list[dict]:
    """One run (see :func:`analyse_runs`)."""
    return analyse_runs(speed, [report])


def analyse_runs(speed: str, reports: list[R.Report], only: str | None = None) -> list[dict]:
    """Per model: every cap's step time, auto against the best layout and
    against cap 25's, the verdicts.  ``reports``: runs of the same rows in
    fresh processes (``--repeats``).  Caps that gave the same buckets (in
    every run) are one layout, their rows pooled per round: the best fixed
    setting is the best layout, not the luckiest of several rows running one
    program.  ``only``: that model's rows."""
    per_model: dict[str, list] = {}
    for rep in reports:
        for sec in rep.sections:
            by_model: dict[str, dict[str, R.Row]] = {}
            for row in sec.rows:
                if row.ok and (only is None or row.model == only):
                    by_model.setdefault(row.model, {})[row.wrapper] = row
            for model, rows in by_model.items():
                per_model.setdefault(model, []).append((sec.bandwidth_gbps, rows))
    out = []
    for model, runs in per_model.items():
        runs = [(bw, rows) for bw, rows in runs if "fastddp-auto" in rows]
        if not runs:
            continue
        autos = [rows["fastddp-auto"] for _, rows in runs]
        caps_runs = [{c: rows[_cap_name(c)] for c in SETTINGS if _cap_name(c) in rows} for _, rows in runs]
        defaults = [rows.get("fastddp") for _, rows in runs]  # bucket_cap_mb=None: torch's default layout
        tunes = [a.autotune or {} for a in autos]
        tried = [t for tune in tunes for lay in tune.get("tried", []) for t in lay.get("step_ms", []) if t is not None]
        chosen = [tune.get("chosen") or tune.get("current") or {} for tune in tunes]
        res = {"speed": speed, "bandwidth_gbps": runs[0][0], "model": model, "runs": len(runs),
               "auto_state": tunes[0].get("state"),
               "auto_settled_at_step": max((t.get("settled_at_step") or 0) for t in tunes) if tunes else None,
               "auto_chose": chosen[0].get("torch_args"), "auto_buckets": chosen[0].get("buckets"),
               "auto_chose_per_run": [c.get("torch_args") for c in chosen],
               "tuning_slowest_step_ms": max(tried) if tried else None,
               "tuning_layouts_tried": max(len(t.get("tried", [])) for t in tunes)}
        common = set.intersection(*(set(c) for c in caps_runs)) if all(caps_runs) else set()
        caps = [c for c in SETTINGS if c in common]
        if any(c != DEFAULT for c in caps):
            groups: dict = {}
            for c in caps:
                groups.setdefault(tuple(_layout_key(cr[c], c) for cr in caps_runs), []).append(c)
            tm_runs = [{c: S.trimmed_mean(cr[c].step_ms) for c in caps} for cr in caps_runs]  # per run, per cap
            auto_tm = [S.trimmed_mean(a.step_ms) for a in autos]
            mean = {c: S.geo_mean([tm[c] for tm in tm_runs]) for c in caps}
            gmean = {k: S.geo_mean([S.trimmed_mean(_pooled([cr[c] for c in m])) for cr in caps_runs])
                     for k, m in groups.items()}
            best_key = min(gmean, key=gmean.get)
            best = min(groups[best_key], key=mean.get)
            rows_of = lambda key: [[cr[c] for c in groups[key]] for cr in caps_runs]  # noqa: E731
            auto_rows = [[a] for a in autos]
            best_label = f"layout {_name(best)}"
            vs_best = _versus(auto_rows, rows_of(best_key), model, "fastddp-auto", best_label)

            def target(setting, whose: str):
                """auto against ``setting``'s layout, that layout against the
                best, and the verdict: beating it is a target only where it is
                measurably slower than the best.  (None, None, None) where the
                sweep did not run ``setting``."""
                key = next((k for k, m in groups.items() if setting in m), None)
                if key is None:
                    return None, None, None
                label = f"layout {_name(setting)}"
                vs = _versus(auto_rows, rows_of(key), model, "fastddp-auto", label)
                gap = _versus(rows_of(key), rows_of(best_key), model, label, best_label) if key != best_key else None
                verdict = (f"n/a ({whose} layout is the best)" if gap is None else
                           f"n/a ({whose} layout within noise of the best)"
                           if gap["ci"] is None or gap["ci"][0] <= 1.0 else _verdict(vs["ci"], 1.0))
                return vs, gap, verdict

            vs25, gap25, beat25 = target(25, "25's")
            vsd, gapd, beatd = target(DEFAULT, "the default's")  # torch's bucket_cap_mb=None, where it ran
            # auto against the fixed rows that ran its very buckets (the same program): the row floor seen from auto
            same = []
            for a, a_tm, cr in zip(autos, auto_tm, caps_runs):
                m = [c for c in caps if a.buckets and cr[c].buckets == a.buckets]
                if m:
                    same.append(a_tm / S.trimmed_mean(_pooled([cr[c] for c in m])))
            floor, floor_dof = _row_floor(groups, tm_runs)
            single = len(runs) == 1
            res.update({
                "rounds": min(len(r.step_ms) for r in autos + [cr[c] for cr in caps_runs for c in caps]),
                "step_ms": {**{_name(c): mean[c] for c in caps}, "auto": S.geo_mean(auto_tm)},
                "p20_p80": ({**{_name(c): (caps_runs[0][c].step.p20, caps_runs[0][c].step.p80) for c in caps},
                             "auto": (autos[0].step.p20, autos[0].step.p80)} if single else
                            {**{_name(c): (min(tm[c] for tm in tm_runs), max(tm[c] for tm in tm_runs)) for c in caps},
                             "auto": (min(auto_tm), max(auto_tm))}),
                "layouts": [{"caps": [_name(c) for c in m], "ms": gmean[k],
                             "buckets": len(caps_runs[0][m[0]].buckets) if caps_runs[0][m[0]].buckets else None}
                            for k, m in groups.items()],
                "best": best, "best_caps": [_name(c) for c in groups[best_key]],
                "auto_vs_best": vs_best, "auto_vs_25": vs25,
                "auto_vs_same_buckets": {"ratio": S.geo_mean(same), "runs": len(same)} if same else None,
                "row_floor": floor, "row_floor_dof": floor_dof,
                "within_3pct_of_best": _verdict(vs_best["ci"], 1.0 + WITHIN),
                "layout25_vs_best": gap25,
                "better_than_25": beat25 or "n/a (no cap 25 row)",
                "auto_vs_default_layout": vsd, "default_layout_vs_best": gapd,
                "better_than_default": beatd})
        if defaults[0] is not None and len(runs) == 1 and "best" not in res:
            auto, default = autos[0], defaults[0]
            v = S.compare(auto.step_ms, default.step_ms, model=model, wrapper="fastddp-auto", peer="fastddp")
            res["auto_vs_default"] = {"ratio": v.ratio, "ci": v.ratio_ci, "rounds": v.rounds,
                                      "verdict": S.decide(v.ratio_ci, WITHIN),
                                      "default_ms": S.trimmed_mean(default.step_ms),
                                      "auto_ms": S.trimmed_mean(auto.step_ms)}
        out.append(res)
    return out


def _ci(ci) -> str:
    return "-" if ci is None else f"{ci[0]:.3f}..{ci[1]:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def to_markdown(results: list[dict], meta: dict, runs: dict[str, str]) -> str:
    swept = [r for r in results if "best" in r]
    with_default = any(r.get("auto_vs_default_layout") for r in swept)
    caps = [f"{c:g}" for c in SWEEP_CAPS_MB] + ([DEFAULT] if with_default else [])
    lines = ["# Bucket sweep: fixed bucket_cap_mb against \"auto\"", "",
             "How to read it: every setting runs one step per round, in rotated order, on the same "
             "ranks; a round's time is the slowest rank's. Step times are trimmed means over rounds "
             "(ms; over several runs, their geometric mean). Caps that gave the same buckets ran the "
             "same program: they are one layout, their rows pooled per round, and `best` is the best "
             "layout (named by its smallest row). `auto / best`: auto's step over that layout's, with "
             "its 90% interval: for one run the paired bootstrap over rounds, for several runs (fresh "
             "processes) the t interval over the runs' ratios, which also holds the spread of rows "
             "that keep one memory placement for a whole run (`row floor`: the relative sd of rows "
             "that ran the same buckets in the same run; the bootstrap over rounds cannot see it). "
             "Verdicts: auto within 3% of the best (interval below 1.03), and faster than cap 25's "
             "layout (interval below 1) where that layout is measurably slower than the best (its "
             "own interval against the best above 1; else `n/a`)" +
             ("; the same against torch's default (`default`: `bucket_cap_mb=None`, 25 MiB with a 1 MiB "
              "first bucket; an explicit 25 makes the first bucket 25 MiB too)." if with_default else "."), "",
             f"Machine: {meta.get('device')}, {meta.get('cores')}; world {meta.get('world_size')} "
             f"({meta.get('backend')}); torch {meta.get('torch')}; git `{meta.get('git')}`; "
             f"load {meta.get('load')}.", "",
             "Runs: " + "; ".join(f"{k}: `{v}`" for k, v in runs.items()), "",
             "| speed | model | runs x rounds | " + " | ".join(c if c == DEFAULT else f"cap {c}" for c in caps) +
             " | auto | best | auto / best | 90% | within 3% | auto / 25 | 90% | better than 25 | " +
             ("auto / default | 90% | better than default | " if with_default else "") +
             "auto chose | auto / same buckets | row floor |",
             "|---|---|---:|" + "---:|" * len(caps) + "---:|---:|---:|---:|---|---:|---:|---|" +
             ("---:|---:|---|" if with_default else "") + "---|---:|---:|"]
    for r in swept:
        cells = [r["speed"], r["model"], f"{r['runs']} x {r['rounds']}"]
        cells += [f"{r['step_ms'][c]:.1f}" if c in r["step_ms"] else "-" for c in caps]
        vb, v25 = r["auto_vs_best"], r["auto_vs_25"]
        cells += [f"{r['step_ms']['auto']:.1f}", "/".join(r["best_caps"]), f"{vb['ratio']:.3f}",
                  _ci(vb["ci"]), r["within_3pct_of_best"]]
        cells += [f"{v25['ratio']:.3f}" if v25 else "-", _ci(v25["ci"]) if v25 else "-", r["better_than_25"]]
        if with_default:
            vd = r.get("auto_vs_default_layout")
            cells += ([f"{vd['ratio']:.3f}", _ci(vd["ci"]), r["better_than_default"]] if vd else ["-", "-", "-"])
        chose = [c for c in r.get("auto_chose_per_run") or [r["auto_chose"]] if c is not None]
        cells.append("-" if not chose else "; ".join(", ".join(f"{k}={v}" for k, v in c.items()) for c in chose) +
                     ("" if r["runs"] > 1 else f" ({r['auto_buckets']} buckets)"))
        same = r["auto_vs_same_buckets"]
        cells += [f"{same['ratio']:.3f} ({same['runs']} run{'s' if same['runs'] > 1 else ''})" if same else "-",
                  _pct(r["row_floor"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Layouts (caps that gave the same buckets; buckets; step ms):", ""]
    for r in swept:
        lines.append(f"- {r['speed']} / {r['model']}: " + "; ".join(
            f"{', '.join(l['caps'])}: {l['buckets'] if l['buckets'] is not None else '?'} buckets, {l['ms']:.1f}"
            for l in r["layouts"]))
    lines += ["", "Tuning cost (auto's own first steps, run alone before the rounds above and not timed):", "",
              "| speed | model | layouts tried | settled at step | slowest trial step ms | settled step ms | x |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in swept:
        slow, settled = r["tuning_slowest_step_ms"], r["step_ms"]["auto"]
        x = "-" if slow is None else f"{slow / settled:.2f}"
        lines.append(f"| {r['speed']} | {r['model']} | {r['tuning_layouts_tried']} | "
                     f"{r['auto_settled_at_step'] if r['auto_settled_at_step'] is not None else '-'} | "
                     f"{'-' if slow is None else f'{slow:.1f}'} | {settled:.1f} | {x} |")
    met = sum(r["within_3pct_of_best"] == "met" for r in swept)
    lines += ["", f"auto within 3% of the best fixed cap: {met} of {len(swept)} (model, speed) pairs; "
              f"better than an explicit 25 where 25's layout is not the best: "
              f"{sum(r['better_than_25'] == 'met' for r in swept)} of "
              f"{sum(not r['better_than_25'].startswith('n/a') for r in swept)}" +
              (f"; better than torch's default where its layout is not the best: "
               f"{sum(r.get('better_than_default') == 'met' for r in swept)} of "
               f"{sum(bool(r.get('better_than_default')) and not r['better_than_default'].startswith('n/a') for r in swept)}"
               if with_default else "") + ".", ""]
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
                         f"{S.verdict_text(v['verdict'], WITHIN)} |")
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
        colors = ["#d62728" if k == "auto" else ("#2ca02c" if k in r["best_caps"] else "#1f77b4")
                  for k in names]
        ax.bar(range(len(names)), vals, yerr=[[max(0, x) for x in lo], [max(0, x) for x in hi]],
               color=colors, capsize=3)
        ax.set_xticks(range(len(names)), [k if k in ("auto", DEFAULT) else f"{k} MiB" for k in names], fontsize=8)
        ax.set_ylabel("step ms (trimmed mean, p20-p80)")
        ratio = r["auto_vs_best"]["ratio"]
        ax.set_title(f"{r['model']} @ {r['speed']}: auto / best {ratio:.3f}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("bucket_cap_mb sweep (green: best fixed, red: auto)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bucket_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small", "transformer", "convnet", "mlp25m"])
    ap.add_argument("--speeds", nargs="+", default=["none", "netns:1"],
                    help="none (the local link), netns:RATE (Gbit/s, real shaped link; root), sim:GBPS")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per model and speed (bench --budget)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed rounds of every row (auto has tuned alone before them)")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--repeats", type=int, default=1,
                    help="bench runs per speed, each in fresh processes (fresh memory placement); "
                         "verdicts from the spread of their ratios")
    ap.add_argument("--from-json", nargs="*", default=None, metavar="SPEED=PATH",
                    help="analyse existing bench reports instead of running (a later report of the "
                         "same speed and model replaces an earlier one's rows, or with --as-repeats "
                         "joins them as another run)")
    ap.add_argument("--as-repeats", action="store_true",
                    help="with --from-json: reports of the same speed and model are repeated runs")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    out = Path(args.out)
    paths: list[tuple[str, Path]] = []
    if args.from_json:
        for item in args.from_json:
            speed, _, p = item.partition("=")
            paths.append((speed, Path(p)))
    else:
        for speed in args.speeds:
            for k in range(args.repeats):
                tag = f"r{k + 1}" if args.repeats > 1 else ""
                paths.append((speed, run_speed(speed, args.models, args.budget, args.warmup, out, tag)))
    combine = args.as_repeats or args.repeats > 1
    grouped: dict[tuple[str, str], list[R.Report]] = {}  # (speed, model) -> its runs
    meta, runs = {}, {}
    for speed, p in paths:
        rep = R.from_json(p.read_text())
        meta = meta or rep.meta
        runs.setdefault(speed, []).append(str(p))
        for model in dict.fromkeys(row.model for sec in rep.sections for row in sec.rows):
            if combine:
                grouped.setdefault((speed, model), []).append(rep)
            else:
                grouped[(speed, model)] = [rep]
    merged = {key: r for key, reps in grouped.items() for r in analyse_runs(key[0], reps, only=key[1])}
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
