"""The end-to-end runner (``fastddp-bench``): statistics and report code as
pure units and one tiny 2-rank run through the command line (spawned once
for the module).  The simulated wire has its own tests (test_bench_simwire.py)."""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
import torch

from fastddp.bench import report as R
from fastddp.bench import export as E
from fastddp.bench import stats as S
from fastddp.bench import stoprule as SR
from fastddp.bench.wrappers import DEFAULT_WRAPPERS, computed_wire_bytes, registry
from tests._dist import torch_ddp_accepts, world2  # noqa: F401  (module-scoped 2-rank gloo fixture)


# -- statistics ------------------------------------------------------------------

@pytest.mark.parametrize("xs", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.default_rng(0).random(17))])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_quantile_matches_numpy_linear(xs, q):
    assert S.quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=0, abs=1e-12)


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError):
        S.quantile([], 0.5)
    with pytest.raises(ValueError):
        S.quantile([1.0], 1.5)


def test_summarize():
    s = S.summarize([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    assert (s.median, s.p20, s.p80) == pytest.approx((35.0, 20.0, 50.0))
    assert S.summarize([]) is None


def _row(model, wrapper, steps, family=None, baselines=(), status="ok", **kw):
    family = family or wrapper.split("-")[0]
    return R.Row(model, wrapper, status=status, family=family, baselines=list(baselines),
                 step_ms=list(steps), exposed_ms=[0.5] * len(steps), **kw)


def _section(bw=None):
    """Ten rounds of flat step times (plus a little per-round wobble)."""
    wobble = [0.0, 0.1, -0.1, 0.05, -0.05, 0.02, -0.02, 0.0, 0.1, -0.1]
    flat = lambda ms: [ms + w for w in wobble]  # noqa: E731
    rows = [
        _row("m", "local", flat(10)),
        _row("m", "torch", flat(20)),
        _row("m", "torch-batched", flat(9)),                        # faster than local: overhead < 0
        _row("m", "torch-fp16", flat(30)),
        _row("m", "fastddp", flat(15), baselines=("torch",)),
        _row("m", "fastddp-batched", flat(12), baselines=("torch-batched",)),
        _row("m", "fastddp-bf16", flat(20), baselines=("torch-bf16", "torch-fp16")),
        _row("m", "fastddp-view", [], baselines=("torch-view",), status="unavailable: not built"),
        _row("small", "local", flat(100)),
        _row("small", "torch", flat(150)),
        _row("small", "fastddp", flat(145), baselines=("torch",)),
    ]
    return R.derive(R.Section(bw, rows, runs={"m": {"rounds": 10, "stopped": "fixed", "elapsed_s": 1.0,
                                                     "budget_s": None}}))


def test_derive_on_the_runner_rows():
    s = _section()
    r = {(x.model, x.wrapper): x for x in s.rows}
    assert r["m", "local"].overhead_ms == 0
    assert r["m", "torch"].overhead_ms == pytest.approx(10)
    assert r["m", "fastddp"].ratio == pytest.approx(0.75, abs=1e-3) and r["m", "fastddp"].ratio_baseline == "torch"
    # the step-time ratio exists whatever the peer's overhead; the overhead ratio does not
    batched = next(c for c in s.comparisons if c.wrapper == "fastddp-batched")
    assert batched.ratio == pytest.approx(12 / 9, abs=1e-2) and batched.verdict == "slower"
    assert batched.overhead_ratio is None
    fast = next(c for c in s.comparisons if (c.model, c.wrapper) == ("m", "fastddp"))
    assert fast.verdict == "faster" and fast.overhead_ratio == pytest.approx(0.5, abs=0.02)
    # every listed peer present is compared: no torch-bf16 on CPU -> torch-fp16 only
    assert [c.peer for c in s.comparisons if c.wrapper == "fastddp-bf16"] == ["torch-fp16"]
    assert r["m", "fastddp-view"].step is None and r["m", "fastddp-view"].overhead_ms is None
    assert not any(c.wrapper == "fastddp-view" for c in s.comparisons)
    assert next(c for c in s.comparisons if c.model == "small").verdict == "faster"  # 145 / 150: 3.3% faster


def test_json_roundtrip_and_markdown():
    rep = R.Report({"label": "t", "device": "Some CPU", "date": "2026-01-01"},
                   [_section(), _section(1.0)])
    back = R.from_json(R.to_json(rep))
    assert back.meta == rep.meta
    assert [(x.model, x.wrapper, x.status, x.step_ms) for x in back.sections[1].rows] == \
           [(x.model, x.wrapper, x.status, x.step_ms) for x in rep.sections[1].rows]
    assert back.sections[0].rows[4].ratio == pytest.approx(0.75, abs=1e-3)
    md = E.to_markdown(rep, {"": ["x-step.png"]})
    assert "## Results" in md and "## Simulated interconnect: 1 GB/s" in md
    assert "![x-step.png](x-step.png)" in md and "unavailable: not built" in md
    assert "| m | 10 | 1 | - | fixed number of rounds (--steps) |" in md
    assert "## Notes" not in md  # prose lives in reports/README.md


def test_write_report_files(tmp_path):
    rep = R.Report({"label": "unit test", "device": "Unit CPU", "date": "2026-01-02"},
                   [_section(1.0), _section(10.0)])
    paths = E.write_report(rep, tmp_path)
    folder = tmp_path / "unit-cpu"
    assert paths["md"] == folder / "2026-01-02-unit-test.md" and paths["md"].exists()
    assert json.loads(paths["json"].read_text())["meta"]["label"] == "unit test"
    names = sorted(p.name for p in paths["charts"])
    assert names == sorted(["2026-01-02-unit-test-bw1-step.png", "2026-01-02-unit-test-bw1-ratio.png",
                            "2026-01-02-unit-test-bw10-step.png", "2026-01-02-unit-test-bw10-ratio.png",
                            "2026-01-02-unit-test-bandwidth.png"])
    for p in paths["charts"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- wrappers ----------------------------------------------------------------------

def test_registry_covers_defaults():
    reg = registry()
    assert set(DEFAULT_WRAPPERS) <= set(reg)
    for name, spec in reg.items():
        if spec.family == "fastddp":
            # peers: torch's DDP and torch's FSDP2 replicate (the best of them sets the ratio)
            assert spec.baselines and all(reg[b].family in ("torch", "replicate") for b in spec.baselines)
            assert spec.baselines[0].startswith("torch")


def test_comm_floor_one_all_reduce_per_backward_and_dtype(tmp_path, monkeypatch):
    import torch.distributed as dist

    from fastddp.bench.wrappers import CommFloor
    from tests._dist import single_rank_group

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4).double()
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.b(self.a(self.frozen(x)).double()), self.a(x)

    with single_rank_group(tmp_path):
        model = Mixed()
        floor = CommFloor(model)
        assert sorted(f.numel() for f in floor._flats) == [20, 20]  # fp32 a, fp64 b; frozen left out
        calls = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append((t.dtype, t.numel())), real(t, *a, **k))[1])
        x = torch.randn(3, 4)
        for _ in range(2):
            out1, out2 = floor(x)
            assert calls == []  # nothing in forward
            (out1.sum() + out2.sum()).backward()  # both outputs reach the hook: still one callback
            assert sorted(calls, key=str) == sorted([(torch.float32, 20), (torch.float64, 20)], key=str)
            calls.clear()
        with torch.no_grad():
            floor(x)
        assert calls == []
        # the gradients are the local ones (the floor averages nothing)
        ref = Mixed()
        ref.load_state_dict(model.state_dict())
        model.zero_grad(set_to_none=True)
        o1, o2 = floor(x)
        (o1.sum() + o2.sum()).backward()
        r1, r2 = ref(x)
        (r1.sum() + r2.sum()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)


