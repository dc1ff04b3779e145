"""fastddp: a drop-in, faster torch.nn.parallel.DistributedDataParallel.

    from fastddp import DistributedDataParallel as DDP
"""

from __future__ import annotations

from ._version import __version__  # noqa: F401

from . import kernels  # noqa: F401  (installed from the top-level kernels/ folder)
from . import hooks, settings
from ._exit import install as install_exit_drain
from .ddp import DistributedDataParallel
from .options import Options
from .settings import configure
from .hooks import GradBucket
from .cross_site import CrossSite

__all__ = ["CrossSite", "DistributedDataParallel", "GradBucket", "Options", "configure", "hooks", "install_exit_drain", "kernels",
           "settings"]
