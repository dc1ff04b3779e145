"""fastddp: a drop-in, faster torch.nn.parallel.DistributedDataParallel."""

from __future__ import annotations

__version__ = "0.1.0"

from . import kernels  # noqa: F401  (installed from the top-level kernels/ folder)
