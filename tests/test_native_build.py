"""The native modules' shared build machinery (kernels/_native_build.py): the
switch's one rule, torch's two kinds of build lock (a file while building;
an OS lock on a file left behind), the stale build lock a killed builder leaves, a
terminated command-line build releasing torch's lock, and the C++ sources
shipping beside their loaders.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

from tests._dist import REPO_ROOT


def test_switch_has_one_rule(monkeypatch):
    from fastddp.kernels._native_build import switch
    for raw, want in (("", "on"), ("1", "on"), ("yes", "on"), ("0", "off"), (" Off ", "off"), ("false", "off"),
                      ("no", "off"), ("require", "require"), ("REQUIRE", "require")):
        monkeypatch.setenv("FASTDDP_X", raw)
        assert switch("FASTDDP_X") == want, raw
    monkeypatch.delenv("FASTDDP_X")
    assert switch("FASTDDP_X") == "on"
    monkeypatch.setenv("FASTDDP_X", "sometimes")  # the same refusal as fastddp.settings', naming the variable
    with pytest.raises(ValueError, match=r"FASTDDP_X='sometimes' is not a valid value; accepted .*require"):
        switch("FASTDDP_X")


def test_one_place_spells_the_truthiness_words():
    # fastddp.settings and the native builds take the words from kernels._switch; the interpreter
    # switch follows Triton's own reading (an on word), so both agree on TRITON_INTERPRET=false
    from fastddp import settings
    from fastddp.kernels import _switch

    assert settings.OFF_WORDS is _switch.OFF_WORDS and settings.ON_WORDS is _switch.ON_WORDS
    assert not _switch.interpreter_requested({"TRITON_INTERPRET": "false"})
    assert _switch.interpreter_requested({"TRITON_INTERPRET": " 1 "}) and not _switch.interpreter_requested({})


def _lock(path, age_s: float):
    path.write_text("")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


@pytest.fixture(params=["file", "os-lock"])
def lock_style(request, monkeypatch):
    """torch's two build locks: ``"file"`` (torch <= 2.13, FileBaton: the
    file exists while a build runs) or ``"os-lock"`` (torch >= 2.14,
    cpp_extension.FileLock: an OS advisory lock on a file left behind),
    whichever torch is installed."""
    import filelock
    from torch.utils import cpp_extension

    if request.param == "file":
        monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
    else:
        monkeypatch.setattr(cpp_extension, "FileLock", filelock.FileLock, raising=False)
    return request.param


def _hold(path, seconds: float) -> threading.Thread:
    """Another builder: an OS lock on ``path`` (flock, as filelock takes it) for ``seconds``."""
    import fcntl

    held = threading.Event()

    def run():
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.set()
        time.sleep(seconds)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    held.wait(5)
    return t


def test_a_finished_builds_os_lock_file_does_not_block(tmp_path, lock_style):
    """torch >= 2.14 leaves its lock file after every build: a process that
    starts after it imports the module at once (no wait, no "stale" removal:
    read as torch <= 2.13's lock it cost every process for 10 minutes after
    a build); under torch <= 2.13 the same file is a build in progress."""
    from fastddp.kernels import _native_build as B
    lock = _lock(tmp_path / "lock", 1)
    assert B.building(str(lock)) == (lock_style == "file")
    if lock_style == "os-lock":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = time.monotonic()
            B.wait_for_lock(str(lock), limit=0.5, poll=0.05)
        assert time.monotonic() - t < 0.3 and lock.exists()


def test_a_lock_older_than_the_build_limit_is_stale(tmp_path, monkeypatch):
    from fastddp.kernels import _native_build as B
    from torch.utils import cpp_extension

    monkeypatch.delattr(cpp_extension, "FileLock", raising=False)  # (torch <= 2.13's lock: a file)
    old = _lock(tmp_path / "lock", B.BUILD_LIMIT_S + 5)
    with pytest.warns(RuntimeWarning, match="removed the stale build lock .*its builder died"):
        B.wait_for_lock(str(old))  # returns at once instead of waiting for ever
    assert not old.exists()
    fresh = _lock(tmp_path / "lock", 1)
    assert not B.remove_stale_lock(str(fresh)) and fresh.exists()  # a live build's lock stays


def test_a_live_builders_lock_is_waited_for(tmp_path, lock_style):
    from fastddp.kernels import _native_build as B
    if lock_style == "file":
        lock = _lock(tmp_path / "lock", 0)
        threading.Timer(0.5, lock.unlink).start()  # the other builder finishes
    else:  # an old file (its age says nothing), held by a live builder for 0.5 s
        lock = _lock(tmp_path / "lock", B.BUILD_LIMIT_S + 60)
        _hold(lock, 0.5)
    t = time.monotonic()
    B.wait_for_lock(str(lock), poll=0.05)
    assert 0.4 < time.monotonic() - t < 5
    assert lock.exists() == (lock_style == "os-lock")  # (a held OS lock's file is never removed as stale)


def test_a_stale_lock_does_not_stop_the_build(tmp_path, monkeypatch):
    """The loader meets a dead builder's lock in its build folder: it removes
    it and builds (torch <= 2.13's builder alone would wait on it for ever)."""
    from fastddp.kernels import _native_build as B
    from torch.utils import cpp_extension

    monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
    src = tmp_path / "x.cpp"
    src.write_text("// nothing\n")
    ext = B.Extension("fastddp_test", [str(src)], env="FASTDDP_TEST_NATIVE", what="test module",
                      fallback="nothing", instead="nothing")
    d = tmp_path / "build"
    d.mkdir()
    monkeypatch.setattr(ext, "built_path", lambda: ("fastddp_test", str(d), str(d / "fastddp_test.so")))
    _lock(d / "lock", B.BUILD_LIMIT_S + 60)
    built = object()
    monkeypatch.setattr(ext, "_build", lambda: built)
    monkeypatch.delenv("FASTDDP_TEST_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert ext.module() is built
    assert not (d / "lock").exists()


def test_a_terminated_build_releases_torchs_lock(tmp_path):
    """exit_on_sigterm (each loader's main() calls it): SIGTERM unwinds the
    build, so torch's lock (FileBaton, released in a finally) is not left
    behind for the next run to wait on."""
    lock = tmp_path / "lock"
    code = ("import sys, time\n"
            "from torch.utils.file_baton import FileBaton\n"
            "from fastddp.kernels._native_build import exit_on_sigterm\n"
            "exit_on_sigterm()\n"
            f"b = FileBaton({str(lock)!r})\n"
            "assert b.try_acquire()\n"
            "try:\n"
            "    print('building', flush=True); time.sleep(60)\n"
            "finally:\n"
            "    b.release()\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "building" and lock.exists()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
    assert not lock.exists()


def test_the_sources_ship_beside_their_loaders():
    """Each native module is a real .cpp beside its loader, and the wheel,
    the sdist and the editable install carry it (package-data, MANIFEST.in)."""
    from fastddp import _native
    from fastddp.kernels import _fp8_native
    for ext, rel in ((_native.EXTENSION, "fastddp/csrc/countdown.cpp"),
                     (_fp8_native.EXTENSION, "kernels/csrc/fp8_cpu.cpp")):
        assert [os.path.realpath(s) for s in ext.sources] == [os.path.realpath(os.path.join(REPO_ROOT, rel))]
        assert os.path.isfile(ext.sources[0])
    pyproject = open(os.path.join(REPO_ROOT, "pyproject.toml")).read()
    assert 'fastddp = ["csrc/*.cpp"]' in pyproject and '"fastddp.kernels" = ["csrc/*.cpp"]' in pyproject
    manifest = open(os.path.join(REPO_ROOT, "MANIFEST.in")).read()
    assert "include fastddp/csrc/*.cpp" in manifest and "include kernels/csrc/*.cpp" in manifest


def test_kernels_never_import_fastddp():
    """kernels/ sits below fastddp/: no module there imports upward."""
    import re
    kdir = os.path.join(REPO_ROOT, "kernels")
    bad = []
    for f in sorted(os.listdir(kdir)):
        if f.endswith(".py"):
            text = open(os.path.join(kdir, f)).read()
            if re.search(r"^\s*(from fastddp\b(?!\.kernels)|import fastddp\b(?!\.kernels))", text, re.M):
                bad.append(f)
    assert bad == [], f"kernels/ modules importing fastddp: {bad}"
