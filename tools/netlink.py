"""A real bandwidth-limited link on one machine: ``fastddp-bench --link netns:RATE``.

Two network namespaces joined by a veth pair, each end shaped by a token
bucket (``tc qdisc ... tbf``) to RATE Gbit/s; each namespace is a "host"
with L ranks (``ranks_per_host``, default 1)::

    namespace fddp-<pid>-<n>-0                  namespace fddp-<pid>-<n>-1
      ranks 0..L-1: gloo on fd<pid>-<n>a <== veth ==> fd<pid>-<n>b: ranks L..2L-1
      10.213.7.1/30, tbf RATE out                     10.213.7.2/30, tbf RATE out
      MASTER_ADDR = 10.213.7.1 (the store runs here)

Ranks of one namespace bind gloo to the same veth address; the kernel
delivers packets between two local addresses through that namespace's own
stack (its ``local`` routing table), so they never reach the veth: only
bytes between hosts cross the shaper, and :meth:`NetnsLink.counters` (the
veth's kernel statistics) counts exactly those.

Unlike the simulated wire (``simwire.py``), every byte crosses a real TCP
connection through the kernel: the segmenting, the acknowledgements, the
copies, the shaper's queue and the CPU time all of that costs are in the
step time.  The addresses exist only inside the two namespaces this run
creates (each namespace has its own routing table), so they collide with
nothing on the host.  Names carry the creating process's pid and a counter:
parallel runs do not collide, and :func:`remove_stale` deletes what a killed
run (SIGKILL: no handler runs) left behind.

Teardown on every exit path: the context manager's ``__exit__`` (normal exit
and exceptions), an ``atexit`` hook, and SIGTERM/SIGHUP handlers that raise
``SystemExit`` so the ``finally`` blocks run.  Deleting a namespace destroys
its end of the veth pair and with it the other end.

Root and iproute2 (``ip``, ``tc``) are required; :func:`check_requirements`
refuses with a message saying what is missing and what to do instead.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

__all__ = ["LinkError", "LinkSpec", "NetnsLink", "check_requirements", "parse_link",
           "probe_link", "read_counters", "remove_stale", "supervise"]

NS_PREFIX = "fddp-"
#: the /30 used inside the namespaces (never on the host)
_SUBNET = "10.213.7"
_ADDRS = (f"{_SUBNET}.1", f"{_SUBNET}.2")
MTU = 1500  # an ordinary Ethernet link, frame overhead included
_counter = itertools.count()


class LinkError(RuntimeError):
    """The link cannot be set up here (the message says why and what to do)."""


@dataclass(frozen=True)
class LinkSpec:
    """What ``--link`` asked for."""

    kind: str
    """``netns`` (the only kind)."""
    gbit: float | None
    """Rate of each direction in Gbit/s (1e9 bit/s); None: not shaped."""

    def describe(self) -> str:
        rate = f"{self.gbit:g} Gbit/s (tbf)" if self.gbit is not None else "unshaped"
        return f"netns veth pair, {rate}, MTU {MTU}"


def parse_link(text: str) -> LinkSpec:
    """``netns:RATE`` (Gbit/s, > 0) or ``netns`` (unshaped) -> LinkSpec."""
    kind, _, rate = text.partition(":")
    if kind != "netns":
        raise ValueError(f"--link {text!r}: unknown kind {kind!r}; use netns:RATE with RATE in "
                         "Gbit/s, e.g. --link netns:1")
    if not rate:
        return LinkSpec("netns", None)
    try:
        gbit = float(rate)
    except ValueError:
        raise ValueError(f"--link {text!r}: RATE {rate!r} is not a number of Gbit/s "
                         "(e.g. netns:1 or netns:0.2)") from None
    if not (gbit > 0 and gbit < float("inf")):
        raise ValueError(f"--link {text!r}: RATE must be a positive number of Gbit/s, got {rate}")
    return LinkSpec("netns", gbit)


def check_requirements(euid: int | None = None, which=shutil.which) -> None:
    """Raise :class:`LinkError` unless this process can build the link:
    root (namespaces, veth and qdiscs need CAP_NET_ADMIN / CAP_SYS_ADMIN)
    and the ``ip`` and ``tc`` tools on PATH."""
    euid = os.geteuid() if euid is None else euid
    problems = []
    if euid != 0:
        problems.append(f"root (it creates network namespaces, a veth pair and tc qdiscs; this "
                        f"process runs as uid {euid})")
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        problems.append(f"the iproute2 tools {' and '.join(missing)} on PATH (not found; "
                        "install iproute2)")
    if problems:
        raise LinkError("--link netns needs " + "; and ".join(problems)
                        + ". Without them use --simulate-bandwidth GBPS (a simulated wire, no root).")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces this module named for a process that no longer
    exists (a run killed by SIGKILL); returns their names."""
    gone = []
    for ns in list_namespaces():
        m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)-\d+-[01]", ns)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", ns], check=False)
            gone.append(ns)
    return gone


