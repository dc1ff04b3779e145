"""Named ranges: present in a torch.profiler trace, absent (no work) when off."""

from __future__ import annotations

import json

import pytest
import torch

from tests._dist import STAND_IN, single_rank_group
from tests._models import loss_fn, make_batch, make_model

pytestmark = pytest.mark.skipif(STAND_IN, reason="fastddp's own ranges")


def _step(m, step=0):
    x, y = make_batch("deep", 0, step)
    m.zero_grad(set_to_none=True)
    loss_fn(m(x), y).backward()


def test_ranges_in_chrome_trace(tmp_path):
    from fastddp import DistributedDataParallel as F

    with single_rank_group(tmp_path):
        m = F(make_model("deep"), bucket_cap_mb=0.001)
        _step(m, 0)
        _step(m, 1)  # after the rebuild: several buckets
        nb = m.reducer.num_buckets
        assert nb > 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _step(m, 2)
        path = tmp_path / "trace.json"
        prof.export_chrome_trace(str(path))
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    for b in range(nb):
        for phase in ("pack", "allreduce", "wait", "unpack"):
            assert f"fastddp/{phase}[{b}]" in names, (phase, b, sorted(n for n in names if n and "fastddp" in n))
    assert "fastddp/finalize" in names
    assert "fastddp/forward" in names


def test_ranges_are_a_shared_noop_when_off(monkeypatch):
    from fastddp import profiling

    monkeypatch.setattr(profiling, "_state", {"on": False})
    a = profiling.range("fastddp/pack[0]")
    b = profiling.range("fastddp/unpack[3]")
    assert a is b  # the one shared nullcontext: nothing allocated, nothing recorded


def test_env_switch_turns_ranges_on(monkeypatch):
    from fastddp import profiling, settings

    monkeypatch.setattr(profiling, "_state", {"on": None})
    monkeypatch.setenv("FASTDDP_NVTX", "1")
    settings.reload()  # the environment is read once: re-read it after the change
    try:
        assert profiling.enabled()
        r = profiling.range("fastddp/pack[0]")
        assert r is not profiling._NULL and r.name == "fastddp/pack[0]"
    finally:
        monkeypatch.undo()
        settings.reload()


def test_env_switch_off_words_keep_ranges_off(monkeypatch):
    """One truthiness rule: FASTDDP_NVTX=false is off (it used to turn ranges on)."""
    from fastddp import profiling, settings

    monkeypatch.setattr(profiling, "_state", {"on": None})
    monkeypatch.setenv("FASTDDP_NVTX", "false")
    settings.reload()
    try:
        assert not profiling.enabled()
    finally:
        monkeypatch.undo()
        settings.reload()
