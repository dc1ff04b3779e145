"""``fastddp-bench --link netns:RATE`` (tools/netlink.py): the refusal, the
namespaces' setup and teardown on every exit path, and that traffic between
the two ranks really crosses the shaped veth.

The tests that build namespaces need root and iproute2 (CI runs as root);
without them they skip, saying so.  Every namespace name carries the pid of
the process that made it, so these tests can run beside a bench run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools import netlink as N

pytestmark = pytest.mark.timeout(180)

CAN_LINK = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not CAN_LINK, reason="needs root and iproute2 (ip, tc) to create "
                                                     "network namespaces; CI runs as root")
REPO = str(Path(__file__).resolve().parents[2])


# -- parsing and refusal (no root needed) ------------------------------------------

def test_parse_link():
    assert N.parse_link("netns:1") == N.LinkSpec("netns", 1.0)
    assert N.parse_link("netns:0.2").gbit == 0.2
    assert N.parse_link("netns").gbit is None
    for bad, msg in (("tcp:1", "unknown kind 'tcp'"), ("netns:fast", "'fast' is not a number"),
                     ("netns:0", "positive"), ("netns:-1", "positive"), ("netns:inf", "positive")):
        with pytest.raises(ValueError, match=msg):
            N.parse_link(bad)


def test_refuses_without_root_saying_what_to_do():
    with pytest.raises(N.LinkError) as e:
        N.check_requirements(euid=1000, which=lambda tool: f"/usr/sbin/{tool}")
    text = str(e.value)
    assert "needs root" in text and "uid 1000" in text and "--simulate-bandwidth" in text
    assert "iproute2" not in text


def test_refuses_without_ip_or_tc():
    with pytest.raises(N.LinkError, match=r"iproute2 tools tc on PATH") as e:
        N.check_requirements(euid=0, which=lambda tool: None if tool == "tc" else "/sbin/ip")
    assert "root" not in str(e.value).split("needs", 1)[1].split(";")[0]


def test_cli_refuses_before_starting_anything(monkeypatch, capsys, tmp_path):
    from fastddp.bench.__main__ import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = main(["--link", "netns:1", "--models", "tiny", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--link netns needs root" in err and "uid 1000" in err
    assert not any(tmp_path.iterdir())  # no report: nothing ran


def test_config_rejects_link_with_other_wires():
    from fastddp.bench.config import BenchConfig

    with pytest.raises(ValueError, match="--world must be 2"):
        BenchConfig(models=("tiny",), link="netns:1", world=3).validate()
    with pytest.raises(ValueError, match="two different wires"):
        BenchConfig(models=("tiny",), link="netns:1", bandwidths=(0.1,)).validate()
    with pytest.raises(ValueError, match="RATE"):
        BenchConfig(models=("tiny",), link="netns:x").validate()
    BenchConfig(models=("tiny",), link="netns:1", world=2).validate()


def test_names_are_unique_and_fit_interface_limits():
    a, b = N.NetnsLink(N.LinkSpec("netns", 1.0)), N.NetnsLink(N.LinkSpec("netns", 1.0))
    assert set(a.namespaces).isdisjoint(b.namespaces) and set(a.ifnames).isdisjoint(b.ifnames)
    assert all(len(n) <= 15 for n in a.ifnames + b.ifnames)
    assert all(str(os.getpid()) in n for n in a.namespaces)


def test_tbf_burst_covers_frames_and_one_ms():
    args = N._tbf_args(1.0)
    assert args[:3] == ["tbf", "rate", "1000000000bit"]
    assert int(args[args.index("burst") + 1]) == 125_000  # 1 ms at 1 Gbit/s
    assert int(N._tbf_args(0.001)[4]) >= 4 * N.MTU  # never below a few frames


# -- the real thing (root) ------------------------------------------------------------

def _namespaces():
    return set(N.list_namespaces())


def _links():
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@needs_root
def test_setup_and_teardown():
    link = N.NetnsLink(N.parse_link("netns:0.5"))
    with link:
        assert set(link.namespaces) <= _namespaces()
        for side, ns in enumerate(link.namespaces):
            addr = subprocess.run(["ip", "-n", ns, "-o", "addr", "show", "dev", link.ifnames[side]],
                                  capture_output=True, text=True, check=True).stdout
            assert f"{link.addrs[side]}/30" in addr and "mtu 1500" in subprocess.run(
                ["ip", "-n", ns, "-o", "link", "show", link.ifnames[side]],
                capture_output=True, text=True, check=True).stdout
            qd = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", link.ifnames[side]],
                                capture_output=True, text=True, check=True).stdout
            assert "tbf" in qd and "rate 500Mbit" in qd, qd
        assert link.ifnames[0] not in _links()  # the veth lives inside the namespaces only
        env = link.rank_env(1)
        assert env["GLOO_SOCKET_IFNAME"] == link.ifnames[1] and env["MASTER_ADDR"] == link.addrs[0]
        assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert not set(link.namespaces) & _namespaces()
    link.teardown()  # twice is fine


@needs_root
def test_teardown_on_exception():
    link = N.NetnsLink(N.parse_link("netns:1"))
    with pytest.raises(ZeroDivisionError):
        with link:
            assert set(link.namespaces) <= _namespaces()
            1 / 0
    assert not set(link.namespaces) & _namespaces()


@needs_root
def test_failed_setup_leaves_nothing(monkeypatch):
    link = N.NetnsLink(N.parse_link("netns:1"))
    monkeypatch.setattr(N, "_tbf_args", lambda gbit: ["tbf", "rate", "nonsense"])
    with pytest.raises(N.LinkError, match="tc -n .* failed"):
        link.setup()
    assert not set(link.namespaces) & _namespaces()
    assert link.ifnames[0] not in _links()


_HOLDER = textwrap.dedent("""
    import signal, sys, time
    # a shell without job control starts background jobs with SIGINT ignored,
    # and Python then installs no KeyboardInterrupt handler: make it a user's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from tools.netlink import NetnsLink, parse_link
    with NetnsLink(parse_link("netns:1")) as link:
        print(" ".join(link.namespaces), flush=True)
        time.sleep(120)
