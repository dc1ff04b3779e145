"""The bench's two hosts of several ranks (``--link netns:RATE
--ranks-per-host L``): the options' validation, the per-step byte
accounting of host 1's veth counters in the rounds, the report's columns and
the hierarchical wrapper rows.  No namespaces here (tools/tests/test_netlink.py
runs the real thing as root); no timing asserts."""

from __future__ import annotations

import pytest

from fastddp.bench import linkbytes as LB
from fastddp.bench import report as R
from fastddp.bench import export as E
from fastddp.bench import rounds
from fastddp.bench import wrappers as W
from fastddp.bench.config import BenchConfig


# -- configuration ----------------------------------------------------------------------

def test_ranks_per_host_needs_link():
    with pytest.raises(ValueError, match="--ranks-per-host places ranks on the two hosts of --link"):
        BenchConfig(models=("tiny",), ranks_per_host=2).validate()


def test_world_must_be_twice_ranks_per_host():
    with pytest.raises(ValueError, match=r"2 rank\(s\) in each of two namespaces: --world must be 4 "
                                         r"\(2 x --ranks-per-host\), got 2"):
        BenchConfig(models=("tiny",), link="netns:1", ranks_per_host=2, world=2).validate()
    with pytest.raises(ValueError, match="--world must be 2 "):
        BenchConfig(models=("tiny",), link="netns:1", world=4).validate()
    BenchConfig(models=("tiny",), link="netns:1", ranks_per_host=2, world=4).validate()
    BenchConfig(models=("tiny",), link="netns:1", ranks_per_host=3).validate()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_ranks_per_host_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="--ranks-per-host must be an integer >= 1"):
        BenchConfig(models=("tiny",), link="netns:1", ranks_per_host=bad).validate()


def test_cli_refuses_ranks_per_host_without_link(capsys, tmp_path):
    from fastddp.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--ranks-per-host", "2", "--models", "tiny", "--out", str(tmp_path), "--no-progress"])
    assert e.value.code == 2
    assert "--ranks-per-host places ranks on the two hosts of --link" in capsys.readouterr().err


# -- the meter ----------------------------------------------------------------------------

def test_meter_laps_are_differences_of_the_counters():
    readings = iter([(100, 50), (160, 55), (160, 55), (1160, 2055)])
    m = LB.LinkMeter(lambda: next(readings))
    assert m.counting
    assert m.lap() == (60, 5) and m.lap() == (0, 0) and m.lap() == (1000, 2000)


def test_only_host_1s_first_rank_counts(monkeypatch):
    for env in ({"GROUP_RANK": "0", "LOCAL_RANK": "0"}, {"GROUP_RANK": "1", "LOCAL_RANK": "1"}, {}):
        m = LB.LinkMeter.for_rank(env)
        assert not m.counting and m.lap() == (0, 0)
    with pytest.raises(RuntimeError, match="without GLOO_SOCKET_IFNAME"):
        LB.LinkMeter.for_rank({"GROUP_RANK": "1", "LOCAL_RANK": "0"})


def test_median_bytes():
    assert LB.median_bytes([]) is None
    assert LB.median_bytes([5, 1, 3]) == 3 and LB.median_bytes([4, 1, 3, 2]) == 2


# -- accounting in the rounds ------------------------------------------------------------

class _Wire:
    """A fake veth counter: steps and barriers add to it."""

    def __init__(self):
        self.tx = self.rx = 0

    def read(self):
        return self.tx, self.rx


class _FakeCtx:
    BARRIER = 7  # bytes a barrier sends

    def __init__(self, wire, counting):
        self.wire, self.cuda, self.world = wire, False, 1
        self.meter = LB.LinkMeter(wire.read if counting else None)

    def barrier(self):
        self.wire.tx += self.BARRIER
        self.wire.rx += self.BARRIER


class _E:
    def __init__(self, name, sends):
        self.name, self.sends = name, sends
        self.row = R.Row("m", name)


def _run_rounds(monkeypatch, counting, timed_rounds=3, warmup_rounds=2):
    wire = _Wire()
    ctx = _FakeCtx(wire, counting)
    entries = [_E("a", 1000), _E("b", 50), _E("c", 0)]

    def step(ctx, spec, e, batch):
        wire.tx += e.sends
        wire.rx += 2 * e.sends
        return 1.0, 0.5, 1.0

    monkeypatch.setattr(rounds, "timed_step", step)
    monkeypatch.setattr(rounds, "_batch", lambda ctx, spec, index: None)
    monkeypatch.setattr(rounds, "all_gather", lambda ctx, t: [t])
    wire.tx += 12345  # what happened before the rounds is never counted
    for i in range(warmup_rounds):
        rounds._round(ctx, None, entries, i, timed=False)
    for i in range(timed_rounds):
        rounds._round(ctx, None, entries, warmup_rounds + i, timed=True)
        wire.tx += 999  # between rounds (the all_gather of the times): not any wrapper's
    return entries


