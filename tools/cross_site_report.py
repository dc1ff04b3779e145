"""The figures of tools/cross_site_bench.py's JSON, as markdown tables.

    python tools/cross_site_report.py /tmp/cs.json [--fixed fixed.json]

* loss at equal steps: each run's validation loss at every evaluation, and
  its gap to torch's DDP at the same step;
* steps to target: the first evaluation at or below the target, torch's
  DDP's validation loss at the evaluation nearest ``--target-frac`` of the
  run (default 0.75: the other runs get a quarter more steps to reach it
  than DDP took); ``never`` where the run did not reach it;
* time to target at each timed rate: the warm-up's steps at torch's DDP's
  step time (the warm-up reduces as torch's DDP does; ``-wFORMAT``: at the
  hierarchical mode's with that wire), the others at the run's own mean step
  time at that rate (a whole number of sync periods);
* step time ÷ the local step (no communication) and ÷ torch's DDP;
* bytes out of a host per step past the fixed cost (veth counters; the
  fixed cost is a run of the same kind with no step, ``--fixed``).
"""

from __future__ import annotations

import argparse
import json


def steps_to(evals, target):
    for t, loss in evals:
        if loss <= target:
            return t + 1
    return None


def _warm(run: str, warmup: int) -> int:
    return warmup if run.startswith(("cross", "torch-postlocal")) else 0


def _warm_peer(run: str) -> str:
    """The timed run whose step time the warm-up's steps take: torch's DDP,
    or the hierarchical mode a ``-wFORMAT`` warm-up runs on."""
    last = run.split("-")[-1]
    return f"fastddp-hier-{last[1:]}" if run.startswith("cross") and last in ("wfp32", "wbf16", "wfp8") else "torch-ddp"