def read_counters(ifname: str, root: str = "/sys/class/net") -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of interface ``ifname`` as the kernel counts
    them, read from sysfs: inside a namespace ``ip netns exec`` started (it
    mounts that namespace's sysfs), the namespace's own interfaces."""
    stats = os.path.join(root, ifname, "statistics")
    try:
        with open(os.path.join(stats, "tx_bytes")) as tx, open(os.path.join(stats, "rx_bytes")) as rx:
            return int(tx.read()), int(rx.read())
    except FileNotFoundError:
        raise LinkError(f"no interface {ifname!r} here ({stats} missing): read the counters inside "
                        "the namespace that holds it") from None


def _tbf_args(gbit: float) -> list[str]:
    """tbf for ``gbit``: a bucket of 1 ms at the rate (at least 4 frames; the
    rate is held over any longer interval) and a 50 ms queue."""
    bytes_per_s = gbit * 1e9 / 8
    burst = max(4 * (MTU + 14), int(bytes_per_s * 1e-3))
    return ["tbf", "rate", f"{int(gbit * 1e9)}bit", "burst", str(burst), "latency", "50ms"]


class NetnsLink:
    """The two namespaces and the veth pair; a context manager.

    ``with NetnsLink(spec) as link:`` builds it (refusing first when
    :func:`check_requirements` fails) and tears it down on leaving;
    :meth:`popen` starts a command inside namespace 0 or 1 with the
    environment a gloo rank needs there (:meth:`rank_env`); :meth:`run_ranks`
    runs ``ranks_per_host`` ranks in each."""

    def __init__(self, spec: LinkSpec, ranks_per_host: int = 1):
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be an integer >= 1, got {ranks_per_host!r}")
        self.spec = spec
        self.ranks_per_host = ranks_per_host
        n = next(_counter)
        pid = os.getpid()
        self.namespaces = (f"{NS_PREFIX}{pid}-{n}-0", f"{NS_PREFIX}{pid}-{n}-1")
        stem = f"fd{pid:x}-{n:x}"[:14]  # interface names: 15 characters at most
        self.ifnames = (f"{stem}a", f"{stem}b")
        self.addrs = _ADDRS
        self._up = False
        self._lock = threading.Lock()
        self._old_handlers: dict = {}

    # -- lifetime --------------------------------------------------------------
    def __enter__(self) -> "NetnsLink":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        check_requirements()
        remove_stale()
        atexit.register(self.teardown)
        self._install_signal_handlers()
        self._up = True  # from here on teardown has something to do
        try:
            ns0, ns1 = self.namespaces
            a, b = self.ifnames
            _run(["ip", "netns", "add", ns0])
            _run(["ip", "netns", "add", ns1])
            _run(["ip", "link", "add", a, "mtu", str(MTU), "type", "veth", "peer", "name", b, "mtu", str(MTU)])
            for ns, ifname, addr in ((ns0, a, self.addrs[0]), (ns1, b, self.addrs[1])):
                _run(["ip", "link", "set", ifname, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ifname])
                _run(["ip", "-n", ns, "link", "set", ifname, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                if self.spec.gbit is not None:
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", *_tbf_args(self.spec.gbit)])
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Delete both namespaces (and so the veth pair); safe to call twice,
        from atexit or a signal handler."""
        with self._lock:
            if not self._up:
                return
            self._up = False
            for ns in self.namespaces:
                _run(["ip", "netns", "del", ns], check=False)
            # setup may have failed before the veth moved into a namespace
            if _run(["ip", "link", "show", self.ifnames[0]], check=False).returncode == 0:
                _run(["ip", "link", "del", self.ifnames[0]], check=False)
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.teardown)
            except Exception:  # noqa: BLE001 - interpreter shutting down
                pass

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; atexit still covers a normal exit

        def handler(signum, frame):
            # SystemExit unwinds through the `with`/finally blocks, which tear down
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- using it ----------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._up

    def exec_prefix(self, side: int) -> list[str]:
        """``ip netns exec <namespace side>``."""
        return ["ip", "netns", "exec", self.namespaces[side]]

    @property
    def world(self) -> int:
        return 2 * self.ranks_per_host

    def rank_env(self, side: int, local: int = 0, port: int = 29500, base: dict | None = None) -> dict:
        """The environment of local rank ``local`` in namespace ``side``, as
        torchrun would set it (RANK = side * L + local, GROUP_RANK = side):
        gloo bound to this side's veth, the store at side 0's address."""
        L = self.ranks_per_host
        if side not in (0, 1) or not 0 <= local < L:
            raise ValueError(f"no rank at side {side}, local rank {local} (2 hosts of {L} ranks)")
        env = dict(os.environ if base is None else base)
        env.update(RANK=str(side * L + local), WORLD_SIZE=str(2 * L), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(L), GROUP_RANK=str(side), MASTER_ADDR=self.addrs[0],
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=self.ifnames[side])
        return env

    def counters(self, side: int) -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` of side ``side``'s veth end, read by the
        kernel's statistics inside its namespace (frames with their headers)."""
        if not self._up:
            raise LinkError("NetnsLink.counters outside its `with` block (the namespaces do not exist)")
        stats = f"/sys/class/net/{self.ifnames[side]}/statistics"
        out = _run(self.exec_prefix(side) + ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).stdout
        tx, rx = out.split()
        return int(tx), int(rx)

    def set_rate(self, gbit: float | None) -> None:
        """Change both ends' shaping in place on a live link (connections stay
        up): ``gbit`` Gbit/s, or None to remove the shaper."""
        if not self._up:
            raise LinkError("NetnsLink.set_rate outside its `with` block (the namespaces do not exist)")
        if gbit is not None and not (gbit > 0 and gbit < float("inf")):
            raise ValueError(f"set_rate: the rate must be a positive number of Gbit/s, got {gbit}")
        for ns, ifname in zip(self.namespaces, self.ifnames):
            if gbit is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", ifname, "root"], check=False)
            else:  # replace: changes a tbf in place, or adds one where the link was unshaped
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", ifname, "root", *_tbf_args(gbit)])
        self.spec = LinkSpec(self.spec.kind, gbit)

    def popen(self, side: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        if not self._up:
            raise LinkError("NetnsLink.popen outside its `with` block (the namespaces do not exist)")
        return subprocess.Popen(self.exec_prefix(side) + list(argv),
                                env=self.rank_env(side) if env is None else env, **kwargs)

    def run_ranks(self, argv: list[str], timeout_s: float | None = None, grace_s: float = 30.0,
                  on_poll=None) -> list[int]:
        """Run ``argv`` as every rank: ``ranks_per_host`` in each namespace
        (:meth:`rank_env`), and wait for all.  When one fails the others get
        ``grace_s`` to notice before they are killed; all are killed on
        timeout or on an exception here.  ``on_poll()``, if given, runs at
        every poll while they run (e.g. to change the rate when the ranks ask).
        Returns the exit codes in rank order; raises :class:`LinkError` when
        any is non-zero (a killed rank shows -9)."""
        procs = [self.popen(side, argv, env=self.rank_env(side, local))
                 for side in (0, 1) for local in range(self.ranks_per_host)]
        return supervise(procs, timeout_s, grace_s, on_poll, "on the netns link")


def supervise(procs: list, timeout_s: float | None = None, grace_s: float = 30.0, on_poll=None,
              where: str = "") -> list[int]:
    """Wait for every one of ``procs`` (the ranks of one run, in rank
    order).  When one fails the others get ``grace_s`` to notice before they
    are killed; all are killed on timeout or on an exception here.
    ``on_poll()``, if given, runs at every poll.  Returns the exit codes;
    raises :class:`LinkError` when any is non-zero (a killed rank shows -9)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one, every time
            if None not in codes:
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now > failed_at + grace_s:
                break  # the survivor is killed below; the exit codes tell
            if deadline is not None and now > deadline:
                raise LinkError(f"ranks still running after {timeout_s:g} s (exit codes so far "
                                f"{codes}, in rank order); killed")
            if on_poll is not None:
                on_poll()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise LinkError(f"rank(s) failed {where}: exit codes {codes} (in rank order; "
                        f"-9: killed {grace_s:g} s after another failed)")
    return codes


def probe_link(nbytes: int = 64 * 2**20, reps: int = 3, group=None) -> dict:
    """Time all-reduces on the current (2-rank, gloo) group: ``nbytes`` of
    fp32 ``reps`` times after one warm-up, and 20 of 4 bytes.  At W=2 each
    rank sends ``nbytes`` each way per all-reduce (reduce-scatter, then
    all-gather, half each), so ``nbytes * 8 / t`` is the rate one direction
    carried.  Collective: every rank calls it; all get the same dict."""
    import torch
    import torch.distributed as dist

    big = torch.ones(nbytes // 4, dtype=torch.float32)
    small = torch.ones(1, dtype=torch.float32)
    dist.all_reduce(big, group=group)  # warm-up: connections, page faults
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(big, group=group)
        times.append(time.perf_counter() - t0)
    lat = []
    for _ in range(20):
        t0 = time.perf_counter()
        dist.all_reduce(small, group=group)
        lat.append(time.perf_counter() - t0)
    # the slowest rank's figure (all ranks report the same)
    t = torch.tensor([sorted(times)[len(times) // 2], sorted(lat)[len(lat) // 2]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t_big, t_small = t.tolist()
    return {"probe": f"{nbytes / 2**20:g} MiB fp32 all-reduce, median of {reps}",
            "measured_gbit": round(nbytes * 8 / t_big / 1e9, 4),
            "small_allreduce_ms": round(t_small * 1e3, 3)}
