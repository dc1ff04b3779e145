"""Which ranks share a host: the topology the hierarchical reduction needs.

Decided once, when the hierarchical hook is registered, on every rank alike
(every rank runs the same steps and sees the same gathered facts):

1. an explicit setting wins: ``HierarchicalState(ranks_per_host=L)`` or
   ``FASTDDP_RANKS_PER_HOST=L`` (consecutive group ranks ``[hL, hL+L)`` are
   host ``h``): for launchers whose environment lies, and for test rigs;
2. else each rank's host key is gathered from all ranks: torchrun's node
   rank (``GROUP_RANK``, with ``LOCAL_WORLD_SIZE`` checked against the
   gathered counts) where it is set, else the host's name plus its network
   namespace (two namespaces on one machine are two hosts to the network).

Hosts are ordered by their lowest rank, ranks inside a host ascending.  The
hierarchy needs at least two hosts of the same number (>= 2) of ranks, and a
process group that spans the whole world (the sub-groups are made with
``new_group``, which every rank of the world must call); otherwise
:func:`resolve` says why the reduction stays flat.  An explicit setting that
cannot be honoured is an error instead.

The sub-groups (one inside each host, one per local rank across the hosts)
are made once per (process group, topology) and reused.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from . import groups, settings

__all__ = ["Topology", "Flat", "resolve", "subgroups"]


@dataclass(frozen=True)
class Topology:
    """``hosts[h]``: the group ranks on host ``h``, ascending; all of one size."""

    hosts: tuple
    source: str
    """How it was decided (for the log line and ``stats()``)."""

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def describe(self) -> str:
        return f"{self.num_hosts} hosts x {self.ranks_per_host} ranks ({self.source})"


@dataclass(frozen=True)
class Flat:
    """The hierarchy does not apply: ``why`` (one sentence for the log)."""

    why: str


def _explicit(world: int, per_host: int, source: str) -> Topology:
    if per_host < 1 or world % per_host:
        raise ValueError(f"fastddp: {source} asks for {per_host} ranks per host, but the process group "
                         f"has {world} ranks, not a multiple of it: set it to a divisor of {world} (the "
                         "ranks of one host are consecutive), or leave it unset to detect the hosts")
    return Topology(tuple(tuple(range(h, h + per_host)) for h in range(0, world, per_host)), source)


def host_key() -> str:
    """This process's host: torchrun's node rank, else name + network namespace."""
    s = settings.get()
    if s.group_rank is not None:
        return f"node {s.group_rank}"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()} netns {netns}"


def _gathered(pg, world: int) -> list:
    keys: list = [None] * world
    dist.all_gather_object(keys, (host_key(), settings.get().local_world_size), group=pg)
    return keys


def resolve(pg, ranks_per_host: int | None = None, min_ranks_per_host: int = 2) -> Topology | Flat:
    """This process group's topology, or why the reduction stays flat.
    Collective where nothing explicit is set (every rank must call it).
    ``min_ranks_per_host``: fewer ranks per host is flat (the hierarchy needs
    2; cross-site training takes 1)."""
    world = groups.size(pg)
    explicit = ranks_per_host is not None
    if not explicit and settings.get().ranks_per_host is not None:
        ranks_per_host, source = settings.get().ranks_per_host, "FASTDDP_RANKS_PER_HOST"
        explicit = True
    else:
        source = f"ranks_per_host={ranks_per_host}"
    registered = groups.is_registered(pg)
    whole = registered and dist.is_initialized() and world == dist.get_world_size()
    if not whole:
        why = ("the process group is not one torch.distributed made (new_group cannot make sub-groups "
               "of it)" if not registered else
               f"the process group has {world} of the world's {dist.get_world_size()} ranks (the "
               "sub-groups are made by new_group, which every rank of the world must call)")
        if explicit:
            raise ValueError(f"fastddp: {source} asks for the hierarchical reduction, but {why}; "
                             "use the flat hooks on this group")
        return Flat(why)
    if explicit:
        topo = _explicit(world, ranks_per_host, source)
    else:
        keys = _gathered(pg, world)
        by_host: dict = {}
        for r, (key, _) in enumerate(keys):
            by_host.setdefault(key, []).append(r)
        hosts = sorted((tuple(v) for v in by_host.values()), key=lambda t: t[0])
        sizes = sorted({len(h) for h in hosts})
        if len(sizes) > 1:
            return Flat(f"hosts hold unequal numbers of ranks ({', '.join(map(str, sizes))})")
        told = {lws for _, lws in keys if lws is not None}
        if told and told != {len(hosts[0])}:
            return Flat(f"LOCAL_WORLD_SIZE says {sorted(told)} ranks per host but the ranks' host keys "
                        f"group them {len(hosts[0])} per host")
        src = "torchrun GROUP_RANK" if keys[0][0].startswith("node ") else "host name + network namespace"
        topo = Topology(tuple(hosts), src)
    if topo.num_hosts < 2:
        return Flat(f"all {world} ranks are on one host")
    if topo.ranks_per_host < min_ranks_per_host:
        return Flat(f"one rank per host ({topo.num_hosts} hosts): the flat reduction already "
                    "crosses each host link once")
    return topo


_SUBGROUPS: dict = {}


def subgroups(pg, topo: Topology):
    """``(inside, across)``: this rank's group of the ranks on its host, and
    of the ranks with its local rank on every host.  Made once per
    (group, topology), collectively: every rank of the world calls
    ``new_group`` for every sub-group in the same order."""
    key = (id(pg), topo.hosts)
    got = _SUBGROUPS.get(key)
    if got is not None and got[0] is pg:
        return got[1], got[2]
    me = groups.rank(pg)
    to_global = groups.global_ranks(pg)
    backend = dist.get_backend(pg)
    inside = across = None
    for ranks in topo.hosts:
        g = dist.new_group([to_global[r] for r in ranks], backend=backend)
        if me in ranks:
            inside = g
    for i in range(topo.ranks_per_host):
        ranks = [h[i] for h in topo.hosts]
        g = dist.new_group([to_global[r] for r in ranks], backend=backend)
        if me in ranks:
            across = g
    _SUBGROUPS[key] = (pg, inside, across)
    return inside, across


def late_inside(pg, topo: Topology):
    """A second group of the ranks on this rank's host, for the rounds the
    phase-2 thread runs inside the host while the backward thread issues the
    first one on :func:`subgroups`' (each group sees one thread's
    collectives: one order on every rank).  Made once per (group, topology),
    collectively, as :func:`subgroups`."""
    key = (id(pg), topo.hosts, "late")
    got = _SUBGROUPS.get(key)
    if got is not None and got[0] is pg:
        return got[1]
    me = groups.rank(pg)
    to_global = groups.global_ranks(pg)
    inside = None
    for ranks in topo.hosts:
        g = dist.new_group([to_global[r] for r in ranks], backend=dist.get_backend(pg))
        if me in ranks:
            inside = g
    _SUBGROUPS[key] = (pg, inside, None)
    return inside
