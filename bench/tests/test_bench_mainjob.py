"""The main job's wire section and its one-screen summary (``fastddp-bench``
with no arguments): when the wire section runs and on which wire, how its
report merges with the loopback sections, and the summary's pick, ratios,
intervals and wording.  Pure units: no rank is spawned (``wire_section.launch`` is
replaced where a run is needed)."""

from __future__ import annotations

import math
import random
import re

import pytest

from fastddp.bench import clone
from fastddp.bench import report as R
from fastddp.bench import advice as A
from fastddp.bench import export as E
from fastddp.bench import rounds, wire_section
from fastddp.bench import stoprule as SR
from fastddp.bench.__main__ import build_parser, config_from_args, main
from fastddp.bench.config import REBUILD_EVERY, BenchConfig
from fastddp.bench.rank import RankContext
from fastddp.bench.stats import compare, trimmed_mean


# -- when the wire section runs ------------------------------------------------------

@pytest.fixture
def cpu_machine(monkeypatch):
    """Not under torchrun, no CUDA: where the main job has its wire section."""
    import torch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return monkeypatch


def _cfg(argv):
    return config_from_args(build_parser().parse_args(argv), argv)


def test_the_default_run_has_the_wire_section(cpu_machine):
    cfg = _cfg([])
    assert cfg.wire_gbit == wire_section.DEFAULT_WIRE_GBIT == 1.0
    assert cfg.models == ("small", "transformer", "convnet", "mlp25m")  # the loopback sections stay
    cfg.validate()
    assert _cfg(["--wire-rate", "0.5"]).wire_gbit == 0.5
    assert _cfg(["--budget", "60", "--label", "x"]).wire_gbit == 1.0  # a shorter main job still has it
    assert _cfg(["--cpu"]).wire_gbit == 1.0


@pytest.mark.parametrize("argv", [["--no-wire"], ["--models", "small"], ["--wrappers", "torch", "fastddp"],
                                  ["--link", "netns:1"], ["--simulate-bandwidth", "1"], ["--world", "1"]])
def test_no_wire_section_where_the_command_chose(cpu_machine, argv):
    assert _cfg(argv).wire_gbit is None


def test_no_wire_section_on_a_gpu_machine_or_under_torchrun(cpu_machine):
    import torch

    cpu_machine.setattr(torch.cuda, "is_available", lambda: True)
    assert _cfg([]).wire_gbit is None  # bench/gpu_check.sh's runs stay as they were
    assert _cfg(["--cpu"]).wire_gbit == 1.0  # ... unless the run is on the CPU
    cpu_machine.setattr(torch.cuda, "is_available", lambda: False)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "x"),
                 ("MASTER_PORT", "1")):
        cpu_machine.setenv(k, v)
    assert _cfg([]).wire_gbit is None


def test_quick_runs_the_wire_model_once(cpu_machine):
    cfg = _cfg(["--quick"])
    assert cfg.wire_gbit == 1.0 and wire_section.WIRE_MODEL not in cfg.models
    assert cfg.models == ("small", "transformer", "convnet")
    assert _cfg(["--quick", "--no-wire"]).models == ("small", "transformer", "convnet", "mlp25m")


