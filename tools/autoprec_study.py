"""``auto_precision_hook`` on the real link (two network namespaces joined by a
``tc tbf``-shaped veth, tools/netlink.py; needs root and iproute2): the two
studies the issue asks for besides the benchmark's fixed-rate rows.

``drop``: the link starts at ``--before`` Gbit/s and drops to ``--after``
mid-training.  Every rank trains five models of the same MLP side by side,
one step each per round, order rotated: the auto setting (lowest fp8) and
the four fixed formats it chooses from, fastddp's default (fp32), bf16 +
fp32 sum, fp8 with error feedback, and torch's DDP.  Once the auto setting
has settled on the fast link and its watch holds a baseline, the ranks ask
for the drop (a file), the parent shapes the live link, and the rounds go
on: how many steps the setting takes to move, and then ``--rounds`` paired
rounds of its step against each fixed format's (geometric mean of the
per-round ratios, 90% t interval).

``train``: ``--steps`` SGD steps at ``--rate`` Gbit/s, torch's DDP (fp32)
and the auto setting trained side by side from one initialisation on the
same batches (SGD with momentum 0.9); every step's loss (the mean over the ranks), the format the
setting chose and when.  ``--chart`` draws the two curves.

    python -m tools.autoprec_study drop --before 10 --after 0.5 --out reports/amd-epyc/x-drop.json
    python -m tools.autoprec_study train --rate 0.2 --steps 300 --out reports/amd-epyc/x-train.json --chart x.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastddp.autotune.precision import paired_interval

REPO = Path(__file__).resolve().parents[1]
FIXED = ("fastddp", "bf16acc", "fp8", "torch")
TAIL = 20  # steps after a trial whose median is its result's


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``a[i] / b[i]`` with its 90% t interval (the rounds
    pair the two: what moves a round moves both): the auto setting's own
    paired interval, untrimmed."""
    pairs = [(x, y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not pairs:
        raise ValueError("no paired samples")
    est, lo, hi = paired_interval([y for _, y in pairs], [x for x, _ in pairs], trim=0.0)
    if len(pairs) < 2:
        return math.exp(est), math.nan, math.nan
    return math.exp(est), math.exp(lo), math.exp(hi)


def moved_after(formats: list[str]) -> int | None:
    """Steps from the drop until the format stops changing for good (the
    first index from which every step uses the last step's format)."""
    if not formats:
        return None
    last = formats[-1]
    k = len(formats)
    while k > 0 and formats[k - 1] == last:
        k -= 1
    return k


# ----------------------------------------------------------------- ranks
def _mlp(width: int, depth: int):
    import torch

    torch.manual_seed(0)
    layers, d = [], 256
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.GELU()]
        d = width
    layers.append(torch.nn.Linear(d, 10))
    return torch.nn.Sequential(*layers)


def _wrap(name: str, width: int, depth: int):
    import torch

    import fastddp
    import fastddp.hooks as fh

    if name == "torch":
        return torch.nn.parallel.DistributedDataParallel(_mlp(width, depth))
    m = fastddp.DistributedDataParallel(_mlp(width, depth))
    if name == "auto":
        m.register_comm_hook(fh.AutoPrecisionState(lowest="fp8"), fh.auto_precision_hook)
    elif name == "bf16acc":
        m.register_comm_hook(None, fh.bf16_fp32acc_hook)
    elif name == "fp8":
        m.register_comm_hook(fh.FP8CompressionState(), fh.fp8_compress_hook)
    return m


_TEACHER = []


def _batch(rank: int, step: int):
    """Rank ``rank``'s batch of step ``step``: inputs and a fixed random
    teacher's outputs plus noise (a target an MLP learns in a few hundred steps)."""
    import torch

    if not _TEACHER:
        _TEACHER.append(torch.randn(256, 10, generator=torch.Generator().manual_seed(123)) / 16)
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 256, generator=g)
    return x, torch.tanh(2 * x @ _TEACHER[0]) + 0.05 * torch.randn(32, 10, generator=g)


class _Trainer:
    def __init__(self, name, width, depth, lr):
        import torch

        self.name, self.model = name, _wrap(name, width, depth)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)

    def step(self, x, y) -> tuple[float, float]:
        import torch

        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss.detach())

    def auto(self) -> dict:
        return self.model.stats()["auto_precision"]

    def layout_settled(self) -> bool:
        """The bucket tuner the setting turns on (torch's default caps) is not trying layouts."""
        tune = self.model.stats().get("autotune")
        return tune is None or tune["state"] == "settled"


