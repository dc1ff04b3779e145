"""What a report records about the run besides its rows: the machine,
the versions, the command, the load, the time per model
(:func:`run_meta`)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from . import report as R
from .models import model_zoo

__all__ = ["run_meta", "load_average"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not sha:
        return None
    return sha + (" (uncommitted changes)" if dirty else "")


def load_average() -> str | None:
    """The load average (1, 5, 15 min), or None where the OS has none."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def run_meta(ctx, names: tuple[str, ...], elapsed: float, sections: list[R.Section]) -> dict:
    """The report's ``meta`` for rank 0 (``ctx``: its :class:`~bench.rank.RankContext`) after
    ``elapsed`` seconds that ran ``names`` in ``sections``."""
    cfg = ctx.cfg
    zoo = model_zoo()
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001 - not installed / broken: recorded as such
        triton_v = None
    nccl = None
    if ctx.cuda:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            nccl = "unknown"
    try:
        import numpy
        numpy_v = numpy.__version__
    except ImportError:
        numpy_v = None
    try:
        import fastddp
        fastddp_v = getattr(fastddp, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        fastddp_v = f"unavailable ({R.reason(exc)})"
    cpu = _cpu_model()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    now = _dt.datetime.now()
    meta = {
        "label": cfg.resolved_label(),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else cpu,
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {affinity} usable",
        "gpus": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                 if ctx.cuda else None),
        "backend": "nccl" if ctx.cuda else "gloo",
        "world_size": ctx.world,
        "threads_per_rank": cfg.threads,
        "torch": torch.__version__,
        "triton": triton_v,
        "nccl": nccl,
        "python": platform.python_version(),
        "numpy": numpy_v,
        "fastddp": fastddp_v,
        "git": _git(),
        "models": list(cfg.models),
        "model_descriptions": {m: zoo[m].description for m in cfg.models},
        "wrappers": list(names),
        "mode": cfg.mode,
        "rounds": {f"{m}{s.tag}": info["rounds"] for s in sections for m, info in s.runs.items()},
        "half_width": f"{cfg.half_width * 100:g}%",
        "precision": f"{cfg.stop_rule().half_width * 100:g}%",
        "budget_s": cfg.stop_rule().budget_s if cfg.mode == "adaptive" else None,
        "warmup": cfg.warmup_steps(),
        "bucket_cap_mb": cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else "default (25)",
        "simulate_bandwidth_gbps": [b for b in cfg.bandwidths if b is not None] or None,
        "quick": cfg.quick,
        "load": f"{ctx.load_start} at start, {load_average()} at the end" if ctx.load_start else None,
        "command": cfg.command,
        "elapsed_s": round(elapsed, 1),
        "elapsed_per_model_s": dict(ctx.elapsed),
        "config": {k: v for k, v in asdict(cfg).items() if k != "command"},
    }
    return meta
