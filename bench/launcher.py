"""Starting the ranks of a run (:func:`launch`) and one rank's whole run
(:func:`worker`)::

    parent: spawn W ranks (gloo on CPU; NCCL, one per GPU) -- or, under
            torchrun, every process is a rank already; with ``--link``,
            ranks inside two network namespaces (:func:`link_rank`)
    rank:   one section per wire (:func:`rounds.bench_section`); rank 0
            builds the report and hands it back as JSON
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from . import report as R
from .config import BenchConfig
from .meta import run_meta
from .progress import Progress
from .rank import RankContext
from .rounds import bench_section

__all__ = ["launch", "worker", "under_torchrun", "resolve_world", "link_rank"]


def under_torchrun() -> bool:
    """True when launched by torchrun (or any env:// launcher setting these)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def worker(rank: int, world: int, local_rank: int, cfg: BenchConfig, init_method: str,
           result_path: str | None) -> R.Report | None:
    """One rank's whole run; rank 0 returns the report (and writes it as JSON
    to ``result_path`` when given), the others return None."""
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    cuda = torch.cuda.is_available() and not cfg.cpu
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=_dt.timedelta(seconds=cfg.timeout_s))
    try:
        ctx = RankContext(cfg, rank, world, local_rank, device)
        link_probe = None
        if cfg.link is not None:  # the rate the link really carries, before the rounds
            from .clone import netlink
            from .linkbytes import LinkMeter, probe_between_hosts

            link_probe = probe_between_hosts(netlink().probe_link, cfg.ranks_per_host or 1)
            ctx.meter = LinkMeter.for_rank()
        names = cfg.wrapper_names(cuda)
        bar = Progress(ctx.lead and cfg.progress, cfg)
        wire = None
        if link_probe is not None:  # the section says what carried it (the main job has several wires)
            spec = netlink().parse_link(cfg.link)
            wire = {"kind": "netns", "gbit": spec.gbit, "what": spec.describe(), **link_probe}
            link_meta = {"spec": cfg.link, "what": wire["what"], "ranks_per_host": cfg.ranks_per_host or 1,
                         **link_probe}
        try:
            sections = [bench_section(ctx, bw, names, bar, wire) for bw in cfg.bandwidths]
        finally:
            bar.close()
        if not ctx.lead:
            return None
        meta = run_meta(ctx, names, time.perf_counter() - t_start, sections)
        if link_probe is not None:
            meta["link"] = link_meta
        report = R.Report(meta, sections)
        for s in report.sections:
            R.derive(s)
        if result_path:
            Path(result_path).write_text(R.to_json(report))
        return report
    finally:
        dist.destroy_process_group()


def _spawn_entry(rank: int, world: int, cfg: BenchConfig, init_method: str, result_path: str) -> None:
    worker(rank, world, rank, cfg, init_method, result_path)


def resolve_world(cfg: BenchConfig) -> int:
    if cfg.world is not None:
        return cfg.world
    if torch.cuda.is_available() and not cfg.cpu:
        return max(1, torch.cuda.device_count())
    return 2


def link_rank(cfg_path: str, result_path: str) -> None:
    """A rank of a ``--link`` run, started inside its namespace by
    :func:`_run_linked` (RANK and the rest come from the environment)."""
    import pickle

    cfg = pickle.loads(Path(cfg_path).read_bytes())
    rank = int(os.environ["RANK"])
    worker(rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), cfg, "env://",
           result_path if rank == 0 else None)


def _run_linked(cfg: BenchConfig) -> R.Report:
    """``--ranks-per-host`` ranks (1 by default) in each of two network
    namespaces, over the ``--link`` veth pair."""
    import pickle

    from .clone import netlink

    N = netlink()
    L = cfg.ranks_per_host or 1
    cfg = replace(cfg, cpu=True, world=2 * L)
    with tempfile.TemporaryDirectory(prefix="fastddp-bench-") as tmp:
        cfg_path, result = Path(tmp, "cfg.pkl"), Path(tmp, "result.json")
        cfg_path.write_bytes(pickle.dumps(cfg))
        argv = [sys.executable, "-c", "import sys; from fastddp.bench.launcher import link_rank; "
                "link_rank(sys.argv[1], sys.argv[2])", str(cfg_path), str(result)]
        with N.NetnsLink(N.parse_link(cfg.link), ranks_per_host=L) as link:
            link.run_ranks(argv)
        return R.from_json(result.read_text())


def launch(cfg: BenchConfig) -> R.Report | None:
    """Run ``cfg``'s ranks; rank 0's report (None on other torchrun ranks)."""
    if cfg.link is not None:
        return _run_linked(cfg)
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return worker(rank, world, int(os.environ["LOCAL_RANK"]), cfg, "env://", None)
    import torch.multiprocessing as mp

    world = resolve_world(cfg)
    with tempfile.TemporaryDirectory(prefix="fastddp-bench-") as tmp:
        init = Path(tmp, "init").as_uri()
        result = Path(tmp, "result.json")
        mp.spawn(_spawn_entry, args=(world, cfg, init, str(result)), nprocs=world, join=True)
        return R.from_json(result.read_text())
