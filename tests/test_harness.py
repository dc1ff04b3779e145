"""The multi-rank harness itself (tests/_dist.py): workers shared by the
whole session, started from a forkserver, and put back between calls so
that a test sees the same worker state whichever modules ran before it
(its failure, timeout and respawn behaviour: tests/test_ddp_api.py); and
the fast tier's choice and the recorded durations it reads
(tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._dist import REPO_ROOT, shared_world, single_rank_group, world2  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def _pid(rank, world_size):
    return os.getpid()


def _parent_pid(rank, world_size):
    return os.getppid()


def _leave_state_behind(rank, world_size):
    import fastddp
    os.environ["FASTDDP_NVTX"] = "1"
    os.environ["FASTDDP_HARNESS_LEFTOVER"] = "yes"
    fastddp.configure(check_finite="raise", bucket_cap_mb=7)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234)
    return True


def _what_the_next_call_sees(rank, world_size):
    from fastddp import settings
    return {
        "leftover": os.environ.get("FASTDDP_HARNESS_LEFTOVER"),
        "nvtx": settings.get().nvtx,
        "configured": (settings.configured("check_finite"), settings.configured("bucket_cap_mb")),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "draw": torch.rand(3),
    }


def test_a_single_rank_group_leaves_no_folder_behind(tmp_path):
    """The folder a 1-rank group makes for its init file goes with the
    group (each used to stay in /tmp: hundreds after a few runs); a folder
    the caller passes stays the caller's."""
    import torch.distributed as dist

    group = single_rank_group()
    with group:
        made = group._made
        assert dist.is_initialized() and made is not None and os.path.isdir(made)
    assert not dist.is_initialized() and not os.path.exists(made)
    with single_rank_group(tmp_path):
        pass
    assert tmp_path.is_dir()


def test_the_fixture_hands_out_the_session_workers(world2):
    assert world2 is shared_world(2)
    before = world2.run(_pid)
    spawns = world2.spawns
    assert shared_world(2).run(_pid) == before
    assert world2.spawns == spawns


def test_another_environment_gets_other_workers(world2, monkeypatch):
    monkeypatch.setenv("FASTDDP_HARNESS_ENV", "other")
    other = shared_world(2)
    assert other is not world2
    assert set(other.run(_pid)).isdisjoint(world2.run(_pid))


def test_a_call_sees_none_of_what_an_earlier_call_left(world2):
    world2.run(_leave_state_behind)
    for seen in world2.run(_what_the_next_call_sees):
        assert seen["leftover"] is None
        assert seen["nvtx"] is False
        assert seen["configured"] == (None, None)
        assert seen["dtype"] is torch.float32 and seen["grad"] is True
        torch.manual_seed(0)
        assert torch.equal(seen["draw"], torch.rand(3))


def test_workers_come_from_a_forkserver(world2):
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver on this platform: the harness spawns")
    # a spawned worker's parent is this process; a forked one's, the server
    assert os.getpid() not in world2.run(_parent_pid)


# ------------------------------------------------------------ the fast tier
class _Item:
    def __init__(self, nodeid, *marks):
        self.nodeid = nodeid
        self.keywords = dict.fromkeys(marks, True)


class _Config:
    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected += items


def test_the_fast_tier_keeps_each_files_quick_cases(monkeypatch):
    from tests import conftest

    table = {"tests/test_a.py::quick": 0.1, "tests/test_a.py::slow_one": 5.0,
             "tests/test_b.py::long": 9.0, "tests/test_b.py::longer": 12.0,
             "tests/test_c.py::quick_but_marked": 0.01}
    monkeypatch.setattr(conftest, "_durations", lambda: table)
    items = [_Item("tests/test_a.py::quick"), _Item("tests/test_a.py::slow_one"),
             _Item("tests/test_a.py::new_unrecorded"), _Item("tests/test_b.py::longer"),
             _Item("tests/test_b.py::long"), _Item("tests/test_c.py::quick_but_marked", "slow"),
             _Item("tests/test_c.py::on_the_rig", "rig")]
    config = _Config()
    kept = list(items)
    conftest._fast_tier(config, kept)
    assert [i.nodeid for i in kept] == [
        "tests/test_a.py::quick", "tests/test_a.py::new_unrecorded",  # quick or not recorded yet
        "tests/test_b.py::long"]  # a file with no quick case keeps its quickest
    assert {i.nodeid for i in config.deselected} == {i.nodeid for i in items} - {i.nodeid for i in kept}


def test_recorded_durations_merge_into_the_table(tmp_path):
    from tests.conftest import write_durations

    path = tmp_path / "durations.json"
    write_durations(path, {"tests/test_a.py::x": 1.23456})
    write_durations(path, {"tests/test_b.py::y": 0.5, "tests/test_a.py::x": 2.0})
    assert json.loads(path.read_text()) == {"tests/test_a.py::x": 2.0, "tests/test_b.py::y": 0.5}


