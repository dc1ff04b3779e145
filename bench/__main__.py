"""``fastddp-bench`` / ``python -m fastddp.bench``: the end-to-end benchmark.

Runs the model zoo under local (no DDP), torch DDP and fastddp side by side,
interleaved round by round, on 2 gloo ranks (CPU) or one NCCL rank per GPU,
until every fastddp row's step-time ratio to each of its peers is known to
±3% (90% interval) or the model's time budget is spent; prints per model a
table and the verdicts (faster / slower / equal / undecided) and writes
``<out>/<device>/<date>-<label>.md`` + ``.json`` + PNG charts.
With no models, wrappers or wire of its own, on the CPU, the main job adds
a wire section: mlp25m over a 1 Gbit/s link (a real one as root with
iproute2, else the simulated wire), and it ends with a one-screen summary
(which fastddp setting to use here and what it gains, with intervals).
``--quick`` checks that every row runs, in about a minute: its few rounds
print no ratio ("too few rounds to compare") and it points to the full run.
Exits 1 when any fastddp row is unavailable or failed (the report is still
written), 2 on bad arguments.
See docs/benchmarking.md for how it measures and what every column means.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def _names(values: list[str] | None) -> tuple[str, ...] | None:
    """``["a,b", "c"]`` -> ``("a", "b", "c")``."""
    if values is None:
        return None
    return tuple(x for v in values for x in v.split(",") if x)


def _bandwidths(values: list[str] | None) -> tuple[float | None, ...]:
    if not values:
        return (None,)
    out: list[float | None] = []
    for x in _names(values) or ():
        if x.lower() in ("none", "off", "inf"):
            out.append(None)
            continue
        try:
            out.append(float(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--simulate-bandwidth: {x!r} is not a number of GB/s") from None
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODELS, model_zoo
    from .config import REBUILD_EVERY
    from .stats import DEFAULT_HALF_WIDTH as R_DEFAULT_HALF_WIDTH
    from .stoprule import DEFAULT_BUDGET_S as R_DEFAULT_BUDGET_S
    from .wire_section import WIRE_BUDGET_S
    from .wrappers import DEFAULT_WRAPPERS, registry

    p = argparse.ArgumentParser(
        prog="fastddp-bench",
        description="fastddp vs torch DDP, end to end: step time, overhead over no-DDP, ops or kernel "
                    "launches, bytes on the wire, peak memory, exposed communication.",
        epilog=f"models: {', '.join(model_zoo())} (default: {','.join(DEFAULT_MODELS)}); "
               f"wrappers: {', '.join(registry())} (default: {','.join(DEFAULT_WRAPPERS)}, "
               "+ torch-bf16 on CUDA). Lists take commas or spaces.")
    p.add_argument("--label", help="report name suffix (default: 'full', or 'quick' with --quick)")
    p.add_argument("--models", nargs="+", metavar="NAME", help="models to run")
    p.add_argument("--wrappers", nargs="+", metavar="NAME", help="wrappers to compare")
    p.add_argument("--world", type=int, help="ranks to spawn (default: 2 on CPU, all GPUs on CUDA; "
                                             "ignored under torchrun)")
    p.add_argument("--half-width", type=float, default=R_DEFAULT_HALF_WIDTH * 100, metavar="PCT",
                   help="precision goal: rounds go on until every fastddp/peer step-time ratio's 90%% interval "
                        "is within +-PCT%% (also the margin of an 'equal' verdict; default %(default)g)")
    p.add_argument("--precision", type=float, metavar="PCT",
                   help="the precision goal alone, when it should be finer than the verdict margin "
                        "(--half-width): e.g. --precision 1.5 keeps the +-3%% margin and measures until "
                        "every interval is within +-1.5%%, so pairs within ~1.5%% end 'equal' "
                        "(default: --half-width)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help=f"time per model (and simulated bandwidth) after which the rounds stop whatever the "
                        f"precision, plus what earlier models left unused: model i ends by (i+1) x SECONDS "
                        f"into the run (default {R_DEFAULT_BUDGET_S:g}: the 4 default models in at most 7 "
                        f"minutes; the main job's wire section gets this too, default "
                        f"{WIRE_BUDGET_S:g} s + what the models left)")
    p.add_argument("--steps", type=int, help="a fixed number of timed rounds per model instead of the "
                                             "precision goal and budget")
    p.add_argument("--warmup", type=int, help="warm-up rounds per model, >= 1 (default 3, quick 1)")
    p.add_argument("--rebuild-every", type=int, default=REBUILD_EVERY, metavar="K",
                   help="build every row afresh (model, wrapper, optimizer, buckets) after each K timed "
                        "rounds, so that a row's speed from where its memory landed is resampled; 0: "
                        "never (default %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float, help="bucket_cap_mb for both DDPs (default: theirs, 25)")
    p.add_argument("--out", default="reports", help="report folder (default: reports/)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a few rounds of every row, to check that each runs; too few to compare "
                        "(no ratio, no verdict: the full run gives them), the main job's self-tuning row "
                        "left out; about a minute on 2 idle CPU cores, the wire section's few rounds included")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace per wrapper (rank 0)")
    p.add_argument("--simulate-bandwidth", nargs="+", metavar="GBPS",
                   help="simulated serial interconnect in GB/s; a list (1,10) gives one section each; "
                        "'none' adds a section without simulation")
    p.add_argument("--link", metavar="netns:RATE",
                   help="a real link: 2 ranks in two network namespaces joined by a veth pair shaped to "
                        "RATE Gbit/s (tc tbf); gloo on the CPU; needs root, iproute2 and a clone of the "
                        "repository (the tooling is its tools/netlink.py, not installed)")
    p.add_argument("--ranks-per-host", type=int, metavar="L",
                   help="with --link: L ranks in each namespace (two hosts of L ranks; --world is then "
                        "2L); the report adds the bytes per step out of and into host 1, read from the "
                        "veth's kernel counters")
    p.add_argument("--no-wire", action="store_true",
                   help="the main job without its wire section (mlp25m over a slow link, run when no "
                        "--models, --wrappers, --link or --simulate-bandwidth is given, on the CPU)")
    p.add_argument("--wire-rate", type=float, metavar="GBIT",
                   help="the wire section's link rate in Gbit/s (default 1): a real link (two network "
                        "namespaces, tc tbf) as root with iproute2 in a clone, else the simulated wire "
                        "at this rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--cpu", action="store_true", help="use gloo on the CPU even when CUDA is available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-charts", action="store_true", help="write the report without PNG charts")
    p.add_argument("--list", action="store_true", help="list models and wrappers, then exit")
    return p


def wire_rate(args: argparse.Namespace, cuda: bool, torchrun: bool) -> float | None:
    """The main job's wire section rate (Gbit/s), or None: it runs when the
    command names no models, wrappers or wire of its own (``--models``,
    ``--wrappers``, ``--link``, ``--simulate-bandwidth``), on the CPU (a GPU
    machine keeps its own run), not under torchrun, at world 2, and without
    ``--no-wire``.  ``--wire-rate`` where there is no wire section is an
    error (:class:`ValueError`)."""
    chosen = [f for f, v in (("--models", args.models), ("--wrappers", args.wrappers), ("--link", args.link),
                             ("--simulate-bandwidth", args.simulate_bandwidth)) if v]
    if args.wire_rate is not None:
        if args.no_wire or chosen:
            raise ValueError(f"--wire-rate sets the main job's wire section, which "
                             f"{'--no-wire' if args.no_wire else ' / '.join(chosen)} leaves out")
        if not args.wire_rate > 0:
            raise ValueError(f"--wire-rate must be a positive number of Gbit/s, got {args.wire_rate:g}")
    if args.no_wire or chosen or torchrun or (cuda and not args.cpu) or args.world not in (None, 2):
        return None
    from .wire_section import DEFAULT_WIRE_GBIT

    return args.wire_rate if args.wire_rate is not None else DEFAULT_WIRE_GBIT


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None):
    """The :class:`~.config.BenchConfig` of a parsed command line (raises
    :class:`argparse.ArgumentTypeError` / :class:`ValueError` on a bad one)."""
    import torch

    from .models import DEFAULT_MODELS
    from .config import BenchConfig
    from .launcher import under_torchrun
    from .wire_section import WIRE_MODEL

    wire = wire_rate(args, torch.cuda.is_available(), under_torchrun())
    models = _names(args.models) or DEFAULT_MODELS
    if wire is not None and args.quick:  # the smoke run's wire section runs the wire model: once is enough
        models = tuple(m for m in models if m != WIRE_MODEL)
    return BenchConfig(
        models=models,
        wrappers=_names(args.wrappers),
        world=args.world, steps=args.steps, warmup=args.warmup,
        half_width=args.half_width / 100, budget_s=args.budget,
        precision=None if args.precision is None else args.precision / 100,
        bucket_cap_mb=args.bucket_cap_mb, out=args.out, label=args.label, quick=args.quick,
        trace_dir=args.trace, bandwidths=_bandwidths(args.simulate_bandwidth), threads=args.threads,
        cpu=args.cpu, seed=args.seed, progress=not args.no_progress, charts=not args.no_charts,
        link=args.link, ranks_per_host=args.ranks_per_host, rebuild_every=args.rebuild_every,
        wire_gbit=wire,
        command=" ".join(shlex.quote(a) for a in ["fastddp-bench", *(sys.argv[1:] if argv is None else argv)]),
    )


def main(argv: list[str] | None = None) -> int:
    from .models import model_zoo
    from .wrappers import registry
    from . import report as R
    from .advice import advice_text
    from .runner import run
    from .wire_section import WIRE_BUDGET_S

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for spec in model_zoo().values():
            print(f"model    {spec.name:12s} {spec.description}")
        for name, ws in registry().items():
            print(f"wrapper  {name:16s} family={ws.family} option={ws.option}")
        return 0
    try:
        cfg = config_from_args(args, argv)
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))
    from .clone import ToolsMissing, netlink

    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    except ToolsMissing as e:  # --link from an installed wheel: the tooling is in a clone only
        print(f"fastddp-bench: {e}", file=sys.stderr)
        return 2
    if cfg.link is not None:
        N = netlink()
        try:
            N.check_requirements()
        except N.LinkError as e:
            print(f"fastddp-bench: {e}", file=sys.stderr)
            return 2
    if cfg.mode == "adaptive" and cfg.progress:
        total = cfg.sections_budget_s
        wire = ""
        if cfg.wire_gbit is not None:
            total += cfg.budget_s if cfg.budget_s is not None else WIRE_BUDGET_S
            wire = f" + a wire section ({cfg.wire_gbit:g} Gbit/s)"
        print(f"fastddp-bench: {len(cfg.models)} model(s) x {len(cfg.bandwidths)} section(s){wire}, rounds until "
              f"every pair is within ±{cfg.stop_rule().half_width * 100:g}% or {cfg.stop_rule().budget_s:g} s per model: "
              f"at most ~{total / 60:.0f} min", file=sys.stderr)
    result = run(cfg)
    if result is None:  # a torchrun rank other than 0
        return 0
    report, paths = result
    print(R.summary_text(report))
    link = report.meta.get("link")
    if link:
        print(f"link: {link['what']}; measured {link['measured_gbit']:g} Gbit/s ({link['probe']}), "
              f"small all-reduce {link['small_allreduce_ms']:g} ms")
    print(f"report: {paths['md']}")
    print(f"json:   {paths['json']}")
    for c in paths["charts"]:
        print(f"chart:  {c}")
    if cfg.trace_dir:
        print(f"traces: {cfg.trace_dir}/")
    print()
    print(advice_text(report))  # last, so that it is what the screen shows
    bad = not_ok_fastddp_rows(report)
    if bad:
        print(f"fastddp-bench: {len(bad)} fastddp row(s) not ok (exit 1):", file=sys.stderr)
        for line in bad:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def not_ok_fastddp_rows(report) -> list[str]:
    """``"<model><section tag> <wrapper>: <status>"`` for every fastddp row that
    is not ``ok`` (unavailable or failed): a run with one exits non-zero, so a
    broken fastddp path is never a green benchmark."""
    return [f"{r.model}{s.tag} {r.wrapper}: {r.status}"
            for s in report.sections for r in s.rows if r.family == "fastddp" and not r.ok]


if __name__ == "__main__":
    sys.exit(main())
