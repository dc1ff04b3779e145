"""Bytes between the two hosts of a ``--link`` run, counted by the kernel.

The runner's rounds interleave the wrappers step by step, so the parent
cannot tell one wrapper's bytes from another's: a rank counts them.  The
first rank of host 1 (rank L, ``GROUP_RANK`` 1, ``LOCAL_RANK`` 0) reads its
namespace's veth end (``GLOO_SOCKET_IFNAME``) from sysfs at each mark of a
round; every other rank's :class:`LinkMeter` reads nothing and reports 0,
so a sum over ranks is host 1's count::

    barrier | mark | step wrapper a | barrier | mark | step wrapper b | barrier | mark
                   '--- a's bytes: its step + one barrier ---'

A wrapper's interval runs from the mark after the barrier before its step to
the mark after the barrier before the next step (or the round's closing
barrier): that barrier waits for every rank to finish, so bytes another rank
of host 1 was still sending are counted for the step that sent them, and
the barrier's own few hundred bytes are counted with it.  Only timed rounds
keep their counts (the runner appends them to ``Row.link_out_bytes`` /
``Row.link_in_bytes``); warm-up rounds, the tuning steps and the profiled
step are marked but dropped.
"""

from __future__ import annotations

import os

__all__ = ["LinkMeter", "median_bytes", "probe_between_hosts"]


def median_bytes(samples: list[int]) -> int | None:
    """The median of per-step byte counts (None: none counted)."""
    if not samples:
        return None
    s = sorted(samples)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


class LinkMeter:
    """Host 1's veth counters as seen by this rank (see the module's doc)."""

    __slots__ = ("_read", "_last")

    def __init__(self, read=None):
        """``read``: a callable -> ``(tx_bytes, rx_bytes)``, or None when this
        rank does not count (it then reports zeros)."""
        self._read = read
        self._last = read() if read is not None else (0, 0)

    @classmethod
    def for_rank(cls, environ=os.environ) -> "LinkMeter":
        """The meter of the rank whose environment is ``environ`` (set by the
        link's :meth:`rank_env`): a counting one on host 1's first rank."""
        if environ.get("GROUP_RANK") != "1" or environ.get("LOCAL_RANK") != "0":
            return cls(None)
        ifname = environ.get("GLOO_SOCKET_IFNAME")
        if not ifname:
            raise RuntimeError("--link rank without GLOO_SOCKET_IFNAME: it was not started by the link")
        from .clone import netlink

        read_counters = netlink().read_counters
        return cls(lambda: read_counters(ifname))

    @property
    def counting(self) -> bool:
        return self._read is not None

    def lap(self) -> tuple[int, int]:
        """Bytes (out of host 1, into host 1) since the last lap; zeros on a
        rank that does not count."""
        if self._read is None:
            return 0, 0
        now = self._read()
        out = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now
        return out


def probe_between_hosts(probe_link, ranks_per_host: int):
    """The link's rate measured between host 0's and host 1's first ranks
    (ranks 0 and L), so a 2 x L run's probe carries what a one-rank-per-host
    probe does.  Collective: every rank calls it (``new_group`` is);
    returns the probe's dict on ranks 0 and L, None elsewhere."""
    import torch.distributed as dist

    if ranks_per_host == 1:
        return probe_link()
    pair = [0, ranks_per_host]
    group = dist.new_group(pair)
    out = probe_link(group=group) if dist.get_rank() in pair else None
    dist.barrier()
    return out