def test_the_shards_deal_whole_files_by_recorded_time(monkeypatch):
    """tests/run.sh's two default shards: every selected test in exactly one
    shard, a file's tests together, the long files spread."""
    from tests import conftest

    table = {"tests/test_a.py::x": 50.0, "tests/test_b.py::x": 40.0, "tests/test_b.py::y": 5.0,
             "tests/test_c.py::x": 30.0, "tests/test_d.py::x": 20.0}
    monkeypatch.setattr(conftest, "_durations", lambda: table)
    monkeypatch.delenv("FASTDDP_TESTS_CLAIMS", raising=False)  # the static deal (run.sh's shards claim)
    items = [_Item(n) for n in [*table, "tests/test_e.py::unrecorded"]]
    kept = []
    for i in range(2):
        monkeypatch.setenv("FASTDDP_TESTS_SHARD", f"{i}/2")
        mine = list(items)
        conftest._shard(mine)
        kept.append([it.nodeid for it in mine])
    assert sorted(kept[0] + kept[1]) == sorted(it.nodeid for it in items)  # each once
    files = [{n.split("::")[0] for n in k} for k in kept]
    assert not files[0] & files[1]  # whole files
    loads = [sum(table.get(n, 0.05) for n in k) for k in kept]
    assert max(loads) <= 75.05, loads  # a+d | b+c (the best deal: 70 / 75)
    monkeypatch.setenv("FASTDDP_TESTS_SHARD", "2/2")
    with pytest.raises(pytest.UsageError, match="FASTDDP_TESTS_SHARD='2/2'"):
        conftest._shard(list(items))
    monkeypatch.delenv("FASTDDP_TESTS_SHARD")
    whole = list(items)
    conftest._shard(whole)
    assert whole == items  # unset: everything


def test_claiming_shards_work_their_deal_longest_first_then_steal_short_files(tmp_path, monkeypatch):
    from tests import conftest

    table = {"tests/test_a.py::x": 50.0, "tests/test_b.py::x": 40.0, "tests/test_b.py::y": 5.0,
             "tests/test_c.py::x": 30.0, "tests/test_d.py::x": 20.0}
    items = [_Item(n) for n in [*table, "tests/test_e.py::unrecorded", "tests/test_a.py::z"]]
    deal = conftest.shard_files(items, table, 2)  # a+d+e | b+c
    assert deal == [{"tests/test_a.py", "tests/test_d.py", "tests/test_e.py"}, {"tests/test_b.py", "tests/test_c.py"}]
    files = [list(dict.fromkeys(i.nodeid.split("::")[0] for i in conftest.claim_order(items, table, deal, k)))
             for k in range(2)]
    # its own share longest first (a 50.05, d 20, e 0.05), then the other's shortest first (c 30, b 45)
    assert files[0] == ["tests/test_a.py", "tests/test_d.py", "tests/test_e.py", "tests/test_c.py", "tests/test_b.py"]
    assert files[1] == ["tests/test_b.py", "tests/test_c.py", "tests/test_e.py", "tests/test_d.py", "tests/test_a.py"]
    mine = [i.nodeid for i in conftest.claim_order(items, table, deal, 0)]
    assert mine[:2] == ["tests/test_a.py::x", "tests/test_a.py::z"]  # a file's tests together
    assert sorted(mine) == sorted(i.nodeid for i in items)  # every test, once
    assert conftest.claim(str(tmp_path), "tests/test_b.py") and not conftest.claim(str(tmp_path), "tests/test_b.py")
    monkeypatch.setattr(conftest, "_durations", lambda: table)
    monkeypatch.setenv("FASTDDP_TESTS_SHARD", "1/2")
    monkeypatch.setenv("FASTDDP_TESTS_CLAIMS", str(tmp_path))
    kept = list(items)
    conftest._shard(kept)
    assert [i.nodeid for i in kept] == [i.nodeid for i in conftest.claim_order(items, table, deal, 1)]  # all: the loop claims


@pytest.mark.slow
def test_two_claiming_shards_run_every_test_once(tmp_path):
    """tests/run.sh's default session: two pytest processes claiming whole
    files from one folder run each selected test exactly once between them."""
    files = ["tests/test_compare.py", "tests/test_kernels_health_cpu.py", "tests/test_autotune_search.py",
             "tests/test_docs_links.py", "tests/test_kernels_torch_path.py"]  # quick ones: what matters is who runs them
    env = {k: v for k, v in os.environ.items() if k not in ("FASTDDP_TESTS_SHARD", "TRITON_INTERPRET")}
    claims, ran = tmp_path / "claims", [tmp_path / "ran-0.json", tmp_path / "ran-1.json"]
    claims.mkdir()
    env["FASTDDP_TESTS_CLAIMS"] = str(claims)
    sel = ["-q", "-p", "no:randomly", "-m", "not interpret and not gpu", *files]
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", *sel, "--record-durations", str(ran[i])],
                              cwd=REPO_ROOT, env={**env, "FASTDDP_TESTS_SHARD": f"{i}/2"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    ran = [set(json.loads(r.read_text())) if r.exists() else set() for r in ran]  # the test ids each one ran
    assert not ran[0] & ran[1], ran[0] & ran[1]  # no test twice
    assert {n.split("::")[0] for n in ran[0]}.isdisjoint({n.split("::")[0] for n in ran[1]})  # whole files
    whole = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *sel], cwd=REPO_ROOT,
                           env={k: v for k, v in env.items() if k != "FASTDDP_TESTS_CLAIMS"},
                           capture_output=True, text=True, timeout=120).stdout
    want = {line for line in whole.splitlines() if "::" in line}
    assert len(want) > 50 and ran[0] | ran[1] == want, (want - (ran[0] | ran[1]), (ran[0] | ran[1]) - want)
    assert sorted(os.listdir(claims)) == sorted({n.split("::")[0].replace("/", "__") for n in want})