def test_computed_wire_bytes():
    reg = registry()
    params = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(3), requires_grad=False),
              torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert computed_wire_bytes(reg["local"], params) == 0
    assert computed_wire_bytes(reg["torch"], params) == 10 * 4 + 4 * 8
    assert computed_wire_bytes(reg["fastddp-fp16"], params) == 14 * 2


def test_torch_batched_stand_in_is_labelled_and_averages(tmp_path, monkeypatch):
    """torch 2.11's DDP has no batched_grad_copy: the torch-batched row is then
    torch DDP + the builtin ALLREDUCE hook, and its note says so."""
    from fastddp.bench import wrappers as W
    from tests._dist import single_rank_group

    monkeypatch.setattr(W, "torch_has_batched_grad_copy", lambda: False)
    with single_rank_group(tmp_path):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        ref = copy.deepcopy(model)
        ddp, note = W.build_wrapper("torch-batched", model, None, W.WrapperOptions())
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        assert note.startswith("stand-in: torch ") and "no batched_grad_copy" in note, note
        assert "ALLREDUCE" in note
        x = torch.randn(5, 8)
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(ddp.module.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)  # W = 1: the average is the local grad


def test_torch_batched_uses_the_real_argument_where_torch_has_it(tmp_path):
    from fastddp.bench import wrappers as W
    from tests._dist import single_rank_group

    import inspect
    has = "batched_grad_copy" in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert W.torch_has_batched_grad_copy() == has
    with single_rank_group(tmp_path):
        _, note = W.build_wrapper("torch-batched", torch.nn.Linear(4, 4), None, W.WrapperOptions())
    assert note.startswith("stand-in") != has, note


