"""The multi-rank harness itself (tests/_dist.py): workers shared by the
whole session, started from a forkserver, and put back between calls so
that a test sees the same worker state whichever modules ran before it.
(Its failure, timeout and respawn behaviour: tests/test_ddp_api.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import shared_world, world2  # noqa: F401

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
