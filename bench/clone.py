"""What only a clone of the repository has: the tools/ folder.

``fastddp-bench --link netns:RATE`` needs tools/netlink.py (two network
namespaces and a shaped veth pair; root only).  That tooling is not
installed with the package, so the CLI reaches it through the clone the
bench runs from: with ``pip install -e <clone>`` this package is the clone's
bench/ folder, and tools/ sits beside it.  From an installed wheel there is
no clone, and :func:`netlink` says so and what to do.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

__all__ = ["ToolsMissing", "repo_root", "netlink"]


class ToolsMissing(RuntimeError):
    """A bench option needs the repository's tools/ folder, which this install lacks."""


def repo_root() -> Path | None:
    """The clone this package runs from (the folder holding bench/ and
    tools/), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tools" / "__init__.py").is_file() and (root / "bench").is_dir() else None


def netlink():
    """The clone's :mod:`tools.netlink`; raises :class:`ToolsMissing` when
    there is no clone (or another package named ``tools`` shadows it)."""
    root = repo_root()
    if root is None:
        raise ToolsMissing(
            "--link needs tools/netlink.py, the root-only network-namespace tooling, which is in a clone "
            "of the fastddp repository and not installed with the package. Clone the repository, "
            "`pip install -e .` in it and run fastddp-bench from that install (as root, with iproute2); "
            "or use --simulate-bandwidth GBPS (a simulated wire, no root).")
    if str(root) not in sys.path:
        sys.path.append(str(root))  # appended: an installed package keeps its name
    try:
        mod = importlib.import_module("tools.netlink")
    except ImportError as e:
        raise ToolsMissing(f"--link: could not import tools.netlink from {root}: {e}") from None
    where = Path(mod.__file__).resolve().parent
    if where != root / "tools":
        raise ToolsMissing(f"--link: the module tools.netlink comes from {where}, not from the clone's "
                           f"{root / 'tools'}: another package named 'tools' shadows it; uninstall it or "
                           f"run from the clone's folder")
    return mod