def _stand_in_vs_batched(rank, world_size):
    """Inside each of 2 gloo ranks: the stand-in's grads against torch's
    batched_grad_copy (where this torch has it) and against the rule itself
    (grad / W, SUM), bit for bit, over a few SGD steps."""
    import torch.distributed as dist

    from fastddp.bench import wrappers as W

    torch.manual_seed(3)
    base = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)], torch.nn.Linear(24, 5))
    real = W.torch_has_batched_grad_copy()
    saved = W.torch_has_batched_grad_copy
    W.torch_has_batched_grad_copy = lambda: False
    try:
        stand_in, note = W.build_wrapper("torch-batched", copy.deepcopy(base), None,
                                         W.WrapperOptions(bucket_cap_mb=0.002))
    finally:
        W.torch_has_batched_grad_copy = saved
    assert note.startswith("stand-in"), note
    ref = None
    if real:
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002,
                                                        batched_grad_copy=True)
    rule = copy.deepcopy(base)
    models = [m for m in (stand_in, ref, rule) if m is not None]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    checks = 0
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(7, 24, generator=gen) * (10.0 ** (rank - step))  # magnitudes that round differently
        for m, o in zip(models, opts):
            o.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        with torch.no_grad():
            for p in rule.parameters():
                p.grad.div_(world_size)
                dist.all_reduce(p.grad)
        for other in models[1:]:
            for (n, a), b in zip(stand_in.module.named_parameters(), other.parameters()):
                assert torch.equal(a.grad, b.grad), (step, n, (a.grad - b.grad).abs().max().item())
                checks += 1
        for o in opts:
            o.step()
    return checks, real


def test_torch_batched_stand_in_equals_batched_grad_copy_bit_for_bit(world2):
    for checks, real in world2.run(_stand_in_vs_batched):
        assert checks == 3 * 14 * (2 if real else 1)


