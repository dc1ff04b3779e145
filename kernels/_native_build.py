"""Builds and loads one C++ extension from ``.cpp`` files beside its loader,
once per source and torch version, cached in torch's extension folder.

The shared machinery of fastddp's two native modules, each one concern with
its own switch (``fastddp/_native.py``: the readiness countdown;
``kernels/_fp8_native.py``: the fp8 CPU loops).  It lives in ``kernels/``
because both may import it (``fastddp`` imports ``kernels``, never the other
way round).

A switch variable takes ``1`` (the default: build on first use; a failed
build warns once and the caller's Python path is used), ``0`` (off: no
build, the Python path) or ``require`` (a failed build is an error).

Two build paths: torch's JIT builder (``cpp_extension.load``) where ninja is
at hand, else the C++ compiler directly with the flags torch's builder would
pass.  A previous process's result is imported without re-running torch's
build check (~0.5 s per process: every rank of every run pays it).

torch's builder locks the build folder's ``lock`` file while it builds,
in one of two ways (:func:`building` reads either).  torch <= 2.13
(``FileBaton``) creates the file and removes it after: a builder killed hard
(SIGKILL) leaves it behind and every later process would wait on it for
ever, so a lock older than :data:`BUILD_LIMIT_S` is stale, removed (with a
warning), and the build runs; :func:`exit_on_sigterm` makes a command-line
build release it when it is terminated.  torch >= 2.14 holds an OS advisory
lock on a file it leaves behind (the kernel releases a dead holder's): there
the lock is tried, and the file's presence or age says nothing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from typing import Sequence

import torch

from ._switch import parse_switch

__all__ = ["BUILD_LIMIT_S", "Extension", "exit_on_sigterm", "has_ninja", "switch"]

#: seconds after which a build lock is a dead builder's: a build of either
#: module takes ~1 min on 2 busy cores (40-70 s on one); 10x that is no build.
BUILD_LIMIT_S = 600.0

def switch(var: str) -> str:
    """``"on"``, ``"off"`` or ``"require"``: the value of the switch ``var``
    (unset or empty: on), by the one truthiness rule (:mod:`._switch`).
    Read at each call: tests and tools flip it."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return "on"
    v = parse_switch(var, raw, ("require",))
    return "require" if v == "require" else "on" if v else "off"


def has_ninja() -> bool:
    try:
        import ninja  # noqa: F401  (pip's ninja puts the binary on PATH)
        return True
    except ImportError:
        return shutil.which("ninja") is not None


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread, so a build being run
    from the command line unwinds (torch's builder releases its lock in a
    ``finally``, ``subprocess.run`` kills the compiler) instead of leaving
    the lock behind.  For command-line entry points only, never a library."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def remove_stale_lock(path: str, limit: float = BUILD_LIMIT_S) -> bool:
    """Remove the lock file ``path`` when it is older than ``limit`` seconds
    (its builder is dead); True when it did."""
    try:
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return False
    if age <= limit:
        return False
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    warnings.warn(f"fastddp: removed the stale build lock {path} ({age:.0f} s old, more than the "
                  f"{limit:.0f} s any build takes: its builder died)", RuntimeWarning, stacklevel=2)
    return True


def _torch_lock():
    """torch's build lock class where it is an OS advisory lock (torch >= 2.14:
    ``cpp_extension.FileLock``, whose file stays behind after the build), else
    None (torch <= 2.13's ``FileBaton``: the file exists exactly while a build
    runs)."""
    from torch.utils import cpp_extension
    return getattr(cpp_extension, "FileLock", None)


def building(path: str) -> bool:
    """Whether another process builds under torch's lock file ``path``: the
    file's existence (torch <= 2.13), or the OS lock on it, tried without
    waiting (torch >= 2.14, whose finished builds leave the file)."""
    if not os.path.exists(path):
        return False
    lock_cls = _torch_lock()
    if lock_cls is None:
        return True
    lock = lock_cls(path)
    try:
        lock.acquire(timeout=0)
    except TimeoutError:  # (filelock.Timeout) a builder holds it
        return True
    lock.release()
    return False


def wait_for_lock(path: str, limit: float = BUILD_LIMIT_S, poll: float = 0.2) -> None:
    """Wait while another process builds (:func:`building`).  Never for ever
    on a dead builder's lock: torch <= 2.13's file is removed as stale once
    it is ``limit`` seconds old; torch >= 2.14's OS lock is released by the
    kernel when its holder dies (its file's age says nothing)."""
    while building(path):
        if _torch_lock() is None and remove_stale_lock(path, limit):
            return
        time.sleep(poll)


def _pybind_abi_flags() -> list[str]:
    """torch's pybind11 ABI defines, as its JIT builder passes them (older
    torch; newer pybind11 keys its shared type registry itself): without
    them the countdown could not take a torch ProcessGroup from Python (the
    native issue chain would stay off)."""
    import warnings
    from torch.utils import cpp_extension
    get = getattr(cpp_extension, "_get_pybind11_abi_build_flags", None)
    if get is None:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(get())


