"""Shared test fixtures: isolation (seed, kernel counters, backend probe);
the fast tier (``--fast``) and the durations it is chosen from; the shards
tests/run.sh runs side by side (``FASTDDP_TESTS_SHARD``, whole files claimed
as each shard gets to them: ``FASTDDP_TESTS_CLAIMS``)."""

from __future__ import annotations

import fcntl
import gc
import heapq
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from fastddp.kernels._switch import interpreter_requested

INTERPRET = interpreter_requested()


#: each test's seconds (setup + call + teardown) on a quiet 2-core machine,
#: written by ``--record-durations tests/durations.json`` (tests/README.md)
DURATIONS = Path(__file__).with_name("durations.json")
#: the fast tier keeps a test whose recorded time is at most this (a test
#: not recorded yet counts as quick), and each file's quickest test
FAST_TEST_S = 0.2


def pytest_addoption(parser):
    group = parser.getgroup("fastddp")
    group.addoption("--fast", action="store_true",
                    help="the fast tier: every file's quick cases (recorded time <= %g s in "
                         "tests/durations.json, and each file's quickest), not the tests marked "
                         "slow or rig" % FAST_TEST_S)
    group.addoption("--record-durations", metavar="PATH",
                    help="write each test's time to PATH (JSON, merged into what it holds)")


def _durations() -> dict:
    try:
        return json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}


def _fast_tier(config, items) -> None:
    """Keep every file's quick cases (see --fast), in collection order."""
    table = _durations()
    by_file = defaultdict(list)
    for item in items:
        if "slow" not in item.keywords and "rig" not in item.keywords:
            by_file[_file_of(item)].append(item)
    keep = set()
    for file_items in by_file.values():
        quick = [i for i in file_items if table.get(i.nodeid, 0.0) <= FAST_TEST_S]
        keep.update(quick or [min(file_items, key=lambda i: table[i.nodeid])])
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = [i for i in items if i in keep]


def shard_files(items, table: dict, shards: int) -> list[set]:
    """The selected tests' files dealt into ``shards`` sets of about equal
    recorded time (longest file first to the least loaded shard).  Whole
    files, so that a module's fixtures and shared workers start once; every
    shard computes the same deal from the same selection."""
    by_file: dict = defaultdict(float)
    for item in items:  # an unrecorded test counts as quick
        by_file[_file_of(item)] += table.get(item.nodeid, 0.05)
    heap = [(0.0, k) for k in range(shards)]
    out = [set() for _ in range(shards)]
    for name, t in sorted(by_file.items(), key=lambda kv: (-kv[1], kv[0])):
        load, k = heapq.heappop(heap)
        out[k].add(name)
        heapq.heappush(heap, (load + t, k))
    return out


def _shard(items) -> None:
    """``FASTDDP_TESTS_SHARD=i/n``: keep shard ``i`` of ``n`` (tests/run.sh
    runs the default session as two such pytest processes side by side: its
    subprocess-heavy tests leave a core idle).  The other shards' tests are
    dropped, not deselected: each shard's summary counts what it ran and
    what -m/-k deselected, which is the same in every shard."""
    spec = os.environ.get("FASTDDP_TESTS_SHARD", "")
    if not spec:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"FASTDDP_TESTS_SHARD={spec!r}: expected i/n with 0 <= i < n, e.g. 0/2")
    table = _durations()
    deal = shard_files(items, table, n)
    if os.environ.get("FASTDDP_TESTS_CLAIMS"):
        items[:] = claim_order(items, table, deal, i)  # every file: the loop claims each as it gets to it
        return
    items[:] = [item for item in items if _file_of(item) in deal[i]]


def claim_order(items, table: dict, deal: list, i: int) -> list:
    """The order in which shard ``i`` of claiming shards
    (``FASTDDP_TESTS_CLAIMS``) tries the files: its own share of the static
    deal (:func:`shard_files`), longest first by recorded time, then the
    others' files, shortest first, i.e. work stealing from the ends of their
    lists: each long file stays with the shard it was dealt to, and whichever
    shard is done first takes the other's short files while that one runs
    its last long one.  Whole files, collection order inside each."""
    by_file: dict = defaultdict(list)
    for item in items:
        by_file[_file_of(item)].append(item)
    t = {f: sum(table.get(i.nodeid, 0.05) for i in its) for f, its in by_file.items()}
    own = sorted((f for f in by_file if f in deal[i]), key=lambda f: (-t[f], f))
    rest = sorted((f for f in by_file if f not in deal[i]), key=lambda f: (t[f], f))
    return [item for f in own + rest for item in by_file[f]]