def test_exit_status_is_nonzero_when_a_fastddp_row_is_not_ok(tmp_path, monkeypatch, capsys):
    from fastddp.bench import runner
    from fastddp.bench.__main__ import main, not_ok_fastddp_rows

    def fake_run(sections):
        def run(cfg):
            rep = R.Report({"label": "t", "device": "Unit CPU", "date": "2026-01-03"}, sections)
            return rep, {"md": tmp_path / "r.md", "json": tmp_path / "r.json", "charts": []}
        return run

    argv = ["--models", "tiny", "--no-progress", "--out", str(tmp_path)]
    monkeypatch.setattr(runner, "run", fake_run([_section()]))  # fastddp-view unavailable
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "m fastddp-view: unavailable: not built" in err
    assert not_ok_fastddp_rows(R.Report({}, [_section(), _section(2.0)])) == [
        "m fastddp-view: unavailable: not built", "m-bw2 fastddp-view: unavailable: not built"]

    ok_rows = [r for r in _section().rows if r.wrapper != "fastddp-view"]
    failed_torch = _row("m", "torch-view", [], status="failed: boom")
    monkeypatch.setattr(runner, "run", fake_run([R.derive(R.Section(None, ok_rows + [failed_torch]))]))
    assert main(argv) == 0  # a torch row that failed does not fail the run

    failed = _row("m", "fastddp-fp16", [], baselines=("torch-fp16",), status="failed: RuntimeError: x")
    monkeypatch.setattr(runner, "run", fake_run([R.derive(R.Section(None, ok_rows + [failed]))]))
    assert main(argv) == 1


# -- one tiny end-to-end run ------------------------------------------------------

SIM_GBPS = 0.002  # 2 MB/s: the tiny model's 4.9 KB take ~2.4 ms on the wire


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from fastddp.bench.__main__ import main

    out = tmp_path_factory.mktemp("reports")
    traces = tmp_path_factory.mktemp("traces")
    t0 = time.perf_counter()
    rc = main(["--models", "tiny", "--steps", "2", "--warmup", "1", "--out", str(out), "--label", "ci",
               "--no-progress", "--simulate-bandwidth", "none", str(SIM_GBPS), "--trace", str(traces)])
    return rc, out, traces, time.perf_counter() - t0


def test_tiny_run_writes_report(tiny_run):
    rc, out, traces, elapsed = tiny_run
    assert rc == 0
    # a runaway guard, not a timing claim: ~25 s quiet; 60 s failed twice at load 20+
    assert elapsed < 180, f"the tiny run took {elapsed:.0f} s"
    (folder,) = out.iterdir()
    md = list(folder.glob("*-ci.md"))
    js = list(folder.glob("*-ci.json"))
    assert len(md) == 1 and len(js) == 1
    pngs = {p.name.split("-ci", 1)[1] for p in folder.glob("*.png")}
    assert pngs == {"-step.png", f"-bw{SIM_GBPS:g}-step.png"}  # 2 rounds: no interval, so no ratio chart
    text = md[0].read_text()
    assert "## Results" in text and f"## Simulated interconnect: {SIM_GBPS:g} GB/s" in text
    for w in DEFAULT_WRAPPERS:
        assert f"| tiny | {w} |" in text


def test_tiny_run_rows(tiny_run):
    _, out, _, _ = tiny_run
    rep = R.from_json(next(out.glob("*/*-ci.json")).read_text())
    assert rep.meta["world_size"] == 2 and rep.meta["backend"] == "gloo"
    assert rep.meta["torch"] == torch.__version__
    assert [s.bandwidth_gbps for s in rep.sections] == [None, SIM_GBPS]
    assert rep.meta["mode"] == "fixed" and rep.meta["rounds"] == {"tiny": 2, f"tiny-bw{SIM_GBPS:g}": 2}
    for s in rep.sections:
        assert s.runs["tiny"]["stopped"] == "fixed" and s.runs["tiny"]["rounds"] == 2
        assert s.verdicts and {c.verdict for c in s.comparisons} == {"undecided"}  # 2 rounds: no interval
        assert [(r.model, r.wrapper) for r in s.rows] == [("tiny", w) for w in DEFAULT_WRAPPERS]
        rows = {r.wrapper: r for r in s.rows}
        measured = ["local", "comm-floor", "torch", "torch-batched", "torch-view", "torch-fp16"]
        if not torch_ddp_accepts("batched_grad_copy"):  # torch 2.11: a labelled stand-in, measured
            assert "stand-in" in rows["torch-batched"].note, rows["torch-batched"].note
        assert rows["fastddp-batched"].ok, rows["fastddp-batched"].status
        for w in measured:
            r = rows[w]
            assert r.ok, (w, r.status)
            assert len(r.step_ms) == 2 and len(r.exposed_ms) == 2
            assert r.step.p20 <= r.step.median <= r.step.p80
            assert r.ops_per_step and r.ops_kind == "aten ops"
            assert r.resident_bytes is not None and r.step_peak_bytes is not None
        assert rows["local"].overhead_ms == 0 and rows["local"].wire_bytes == 0
        nparams = 4 * (16 * 16 + 16 + 16 + 16)
        assert rows["torch"].wire_bytes == 4 * nparams
        assert rows["comm-floor"].wire_bytes == 4 * nparams
        assert rows["torch-fp16"].wire_bytes == 2 * nparams
        for w in DEFAULT_WRAPPERS:
            assert rows[w].ok or rows[w].status.startswith(("unavailable: ", "failed: ")), rows[w].status
    # under simulation every row but local goes through the simulated wire
    # (measured bytes), and a backward that waits for the last bucket pays
    # at least its wire time
    sim = {r.wrapper: r for r in rep.sections[1].rows}
    wire_ms = sim["torch"].wire_bytes / (SIM_GBPS * 1e9) * 1e3
    for w in ("torch", "comm-floor", "fastddp"):
        if sim[w].ok:
            assert sim[w].wire_source == "measured", w
            assert sim[w].wire_bytes == sim["torch"].wire_bytes, w
            assert min(sim[w].exposed_ms) >= 0.9 * wire_ms, w


