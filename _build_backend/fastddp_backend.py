"""setuptools' PEP 517 backend with one change: the editable install answers
for `fastddp` from any folder.

For this layout (`fastddp.kernels` lives in `kernels/`, `fastddp.bench` in
`bench/`) setuptools implements `pip install -e .` with a meta-path finder
that it *appends* to `sys.meta_path`, after Python's PathFinder. Python
started in a folder holding a directory named `fastddp` without an
`__init__.py` -- the clone itself, seen from the folder that contains it --
gets an empty namespace package from PathFinder first, and
`from fastddp import DistributedDataParallel` fails with "(unknown
location)". The editable wheel built here carries one more module, run from
the same `.pth` file right after setuptools' own line, that moves
setuptools' finder in front of PathFinder. The finder only answers for
fastddp's names. Wheels, sdists and every other hook are setuptools'
unchanged; if a future setuptools writes no finder (or another .pth), the
wheel is left as it is and tests/test_newcomer.py says so.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook unchanged)

FIRST_MODULE = "_fastddp_editable_first"

_FIRST_SOURCE = '''\
"""Moves setuptools' editable finder for fastddp in front of PathFinder, so a
folder named `fastddp` without `__init__.py` in the current directory (the
clone, seen from its parent) cannot shadow the editable install as an empty
namespace package. Written by fastddp's _build_backend/fastddp_backend.py."""

import sys
from importlib.machinery import PathFinder


def install(finder_module):
    finders = [f for f in sys.meta_path if getattr(f, "__module__", None) == finder_module]
    if not finders or PathFinder not in sys.meta_path:
        return
    for f in finders:
        sys.meta_path.remove(f)
    at = sys.meta_path.index(PathFinder)
    sys.meta_path[at:at] = finders
'''

# setuptools' line in the editable .pth: "import MOD; MOD.install()"
_PTH_LINE = re.compile(r"^import (__editable___\w+_finder); \1\.install\(\)\s*$", re.M)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    _put_finder_first(os.path.join(wheel_directory, name))
    return name


def _record_row(path: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def _put_finder_first(wheel_path: str) -> None:
    with zipfile.ZipFile(wheel_path) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist()]
    changed: dict[str, bytes] = {}
    for info, data in entries:
        if "/" in info.filename or not info.filename.endswith(".pth"):
            continue
        text = data.decode("utf-8")
        m = _PTH_LINE.search(text)
        if m is None:
            continue
        line = f"import {FIRST_MODULE}; {FIRST_MODULE}.install({m.group(1)!r})"
        changed[info.filename] = (text.rstrip("\n") + "\n" + line + "\n").encode("utf-8")
    if not changed:
        return
    added = {f"{FIRST_MODULE}.py": _FIRST_SOURCE.encode("utf-8")}
    record_name = next(i.filename for i, _ in entries if i.filename.endswith(".dist-info/RECORD"))
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        rows = []
        for info, data in entries:
            if info.filename == record_name:
                rows = [r for r in csv.reader(io.StringIO(data.decode("utf-8"))) if r]
                continue
            zout.writestr(info, changed.get(info.filename, data))
        for path, data in added.items():
            zout.writestr(path, data)
        rows = [r for r in rows if r[0] not in changed and r[0] not in added and r[0] != record_name]
        rows += [_record_row(p, d) for p, d in {**changed, **added}.items()]
        rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zout.writestr(record_name, buf.getvalue())
    os.replace(tmp, wheel_path)