def _file_of(item) -> str:
    """The test file of ``item``: its node id's path, or for a file outside
    the rootdir (whose node id starts with ``::``) its own path."""
    return item.nodeid.split("::")[0] or str(item.path)


def claim(folder: str, name: str) -> bool:
    """Take test file ``name`` for this process: True for the first process
    of the run to ask (an exclusive create in ``folder``), False after."""
    try:
        os.close(os.open(os.path.join(folder, name.replace("/", "__")), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def pytest_runtestloop(session):
    """Shards that claim files (``FASTDDP_TESTS_SHARD=i/n`` with
    ``FASTDDP_TESTS_CLAIMS=<folder>``, tests/run.sh): each shard runs the
    next file of its :func:`claim_order` that no shard has claimed yet,
    so the shards end together whatever the recorded times say (the static
    deal alone left one shard 17-37 s behind the other when the times went
    stale).  A file's tests run in one process, in order;
    the files the other shards took are neither run nor reported here."""
    folder = os.environ.get("FASTDDP_TESTS_CLAIMS")
    if not folder or not os.environ.get("FASTDDP_TESTS_SHARD") or session.config.option.collectonly:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error{'s' if session.testsfailed != 1 else ''} "
                                  "during collection")
    items = session.items
    start = [k for k, item in enumerate(items) if k == 0 or _file_of(items[k - 1]) != _file_of(item)]
    for a, b in zip(start, start[1:] + [len(items)]):
        if not claim(folder, _file_of(items[a])):
            continue
        for k in range(a, b):
            # the next file's first test as nextitem: its module is set up only if this shard claims it,
            # and what both share (the session, the folder) stays up meanwhile
            nxt = items[k + 1] if k + 1 < len(items) else None
            items[k].config.hook.pytest_runtest_protocol(item=items[k], nextitem=nxt)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
    return True


_recorded: dict = defaultdict(float)


def write_durations(path: Path, recorded: dict) -> None:
    """Merge ``recorded`` (test id -> seconds) into the JSON table at ``path``
    (the other session's tests, or tests not run this time, stay)."""
    with open(path, "a+") as f:  # the shards write the same table: one at a time
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        table = json.loads(text) if text.strip() else {}
        table.update({k: round(v, 3) for k, v in recorded.items()})
        f.seek(0)
        f.truncate()
        f.write(json.dumps(dict(sorted(table.items())), indent=0) + "\n")


def pytest_runtest_logreport(report):
    _recorded[report.nodeid] += report.duration


def pytest_sessionstart(session):
    """Build the native modules now (about a minute each the first time, then
    cached: fastddp/_native.py, kernels/_fp8_native.py), not inside the first
    test's timeout."""
    from fastddp import _native
    from fastddp.kernels import _fp8_native
    _native.countdown_module()
    _fp8_native.module()


def pytest_collection_finish(session):
    """What the session has imported and collected lives as long as the
    session: out of the collector's sight, every gc.collect() a test makes
    (single_rank_group's, ...) costs ~0.1 ms instead of ~70 ms."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Stop the multi-rank workers the session shared (tests/_dist.py)."""
    from tests._dist import close_shared_worlds
    close_shared_worlds()
    gc.unfreeze()  # collectable again at exit (frozen triton objects make nanobind report leaks)
    path = session.config.getoption("record_durations", None)  # None where --record-durations is not defined (bench/tests)
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # xdist: the controller gets every report
        write_durations(Path(path), _recorded)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    # .ci/run's legs 2 and 3 (other torch and Python) leave the netns rig's torchrun
    # runs to leg 1: the same tooling, minutes of it, nothing of the stack's own
    rig_off = os.environ.get("FASTDDP_TESTS_RIG", "1") == "0"
    for item in items:
        if "rig" in item.keywords and rig_off:
            item.add_marker(pytest.mark.skip(reason="FASTDDP_TESTS_RIG=0: the netns rig runs on CI's leg 1"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "interpret" in item.keywords and not INTERPRET and not has_cuda:
            item.add_marker(pytest.mark.skip(
                reason="kernel test: run with TRITON_INTERPRET=1 (tests/run.sh does)"))
    if config.getoption("fast"):
        _fast_tier(config, items)
    _shard(items)


@pytest.fixture(autouse=True)
def _isolate():
    """Seed every test and zero the kernel counters (a leaked count or backend
    choice once caused order-dependent failures in Liger-Kernel); re-read the
    settings after each test (after monkeypatch has put the environment back),
    so a test's variables never reach the next one."""
    import fastddp.kernels as K
    from fastddp import settings

    torch.manual_seed(0)
    K.reset_launch_count()
    yield
    K.reset_launch_count()
    settings.reload()