class Extension:
    """One native module: ``sources`` (paths), its switch variable ``env``,
    what it is (``what``: "the native <what> could not be built"), what runs
    instead (``fallback``: a sentence for the warning; ``instead``: two words
    for :meth:`main`'s line)."""

    def __init__(self, prefix: str, sources: Sequence[str], env: str, what: str, fallback: str, instead: str,
                 cflags: Sequence[str] = ("-O3", "-ffp-contract=off"), mode=None):
        # mode: a callable giving "on"/"off"/"require" (fastddp passes its
        # settings' reading of ``env``); default: :func:`switch`
        self.prefix, self.sources, self.env = prefix, list(sources), env
        self._mode = mode or functools.partial(switch, env)  # a partial: no Python frame per call
        self.what, self.fallback, self.instead, self.cflags = what, fallback, instead, list(cflags)
        self._lock = threading.Lock()
        self._module = None
        self._failed: str | None = None
        self._name: str | None = None

    def enabled(self) -> bool:
        return self._mode() != "off"

    def module(self, stacklevel: int = 2):
        """The compiled module (built on first use, then loaded from torch's
        extension cache), or None where it is off or cannot be built."""
        mode = self._mode()  # read at each call (tests and tools flip it), inline: this is the hot path
        if mode == "off":
            return None
        if self._module is not None or self._failed is not None:
            if self._failed is not None and mode == "require":
                raise RuntimeError(self._failed)
            return self._module
        with self._lock:
            if self._module is None and self._failed is None:
                try:
                    self._module = self._load()
                except Exception as e:  # no compiler, no ninja, headers of another torch ...
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                    self._failed = (f"fastddp: the native {self.what} could not be built ({type(e).__name__}: {last}); "
                                    f"{self.fallback}. Set {self.env}=0 to skip the build.")
                    if self._mode() == "require":
                        raise RuntimeError(self._failed) from e
                    warnings.warn(self._failed, RuntimeWarning, stacklevel=stacklevel + 1)
        return self._module

    def _load(self):
        mod = self._import_built()
        if mod is None:
            _, d, _ = self.built_path()
            wait_for_lock(os.path.join(d, "lock"))  # another process building: its result, or stale
            mod = self._import_built() or self._build()
        return mod

    def name(self) -> str:
        """The module's name: a hash of the sources, the flags and torch's
        version, so a change to any of them is a new build."""
        if self._name is None:
            h = hashlib.sha1(torch.__version__.encode())
            for path in self.sources:
                with open(path, "rb") as f:
                    h.update(f.read())
            h.update(" ".join(self.cflags).encode())
            self._name = f"{self.prefix}_{h.hexdigest()[:12]}"
        return self._name

    def built_path(self) -> tuple[str, str, str]:
        """The module's name, its build folder (torch's extension cache) and
        the shared object's path there."""
        from torch.utils import cpp_extension
        name = self.name()
        d = cpp_extension._get_build_directory(name, verbose=False)
        return name, d, os.path.join(d, name + importlib.machinery.EXTENSION_SUFFIXES[-1])

    def _import_built(self):
        """The module a previous process built, imported directly; None
        while absent or while another process holds the build lock."""
        name, d, so = self.built_path()
        if not os.path.isfile(so) or building(os.path.join(d, "lock")):
            return None
        spec = importlib.util.spec_from_file_location(name, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def _build(self):
        """torch's JIT builder where ninja is at hand; else the compiler
        directly (machines with a compiler but no ninja, e.g. one with only
        triton's runtime needs installed)."""
        from torch.utils import cpp_extension
        if has_ninja():
            return cpp_extension.load(name=self.name(), sources=self.sources, extra_cflags=self.cflags,
                                      verbose=False)
        return self._build_direct()

    def _build_direct(self):
        import fcntl
        from torch.utils import cpp_extension
        name, d, so = self.built_path()
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (c++/g++) on PATH and no ninja")
        with open(os.path.join(d, "direct.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then import its result
            if not os.path.isfile(so):
                std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12) else "-std=c++17"
                incs = [a for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                        for a in ("-isystem", p)]
                libs = [f"-L{p}" for p in cpp_extension.library_paths()]
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
                os.close(fd)
                cmd = [cxx, f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", *incs, "-fPIC",
                       std, *_pybind_abi_flags(), *self.cflags, "-shared", *self.sources, *libs, "-lc10", "-ltorch_cpu", "-ltorch",
                       "-ltorch_python", "-o", tmp]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode != 0:
                        raise RuntimeError(f"{cxx} failed: {(out.stderr or out.stdout).strip()[-800:]}")
                    os.replace(tmp, so)  # never a half-written module for another process to import
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        mod = self._import_built()
        if mod is None:
            raise RuntimeError(f"built {so} but could not import it")
        return mod

    def main(self) -> None:
        """Build now (CI and the GPU check do, before timed tests); says
        where, and how long it took."""
        exit_on_sigterm()
        t = time.perf_counter()
        if self.enabled():
            print(f"fastddp native build folder: {self.built_path()[1]}", flush=True)
        mod = self.module()
        state = "ready" if mod is not None else f"off ({self.instead})"
        print(f"fastddp native {self.what}: {state} in {time.perf_counter() - t:.1f} s", flush=True)
