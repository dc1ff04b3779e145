"""The sites of cross-site training: which ranks share a host, and the
process groups the two tiers run on.

The hosts are found as the hierarchical reduction finds them
(:func:`fastddp.topology.resolve`: ``ranks_per_host=`` or
``FASTDDP_RANKS_PER_HOST``, else torchrun's node rank or the host name +
network namespace), except that one rank per host is a valid site here
(there is nothing to reduce inside it).  Fewer than two hosts, or hosts of
unequal rank counts, are errors: the setting would be exact DDP with extra
work, or could not shard the model evenly.

Groups, made collectively at construction (every rank of the world calls
``new_group`` for each, in the same order):

* ``inside``: this rank's host (the inner, exact reduction, main thread);
* ``across``: the ranks with this local rank on every host (the outer sync's
  payload, on the outer sync's thread);
* ``inside_sync``: this rank's host again, for the outer sync's gather of
  the new parameters (the thread's own, so no group sees two threads'
  collectives);
* ``world_sync``: every rank, for the outer sync's agreement (step counts,
  the delay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .. import groups, topology

__all__ = ["Sites", "resolve_sites"]


@dataclass(frozen=True)
class Sites:
    topology: topology.Topology
    host: int
    local_rank: int
    inside: object
    across: object
    inside_sync: object
    world_sync: object

    @property
    def num_hosts(self) -> int:
        return self.topology.num_hosts

    @property
    def ranks_per_host(self) -> int:
        return self.topology.ranks_per_host


def _topology(pg, ranks_per_host: int | None) -> topology.Topology:
    world = groups.size(pg)
    if ranks_per_host is not None and (not isinstance(ranks_per_host, int) or ranks_per_host < 1
                                       or world % ranks_per_host):
        raise ValueError(f"fastddp.CrossSite: ranks_per_host={ranks_per_host!r} must be a positive divisor "
                         f"of the process group's {world} ranks (the ranks of one host are consecutive)")
    if ranks_per_host == 1 or (ranks_per_host is None and world >= 2 and _one_per_host(pg, world)):
        topo = topology.Topology(tuple((r,) for r in range(world)),
                                 "ranks_per_host=1" if ranks_per_host else "one rank per host key")
    else:
        found = topology.resolve(pg, ranks_per_host)
        if isinstance(found, topology.Flat):
            raise ValueError(f"fastddp.CrossSite: cannot split the process group into sites: {found.why}. "
                             "Cross-site training needs at least two hosts of equal rank counts "
                             "(set ranks_per_host= or FASTDDP_RANKS_PER_HOST where detection cannot tell)")
        topo = found
    if topo.num_hosts < 2:
        raise ValueError(f"fastddp.CrossSite: all {world} ranks are on one host; cross-site training "
                         "needs at least two (on one host, plain DDP is exact and as fast)")
    return topo


def _one_per_host(pg, world: int) -> bool:
    """Every rank reports a host key of its own (collective: the keys are
    gathered).  Explicit settings are left to :func:`topology.resolve`."""
    from .. import settings

    if settings.get().ranks_per_host is not None:
        return settings.get().ranks_per_host == 1
    keys: list = [None] * world
    dist.all_gather_object(keys, topology.host_key(), group=pg)
    return len(set(keys)) == world


def resolve_sites(pg, ranks_per_host: int | None = None) -> Sites:
    """This rank's site and the groups of both tiers (collective)."""
    if not groups.is_registered(pg) or groups.size(pg) != dist.get_world_size():
        raise ValueError("fastddp.CrossSite: the DDP module's process group must be the whole world (its "
                         "sub-groups are made by new_group, which every rank must call)")
    topo = _topology(pg, ranks_per_host)
    me = groups.rank(pg)
    to_global = groups.global_ranks(pg)
    backend = dist.get_backend(pg)
    made: dict = {}
    for name, sets in (("inside", topo.hosts),
                       ("across", [tuple(h[i] for h in topo.hosts) for i in range(topo.ranks_per_host)]),
                       ("inside_sync", topo.hosts),
                       ("world_sync", [tuple(range(groups.size(pg)))])):
        for ranks in sets:
            g = dist.new_group([to_global[r] for r in ranks], backend=backend)
            if me in ranks:
                made[name] = g
    return Sites(topo, topo.host_of(me), topo.local_rank(me), **made)