""")


def _start_holder():
    p = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=REPO)], stdout=subprocess.PIPE, text=True)
    names = p.stdout.readline().split()
    assert len(names) == 2 and set(names) <= _namespaces(), names
    return p, names


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_teardown_on_signal(sig):
    p, names = _start_holder()
    p.send_signal(sig)
    p.wait(30)
    assert not set(names) & _namespaces()


@needs_root
def test_stale_namespaces_of_a_killed_run_are_removed():
    p, names = _start_holder()
    p.kill()  # SIGKILL: no handler runs, the namespaces stay
    p.wait(30)
    assert set(names) <= _namespaces()
    removed = N.remove_stale()
    assert set(names) <= set(removed) and not set(names) & _namespaces()


_RANK = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import torch.distributed as dist
    from tools.netlink import probe_link
    dist.init_process_group("gloo")
    out = probe_link(nbytes=4 * 2**20, reps=2)
    out["rank"] = dist.get_rank()
    if dist.get_rank() == 0:
        open(sys.argv[1], "w").write(json.dumps(out))
    dist.destroy_process_group()
""")


@needs_root
def test_two_ranks_cross_the_shaped_veth(tmp_path):
    """A 4 MiB all-reduce at 0.1 Gbit/s takes >= 0.34 s; over loopback or an
    unshaped veth it takes milliseconds, so the measured rate shows that the
    ranks' traffic went through the shaper."""
    result = tmp_path / "probe.json"
    with N.NetnsLink(N.parse_link("netns:0.1")) as link:
        t0 = time.monotonic()
        assert link.run_ranks([sys.executable, "-c", _RANK.format(repo=REPO), str(result)],
                              timeout_s=120) == [0, 0]
        elapsed = time.monotonic() - t0
    probe = json.loads(result.read_text())
    assert 0.02 < probe["measured_gbit"] <= 0.1 * 1.05, probe
    assert elapsed > 3 * 4 * 2**20 * 8 / 0.1e9  # warm-up + 2 timed all-reduces at the rate
    assert not set(link.namespaces) & _namespaces()


