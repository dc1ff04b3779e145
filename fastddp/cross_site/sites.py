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
  these two are :func:`fastddp.topology.subgroups`' (shared with a
  hierarchical warm-up, whose rounds end before any outer sync starts);
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
    found = topology.resolve(pg, ranks_per_host, min_ranks_per_host=1)
    if isinstance(found, topology.Flat):
        raise ValueError(f"fastddp.CrossSite: cannot split the process group into sites: {found.why}. "
                         "Cross-site training needs at least two hosts of equal rank counts (on one host, "
                         "plain DDP is exact and as fast; set ranks_per_host= or FASTDDP_RANKS_PER_HOST "
                         "where detection cannot tell)")
    return found


def resolve_sites(pg, ranks_per_host: int | None = None) -> Sites:
    """This rank's site and the groups of both tiers (collective)."""
    if not groups.is_registered(pg) or groups.size(pg) != dist.get_world_size():
        raise ValueError("fastddp.CrossSite: the DDP module's process group must be the whole world (its "
                         "sub-groups are made by new_group, which every rank must call)")
    topo = _topology(pg, ranks_per_host)
    # inside/across: the hierarchical reduction's sub-groups, made once per topology; a warm-up on that
    # mode uses them too, but every round of a warm-up step ends in its backward, before any outer sync
    inside, across = topology.subgroups(pg, topo)
    me = groups.rank(pg)
    to_global = groups.global_ranks(pg)
    backend = dist.get_backend(pg)
    made: dict = {}
    for name, sets in (("inside_sync", topo.hosts), ("world_sync", [tuple(range(groups.size(pg)))])):
        for ranks in sets:
            g = dist.new_group([to_global[r] for r in ranks], backend=backend)
            if me in ranks:
                made[name] = g
    return Sites(topo, topo.host_of(me), topo.local_rank(me), inside, across, **made)
