"""tools/step_phases.py: the per-phase probe on loopback (two gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import step_phases

pytestmark = pytest.mark.timeout(300)


def test_paired_ratio_is_the_geometric_mean_with_an_interval():
    g, lo, hi = step_phases.paired([10.0, 10.0, 10.0, 10.0], [9.0, 11.0, 9.0, 11.0])
    assert lo < g < hi
    assert g == pytest.approx((0.9 * 1.1) ** 0.5)


def _loopback(tmp_path, rows: str, steps: int, port: int):
    """``step_phases`` on loopback, the tiny model: (the finished run, rank 0's samples)."""
    return _loopback_args(tmp_path, ["--rows", rows], steps, port)


def _loopback_args(tmp_path, args: list, steps: int, port: int):
    out = tmp_path / "s.json"
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", *args, "--model", "tiny",
                          "--steps", str(steps), "--json", str(out), "--port", str(port)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    return run, json.loads(out.read_text())


def test_two_rows_on_loopback(tmp_path):
    run, samples = _loopback(tmp_path, "torch,fastddp", 3, 29547)
    assert "fastddp / torch step:" in run.stdout and "fastddp / torch cpu:" in run.stdout
    assert "fastddp - torch training thread CPU ms: fwd " in run.stdout
    assert set(samples) == {"torch", "fastddp"}
    assert all(len(samples[r][p]) == 3 and min(samples[r][p]) > 0 for r in samples for p in step_phases.PHASES
               if p != "cpu")
    assert all(len(samples[r][f"thread-{q}"]) == 3 for r in samples for q in step_phases.THREAD)


def test_view_rows_wrap_with_bucket_views():
    """``torch-view`` and ``fastddp-view``: each DDP with
    gradient_as_bucket_view=True, the other rows without."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29539", rank=0, world_size=1)
    try:
        got = {name: step_phases._wrap(name, torch.nn.Linear(4, 4)).gradient_as_bucket_view
               for name in ("torch", "torch-view", "fastddp", "fastddp-view")}
    finally:
        dist.destroy_process_group()
    assert got == {"torch": False, "torch-view": True, "fastddp": False, "fastddp-view": True}


def test_end_rows_run_phase_two_at_the_end_of_backward(tmp_path):
    out = tmp_path / "s.json"
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows",
                          "fastddp-bf16acc,fastddp-bf16acc@end", "--model", "tiny", "--steps", "2",
                          "--json", str(out), "--port", "29533"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert set(json.loads(out.read_text())) == {"fastddp-bf16acc", "fastddp-bf16acc@end"}
    bad = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows", "torch,fastddp@end", "--model",
                          "tiny", "--steps", "2", "--port", "29535"], capture_output=True, text=True, timeout=240)
    assert bad.returncode != 0 and "runs no phase-2 thread" in bad.stdout + bad.stderr


def test_thread_cpu_difference_is_paired_with_an_interval():
    d, lo, hi = step_phases.difference([10.0, 10.0, 10.0, 10.0], [10.4, 10.6, 10.4, 10.6])
    assert d == pytest.approx(0.5) and lo < 0.5 < hi


def test_unknown_rows_are_refused():
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows", "torch,fastdp"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown ['fastdp']" in run.stderr


def _mix_rank(rank: int, port: int, out: str) -> None:
    import copy
    import os

    import torch
    import torch.distributed as dist

    from fastddp.bench.models import model_zoo

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = model_zoo()["tiny"]
        torch.manual_seed(0)
        base = spec.build()
        gen = torch.Generator().manual_seed(1 + rank)
        batches = [spec.make_batch(gen, torch.device("cpu")) for _ in range(3)]
        grads = {}
        for name in ("fastddp", "fastddp-fp8", "fastddp-fp8-first32", "fastddp-fp8-last32"):
            ddp = step_phases._wrap(name, copy.deepcopy(base))
            for x, y in batches:  # past torch's bucket rebuild: the mix is set again on the new buckets
                step_phases.mix_buckets(name, ddp)
                ddp.zero_grad(set_to_none=True)
                spec.loss(ddp(x), y).backward()
            grads[name] = [p.grad.clone() for p in ddp.parameters()]
            kinds = {type(b.reduction).__name__ for b in ddp.reducer.buckets}
            grads[name + ":kinds"] = sorted(kinds)
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def test_per_bucket_mix_rows_reduce_their_bucket_in_fp32(tmp_path):
    """``tiny`` has one bucket: the fp8 rows with it mixed to fp32 must give
    the default row's gradients bit for bit, the plain fp8 row must not."""
    import torch
    import torch.multiprocessing as mp

    out = str(tmp_path / "g.pt")
    mp.spawn(_mix_rank, args=(29543, out), nprocs=2)
    g = torch.load(out)
    # two ranks: the fp8 hook's mode is its two-rank choice (two phases or one all-gather)
    assert g["fastddp-fp8:kinds"] == ["AutoPrecision"] and g["fastddp-fp8-first32:kinds"] == ["AllReduce"]
    for name in ("fastddp-fp8-first32", "fastddp-fp8-last32"):
        assert all(torch.equal(a, b) for a, b in zip(g["fastddp"], g[name])), name
    assert not all(torch.equal(a, b) for a, b in zip(g["fastddp"], g["fastddp-fp8"]))


def _row(**cols):
    return {k: list(v) for k, v in cols.items()}


def test_floor_is_forward_first_bucket_wire_and_optimizer():
    # 1 Gbit/s carried: 12.5 MB is 100 ms of wire
    row = _row(fwd=[20.0, 22.0], first=[3.0, 5.0], sent=[12_500_000, 12_500_000], opt=[10.0, 10.0],
               step=[200.0, 220.0])
    row["carried_gbit"] = 1.0
    assert step_phases.floor(row) == pytest.approx([133.0, 137.0])
    # a local backward that outlasts first + wire bounds that step instead
    local = _row(bwd=[50.0, 150.0])
    assert step_phases.floor(row, local) == pytest.approx([133.0, 182.0])
    assert step_phases.floor(_row(fwd=[1.0], opt=[1.0], step=[3.0])) is None  # torch's row, or off a link


def test_a_local_row_and_the_first_bucket_on_loopback(tmp_path):
    run, samples = _loopback(tmp_path, "fastddp,local", 2, 29537)
    fast, local = samples["fastddp"], samples["local"]
    assert len(fast["first"]) == 2 and all(0 < f < b for f, b in zip(fast["first"], fast["bwd"]))
    assert "first" not in local and "sent" not in fast  # loopback: no link counters, so no floor line
    assert "step / floor" not in run.stdout


def test_timeline_of_a_two_phase_row(tmp_path):
    """``--timeline ROW``: rank 0's last timed step of ROW, event by event:
    the pack, the issue and round 0 on the backward thread, round 1 on the
    phase-2 thread, the finish and the unpack, in the order they ran."""
    run, samples = _loopback_args(tmp_path, ["--rows", "torch,fastddp-fp8", "--timeline", "fastddp-fp8"], 2, 29545)
    events = samples["fastddp-fp8"]["timeline"]
    whats = [w for _, _, w in events]
    order = ["forward end", "pack of bucket 0 start", "issue of bucket 0 start", "round 0 of bucket 0 start",
             "finish of bucket 0 end", "unpack of bucket 0 start", "backward end", "optimizer end"]
    assert [w for w in whats if w in order] == order, whats
    assert any(th == "fastddp-phase2" and w == "round 1 of bucket 0 start" for _, th, w in events), events
    assert [t for t, _, _ in events] == sorted(t for t, _, _ in events)
    assert "its last timed step on rank 0" in run.stdout and "timeline" not in samples["torch"]


def test_timeline_restores_what_it_wraps():
    from fastddp.reduction import fp8, twophase
    from tools.timeline import Timeline

    before = (fp8.BlockFp8.pack, twophase.ShardStep.advance, twophase.TwoPhaseEngine.finish)
    with Timeline() as t:
        assert fp8.BlockFp8.pack is not before[0]
        t.note("x")
    assert (fp8.BlockFp8.pack, twophase.ShardStep.advance, twophase.TwoPhaseEngine.finish) == before
    assert [w for _, _, w in t.events] == ["x"]


def test_timeline_row_must_be_a_row():
    run = subprocess.run([sys.executable, "-m", "tools.step_phases", "--rows", "torch,fastddp", "--timeline",
                          "fastddp-fp8"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--timeline fastddp-fp8: not one of --rows" in run.stderr


def test_link_use_finds_first_and_last_bytes_and_the_idle_stretches():
    """A step's trace: nothing for 10 ms, 1 MB by 20 ms, nothing 20-30 ms,
    1 MB more by 40 ms, then flat: first bytes after the 10 ms sample, last
    at 40 ms, one idle stretch; the shares against 1 Gbit/s (125 MB/s)."""
    from tools.timeline import link_use, sent_at

    t = [i * 0.0005 for i in range(121)]  # 0-60 ms every 0.5 ms
    def sent(x):
        if x <= 0.010:
            return 0
        if x <= 0.020:
            return int(1e6 * (x - 0.010) / 0.010)
        if x <= 0.030:
            return 1_000_000
        return min(2_000_000, 1_000_000 + int(1e6 * (x - 0.030) / 0.010))
    trace = [(x, sent(x)) for x in t]
    use = link_use(trace, 1.0)
    assert use["first"] == pytest.approx(0.010) and use["last"] == pytest.approx(0.040)
    assert use["sent"] == 2_000_000
    assert len(use["idle"]) == 1 and use["idle"][0] == (pytest.approx(0.020), pytest.approx(0.030))
    assert use["span_share"] == pytest.approx(2e6 / 0.030 / 125e6)
    assert use["busy_share"] == pytest.approx(2e6 / 0.020 / 125e6)
    assert sent_at(trace, 0.025) == 1_000_000 and sent_at(trace, 0.0) == 0
    assert link_use([(0.0, 0), (0.001, 0)], 1.0) is None  # nothing sent: nothing to say
    assert link_use(trace, 1.0, idle_s=0.02)["idle"] == []  # the stretch is shorter than that


def test_link_trace_samples_a_counter_until_stopped():
    import itertools
    import time

    from tools.timeline import LinkTrace

    count = itertools.count(100, 7)
    trace = LinkTrace(lambda: next(count), every=0.001)
    t0 = time.perf_counter()
    trace.start(t0)
    time.sleep(0.03)
    trace.stop()
    n = len(trace.samples)
    assert n >= 5 and trace.samples[0][1] >= 7  # bytes since start (the start read 100)
    assert [b for _, b in trace.samples] == sorted(b for _, b in trace.samples)
    assert all(0 <= a <= 0.5 for a, _ in trace.samples)
    time.sleep(0.01)
    assert len(trace.samples) == n  # stopped: no thread left sampling


@pytest.mark.skipif(not __import__("tools.tests.test_netlink", fromlist=["CAN_LINK"]).CAN_LINK,
                    reason="needs root and iproute2 to build the netns link")
def test_timeline_on_a_link_says_when_its_bytes_left(tmp_path):
    """``--timeline ROW`` on a netns link: each event with the bytes rank 0
    had sent by then, and the link line (first and last bytes, the shares)."""
    run, samples = _loopback_args(tmp_path, ["--link", "netns:1", "--rows", "torch-fp16,fastddp-fp8",
                                             "--timeline", "fastddp-fp8", "--warmup", "2"], 2, 29541)
    tr = samples["fastddp-fp8"]["link_trace"]
    assert tr and tr[-1][1] > 0 and "link_trace" not in samples["torch-fp16"]
    assert [b for _, b in tr] == sorted(b for _, b in tr)
    assert "link (this rank's interface, sampled every 0.5 ms): first bytes at" in run.stdout
    assert " sent " in run.stdout.split("event by event")[1]