def _rank_drop(out: Path, a: dict) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    names = ("auto",) + FIXED
    tr = {n: _Trainer(n, a["width"], a["depth"], 0.01) for n in names}
    times = {n: [] for n in names}
    fmts, phase_of, k = [], [], 0

    def round_():
        nonlocal k
        x, y = _batch(rank, k)
        order = names[k % len(names):] + names[:k % len(names)]
        for n in order:
            times[n].append(tr[n].step(x, y)[0])
        fmts.append(tr["auto"].auto()["current"])
        k += 1

    while k < a["max_rounds"]:  # the fast link: settle, and a watch baseline
        round_()
        st = tr["auto"].auto()
        if st["state"] == "settled" and st["watch"]["baseline_ms"] is not None:
            break
    before = {"format": tr["auto"].auto()["chosen"], "rounds": k}
    if rank == 0:
        (out / "drop").write_text("")
    deadline = time.monotonic() + 60
    while not (out / "dropped").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the parent never dropped the link")
        time.sleep(0.05)
    dist.barrier()
    k0, remeasures = k, tr["auto"].auto()["watch"]["remeasures"]
    while k < k0 + a["max_rounds"]:  # until the setting has re-measured and settled again
        round_()
        st = tr["auto"].auto()
        if st["state"] == "settled" and st["watch"]["remeasures"] > remeasures and tr["auto"].layout_settled():
            break  # the new format, and its layout tuned again where it changed
    settled = k
    for _ in range(a["rounds"]):
        round_()
    if rank == 0:
        (out / "result.json").write_text(json.dumps({
            "before": before, "drop_round": k0, "settled_round": settled, "formats": fmts,
            "times": times, "stats": tr["auto"].auto(),
            "autotune": tr["auto"].model.stats().get("autotune")}))


