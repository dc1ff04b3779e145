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
from fastddp.bench.wrappers import DEFAULT_WRAPPERS, computed_wire_bytes, registry
from tests._dist import torch_ddp_accepts, world2  # noqa: F401  (module-scoped 2-rank gloo fixture)


# -- statistics ------------------------------------------------------------------

@pytest.mark.parametrize("xs", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.default_rng(0).random(17))])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_quantile_matches_numpy_linear(xs, q):
    assert R.quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=0, abs=1e-12)


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError):
        R.quantile([], 0.5)
    with pytest.raises(ValueError):
        R.quantile([1.0], 1.5)


def test_summarize():
    s = R.summarize([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    assert (s.median, s.p20, s.p80) == pytest.approx((35.0, 20.0, 50.0))
    assert R.summarize([]) is None


def _row(model, wrapper, steps, family=None, baselines=(), status="ok", **kw):
    family = family or wrapper.split("-")[0]
    return R.Row(model, wrapper, status=status, family=family, baselines=list(baselines),
                 step_ms=list(steps), exposed_ms=[0.5] * len(steps), **kw)


def _section(bw=None):
    rows = [
        _row("m", "local", [10, 10, 10]),
        _row("m", "torch", [20, 20, 20]),
        _row("m", "torch-batched", [9, 9, 9]),                       # overhead < 0
        _row("m", "torch-fp16", [30, 30, 30]),
        _row("m", "fastddp", [15, 15, 15], baselines=("torch",)),
        _row("m", "fastddp-batched", [12, 12, 12], baselines=("torch-batched",)),
        _row("m", "fastddp-bf16", [20, 20, 20], baselines=("torch-bf16", "torch-fp16")),
        _row("m", "fastddp-view", [], baselines=("torch-view",), status="unavailable: not built"),
        _row("small", "local", [100, 110, 120]),
        _row("small", "torch", [150, 150, 150]),
        _row("small", "fastddp", [145, 145, 145], baselines=("torch",)),
    ]
    return R.derive(R.Section(bw, rows))


def test_derive_overhead_and_ratios():
    s = _section()
    r = {(x.model, x.wrapper): x for x in s.rows}
    assert r["m", "local"].overhead_ms == 0
    assert r["m", "torch"].overhead_ms == pytest.approx(10)
    assert r["m", "fastddp"].ratio == pytest.approx(0.5) and r["m", "fastddp"].ratio_baseline == "torch"
    # a baseline whose overhead is <= 0 gives no ratio, but is still named
    assert r["m", "fastddp-batched"].ratio is None
    assert r["m", "fastddp-batched"].ratio_baseline == "torch-batched"
    # the first baseline present wins (no torch-bf16 here -> torch-fp16)
    assert r["m", "fastddp-bf16"].ratio_baseline == "torch-fp16"
    assert r["m", "fastddp-bf16"].ratio == pytest.approx(0.5)
    assert r["m", "fastddp-view"].step is None and r["m", "fastddp-view"].overhead_ms is None
    assert r["small", "fastddp"].ratio == pytest.approx(35 / 40)


def test_targets():
    checks = {(c["model"], c["wrapper"]): c for c in R.targets(_section())}
    assert checks["m", "fastddp"]["target"] == R.DEFAULT_TARGET and checks["m", "fastddp"]["met"]
    assert checks["small", "fastddp"]["target"] == 0.8 and not checks["small", "fastddp"]["met"]
    # undefined ratio (torch overhead <= 0): listed, neither met nor missed
    assert checks["m", "fastddp-batched"]["ratio"] is None and checks["m", "fastddp-batched"]["met"] is None
    assert ("m", "fastddp-view") not in checks  # unavailable


def _noisy(n, base, extra, sd, seed, shared):
    """Per-round samples: ``base + extra`` plus the round's shared slowdown
    (a slow round slows every wrapper) plus the wrapper's own noise."""
    rng = np.random.default_rng(seed)
    return [base + extra + shared[i] + float(rng.normal(0, sd)) for i in range(n)]


def test_bootstrap_ratio_interval():
    n = 80
    shared = list(np.random.default_rng(99).normal(0, 5.0, n))  # big per-round noise
    local = _noisy(n, 30, 0, 0.3, 1, shared)
    torch_ = _noisy(n, 30, 10, 0.3, 2, shared)
    fast = _noisy(n, 30, 6, 0.3, 3, shared)
    lo, hi = R.bootstrap_ratio(fast, torch_, local)
    point = R._overhead_ratio(fast, torch_, local)
    assert lo <= point <= hi
    # the truth (0.6) is inside, and the interval is tight: pairing removed
    # the shared round noise that dwarfs the 4 ms difference
    assert lo < 0.6 < hi and hi - lo < 0.15, (lo, hi)
    # without pairing (rounds shuffled for one wrapper) it is much wider
    shuffled = list(np.random.default_rng(5).permutation(fast))
    lo2, hi2 = R.bootstrap_ratio(shuffled, torch_, local)
    assert hi2 - lo2 > 2 * (hi - lo), ((lo, hi), (lo2, hi2))
    # deterministic (seeded) and refuses too few rounds
    assert R.bootstrap_ratio(fast, torch_, local) == (lo, hi)
    assert R.bootstrap_ratio(fast[:4], torch_[:4], local[:4]) is None


def test_targets_verdict_from_the_interval():
    n = 60
    shared = list(np.random.default_rng(7).normal(0, 1.0, n))
    local = _noisy(n, 30, 0, 0.2, 1, shared)
    torch_ = _noisy(n, 30, 10, 0.2, 2, shared)
    rows = [_row("small", "local", local), _row("small", "torch", torch_),
            _row("small", "fastddp", _noisy(n, 30, 5, 0.2, 3, shared), baselines=("torch",)),
            _row("small", "fastddp-batched", _noisy(n, 30, 8, 0.2, 4, shared), baselines=("torch",)),
            _row("small", "fastddp-view", _noisy(n, 30, 12, 0.2, 6, shared), baselines=("torch",))]
    checks = {c["wrapper"]: c for c in R.targets(R.derive(R.Section(None, rows)))}
    assert checks["fastddp"]["verdict"] == "met"           # ~0.5, all of the interval <= 0.8
    assert checks["fastddp-batched"]["verdict"] == "inconclusive"  # ~0.8: on the target
    assert checks["fastddp-view"]["verdict"] == "missed"   # ~1.2
    # a straddling interval is inconclusive
    wide_shared = [0.0] * n
    fast_wide = _noisy(n, 30, 8, 3.0, 8, wide_shared)
    rows2 = [_row("small", "local", _noisy(n, 30, 0, 3.0, 9, wide_shared)),
             _row("small", "torch", _noisy(n, 30, 10, 3.0, 10, wide_shared)),
             _row("small", "fastddp", fast_wide, baselines=("torch",))]
    c = R.targets(R.derive(R.Section(None, rows2)))[0]
    lo, hi = c["ci"]
    assert lo < 0.8 < hi and c["verdict"] == "inconclusive", c


def test_cpu_overhead_and_ratio():
    rows = [_row("m", "local", [10, 10, 10], cpu_ms=[8.0, 8.0, 9.0]),
            _row("m", "torch", [20, 20, 20], cpu_ms=[12.0, 12.0, 13.0]),
            _row("m", "fastddp", [15, 15, 15], baselines=("torch",), cpu_ms=[10.0, 11.0, 10.0])]
    r = {x.wrapper: x for x in R.derive(R.Section(None, rows)).rows}
    assert r["torch"].cpu_overhead_ms == pytest.approx(4.0)
    assert r["fastddp"].cpu_overhead_ms == pytest.approx(2.0)
    assert r["fastddp"].cpu_ratio == pytest.approx(0.5)
    # no CPU samples (an old report): no CPU figures, the rest unchanged
    r2 = {x.wrapper: x for x in _section().rows if x.model == "m"}
    assert r2["fastddp"].cpu_overhead_ms is None and r2["fastddp"].ratio == pytest.approx(0.5)


def test_format_table_rows_and_status():
    text = R.format_table(_section())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["model", "wrapper", "median"]
    body = lines[2:]
    assert len(body) == 11
    view = next(line for line in body if " fastddp-view " in line)
    assert "unavailable: not built" in view
    fast = next(line for line in body if line.startswith("m ") and " fastddp " in line)
    assert "0.50" in fast  # the ratio column


def test_verdict_lines_and_ratio_whiskers():
    rows = [_row("small", "local", [10, 11, 10, 12, 10, 11]),
            _row("small", "torch", [20, 21, 20, 22, 20, 21]),
            _row("small", "fastddp", [15, 16, 15, 17, 15, 16], baselines=("torch",)),
            _row("big", "local", [10, 10, 10]),
            _row("big", "torch", [20, 20, 20]),
            _row("big", "fastddp", [30, 30, 30], baselines=("torch",))]
    s = R.derive(R.Section(None, rows))
    lines = R.verdict_lines(s)
    assert len(lines) == 2
    assert lines[0].startswith("small fastddp vs torch: x0.50 [") and lines[0].endswith("target <= 0.8: met")
    assert lines[1] == "big fastddp vs torch: x2.00, target <= 1.0: median missed, too few rounds for an interval"
    assert "targets (90% interval):" in R.summary_text(R.Report({}, [s]))
    fast = {(r.model, r.wrapper): r for r in s.rows}[("small", "fastddp")]
    by = {(r.model, r.wrapper): r for r in s.rows}
    (lo, hi), none = R._ratio_whiskers(s, [fast, by[("big", "fastddp")]])
    base = by[("small", "torch")].overhead_ms
    assert lo == pytest.approx(fast.overhead_ms - fast.ratio_ci[0] * base)
    assert hi == pytest.approx(fast.ratio_ci[1] * base - fast.overhead_ms)
    assert none is None  # 3 rounds: no interval, no whisker


def test_json_roundtrip_and_markdown():
    rep = R.Report({"label": "t", "device": "Some CPU", "date": "2026-01-01"},
                   [_section(), _section(1.0)])
    back = R.from_json(R.to_json(rep))
    assert back.meta == rep.meta
    assert [(x.model, x.wrapper, x.status, x.step_ms) for x in back.sections[1].rows] == \
           [(x.model, x.wrapper, x.status, x.step_ms) for x in rep.sections[1].rows]
    assert back.sections[0].rows[4].ratio == pytest.approx(0.5)
    md = R.to_markdown(rep, {"": ["x-step.png"]})
    assert "## Results" in md and "## Simulated interconnect: 1 GB/s" in md
    assert "![x-step.png](x-step.png)" in md and "unavailable: not built" in md
    assert "## Notes" not in md  # prose lives in reports/README.md


def test_slugify():
    assert R.slugify("Intel(R) Xeon(R) Processor @ 2.80GHz") == "intel-xeon-processor-2-80ghz"
    assert R.slugify("NVIDIA H200") == "nvidia-h200"
    assert R.slugify("") == "unknown-device"


def test_write_report_files(tmp_path):
    rep = R.Report({"label": "unit test", "device": "Unit CPU", "date": "2026-01-02"},
                   [_section(1.0), _section(10.0)])
    paths = R.write_report(rep, tmp_path)
    folder = tmp_path / "unit-cpu"
    assert paths["md"] == folder / "2026-01-02-unit-test.md" and paths["md"].exists()
    assert json.loads(paths["json"].read_text())["meta"]["label"] == "unit test"
    names = sorted(p.name for p in paths["charts"])
    assert names == sorted(["2026-01-02-unit-test-bw1-step.png", "2026-01-02-unit-test-bw1-overhead.png",
                            "2026-01-02-unit-test-bw10-step.png", "2026-01-02-unit-test-bw10-overhead.png",
                            "2026-01-02-unit-test-bandwidth.png"])
    for p in paths["charts"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- wrappers ----------------------------------------------------------------------

def test_registry_covers_defaults():
    reg = registry()
    assert set(DEFAULT_WRAPPERS) <= set(reg)
    for name, spec in reg.items():
        if spec.family == "fastddp":
            assert spec.baselines and all(reg[b].family == "torch" for b in spec.baselines)


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


# -- bench/gpu_check.sh helpers ------------------------------------------------------

def test_gpu_check_script_parses_and_documents_its_stages():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for word in ("--dry-run", "OUT", "PYTHON", "summary.md", "env.txt", "tests.log", "kernels.json",
                 "bench.json", "gpu_check.log"):
        assert word in out.stdout, word
    assert subprocess.run(["bash", str(script), "--bogus"], capture_output=True).returncode == 2


def test_pytest_shards_reads_pytest_result_lines(tmp_path):
    from fastddp.bench import pytest_shards as S

    log = tmp_path / "shard-0.log"
    log.write_text("....F\nFAILED tests/x.py::t[a] - AssertionError: boom\n"
                   "1 failed, 20 passed, 3 skipped, 2 warnings in 3.21s\n")
    line = S.summary_line(log)
    assert line == "1 failed, 20 passed, 3 skipped, 2 warnings in 3.21s"
    assert S.counts(line) == {"failed": 1, "passed": 20, "skipped": 3, "warnings": 2}
    log.write_text("========== 5 passed, 1 error in 0.50s ==========\n")
    assert S.counts(S.summary_line(log)) == {"passed": 5, "errors": 1}
    assert S.summary_line(tmp_path / "missing.log") == ""


def test_check_summary_lines(tmp_path):
    from fastddp.bench import check_summary as C

    log = tmp_path / "tests.log"
    log.write_text("x\nFAILED tests/a.py::t1 - AssertionError\nERROR tests/b.py::t2 - RuntimeError\n"
                   "===== 1 failed, 7 passed, 1 error in 2.00s =====\n")
    lines = C.pytest_lines(log)
    assert lines[0].strip() == "1 failed, 7 passed, 1 error in 2.00s"
    assert any("FAILED tests/a.py::t1" in ln for ln in lines) and any("ERROR tests/b.py::t2" in ln for ln in lines)

    kern = {"meta": {"copy_GB/s": 4000.0, "backend": "triton", "truncated": True},
            "rows": [{"op": "pack", "wire": "bf16", "shape": "few_large", "method": "fastddp",
                      "device_us": 50.0, "pct_copy": 80.0, "bit_exact": True},
                     {"op": "pack", "wire": "bf16", "shape": "few_large", "method": "foreach",
                      "device_us": 100.0, "pct_copy": 40.0}]}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(kern))
    text = "\n".join(C.kernels_lines(path))
    assert "80% 2.0x" in text and "TRUNCATED" in text and "bit-exact vs reference: all" in text

    rep = R.Report({"label": "t", "device": "Unit GPU", "date": "2026-01-04", "world_size": 1,
                    "backend": "nccl", "torch": "2.11"}, [_section()])
    path = tmp_path / "bench.json"
    path.write_text(R.to_json(rep))
    text = "\n".join(C.bench_lines(path))
    assert "0.50" in text          # m / fastddp against torch
    assert "UNAVAILABLE" in text   # m / fastddp-view
    assert "not ok: m fastddp-view: unavailable: not built" in text
    assert C.main(["kernels", str(tmp_path / "nope.json")]) == 0


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
    assert elapsed < 60, f"the tiny run took {elapsed:.0f} s"
    (folder,) = out.iterdir()
    md = list(folder.glob("*-ci.md"))
    js = list(folder.glob("*-ci.json"))
    assert len(md) == 1 and len(js) == 1
    pngs = {p.name.split("-ci", 1)[1] for p in folder.glob("*.png")}
    assert {"-step.png", "-overhead.png", f"-bw{SIM_GBPS:g}-step.png", f"-bw{SIM_GBPS:g}-overhead.png"} <= pngs
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
    for s in rep.sections:
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
        assert rows["comm-floor"].wire_bytes == 4 * nparams and rows["comm-floor"].ratio_baseline == "torch"
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
