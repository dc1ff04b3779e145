"""``auto_precision_hook`` on a link whose rate changes mid-run (the netns rig).

Two ranks in two network namespaces joined by a veth (tools/netlink.py),
at 10 Gbit/s at first: the setting settles (fp32, where compression
buys nothing) and takes its watch's baseline; then the test shapes the live
link to 0.05 Gbit/s, where the ~1 MiB gradient takes ~0.17 s in fp32 and a
quarter of that in fp8.  The setting must notice (sustained slower windows),
re-measure and move to a compressed format within :data:`BOUND_STEPS`.

Needs root and iproute2; skips otherwise, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tools.netlink import NetnsLink, parse_link

REPO = Path(__file__).resolve().parents[1]
SLOW_GBIT = 0.05
#: the watch (2 windows of 3 steps, read one step late, window alignment) plus
#: a trial of a warm-up and at most 6 rounds of 3 formats, with slack
BOUND_STEPS = 40

pytestmark = [
    pytest.mark.rig,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs root and iproute2 (ip, tc) to build two network namespaces and "
                              "change the link's rate mid-run"),
]


def test_a_link_that_slows_moves_the_setting_to_a_compressed_format(tmp_path):
    argv = [sys.executable, str(REPO / "tests" / "_auto_link_rank.py"), str(tmp_path)]
    with NetnsLink(parse_link("netns:10")) as link:
        procs = []
        for side in (0, 1):
            env = link.rank_env(side, port=29531)
            env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
            procs.append(link.popen(side, argv, env=env))
        try:
            deadline = time.monotonic() + 150
            while not (tmp_path / "settled").exists():
                assert all(p.poll() is None for p in procs), "a rank exited before settling"
                assert time.monotonic() < deadline, "the setting did not settle on the fast link"
                time.sleep(0.1)
            link.set_rate(SLOW_GBIT)
            (tmp_path / "slowed").write_text("")
            codes = [p.wait(120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    assert codes == [0, 0]
    got = json.loads((tmp_path / "result.json").read_text())
    after, st = got["after"], got["stats"]
    assert got["before"] == "fp32", st["decisions"]
    assert st["watch"]["remeasures"] >= 1, st
    moved = next((k for k, f in enumerate(after) if f in ("bf16", "fp8") and
                  all(g == f for g in after[k:])), None)
    assert moved is not None and st["chosen"] in ("bf16", "fp8"), (after, st["decisions"])
    assert moved <= BOUND_STEPS, (moved, after, st["decisions"][-1])