def test_wire_rate_where_there_is_no_wire_section_is_refused(cpu_machine, capsys, tmp_path):
    for argv in (["--wire-rate", "1", "--models", "tiny"], ["--wire-rate", "1", "--no-wire"],
                 ["--wire-rate", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--out", str(tmp_path)])
        assert e.value.code == 2 and "--wire-rate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="wire section"):
        BenchConfig(wire_gbit=1.0, bandwidths=(0.1,)).validate()


# -- which wire ------------------------------------------------------------------------

def test_a_real_link_where_the_machine_allows_it(monkeypatch):
    N = clone.netlink()
    monkeypatch.setattr(N, "check_requirements", lambda: None)
    plan = wire_section.plan_wire(1.0)
    assert (plan.kind, plan.gbit, plan.why) == ("netns", 1.0, "")
    cfg = wire_section._wire_cfg(BenchConfig(wire_gbit=1.0), plan, 150.0)
    assert cfg.link == "netns:1" and cfg.bandwidths == (None,) and cfg.wire_gbit is None
    assert cfg.models == ("mlp25m",) and cfg.wrappers == wire_section.WIRE_WRAPPERS == (
        "torch", "torch-fp16", "fastddp", "fastddp-fp8", "fastddp-autoprec")
    assert cfg.budget_s == 150.0
    cfg.validate()


def test_the_simulated_wire_when_root_or_iproute2_is_missing(monkeypatch):
    N = clone.netlink()

    def refuse():
        raise N.LinkError("--link netns needs root (it creates network namespaces; this process runs as "
                          "uid 1000). Without them use --simulate-bandwidth GBPS (a simulated wire, no root).")

    monkeypatch.setattr(N, "check_requirements", refuse)
    plan = wire_section.plan_wire(1.0)
    assert plan.kind == "simulated" and plan.why.startswith("a real link needs root") and "Without" not in plan.why
    assert "simulated wire at 1 Gbit/s (0.125 GB/s)" in plan.describe() and "uid 1000" in plan.describe()
    cfg = wire_section._wire_cfg(BenchConfig(wire_gbit=1.0), plan, None)
    assert cfg.link is None and cfg.bandwidths == (0.125,) and cfg.models == ("mlp25m",)
    cfg.validate()


def test_the_simulated_wire_from_an_install_without_the_clone(monkeypatch):
    monkeypatch.setattr(clone, "repo_root", lambda: None)
    plan = wire_section.plan_wire(2.0)
    assert plan.kind == "simulated" and "clone" in plan.why


def _fake_report(tag_models, wire=None, bw=None, label="full"):
    rows = []
    for m in tag_models:
        rows += [R.Row(m, "torch", family="torch", step_ms=[10.0] * 6),
                 R.Row(m, "fastddp", family="fastddp", baselines=["torch"], step_ms=[9.0] * 6)]
    sec = R.Section(bw, rows, wire=wire)
    sec.runs = {m: {"rounds": 6, "stopped": "budget", "elapsed_s": 50.0, "budget_s": 105.0} for m in tag_models}
    meta = {"label": label, "device": "Unit CPU", "date": "2026-12-03", "load": "1.00 at start",
            "rounds": {f"{m}{sec.tag}": 6 for m in tag_models},
            "elapsed_per_model_s": {f"{m}{sec.tag}": 50.0 for m in tag_models}}
    return R.Report(meta, [sec])


@pytest.fixture
def simulated_wire(monkeypatch):
    """The wire section on the simulated wire (no root), its launch faked:
    the configurations it launched, in order."""
    monkeypatch.setattr(wire_section, "plan_wire", lambda gbit: wire_section.WirePlan("simulated", gbit, "not root"))
    launched = []

    def launch(cfg):
        launched.append(cfg)
        return _fake_report(["mlp25m"], bw=cfg.bandwidths[0])

    monkeypatch.setattr(wire_section, "launch", launch)
    return launched


def test_the_wire_section_joins_the_report(simulated_wire):
    """The wire section runs after the loopback ones, as its own launch, and
    ends in the same report: its section, rounds and times, what the run was."""
    launched = simulated_wire
    cfg = BenchConfig(models=("small", "mlp25m"), wire_gbit=1.0)
    rep = wire_section.with_wire(cfg, _fake_report(["small", "mlp25m"]), t_start=0.0)
    (wcfg,) = launched
    assert wcfg.bandwidths == (0.125,) and wcfg.models == ("mlp25m",)
    # budget: the wire section's own, plus what the 2 loopback models left of 2 x 105 s (they used 100)
    assert wcfg.budget_s == pytest.approx(wire_section.WIRE_BUDGET_S + 2 * SR.DEFAULT_BUDGET_S - 100.0)
    loop, wire = rep.sections
    assert loop.wire == {"kind": "loopback"} and loop.title == "Loopback: no slow wire" and loop.tag == ""
    assert wire.wire == {"kind": "simulated", "gbit": 1.0, "why": "not root"} and wire.tag == "-bw0.125"
    assert "not a real link because not root" in wire.description
    assert rep.meta["rounds"] == {"small": 6, "mlp25m": 6, "mlp25m-bw0.125": 6}
    assert set(rep.meta["elapsed_per_model_s"]) == {"small", "mlp25m", "mlp25m-bw0.125"}
    assert "simulated wire at 1 Gbit/s" in rep.meta["wire"] and "fastddp-autoprec" in rep.meta["wire"]


def test_quick_leaves_the_self_tuning_row_out_of_the_wire_section_and_says_so(simulated_wire):
    """The auto-precision row tunes itself over its first steps: stepped alone
    until it settles it would double the smoke run, and inside its rounds it
    would time its trial; --quick leaves it out and every text says so."""
    from fastddp.bench.wrappers import registry

    assert {n for n, s in registry().items() if s.tunes} == {"fastddp-autoprec", "fastddp-auto"}
    launched = simulated_wire
    rep = wire_section.with_wire(BenchConfig(models=("small",), wire_gbit=1.0, quick=True), _fake_report(["small"]),
                                 0.0)
    assert launched[-1].wrappers == ("torch", "torch-fp16", "fastddp", "fastddp-fp8")
    loop, wire = rep.sections
    assert (loop.left_out, wire.left_out) == ([], ["fastddp-autoprec"])
    assert "(fastddp-autoprec left out of --quick)" in rep.meta["wire"]
    assert R.from_json(R.to_json(rep)).sections[1].left_out == ["fastddp-autoprec"]
    said = "left out: fastddp-autoprec (self-tuning: the full run steps it alone until it settles)"
    assert f"  {said}" in A.advice_text(rep).splitlines() and said in R.summary_text(rep).splitlines()
    assert said[0].upper() + said[1:] in E.to_markdown(rep)
    # the full run keeps it (stepped alone until it settles)
    rep = wire_section.with_wire(BenchConfig(models=("small",), wire_gbit=1.0), _fake_report(["small"]), 0.0)
    assert launched[-1].wrappers == wire_section.WIRE_WRAPPERS and rep.sections[1].left_out == []
    assert "left out" not in A.advice_text(rep)


def test_a_link_that_does_not_come_up_falls_back_to_the_simulated_wire(monkeypatch):
    N = clone.netlink()
    monkeypatch.setattr(wire_section, "plan_wire", lambda gbit: wire_section.WirePlan("netns", gbit))
    launched = []

    def launch(cfg):
        launched.append(cfg)
        if cfg.link is not None:
            raise N.LinkError("`ip link add` failed (exit 2): Operation not permitted")
        return _fake_report(["mlp25m"], bw=cfg.bandwidths[0])

    monkeypatch.setattr(wire_section, "launch", launch)
    rep = wire_section.with_wire(BenchConfig(wire_gbit=1.0, steps=3), _fake_report(["small"]), 0.0)
    assert [c.link for c in launched] == ["netns:1", None] and launched[0].budget_s is None  # --steps: no budget
    wire = rep.sections[1]
    assert wire.kind == "simulated" and "could not be set up" in wire.wire["why"]


# -- the section's description and the JSON round trip -----------------------------------

def test_a_link_section_says_what_carried_it_and_round_trips():
    wire = {"kind": "netns", "gbit": 1.0, "what": "netns veth pair, 1 Gbit/s (tbf), MTU 1500",
            "probe": "64 MiB fp32 all-reduce, median of 3", "measured_gbit": 0.94, "small_allreduce_ms": 0.5}
    rep = _fake_report(["mlp25m"], wire=wire)
    rep.sections[0].rows[1].autoprec = {"chosen": "fp8", "state": "settled", "tuned_alone_steps": 29}
    sim = _fake_report(["mlp25m"], wire={"kind": "simulated", "gbit": 1.0, "why": "not root"}, bw=0.125)
    rep.sections += sim.sections
    back = R.from_json(R.to_json(rep))
    link, simulated = back.sections
    assert link.wire == wire and simulated.wire == sim.sections[0].wire
    assert back.sections[0].rows[1].autoprec["chosen"] == "fp8"
    assert (link.kind, link.gbit, link.tag, link.title) == ("netns", 1.0, "-link1", "Real link: 1 Gbit/s")
    assert "shaped to 1 Gbit/s by tc tbf; measured 0.94 Gbit/s" in link.description
    assert (simulated.kind, simulated.gbit, simulated.tag) == ("simulated", 1.0, "-bw0.125")
    # sections without a description read as before
    old = R.Section(None)
    assert (old.kind, old.title, old.tag, old.wire) == ("loopback", "Results", "", None)
    assert R.Section(2.0).title.startswith("Simulated interconnect: 2 GB/s")
    md = E.to_markdown(back)
    assert md.index("## Summary") < md.index("## Setup") < md.index("## Real link: 1 Gbit/s")
    assert "Real link: 2 ranks in two network namespaces" in md


# -- the one-screen summary -----------------------------------------------------------------

def _rows(model, means, rounds=40, seed=0, noise=0.01):
    """Rows of ``model`` whose rounds share a machine factor; each row's own
    noise is ``noise`` (relative)."""
    rng = random.Random(seed)
    shared = [1 + rng.uniform(-0.2, 0.2) for _ in range(rounds)]
    spec = {"torch": ("torch", []), "torch-fp16": ("torch", []), "torch-batched": ("torch", []),
            "fastddp": ("fastddp", ["torch"]), "fastddp-fp8": ("fastddp", ["torch-fp16"]),
            "fastddp-view": ("fastddp", ["torch"]),
            "fastddp-autoprec": ("fastddp", ["torch", "torch-fp16"]), "local": ("local", [])}
    out = []
    for name, ms in means.items():
        fam, base = spec[name]
        steps = [ms * f * (1 + rng.uniform(-noise, noise)) for f in shared]
        r = R.Row(model, name, family=fam, baselines=list(base), step_ms=steps)
        if name == "fastddp-fp8":
            r.note = "hooks.fp8_compress_hook"
        if name == "fastddp-autoprec":
            r.note = "hooks.auto_precision_hook, lowest=fp8, chose fp8"
            r.autoprec = {"chosen": "fp8", "state": "settled"}
        out.append(r)
    return out


WIRE = {"torch": 1000.0, "torch-fp16": 690.0, "fastddp": 1000.0, "fastddp-fp8": 520.0, "fastddp-autoprec": 522.0}


def _wire_section(means=WIRE, **kw):
    sec = R.Section(None, _rows("mlp25m", means, **kw),
                    wire={"kind": "netns", "gbit": 1.0, "measured_gbit": 0.94})
    return R.derive(sec)


def test_on_the_link_it_picks_auto_precision_against_torchs_fastest_and_ddp():
    sec = _wire_section()
    (a,) = A.advice(sec)
    assert a.pick == "fastddp-autoprec" and "chose fp8" in a.setting
    fastest, plain = a.gains
    assert (fastest.peer, plain.peer) == ("torch-fp16", "torch")
    assert fastest.ratio == pytest.approx(522 / 690, rel=0.01) and fastest.verdict == "faster"
    assert plain.ratio == pytest.approx(0.522, rel=0.01)
    lo, hi = fastest.ratio_ci
    assert lo < fastest.ratio < hi and hi < 1
    assert a.default_vs_torch.peer == "torch" and a.default_vs_torch.verdict == "equal"
    text = A.advice_text(R.Report({}, [sec]))
    assert "on a 1 Gbit/s link (real: two network namespaces, veth + tc tbf, measured 0.94 Gbit/s):" in text
    assert "  mlp25m: use fastddp-autoprec (hooks.auto_precision_hook, lowest=fp8, chose fp8)" in text
    assert f"{fastest.ratio:.3f} ({lo:.3f}-{hi:.3f}) x torch's fp16 hook, torch's fastest: faster" in text
    assert f"{plain.ratio:.3f} ({plain.ratio_ci[0]:.3f}-{plain.ratio_ci[1]:.3f}) x torch DDP: faster" in text
    d = a.default_vs_torch
    assert f"    fastddp default: {d.ratio:.3f} ({d.ratio_ci[0]:.3f}-{d.ratio_ci[1]:.3f}) x torch DDP: equal ±3%" in text


def test_the_fastest_setting_when_auto_precision_is_decidedly_slower_than_it():
    (a,) = A.advice(_wire_section({**WIRE, "fastddp-autoprec": 700.0}))
    assert a.pick == "fastddp-fp8" and a.setting == "hooks.fp8_compress_hook"


def test_the_default_when_nothing_is_decidedly_faster_and_undecided_says_so():
    # fastddp's round-by-round ratio to each torch row swings 0.85..1.17: an interval around 1.01-1.02,
    # wider than ±3% and holding 1; fastddp-view swings as much (not decidedly faster than the default)
    swing = [0.85, 1.17, 0.9, 1.12, 0.95, 1.08, 1.0, 1.03, 0.88, 1.15] * 2
    rows = [R.Row("small", "torch", family="torch", step_ms=[100.0] * 20),
            R.Row("small", "torch-batched", family="torch", step_ms=[99.0] * 20),
            R.Row("small", "fastddp", family="fastddp", baselines=["torch"], step_ms=[100.0 * x for x in swing]),
            R.Row("small", "fastddp-view", family="fastddp", baselines=["torch"],
                  step_ms=[100.0 * x for x in swing[3:] + swing[:3]])]
    sec = R.derive(R.Section(None, rows))
    (a,) = A.advice(sec)
    assert a.pick == "fastddp" and a.setting == "the default" and "no other setting" in a.why
    assert a.default_vs_torch is None  # the pick is the default: said once
    assert all(c.verdict == "undecided" for c in a.gains)
    text = A.advice_text(R.Report({}, [sec]))
    assert "  small: use fastddp (the default)" in text
    assert text.count(": undecided") == len(a.gains) and "faster" not in text.split("\n", 2)[2]


def test_a_smoke_run_prints_no_ratio_and_points_to_the_full_run():
    """--quick's 3 rounds carry no interval: no ratio is printed, and the
    closing line says where the figures are."""
    sec = _wire_section(rounds=3)
    sec.verdicts = False
    R.derive(sec)
    (a,) = A.advice(sec)
    assert not a.decided and a.rounds == 3 and all(c.verdict is None and c.ratio_ci is None for c in a.gains)
    text = A.advice_text(R.Report({}, [sec]))
    lines = text.splitlines()
    assert lines[0] == "Smoke run (--quick): it checks that every row runs; no verdicts and no picks"
    assert "  mlp25m: too few rounds to compare (3 rounds; an interval needs 5)" in lines
    assert not re.search(r"\d\.\d{3}", text), text  # no ratio at all
    assert lines[-1] == "For figures: the full run, fastddp-bench (rounds until every pair is within ±3%)."
    body = "\n".join(lines[2:])
    assert "use " not in body and not any(w in body for w in ("faster", "slower", "equal ±", "undecided"))


def test_a_smoke_run_with_rounds_enough_shows_intervals_but_no_verdict():
    sec = _wire_section(rounds=20)
    sec.verdicts = False
    R.derive(sec)
    (a,) = A.advice(sec)
    assert a.decided and a.pick == "fastddp" and all(c.verdict is None and c.ratio_ci for c in a.gains)
    text = A.advice_text(R.Report({}, [sec]))
    c = a.gains[0]
    assert f"    {c.ratio:.3f} ({c.ratio_ci[0]:.3f}-{c.ratio_ci[1]:.3f}) x torch's fp16 hook, torch's fastest" in text
    assert "use " not in text and not any(w in text for w in ("faster", "slower", "equal ±", "undecided"))
    assert text.splitlines()[-1].startswith("For figures: the full run, fastddp-bench")


def test_a_smoke_runs_summary_keeps_its_pointer_when_cut():
    loop = []
    for i in range(30):
        loop += _rows(f"m{i}", {"torch": 100.0, "fastddp": 96.0}, rounds=3, seed=i)
    sec = R.derive(R.Section(None, loop, verdicts=False))
    lines = A.advice_text(R.Report({}, [sec])).splitlines()
    assert len(lines) == R.SUMMARY_LINES and lines[-2].endswith("more lines in the report")
    assert lines[-1].startswith("For figures: the full run, fastddp-bench")


def test_too_few_rounds_for_an_interval_pick_nothing_and_say_why():
    sec = _wire_section(rounds=3)  # verdicts on, but 3 rounds give no interval
    (a,) = A.advice(sec)
    fastest = min((r for r in sec.rows if r.family == "fastddp"), key=lambda r: trimmed_mean(r.step_ms))
    assert not a.decided and a.pick == fastest.wrapper != "fastddp"
    assert all(c.ratio_ci is None and c.verdict == "undecided" for c in a.gains)
    text = A.advice_text(R.Report({}, [sec]))
    assert "  mlp25m: too few rounds to compare (3 rounds; an interval needs 5: raise --budget or --steps)" in text
    assert "fastest here" not in text and "use " not in text and not re.search(r"\d\.\d{3}", text), text


def test_the_summary_uses_the_reports_intervals_over_placements():
    """Three builds of the rows, fastddp 7% faster in the first and 7% slower
    in the last: over rounds alone the default would read decided, over
    placements it is undecided; the summary must say what the report says."""
    rng = random.Random(3)
    factors = [0.93] * 10 + [1.0] * 10 + [1.07] * 10
    torch_ms = [100.0 * (1 + rng.uniform(-0.2, 0.2)) for _ in factors]
    rows = [R.Row("m", "torch", family="torch", step_ms=torch_ms),
            R.Row("m", "torch-fp16", family="torch", step_ms=[t * 1.2 for t in torch_ms]),
            R.Row("m", "fastddp", family="fastddp", baselines=["torch"],
                  step_ms=[t * f * (1 + rng.uniform(-0.002, 0.002)) for t, f in zip(torch_ms, factors)]),
            R.Row("m", "fastddp-fp8", family="fastddp", baselines=["torch", "torch-fp16"],
                  step_ms=[t * 0.5 * (1 + rng.uniform(-0.01, 0.01)) for t in torch_ms])]
    rows[3].note = "hooks.fp8_compress_hook"
    sec = R.derive(R.Section(None, rows, runs={"m": {"placements": [0, 10, 20]}}))
    (a,) = A.advice(sec)
    derived = {(c.wrapper, c.peer): c for c in sec.comparisons}
    d = a.default_vs_torch
    assert d.ratio_ci == derived["fastddp", "torch"].ratio_ci and d.verdict == "undecided"
    over_rounds = compare(rows[2].step_ms, torch_ms, margin=sec.half_width)  # what the summary used to print
    assert over_rounds.verdict != "undecided"
    assert a.pick == "fastddp-fp8" and a.gains
    assert [c.ratio_ci for c in a.gains] == [derived["fastddp-fp8", c.peer].ratio_ci for c in a.gains]


def test_the_summary_of_the_main_job_fits_one_screen():
    loop = []
    for i, m in enumerate(("small", "transformer", "convnet", "mlp25m")):
        loop += _rows(m, {"local": 50.0, "torch": 100.0, "torch-batched": 97.0, "torch-fp16": 99.0,
                          "fastddp": 96.0, "fastddp-view": 90.0}, seed=i)
    rep = R.Report({}, [R.derive(R.Section(None, loop, wire={"kind": "loopback"})), _wire_section()])
    text = A.advice_text(rep)
    lines = text.splitlines()
    assert len(lines) <= R.SUMMARY_LINES == 25
    assert all(len(line) <= R.TERMINAL_WIDTH for line in lines)
    assert lines[2] == "no slow wire (loopback: 2 ranks on this machine's shared cores):"
    assert sum(line.startswith("  ") and not line.startswith("   ") for line in lines) == 5  # one pick per model
    assert "  small: use fastddp-view (gradient_as_bucket_view=True)" in lines
    # at the top of the markdown report too
    md = E.to_markdown(rep)
    assert md.split("## Summary", 1)[1].split("```text\n", 1)[1].startswith(text)


def test_the_summary_is_cut_to_one_screen_with_a_pointer():
    loop = []
    for i in range(9):
        loop += _rows(f"m{i}", {"torch": 100.0, "torch-batched": 97.0, "fastddp": 96.0, "fastddp-view": 90.0},
                      seed=i)
    lines = A.advice_text(R.Report({}, [R.derive(R.Section(None, loop))])).splitlines()
    assert len(lines) == R.SUMMARY_LINES and lines[-1].endswith("more lines in the report")


def test_a_section_without_fastddp_rows_says_so():
    sec = R.derive(R.Section(None, [R.Row("m", "torch", family="torch", step_ms=[1.0] * 6)]))
    assert "  m: no fastddp row was measured" in A.advice_text(R.Report({}, [sec]))
    assert math.isclose(SR.DEFAULT_BUDGET_S * 4 + wire_section.WIRE_BUDGET_S, 570.0)  # the main job's ~10 minutes


# -- the row effect: every row rebuilt in fresh allocations every K rounds -------------------

def test_rebuild_gives_every_row_a_fresh_model_and_keeps_its_samples(tmp_path):
    import torch

    from fastddp.bench.models import model_zoo
    from fastddp.bench.wrappers import WrapperOptions
    from tests._dist import single_rank_group

    spec = model_zoo()["tiny"]
    with single_rank_group(tmp_path):
        ctx = RankContext(BenchConfig(models=("tiny",)), 0, 1, 0, torch.device("cpu"))
        base = spec.build()
        opts = WrapperOptions()
        entries = [rounds._build(ctx, spec, base, n, opts, rounds._batch(ctx, spec, -1))[0]
                   for n in ("local", "torch", "fastddp")]
        rounds._round(ctx, spec, entries, 0, timed=True)
        before = [(e.row, e.module, e.opt, [p.data_ptr() for p in e.module.parameters()], e.clock) for e in entries]
        rounds._rebuild(ctx, spec, base, entries, opts, 1)
        rounds._round(ctx, spec, entries, 1, timed=True)
        for e, (row, module, opt, ptrs, clock) in zip(entries, before):
            assert e.row is row and len(row.step_ms) == 2 and row.ok  # the row keeps its samples
            assert e.module is not module and e.opt is not opt and e.builds == 2
            assert not set(ptrs) & {p.data_ptr() for p in e.module.parameters()}  # fresh memory
            assert e.clock is not clock and not clock.handles[0].id in [h.id for h in e.clock.handles]
            assert e.opt.param_groups[0]["params"][0] is next(iter(e.module.parameters()))
        del entries, before


def test_rebuild_every_k_rounds_in_a_run(tmp_path):
    """Five rounds, rebuilt after the 2nd and the 4th (not after the last)."""
    rc = main(["--models", "tiny", "--wrappers", "local", "torch", "fastddp", "--steps", "5", "--warmup", "1",
               "--rebuild-every", "2", "--out", str(tmp_path), "--label", "rb", "--no-progress", "--no-charts"])
    assert rc == 0
    rep = R.from_json(next(tmp_path.glob("*/*-rb.json")).read_text())
    (sec,) = rep.sections
    assert sec.runs["tiny"]["rebuilds"] == 2 and sec.runs["tiny"]["rounds"] == 5
    assert sec.runs["tiny"]["placements"] == [0, 2, 4]  # the timed round each build began at
    assert all(r.ok and len(r.step_ms) == 5 for r in sec.rows)
    assert "5 rounds (2 rebuilds)" in R.run_text("tiny", sec.runs["tiny"], 0.03)
    assert build_parser().parse_args([]).rebuild_every == REBUILD_EVERY == 10
    with pytest.raises(ValueError, match="rebuild-every"):
        BenchConfig(rebuild_every=-1).validate()


def test_a_rebuilt_auto_precision_row_reports_each_builds_pick(tmp_path):
    """A rebuild measures the formats again: the row keeps every build's pick."""
    rc = main(["--models", "tiny", "--wrappers", "local", "fastddp-autoprec", "--steps", "3", "--warmup", "1",
               "--rebuild-every", "2", "--out", str(tmp_path), "--label", "ap", "--no-progress", "--no-charts"])
    assert rc == 0
    rep = R.from_json(next(tmp_path.glob("*/*-ap.json")).read_text())
    (row,) = [r for r in rep.sections[0].rows if r.wrapper == "fastddp-autoprec"]
    picks = row.autoprec["chosen_per_build"]
    assert len(picks) == 2 and all(p in ("fp32", "bf16", "fp8") for p in picks), row.autoprec
    assert picks[-1] == row.autoprec["chosen"]