def test_tiny_run_traces(tiny_run):
    _, _, traces, _ = tiny_run
    files = sorted(p.name for p in traces.iterdir())
    assert "tiny-local.json" in files and "tiny-torch.json" in files
    assert f"tiny-bw{SIM_GBPS:g}-torch.json" in files
    doc = json.loads((traces / "tiny-torch.json").read_text())
    names = {ev.get("name") for ev in doc["traceEvents"]}
    assert "bench/step[0]" in names and "bench/backward" in names


def test_tiny_run_fastddp_trace_has_the_reducer_ranges(tiny_run):
    """`fastddp-bench --trace` on CPU: fastddp's named ranges are in its trace."""
    _, _, traces, _ = tiny_run
    for wrapper in ("fastddp", "fastddp-batched", "fastddp-fp16"):
        doc = json.loads((traces / f"tiny-{wrapper}.json").read_text())
        names = {ev.get("name") for ev in doc["traceEvents"]}
        for rng in ("fastddp/forward", "fastddp/pack[0]", "fastddp/allreduce[0]", "fastddp/wait[0]",
                    "fastddp/unpack[0]", "fastddp/finalize"):
            assert rng in names, (wrapper, rng, sorted(n for n in names if n and n.startswith("fastddp")))


# -- the adaptive main job, end to end -------------------------------------------------

@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
    """The default (adaptive) mode on the tiny model: a wide precision goal
    that 20 rounds reach, a budget it never needs."""
    from fastddp.bench.__main__ import main

    out = tmp_path_factory.mktemp("adaptive")
    rc = main(["--models", "tiny", "--wrappers", "local", "torch", "fastddp", "--half-width", "50",
               "--budget", "120", "--out", str(out), "--label", "ad", "--no-progress", "--no-charts"])
    return rc, R.from_json(next(out.glob("*/*-ad.json")).read_text())


def test_adaptive_run_stops_at_the_precision_goal(adaptive_run):
    rc, rep = adaptive_run
    assert rc == 0
    (s,) = rep.sections
    info = s.runs["tiny"]
    assert info["stopped"] == "precision" and info["rounds"] >= SR.MIN_ROUNDS and info["budget_s"] == 120
    assert info["round_s"] > 0 and info["profile_s"] >= 0 and info["elapsed_s"] < 120
    assert rep.meta["mode"] == "adaptive" and rep.meta["half_width"] == "50%"
    rows = {r.wrapper: r for r in s.rows}
    assert {len(r.step_ms) for r in rows.values()} == {info["rounds"]}  # one merged sample per round
    assert len(rows["fastddp"].cpu_ms) == info["rounds"]
    (c,) = s.comparisons
    assert (c.wrapper, c.peer, c.rounds) == ("fastddp", "torch", info["rounds"])
    assert c.half_width <= 0.5 and c.verdict in ("faster", "slower", "equal", "undecided")


