"""The end-to-end runner (``fastddp-bench``): statistics and report code as
pure units, the simulated wire on its own, and one tiny 2-rank run through
the command line (spawned once for the module)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from fastddp.bench import report as R
from fastddp.bench.wrappers import (DEFAULT_WRAPPERS, SimulatedWire, computed_wire_bytes, registry)
from tests._dist import torch_ddp_accepts


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


def test_json_roundtrip_and_markdown():
    rep = R.Report({"label": "t", "device": "Some CPU", "date": "2026-01-01", "notes": ["a note"]},
                   [_section(), _section(1.0)])
    back = R.from_json(R.to_json(rep))
    assert back.meta == rep.meta
    assert [(x.model, x.wrapper, x.status, x.step_ms) for x in back.sections[1].rows] == \
           [(x.model, x.wrapper, x.status, x.step_ms) for x in rep.sections[1].rows]
    assert back.sections[0].rows[4].ratio == pytest.approx(0.5)
    md = R.to_markdown(rep, {"": ["x-step.png"]})
    assert "## Results" in md and "## Simulated interconnect: 1 GB/s" in md
    assert "![x-step.png](x-step.png)" in md and "unavailable: not built" in md
    assert "* a note" in md


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


def test_simulated_wire_is_serial_and_sleeps():
    gbps = 0.001  # 1 MB/s: 2000 bytes take 2 ms
    done = torch.futures.Future()
    done.set_result(None)
    t0 = time.perf_counter()
    with SimulatedWire(gbps, torch.device("cpu")) as wire:
        futs = [wire.transfer(done, 2000, lambda i=i: torch.tensor(float(i))) for i in range(5)]
        values = [f.wait().item() for f in futs]
        elapsed = time.perf_counter() - t0
        assert wire.bytes_sent == 10_000
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert elapsed >= 5 * 2000 / (gbps * 1e9) * 0.95


def test_simulated_wire_waits_for_the_real_collective():
    real = torch.futures.Future()
    with SimulatedWire(1000.0, torch.device("cpu")) as wire:
        out = wire.transfer(real, 8, lambda: torch.ones(1))
        time.sleep(0.02)
        assert not out.done()
        real.set_result(None)
        assert out.wait().item() == 1.0


def test_simulated_wire_rejects_nonpositive():
    with pytest.raises(ValueError):
        SimulatedWire(0.0, torch.device("cpu"))


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
        if not torch_ddp_accepts("batched_grad_copy"):  # torch 2.11: the row says why it is empty
            r = rows["torch-batched"]
            assert r.status.startswith("unavailable: ") and "batched_grad_copy" in r.status, r.status
            measured.remove("torch-batched")
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
    # under simulation the torch rows go through the simulated wire (measured
    # bytes) and backward waits for it: exposed >= bytes / bandwidth
    sim = {r.wrapper: r for r in rep.sections[1].rows}
    assert sim["torch"].wire_source == "measured"
    wire_ms = sim["torch"].wire_bytes / (SIM_GBPS * 1e9) * 1e3
    assert min(sim["torch"].exposed_ms) >= 0.9 * wire_ms
    assert min(sim["comm-floor"].exposed_ms) >= 0.9 * wire_ms  # the floor pays the wire too


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