def tables(res: dict, fixed: dict | None = None, target_frac: float = 0.75, loss_runs=None, every: int = 1) -> str:
    curves, timed, cfg = res["curves"], res["timed"], res["config"]
    warmup = cfg["warmup"]
    ref = curves["torch-ddp"]["evals"]
    at = min(range(len(ref)), key=lambda i: abs(ref[i][0] + 1 - target_frac * (ref[-1][0] + 1)))
    target = ref[at][1]
    rates = sorted({float(k.split("@")[1]) for k in timed}, reverse=True)
    out = [f"Target: torch's DDP's validation loss at step {ref[at][0] + 1} of {ref[-1][0] + 1}: **{target:.4f}**.", ""]
    out += ["| run | loss at the last step | gap to DDP there | steps to target | " +
            " | ".join(f"time to target @{r:g} (× DDP, × hier fp8)" for r in rates) + " |",
            "|---|---|---|---|" + "---|" * len(rates)]
    for run, c in curves.items():
        if run in ("local", "host"):
            continue
        last = c["evals"][-1][1]
        n = steps_to(c["evals"], target)
        cells = [run, f"{last:.4f}", f"{(last / ref[-1][1] - 1) * 100:+.1f}%", str(n) if n else "never"]
        for r in rates:
            own = timed.get(f"{run}@{r:g}") or timed.get(f"{run}@{r}")
            ddp = timed.get(f"torch-ddp@{r:g}") or timed.get(f"torch-ddp@{r}")
            peer = _warm_peer(run)
            warm_t = timed.get(f"{peer}@{r:g}") or timed.get(f"{peer}@{r}")
            hier = timed.get(f"fastddp-hier-fp8@{r:g}") or timed.get(f"fastddp-hier-fp8@{r}")
            if not (own and ddp and warm_t and n):
                cells.append("—")
                continue
            w = min(_warm(run, c.get("warmup", warmup)), n)
            secs = w * warm_t["mean_step_s"] + (n - w) * own["mean_step_s"]
            ddp_secs = steps_to(ref, target) * ddp["mean_step_s"]
            hn = steps_to(curves.get("fastddp-hier-fp8", {}).get("evals", []), target)
            hier_secs = hn * hier["mean_step_s"] if (hier and hn) else None
            cells.append(f"{secs:.1f} s ({secs / ddp_secs:.3f}, "
                         f"{'—' if hier_secs is None else f'{secs / hier_secs:.3f}'})")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "| run | " + " | ".join(f"step @{r:g}: ms, × local, × DDP; bytes out of a host per step"
                                        for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for run in curves:
        cells = [run]
        for r in rates:
            own = timed.get(f"{run}@{r:g}") or timed.get(f"{run}@{r}")
            loc = timed.get(f"local@{r:g}") or timed.get(f"local@{r}")
            ddp = timed.get(f"torch-ddp@{r:g}") or timed.get(f"torch-ddp@{r}")
            if not own:
                cells.append("—")
                continue
            nbytes = max(own["bytes_out"]) - (max(fixed[run.split("-")[0]]["bytes_out"]) if fixed and
                                                run.split("-")[0] in fixed else 0)
            cells.append(f"{own['mean_step_s'] * 1e3:.0f}, {own['mean_step_s'] / loc['mean_step_s']:.2f}, "
                         f"{own['mean_step_s'] / ddp['mean_step_s']:.3f}; "
                         f"{nbytes / len(own['step_s']) / 1e6:.2f} MB")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Measured end to end: each curve run's own step times summed to the target, at the rate it "
            "ran at (the time a run took to train, without its evaluations):", "",
            "| run | rate, Gbit/s | steps to target | time to target | × DDP's curve run, if at that rate |",
            "|---|---|---|---|---|"]
    ddp_n = steps_to(ref, target)
    for run, c in curves.items():
        n = steps_to(c["evals"], target)
        if run in ("local", "host") or not n or not c.get("step_s"):
            continue
        secs = sum(c["step_s"][:n])
        same = c.get("rate_gbit") == curves["torch-ddp"].get("rate_gbit")
        cell = f"{secs / sum(curves['torch-ddp']['step_s'][:ddp_n]):.3f}" if same else "—"
        out.append(f"| {run} | {c.get('rate_gbit')} | {n} | {secs:.1f} s | {cell} |")
    evals = [t for t, _ in ref]
    shown = {r: curves[r] for r in (loss_runs or curves)}
    out += ["", "Validation loss at equal steps (gap to torch's DDP in brackets):", "",
            "| step | " + " | ".join(r for r in shown) + " |", "|---|" + "---|" * len(shown)]
    for i, t in enumerate(evals):
        if i % every and i != len(evals) - 1:
            continue
        row = [str(t + 1)]
        for run, c in shown.items():
            loss = dict(c["evals"]).get(t)
            row.append("—" if loss is None else f"{loss:.3f} ({(loss / ref[i][1] - 1) * 100:+.1f}%)")
        out.append("| " + " | ".join(row) + " |")
    syncs = {k: v["cross_site"] for k, v in timed.items() if "cross_site" in v}
    if syncs:
        out += ["", "CrossSite in the timed runs: delays chosen, the last exchange, the time the main thread waited:", ""]
        for k, s in syncs.items():
            out.append(f"- {k}: delays {s['delays']}, exchange {s['exchange_s_last']} s, waited "
                       f"{s['exposed_wait_s']:.3f} s over {s['steps']} steps, {s['bytes_between_hosts']} payload bytes")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--fixed", help="another run's JSON whose 'fixed' entry (no-step runs) gives the fixed cost")
    p.add_argument("--target-frac", type=float, default=0.75)
    p.add_argument("--loss-runs", help="comma-separated runs of the loss table (default: all)")
    p.add_argument("--every", type=int, default=1, help="every n-th evaluation in the loss table")
    a = p.parse_args(argv)
    res = json.load(open(a.results))
    fixed = json.load(open(a.fixed))["fixed"] if a.fixed else res.get("fixed") or None
    print(tables(res, fixed, a.target_frac, a.loss_runs.split(",") if a.loss_runs else None, a.every))


if __name__ == "__main__":
    main()