def test_rounds_count_each_wrappers_step_and_one_barrier(monkeypatch):
    entries = _run_rounds(monkeypatch, counting=True)
    for e in entries:  # timed rounds only, whatever the rotated order
        assert e.row.link_out_bytes == [e.sends + _FakeCtx.BARRIER] * 3, (e.name, e.row.link_out_bytes)
        assert e.row.link_in_bytes == [2 * e.sends + _FakeCtx.BARRIER] * 3
        assert len(e.row.step_ms) == 3


def test_ranks_that_do_not_count_add_zeros(monkeypatch):
    for e in _run_rounds(monkeypatch, counting=False):
        assert e.row.link_out_bytes == [0] * 3 and e.row.link_in_bytes == [0] * 3


def test_without_link_nothing_is_counted(monkeypatch):
    wire = _Wire()
    ctx = _FakeCtx(wire, True)
    ctx.meter = None
    e = _E("a", 10)
    monkeypatch.setattr(rounds, "timed_step", lambda ctx, spec, e, batch: (1.0, 0.5, 1.0))
    monkeypatch.setattr(rounds, "_batch", lambda ctx, spec, index: None)
    monkeypatch.setattr(rounds, "all_gather", lambda ctx, t: [t])
    rounds._round(ctx, None, [e], 0, timed=True)
    assert e.row.link_out_bytes == [] and e.row.step_ms == [1.0]
    assert wire.tx == _FakeCtx.BARRIER  # no closing barrier either


# -- the report -----------------------------------------------------------------------------

def _report(link: bool) -> R.Report:
    row = R.Row("tiny", "torch", family="torch", step_ms=[10.0, 11.0, 12.0], wire_bytes=1000,
                wire_source="computed")
    if link:
        row.link_out_bytes, row.link_in_bytes = [1500, 1600, 1400], [1510, 1490, 1500]
    return R.Report({"label": "x"}, [R.derive(R.Section(None, [row]))])


def test_markdown_has_the_link_columns_only_on_a_link_run():
    md = E._md_rows(_report(True).sections[0])
    assert "| link out MB | link in MB | out / wire |" in md
    assert "| 0.0015 | 0.0015 | 1.50 |" in md
    assert "link out MB" not in E._md_rows(_report(False).sections[0])


def test_json_keeps_the_per_step_link_bytes():
    back = R.from_json(R.to_json(_report(True)))
    row = back.sections[0].rows[0]
    assert row.link_out_bytes == [1500, 1600, 1400] and row.link_in_bytes == [1510, 1490, 1500]


# -- the hierarchical rows ------------------------------------------------------------------

HIER = ("fastddp-hier-fp32", "fastddp-hier-bf16", "fastddp-hier-fp8")


def test_hier_rows_are_registered_opt_in_against_torch_and_fp16():
    reg = W.registry()
    for name in HIER:
        spec = reg[name]
        assert spec.family == "fastddp" and spec.baselines == ("torch", "torch-fp16")
        assert name not in W.DEFAULT_WRAPPERS
    assert [reg[n].wire_itemsize for n in HIER] == [None, 2, 1]


def test_hier_rows_are_unavailable_without_the_hook(monkeypatch):
    from fastddp import hooks

    monkeypatch.delattr(hooks, "hierarchical_hook", raising=False)
    for name in HIER:
        with pytest.raises(ImportError, match="no hierarchical_hook yet"):
            W.registry()[name].factory(None, None, W.WrapperOptions())


@pytest.mark.parametrize("name,wire", list(zip(HIER, ("fp32", "bf16", "fp8"))))
def test_hier_rows_register_the_state_and_hook(monkeypatch, name, wire):
    from fastddp import hooks

    class State:
        def __init__(self, wire, process_group=None):
            self.wire, self.process_group = wire, process_group

    def hierarchical_hook(state, bucket):  # pragma: no cover - never called here
        raise AssertionError

    class Ddp:
        def __init__(self):
            self.calls = []

        def register_comm_hook(self, state, hook):
            self.calls.append((state, hook))

    ddp = Ddp()
    monkeypatch.setattr(hooks, "HierarchicalState", State, raising=False)
    monkeypatch.setattr(hooks, "hierarchical_hook", hierarchical_hook, raising=False)
    monkeypatch.setattr(W, "_fastddp", lambda model, pg, options: (ddp, ""))
    module, note = W.registry()[name].factory(None, None, W.WrapperOptions())
    (state, fn), = ddp.calls
    assert module is ddp and fn is hierarchical_hook and state.wire == wire and state.process_group is None
    assert note == f"hooks.hierarchical_hook, wire={wire}"