def test_half_width_and_budget_options(capsys):
    from fastddp.bench.__main__ import build_parser, main
    from fastddp.bench.config import BenchConfig

    args = build_parser().parse_args(["--half-width", "2", "--budget", "30"])
    assert (args.half_width, args.budget) == (2.0, 30.0)
    cfg = BenchConfig(half_width=0.02, budget_s=30.0)
    assert cfg.mode == "adaptive" and cfg.stop_rule() == SR.StopRule(0.02, 30.0)
    assert BenchConfig(steps=5).mode == "fixed" and BenchConfig(quick=True, steps=5).mode == "quick"
    assert BenchConfig().stop_rule().budget_s == SR.DEFAULT_BUDGET_S
    args = build_parser().parse_args(["--precision", "1.5"])
    assert args.precision == 1.5 and args.half_width == 3.0
    fine = BenchConfig(half_width=0.03, precision=0.015, budget_s=30.0)
    assert fine.stop_rule() == SR.StopRule(0.015, 30.0)  # the rounds' goal; the margin stays 3%
    for argv, word in ((["--half-width", "0"], "--half-width"), (["--half-width", "120"], "--half-width"),
                       (["--precision", "0"], "--precision"), (["--budget", "-1"], "--budget")):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--models", "tiny"])
        assert e.value.code == 2 and word in capsys.readouterr().err


def test_gpu_kernels_lowprec_rows_bit_exact_on_cpu():
    """The GPU check's low-precision rows (fp8 quantize with error feedback,
    dequantize, the fp8 and bf16 shard sums) run and are checked bit for bit
    against the reference; on the CPU that is the torch path's result."""
    from fastddp.bench import gpu_kernels as G

    clock = G.Clock(torch.device("cpu"))
    meta, rows = {"copy_GB/s": 1.0}, []
    G.lowprec_rows(clock, {"odd": (3, 1000)}, 1, meta, rows)
    assert [r["op"] for r in rows] == ["fp8 quantize+ef", "fp8 dequantize", "fp8 shard sum W=2",
                                       "bf16 shard sum W=2"]
    assert all(r["bit_exact"] is True for r in rows), rows
    assert all(r["bytes"] > 0 and r["elements"] == 3000 for r in rows)
    meta.update(device="cpu", date="2026-12-01", torch="t", triton="t", cuda=None, python="3",
                block=1, num_warps=1, truncated=False)
    assert "| fp8 quantize+ef |" in G.to_markdown({"meta": meta, "rows": rows, "block_sweep": []})


@pytest.mark.parametrize("rounds", [["--steps", "2", "--warmup", "1"], ["--quick"]], ids=["steps", "quick"])
def test_auto_tunes_alone_before_the_rounds(tmp_path, rounds):
    """``fastddp-auto`` runs its tuning steps back to back, alone, before the
    rotated rounds (as a training loop runs it; inside the rounds each trial
    step would follow the other wrappers' steps): it has settled before the
    first round, and the fixed-cap row ran no such steps.  ``--quick`` too:
    its few rounds time the settled row, not its trials."""
    from fastddp.bench.__main__ import main

    rc = main(["--models", "tiny", "--wrappers", "fastddp-cap25", "fastddp-auto", *rounds,
               "--out", str(tmp_path), "--label", "alone", "--no-progress", "--no-charts"])
    assert rc == 0
    rep = R.from_json(next(tmp_path.glob("*/*-alone.json")).read_text())
    rows = {r.wrapper: r for s in rep.sections for r in s.rows}
    tune = rows["fastddp-auto"].autotune
    assert tune["state"] == "settled", tune["state"]
    assert 0 < tune["tuned_alone_steps"] < 120
    assert tune["settled_at_step"] <= tune["tuned_alone_steps"] + 1, tune  # before any round
    assert rows["fastddp-cap25"].autotune is None
    assert len(rows["fastddp-auto"].step_ms) == 2  # the rounds are the timed ones, as for every row
    # every fastddp row records its buckets (the sweep pools caps that gave the same ones)
    auto_buckets = rows["fastddp-auto"].buckets
    assert rows["fastddp-cap25"].buckets and auto_buckets
    assert sorted(i for b in auto_buckets for i in b) == list(range(sum(len(b) for b in auto_buckets)))
    assert len(auto_buckets) == tune["chosen"]["buckets"]