def _rank_train(out: Path, a: dict) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tr = {n: _Trainer(n, a["width"], a["depth"], a["lr"]) for n in ("torch", "auto")}
    loss = {n: [] for n in tr}
    times = {n: [] for n in tr}
    fmts = []
    for k in range(a["steps"]):
        x, y = _batch(rank, k)
        for n in (("torch", "auto") if k % 2 == 0 else ("auto", "torch")):
            dt, v = tr[n].step(x, y)
            times[n].append(dt)
            loss[n].append(v)
        fmts.append(tr["auto"].auto()["current"])
    mean = torch.tensor([loss["torch"], loss["auto"]], dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    if rank == 0:
        (out / "result.json").write_text(json.dumps({
            "loss": {"torch": mean[0].tolist(), "auto": mean[1].tolist()}, "formats": fmts,
            "times": times, "stats": tr["auto"].auto(),
            "autotune": tr["auto"].model.stats().get("autotune")}))


def rank_main(what: str, out: str, args_json: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        (_rank_drop if what == "drop" else _rank_train)(Path(out), json.loads(args_json))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- parent
def _launch(what: str, rate: float, a: dict, tmp: Path, on_drop=None) -> dict:
    from tools.netlink import NetnsLink, parse_link

    def poll():  # the ranks ask for the drop (a file) at the same step; the link changes live
        if on_drop is not None and (tmp / "drop").exists() and not (tmp / "dropped").exists():
            link.set_rate(on_drop)
            (tmp / "dropped").write_text("")

    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "tools.autoprec_study", "_rank", what, str(tmp), json.dumps(a)]
    with NetnsLink(parse_link(f"netns:{rate:g}")) as link:
        link.run_ranks(argv, timeout_s=1800, on_poll=poll)
    return json.loads((tmp / "result.json").read_text())


def summarise_drop(r: dict) -> dict:
    after = r["formats"][r["drop_round"]:]
    s, t = r["settled_round"], r["times"]
    fixed = {}
    for n in FIXED:
        g, lo, hi = paired_ratio(t["auto"][s:], t[n][s:])
        fixed[n] = {"ratio": round(g, 4), "lo": round(lo, 4), "hi": round(hi, 4),
                    "median_ms": round(statistics.median(t[n][s:]) * 1e3, 2)}
    best = min((n for n in FIXED if n != "torch"), key=lambda n: fixed[n]["median_ms"])
    return {"before": r["before"], "after_format": after[-1], "steps_to_move": moved_after(after),
            "rounds_to_settle": s - r["drop_round"], "timed_rounds": len(t["auto"]) - s,
            "auto_median_ms": round(statistics.median(t["auto"][s:]) * 1e3, 2), "vs": fixed,
            "fixed_best": best, "tuning": tuning(r["stats"]["decisions"], t["auto"]),
            "decisions": r["stats"]["decisions"], "layout": _layout(r.get("autotune"))}


def _layout(tune: dict | None) -> dict | None:
    """The bucket tuner's outcome (the setting turns it on over torch's default caps)."""
    if tune is None:
        return None
    c = tune.get("chosen") or {}
    return {"state": tune["state"], "retunes": tune.get("retunes"), "settled_at_step": tune["settled_at_step"],
            "caps_mb": [c.get("first_mb"), c.get("rest_mb")], "buckets": c.get("buckets")}


def tuning(decisions: list, auto_times: list) -> list:
    """Each trial's cost: its steps, its slowest step, the median step of the
    ``TAIL`` steps after it (the chosen format's), in ms."""
    out = []
    for d in decisions:
        t0, n = d.get("trial_from_step"), d.get("trial_steps")
        if t0 is None or n is None:
            continue
        trial, after = auto_times[t0:t0 + n], auto_times[t0 + n:t0 + n + TAIL]
        out.append({"step": d["step"], "chosen": d["chosen"], "trial_steps": n,
                    "slowest_trial_step_ms": round(max(trial) * 1e3, 2) if trial else None,
                    "median_after_ms": round(statistics.median(after) * 1e3, 2) if after else None})
    return out


def summarise_train(r: dict) -> dict:
    lt, la = r["loss"]["torch"], r["loss"]["auto"]
    st = r["stats"]
    last = st["decisions"][-1]["chosen"] if st.get("decisions") else None
    return {"steps": len(lt), "final_loss": {"torch": lt[-1], "auto": la[-1]},
            "final_rel_diff": (la[-1] - lt[-1]) / lt[-1], "chosen": st.get("chosen") or last,
            "state_at_end": st.get("state"), "remeasures": (st.get("watch") or {}).get("remeasures"),
            "settled_at_step": st["settled_at_step"], "trial_steps": st["trial_steps"],
            "tuning": tuning(st.get("decisions", []), r["times"]["auto"]),
            "max_rel_dev": max(abs(b - a) / a for a, b in zip(lt, la)),
            "median_step_ms": {n: round(statistics.median(v) * 1e3, 2) for n, v in r["times"].items()},
            "layout": _layout(r.get("autotune"))}


def chart(r: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, label, style in (("torch", "torch DDP (fp32)", dict(lw=3, alpha=0.45)),
                            ("auto", "fastddp auto precision", dict(lw=1))):
        ax.plot(r["loss"][n], label=label, **style)  # torch's wide and pale: the two curves overlap
    st = r["stats"]
    if st.get("settled_at_step"):
        ax.axvline(st["settled_at_step"], color="grey", ls=":", lw=1, label=f"chose {st['chosen']}")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        rank_main(*argv[1:4])
        return 0
    p = argparse.ArgumentParser(prog="python -m tools.autoprec_study", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("drop", "train"))
    p.add_argument("--before", type=float, default=10.0, help="drop: Gbit/s at first")
    p.add_argument("--after", type=float, default=0.5, help="drop: Gbit/s after the drop")
    p.add_argument("--rounds", type=int, default=30, help="drop: paired rounds timed after it settles again")
    p.add_argument("--max-rounds", type=int, default=200, help="drop: bound on each phase's rounds")
    p.add_argument("--rate", type=float, default=0.2, help="train: Gbit/s")
    p.add_argument("--steps", type=int, default=300, help="train: steps")
    p.add_argument("--lr", type=float, default=0.05, help="train: SGD learning rate")
    p.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    p.add_argument("--depth", type=int, default=3, help="the MLP's hidden layers")
    p.add_argument("--out", help="write the raw results and the summary as JSON here")
    p.add_argument("--chart", help="train: the loss curves as PNG here")
    a = p.parse_args(argv)
    args = {"width": a.width, "depth": a.depth, "rounds": a.rounds, "max_rounds": a.max_rounds,
            "steps": a.steps, "lr": a.lr}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoprec-study-") as tmp:
        if a.what == "drop":
            raw = _launch("drop", a.before, args, Path(tmp), on_drop=a.after)
            summary = summarise_drop(raw)
        else:
            raw = _launch("train", a.rate, args, Path(tmp))
            summary = summarise_train(raw)
    summary["setup"] = {"what": a.what, **vars(a), "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(summary, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "raw": raw}, default=str))
    if a.chart and a.what == "train":
        chart(raw, a.chart, f"W=2 over a {a.rate:g} Gbit/s link, {a.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