@needs_root
def test_run_ranks_reports_a_failed_rank_and_kills_the_other():
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(300)"
    with N.NetnsLink(N.parse_link("netns")) as link:
        t0 = time.monotonic()
        with pytest.raises(N.LinkError, match=r"failed on the netns link: exit codes \[-9, 3\]"):
            link.run_ranks([sys.executable, "-c", code], timeout_s=60, grace_s=2)
        assert time.monotonic() - t0 < 30  # the grace, not the sleep or the timeout


@needs_root
@pytest.mark.timeout(300)
def test_bench_runs_over_the_link(tmp_path):
    """fastddp-bench --link end to end: ranks in the namespaces, the probe's
    rate in the report, replicate (which the simulated wire cannot carry)
    measured, nothing left behind."""
    before = _namespaces()
    p = subprocess.run([sys.executable, "-m", "fastddp.bench", "--link", "netns:2", "--models", "tiny",
                        "--wrappers", "local", "torch", "fastddp", "replicate", "--steps", "2",
                        "--warmup", "1", "--label", "ci-link", "--out", str(tmp_path), "--no-progress",
                        "--no-charts"], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    from fastddp.bench import report as R

    rep = R.from_json(next(tmp_path.glob("*/*-ci-link.json")).read_text())
    link = rep.meta["link"]
    assert link["spec"] == "netns:2" and 0 < link["measured_gbit"] <= 2 * 1.05, link
    assert "measured" in p.stdout and "Gbit/s" in p.stdout
    md = next(tmp_path.glob("*/*-ci-link.md")).read_text()
    assert "| link |" in md and "measured_gbit" in md
    rows = {r.wrapper: r for r in rep.sections[0].rows}
    assert all(rows[w].ok for w in ("local", "torch", "fastddp", "replicate")), \
        {w: r.status for w, r in rows.items()}
    assert rep.meta["world_size"] == 2 and rep.meta["backend"] == "gloo"
    assert {n for n in _namespaces() - before if n.startswith(N.NS_PREFIX)} == set()


# -- several ranks per host -----------------------------------------------------------

def test_ranks_per_host_is_checked_and_sets_the_world():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
            N.NetnsLink(N.LinkSpec("netns", 1.0), ranks_per_host=bad)
    assert N.NetnsLink(N.LinkSpec("netns", 1.0)).world == 2
    assert N.NetnsLink(N.LinkSpec("netns", 1.0), ranks_per_host=3).world == 6


def test_rank_env_of_several_ranks_per_host():
    link = N.NetnsLink(N.LinkSpec("netns", 1.0), ranks_per_host=2)
    envs = {(side, local): link.rank_env(side, local, base={}) for side in (0, 1) for local in (0, 1)}
    assert [envs[k]["RANK"] for k in sorted(envs)] == ["0", "1", "2", "3"]
    for (side, local), env in envs.items():
        assert env["LOCAL_RANK"] == str(local) and env["GROUP_RANK"] == str(side)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == link.addrs[0] and env["GLOO_SOCKET_IFNAME"] == link.ifnames[side]
    with pytest.raises(ValueError, match="no rank at side 1, local rank 2"):
        link.rank_env(1, 2)
    # one rank per host: the environment it always had
    one = N.NetnsLink(N.LinkSpec("netns", 1.0)).rank_env(1, base={})
    assert (one["RANK"], one["WORLD_SIZE"], one["LOCAL_RANK"], one["LOCAL_WORLD_SIZE"]) == ("1", "2", "0", "1")


def test_read_counters_reads_sysfs(tmp_path):
    stats = tmp_path / "veth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "tx_bytes").write_text("1234\n")
    (stats / "rx_bytes").write_text("99\n")
    assert N.read_counters("veth0", root=str(tmp_path)) == (1234, 99)
    with pytest.raises(N.LinkError, match="no interface 'nope' here"):
        N.read_counters("nope", root=str(tmp_path))


def test_counters_and_set_rate_need_the_link_up():
    link = N.NetnsLink(N.LinkSpec("netns", 1.0))
    with pytest.raises(N.LinkError, match="outside its `with` block"):
        link.counters(0)
    with pytest.raises(N.LinkError, match="outside its `with` block"):
        link.set_rate(0.5)


def _qdisc(link, side):
    return subprocess.run(["tc", "-n", link.namespaces[side], "qdisc", "show", "dev", link.ifnames[side]],
                          capture_output=True, text=True, check=True).stdout


@needs_root
def test_set_rate_changes_both_ends_in_place():
    with N.NetnsLink(N.parse_link("netns:1")) as link:
        assert all("rate 1Gbit" in _qdisc(link, s) for s in (0, 1))
        link.set_rate(0.25)
        assert all("tbf" in _qdisc(link, s) and "rate 250Mbit" in _qdisc(link, s) for s in (0, 1))
        assert link.spec.gbit == 0.25
        link.set_rate(None)
        assert all("tbf" not in _qdisc(link, s) for s in (0, 1))
        link.set_rate(2)  # an unshaped link gets a shaper
        assert all("rate 2Gbit" in _qdisc(link, s) for s in (0, 1))
        with pytest.raises(ValueError, match="positive number of Gbit/s"):
            link.set_rate(0)


_RATE_CHANGE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(2**20 // 4)  # 1 MiB
    dist.barrier()
    t0 = time.monotonic()
    for _ in range(4):
        dist.all_reduce(t)  # the rate changes under these
    dist.barrier()
    if dist.get_rank() == 0:
        open(sys.argv[1], "w").write(repr(time.monotonic() - t0))
    dist.destroy_process_group()
""")


@needs_root
def test_set_rate_on_a_live_link_keeps_the_ranks_connected(tmp_path):
    """Ranks connected at 2 Gbit/s keep their connections when the rate drops
    mid-run, and the all-reduces after the change take the slower rate's time."""
    out = tmp_path / "t"
    with N.NetnsLink(N.parse_link("netns:2")) as link:
        procs = [link.popen(s, [sys.executable, "-c", _RATE_CHANGE.format(repo=REPO), str(out)])
                 for s in (0, 1)]
        time.sleep(0.2)
        link.set_rate(0.02)  # 4 x 1 MiB each way at 20 Mbit/s: >= 1.6 s
        assert [p.wait(120) for p in procs] == [0, 0]
    assert float(out.read_text()) > 1.2


_BYTES = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import torch, torch.distributed as dist
    from tools.netlink import read_counters
    dist.init_process_group("gloo")
    rank, L = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    hosts = [dist.new_group([h * L + i for i in range(L)]) for h in (0, 1)]  # collective: every rank
    mine = hosts[int(os.environ["GROUP_RANK"])]
    t = torch.ones({numel})
    dist.all_reduce(t, group=mine)  # connect before counting
    dist.all_reduce(t)
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    # a window is read between two barriers: the one before, which every
    # rank reaches only when the last collective is done (its bytes are all
    # in), and the one after, which lets the others start the next (read
    # after it, a rank of host 0 may already be sending into host 1)
    def mark():
        dist.barrier()
        marks.append(read_counters(ifname))
        dist.barrier()

    marks = []
    mark()
    dist.all_reduce(t, group=mine)  # inside each host only
    mark()
    marks.append(marks[-1])
    dist.all_reduce(t)  # across the hosts
    mark()
    assert t[0].item() == 4 * 4 ** 2, t[0]  # three all-reduces of 4 ranks' ones, one of 2
    if rank == L:  # host 1's first rank reads host 1's veth end
        open(sys.argv[1], "w").write(json.dumps(marks))
    dist.destroy_process_group()
""")


@needs_root
def test_two_hosts_of_two_ranks_cross_the_veth_only_between_hosts(tmp_path):
    """2 x 2 ranks: an all-reduce inside each host's 2-rank group moves ~0
    bytes over the veth (the ranks of a host meet in its own stack); one
    across all four moves the ring's 2(N-1)/N = 1.5x the tensor out of each
    host (gloo's ring: one hop each way between the hosts)."""
    numel = 2**20  # 4 MiB of fp32
    out = tmp_path / "marks.json"
    with N.NetnsLink(N.parse_link("netns"), ranks_per_host=2) as link:
        before = link.counters(1)
        codes = link.run_ranks([sys.executable, "-c", _BYTES.format(repo=REPO, numel=numel), str(out)],
                               timeout_s=120)
        after = link.counters(1)
    assert codes == [0, 0, 0, 0]
    (tx0, rx0), (tx1, rx1), (tx2, rx2), (tx3, rx3) = json.loads(out.read_text())
    size = numel * 4
    assert tx1 - tx0 < 0.01 * size and rx1 - rx0 < 0.01 * size, \
        f"an all-reduce inside the hosts moved {tx1 - tx0} bytes out of host 1, {rx1 - rx0} in"
    out_ratio, in_ratio = (tx3 - tx2) / size, (rx3 - rx2) / size
    assert 1.4 < out_ratio < 1.7 and 1.4 < in_ratio < 1.7, \
        f"4-rank all-reduce of {size} bytes: {out_ratio:.3f}x out of host 1, {in_ratio:.3f}x in (ring: 1.5x)"
    assert after[0] - before[0] >= tx3 - tx0  # the parent's reading agrees with the rank's


@needs_root
@pytest.mark.timeout(300)
def test_bench_two_hosts_of_two_ranks_counts_the_veth_bytes(tmp_path):
    """fastddp-bench --link --ranks-per-host 2: four ranks, and per step the
    bytes out of host 1 from the veth's counters beside the wrappers' own
    count: the ring's 1.5x of the gradient for torch's DDP and fastddp alike
    (0.64M params: headers add ~0.4%); a hierarchical row this fastddp lacks
    is reported unavailable."""
    p = subprocess.run([sys.executable, "-m", "fastddp.bench", "--link", "netns:4", "--ranks-per-host", "2",
                        "--models", "small", "--wrappers", "torch", "fastddp", "fastddp-hier-fp8",
                        "--steps", "2", "--warmup", "1", "--label", "ci-2x2", "--out", str(tmp_path),
                        "--no-progress", "--no-charts"], capture_output=True, text=True, timeout=280, cwd=REPO)
    from fastddp import hooks
    from fastddp.bench import report as R

    has_hier = hasattr(hooks, "hierarchical_hook")
    assert p.returncode == (0 if has_hier else 1), p.stdout[-2000:] + p.stderr[-3000:]
    rep = R.from_json(next(tmp_path.glob("*/*-ci-2x2.json")).read_text())
    assert rep.meta["world_size"] == 4 and rep.meta["link"]["ranks_per_host"] == 2
    rows = {r.wrapper: r for r in rep.sections[0].rows}
    grad = 2_572_800  # small: 643,200 fp32 parameters
    for w in ("torch", "fastddp"):
        r = rows[w]
        assert r.ok and len(r.link_out_bytes) == 2 and len(r.link_in_bytes) == 2, (w, r.status)
        for sent in r.link_out_bytes + r.link_in_bytes:
            assert 1.49 < sent / grad < 1.55, f"{w}: {sent} bytes per step over the veth = {sent / grad:.3f}x grad"
    assert rows["fastddp"].wire_bytes == grad  # its own count: the bucket bytes, beside the kernel's
    if not has_hier:
        assert rows["fastddp-hier-fp8"].status.startswith("unavailable: ImportError: fastddp.hooks has no "
                                                          "hierarchical_hook yet")
    md = next(tmp_path.glob("*/*-ci-2x2.md")).read_text()
    assert "| link out MB | link in MB | out / wire |" in md