def test_runner_reads_the_buckets_and_the_tuning_through_public_methods(tmp_path):
    """The runner asks fastddp's reducer (``bucket_indices()``,
    ``tuning_active``), and gets None / False from wrappers without one."""
    from types import SimpleNamespace

    import fastddp
    from fastddp.bench import rounds
    from tests._dist import single_rank_group

    with single_rank_group(tmp_path):
        model = torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(6)])  # 0.36 MB a layer
        fixed = fastddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.5)
        x = torch.randn(2, 300)
        assert len(fixed.reducer.plans.bucket_indices()) == 1  # torch's rule: one bucket until the rebuild
        fixed(x).sum().backward()
        fixed(x)  # the rebuild, in the order the gradients came
        buckets = rounds._buckets(SimpleNamespace(module=fixed))
        assert buckets == fixed.reducer.plans.bucket_indices() and len(buckets) > 1
        assert sorted(i for b in buckets for i in b) == list(range(12))  # every parameter once
        # no gradient of 2^20 elements: the in-place rule has nothing to choose, nothing is measured
        assert "in_place" not in fixed.stats()
        assert not fixed.reducer.tuning_active and not rounds._tuning(SimpleNamespace(module=fixed))
        big = fastddp.DistributedDataParallel(torch.nn.Linear(1024, 1024))  # a weight of 2^20 elements
        assert rounds._tuning(SimpleNamespace(module=big))  # the in-place rule waits for the rebuilt plan
        for _ in range(3):
            big(torch.randn(2, 1024)).sum().backward()
        assert big.stats()["in_place"]["state"] == "trial" and rounds._tuning(SimpleNamespace(module=big))
        auto = fastddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb="auto")
        assert auto.reducer.tuning_active and rounds._tuning(SimpleNamespace(module=auto))
        auto.reducer.plans.freeze_tuning("test")
        assert not auto.reducer.tuning_active
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        assert rounds._buckets(SimpleNamespace(module=theirs)) is None
        assert not rounds._tuning(SimpleNamespace(module=theirs))


def test_link_from_an_install_without_the_clone_says_what_to_do(tmp_path, monkeypatch, capsys):
    """``--link`` needs the clone's tools/netlink.py: from an installed wheel
    the CLI refuses (exit 2) before starting anything and says what to do."""
    from fastddp.bench import clone
    from fastddp.bench.__main__ import main

    assert clone.repo_root() is not None  # the tests run from a clone
    monkeypatch.setattr(clone, "repo_root", lambda: None)
    rc = main(["--link", "netns:1", "--models", "tiny", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tools/netlink.py" in err and "pip install -e" in err and "--simulate-bandwidth" in err
    assert not any(tmp_path.iterdir())


def test_the_in_place_decision_is_noted_only_after_a_trial():
    from fastddp.bench.rounds import in_place_note

    trial = {"rounds": 5, "chosen": "in-place"}
    assert in_place_note({"in_place": {"chosen": "in-place", "decisions": [trial]}}) == \
        "large grads reduced in place after its trial"
    assert in_place_note({"in_place": {"chosen": "flat", "decisions": [dict(trial, chosen="flat")]}}) == \
        "buckets whole (in place not faster) after its trial"
    assert in_place_note({"in_place": {"chosen": "flat", "decisions": [{"rounds": 0}]}}) is None  # nothing large
    assert in_place_note({"in_place": {"chosen": None, "decisions": []}}) is None  # still measuring
    assert in_place_note({}) is None  # torch's DDP, or fastddp on a GPU
