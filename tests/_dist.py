"""Multi-rank test harness: W gloo ranks, started once per pytest session.

Usage in a test module::

    from tests._dist import world2, world3, ddp_class, STAND_IN, fastddp_only

    def _body(rank, world_size, n):          # runs INSIDE every rank
        DDP = ddp_class()                     # the class under test
        ...
        return something_picklable

    def test_x(world2):
        results = world2.run(_body, 3)        # list, one entry per rank

``world.run(fn, *args, timeout=120)`` sends ``(fn.__module__, fn.__qualname__,
args)`` to every rank; each rank imports the module, calls ``fn(rank,
world_size, *args)`` and sends back the result (pickled with plain
:mod:`pickle`, so tensors travel by value) or the formatted traceback.  Any
failing rank makes ``run`` raise an ``AssertionError`` carrying every failing
rank's traceback.  After a failure or a timeout the workers are killed and the
next ``run`` respawns them, so one broken test never poisons the next.

Workers are shared by every test module of the session, one set per (world
size, environment) (:func:`shared_world`; the fixtures ``world2``,
``world3`` and ``_world_fixture(n)`` hand them out, :func:`close_shared_worlds`
stops them at the session's end), and started by a ``forkserver`` that has
imported torch and fastddp once: a worker costs a fork, not an interpreter
and torch's import (measured: ``tests/README.md``).  Workers:
``torch.set_num_threads(1)``, the environment of the process that asked for
them, one gloo process group (``file://`` init in a temporary folder,
``timeout`` = :data:`PG_TIMEOUT_S`) kept alive across calls.  Before every
call a worker puts back what a call may leave behind (its environment,
fastddp's settings and ``configure()``, the seed, torch's default dtype and
grad mode, torch.compile's caches when the test module changes); after
every call it drops leftover state (``gc``) and runs
``dist.monitored_barrier`` so a rank that is still busy is reported, not
waited on forever.

Also here: :class:`World` (to drive ranks by hand), :class:`single_rank_group`
(a 1-rank gloo default group inside the pytest process, for single-process
tests), :func:`ddp_class` / :func:`torch_ddp_class`, :func:`torch_reference`
and :func:`torch_ddp_accepts` (torch's DDP as the reference on every
supported torch), :data:`STAND_IN` and the :data:`fastddp_only` mark.
Training torch's DDP and the class under test side by side inside a rank:
:func:`tests._parity.side_by_side`; comparing tensors: :mod:`tests._compare`.

The class under test is chosen by the environment variable
``FASTDDP_TEST_IMPL``: ``torch`` makes :func:`ddp_class` return
``torch.nn.parallel.DistributedDataParallel`` (the *stand-in* mode that
proves the tests themselves); anything else (default) returns
``fastddp.DistributedDataParallel``.  Workers get the environment of the
pytest process, so the choice is the same there and in every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib
import inspect
import multiprocessing as _mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[1])

#: process-group timeout inside the workers (collectives that never match fail
#: after this long instead of hanging).
PG_TIMEOUT_S = 60
#: barrier after each call.
BARRIER_TIMEOUT_S = 30
#: once a rank has failed, how long to wait for the others before killing all.
FAILURE_GRACE_S = 5

IMPL = os.environ.get("FASTDDP_TEST_IMPL", "fastddp").strip().lower()
#: True when torch's own DDP stands in for fastddp's class.
STAND_IN = IMPL == "torch"

#: mark for tests about fastddp-only behaviour (skipped in stand-in mode).
fastddp_only = pytest.mark.skipif(
    STAND_IN, reason="fastddp-only behaviour (FASTDDP_TEST_IMPL=torch stand-in)")


def ddp_class():
    """The DistributedDataParallel class under test (see module docstring).

    ``FASTDDP_TEST_IMPL=package.module:Class`` selects any other class (e.g. a
    deliberately broken variant, to check that the tests catch it)."""
    if ":" in IMPL:
        mod, _, name = os.environ["FASTDDP_TEST_IMPL"].strip().partition(":")
        return getattr(importlib.import_module(mod), name)
    if STAND_IN:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel
    from fastddp import DistributedDataParallel
    return DistributedDataParallel


def torch_ddp_class():
    """The reference: torch's own DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


@functools.lru_cache(maxsize=None)
def torch_ddp_accepts(arg: str) -> bool:
    """Whether this torch's DistributedDataParallel constructor takes ``arg``.

    torch 2.11 lacks ``batched_grad_copy`` and ``forward_sync_buffers`` (new in
    2.13); fastddp takes both on every torch."""
    return arg in inspect.signature(torch_ddp_class().__init__).parameters


#: the arguments :func:`torch_reference` knows how to emulate.
EMULATED_ARGS = ("batched_grad_copy", "forward_sync_buffers")


def torch_reference(module, *, hook=False, emulate=(), **kwargs):
    """torch's DDP around ``module`` with ``kwargs``, as the parity reference.

    Where this torch's DDP lacks an argument (or it is named in ``emulate``,
    to check the emulation where torch has it), the reference is built with
    what gives torch 2.13's result bit for bit on this torch:

    * ``batched_grad_copy=True`` (torch: foreach copy of the grads into the
      flat bucket, then one flat ``div_(W)``): torch's
      ``default_hooks.allreduce_hook`` is registered; with a hook, torch's
      reducer copies the grads unscaled and the hook divides the flat bucket
      by W before the all-reduce: the same bits (tests/test_parity.py
      ``test_torch_reference_emulation`` checks it where torch has both).
      ``hook=True`` says the caller registers a comm hook of its own: a hook
      replaces either scaling rule, so the argument is only dropped.
      ``batched_grad_copy=False`` is torch's default rule: dropped.
    * ``forward_sync_buffers=X`` (torch 2.13: buffers synced at construction
      whatever X, then in forward only if X): built with
      ``broadcast_buffers=True`` (the init sync), then ``broadcast_buffers = X``
      for the forward syncs.  ``broadcast_buffers=False`` at construction
      would skip the init sync too.  Given both, ``forward_sync_buffers``
      wins, as in torch 2.13.
    """
    unknown = set(emulate) - set(EMULATED_ARGS)
    if unknown:
        raise ValueError(f"torch_reference cannot emulate {sorted(unknown)}")
    todo = {a for a in EMULATED_ARGS
            if a in kwargs and (a in emulate or not torch_ddp_accepts(a))}
    kwargs = dict(kwargs)
    batched = bool(kwargs.pop("batched_grad_copy", False)) if "batched_grad_copy" in todo else False
    fsb = kwargs.pop("forward_sync_buffers") if "forward_sync_buffers" in todo else None
    if fsb is not None:
        kwargs["broadcast_buffers"] = True
    ddp = torch_ddp_class()(module, **kwargs)
    if fsb is not None:
        ddp.broadcast_buffers = bool(fsb)
    if batched and not hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(kwargs.get("process_group"), default_hooks.allreduce_hook)
    return ddp


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------

#: variables read when a module is imported (triton's ``@jit`` reads
#: TRITON_INTERPRET then): a forkserver that imported fastddp under other
#: values cannot serve a world that needs these, which is then spawned.
IMPORT_TIME_VARIABLES = ("TRITON_INTERPRET",)
#: what the forkserver imports once, before it forks any worker
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "fastddp")


def _apply_environment(env: dict) -> None:
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


def _reset_between_calls(env: dict, last_module: str | None, module: str) -> None:
    """Put back what a call may leave behind, so that a call sees the same
    worker state whichever test modules ran before it in this session."""
    import torch

    _apply_environment(env)
    fastddp_settings = sys.modules.get("fastddp.settings")
    if fastddp_settings is not None:
        fastddp_settings.configure(sys.modules["fastddp.options"].Options())  # every option unconfigured
        fastddp_settings.reload()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if last_module is not None and last_module != module and "torch._dynamo" in sys.modules:
        # compiled frames and their recompile counts belong to one test module
        torch._dynamo.reset()


def _worker_main(rank, world_size, init_file, cmd_q, res_q, env):
    _apply_environment(env)
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    except BaseException:
        res_q.put((rank, "error", "init_process_group failed:\n" + traceback.format_exc()))
        return
    # what exists now (torch, fastddp, the group) lives as long as the worker:
    # out of the collector's sight, the gc.collect() after every call costs
    # ~0.01 ms instead of ~70 ms
    gc.freeze()
    res_q.put((rank, "ready", None))

    parent = os.getppid()
    last_module = None
    while True:
        try:
            msg = cmd_q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the pytest process died: do not linger
                break
            continue
        if msg is None:
            break
        mod_name, qualname, args = msg
        status, payload = "ok", None
        try:
            _reset_between_calls(env, last_module, mod_name)
            last_module = mod_name
            obj = importlib.import_module(mod_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            out = obj(rank, world_size, *args)
            payload = pickle.dumps(out)
        except BaseException:
            status, payload = "error", traceback.format_exc()
        # Drop leftover wrappers / reducers / autograd hooks of this call.
        obj = out = None
        gc.collect()
        if status == "ok":
            try:
                if dist.is_initialized():
                    dist.monitored_barrier(
                        timeout=datetime.timedelta(seconds=BARRIER_TIMEOUT_S))
                else:
                    status, payload = "error", "the call destroyed the process group"
            except BaseException:
                status, payload = "error", "barrier after the call failed:\n" + traceback.format_exc()
        res_q.put((rank, status, payload))

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        pass
    gc.unfreeze()


# --------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------

_forkserver_env: dict | None = None


def _context(env: dict):
    """``forkserver`` with torch and fastddp imported once (a worker is a
    fork: ~0.1 s where a spawned one imports torch for ~2 s), started with
    this session's import-time variables; ``spawn`` where it cannot serve
    (no forkserver on this platform, or those variables changed since)."""
    global _forkserver_env
    if "forkserver" not in _mp.get_all_start_methods():
        return _mp.get_context("spawn")
    wanted = {k: env.get(k) for k in IMPORT_TIME_VARIABLES}
    ctx = _mp.get_context("forkserver")
    if _forkserver_env is None:
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        # the server forks from its own state: it takes this process's
        # sys.path, and its environment now
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        _forkserver_env = wanted
    return ctx if wanted == _forkserver_env else _mp.get_context("spawn")


class WorldError(AssertionError):
    pass


class World:
    """W ranks in one gloo process group; see the module docstring."""

    def __init__(self, world_size: int, tmpdir: str | os.PathLike | None = None,
                 start_timeout: float = 120.0):
        self.world_size = world_size
        self._tmpdir = str(tmpdir) if tmpdir is not None else tempfile.mkdtemp(prefix="fastddp-world-")
        self._start_timeout = start_timeout
        self._ctx = None
        self._procs: list = []
        self._cmd_qs: list = []
        self._res_q = None
        self._generation = 0
        self.spawns = 0

    # -- lifecycle ---------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        self._generation += 1
        init_file = os.path.join(self._tmpdir, f"pg-init-{os.getpid()}-{self._generation}")
        if os.path.exists(init_file):
            os.unlink(init_file)
        env = _worker_environment()
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["OMP_NUM_THREADS"] = "1"
        self._ctx = _context(env)
        self._res_q = self._ctx.Queue()
        self._cmd_qs = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for r in range(self.world_size):
            p = self._ctx.Process(
                target=_worker_main, name=f"fastddp-test-rank{r}",
                args=(r, self.world_size, init_file, self._cmd_qs[r], self._res_q, env),
                daemon=True)
            p.start()
            self._procs.append(p)
        self.spawns += 1
        got = self._collect(self._start_timeout, "start")
        bad = {r: v for r, (s, v) in got.items() if s != "ready"}
        if bad:
            self.close()
            raise WorldError(_format_failures("starting the workers", bad))

    def close(self) -> None:
        """Stop the workers: politely (destroys the process group), then by force."""
        procs, self._procs = self._procs, []
        for p, q in zip(procs, self._cmd_qs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in self._cmd_qs + ([self._res_q] if self._res_q is not None else []):
            try:
                q.close()
                q.cancel_join_thread()
            except Exception:
                pass
        self._cmd_qs, self._res_q = [], None

    def kill(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        self._procs = []
        self.close()

    # -- calls -------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 120.0) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; per-rank results."""
        mod_name = fn.__module__
        qualname = fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(f"world.run needs a module-level function, got {qualname}")
        if mod_name == "__main__":
            raise TypeError("world.run needs a function importable by module name")
        self.start()
        for q in self._cmd_qs:
            q.put((mod_name, qualname, args))
        try:
            got = self._collect(timeout, f"{qualname}")
        except WorldError:
            self.kill()
            raise
        failures = {r: v for r, (s, v) in got.items() if s != "ok"}
        if failures:
            # A failed rank may have left collectives in flight: start afresh.
            self.kill()
            raise WorldError(_format_failures(f"{mod_name}.{qualname}", failures))
        return [pickle.loads(got[r][1]) for r in range(self.world_size)]

    def _collect(self, timeout: float, what: str) -> dict:
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                failed = {r: v for r, (s, v) in got.items() if s not in ("ok", "ready")}
                if failed:
                    raise WorldError(
                        _format_failures(what, failed)
                        + f"\n(rank(s) {missing} still busy {FAILURE_GRACE_S} s after that; "
                        "workers killed, respawned on the next call)")
                raise WorldError(
                    f"{what}: timed out after {timeout:.0f} s waiting for rank(s) {missing}; "
                    "workers killed (respawned on the next call).")
            try:
                rank, status, payload = self._res_q.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs)
                        if not p.is_alive() and r not in got]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    # Give the others a moment to report their own errors.
                    _drain(self._res_q, got, 2.0)
                    detail = _format_failures(what, {r: v for r, (s, v) in got.items() if s not in ("ok", "ready")})
                    raise WorldError(f"{what}: worker rank(s) died, exit codes {codes}\n{detail}")
                continue
            got[rank] = (status, payload)
            if status not in ("ok", "ready") and len(got) < self.world_size:
                # One rank failed: the others may be stuck in a collective
                # with it; give them a short grace period, not the timeout.
                grace_end = time.monotonic() + FAILURE_GRACE_S
                deadline = min(deadline, grace_end)
        return got


def _drain(q, got, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            rank, status, payload = q.get(timeout=0.2)
            got[rank] = (status, payload)
        except queue.Empty:
            pass
        except Exception:
            return


def _format_failures(what: str, failures: dict) -> str:
    parts = [f"{what} failed on rank(s) {sorted(failures)}:"]
    for r in sorted(failures):
        parts.append(f"----- rank {r} -----\n{failures[r]}")
    return "\n".join(parts)


def _restore_env(key, old):
    if old is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = old


@contextlib.contextmanager
def setting(name: str, value):
    """Environment variable ``name`` set to ``value`` (None: unset) in this
    process, fastddp's settings re-read, both restored after (use inside a
    rank worker; the pytest process has monkeypatch)."""
    from fastddp import settings

    old = os.environ.get(name)
    _restore_env(name, None if value is None else str(value))
    settings.reload()
    try:
        yield
    finally:
        _restore_env(name, old)
        settings.reload()


# --------------------------------------------------------------------------
# fixtures (import them into a test module: ``from tests._dist import world2``)
# --------------------------------------------------------------------------

#: the session's workers, one World per (world size, environment)
_shared: dict = {}


#: variables that say where pytest is, not what a worker should see
_NOT_THE_WORKERS = ("PYTEST_CURRENT_TEST",)


def _worker_environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _NOT_THE_WORKERS}


def _environment_key() -> tuple:
    return tuple(sorted(_worker_environment().items()))


def shared_world(world_size: int) -> World:
    """This session's workers for ``world_size`` ranks under the current
    environment (started on their first ``run``, stopped by
    :func:`close_shared_worlds`)."""
    key = (world_size, _environment_key())
    w = _shared.get(key)
    if w is None:
        w = _shared[key] = World(world_size)
    return w


def close_shared_worlds() -> None:
    """Stop every shared world (tests/conftest.py: at the session's end)."""
    worlds = list(_shared.values())
    _shared.clear()
    for w in worlds:
        w.close()
        shutil.rmtree(w._tmpdir, ignore_errors=True)


def _world_fixture(world_size):
    @pytest.fixture(scope="module")
    def _fixture():
        yield shared_world(world_size)
    _fixture.__name__ = f"world{world_size}"
    return _fixture


world2 = _world_fixture(2)
world3 = _world_fixture(3)


# --------------------------------------------------------------------------
# single-process helpers (a 1-rank gloo group inside the pytest process)
# --------------------------------------------------------------------------

class single_rank_group:
    """Context manager: a 1-rank gloo default process group in this process.

    Destroys it on exit (also on error) so it never leaks into other tests.
    """

    def __init__(self, tmpdir=None):
        self._tmpdir = tmpdir
        self._made = None  # the folder this group made for its init file (removed on exit)

    def __enter__(self):
        import torch.distributed as dist
        if dist.is_initialized():
            raise RuntimeError("a default process group is already initialised in the test process")
        if self._tmpdir is None:
            self._made = d = tempfile.mkdtemp(prefix="fastddp-pg1-")
        else:
            d = str(self._tmpdir)
        path = os.path.join(d, f"pg1-{os.getpid()}-{time.monotonic_ns()}")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        return dist.group.WORLD

    def __exit__(self, *exc):
        import torch.distributed as dist
        if dist.is_initialized():
            # A gloo group is destroyed where its last reference goes, often
            # a torch DDP's C++ Reducer freed when the test returns, with the
            # GIL held; the group's destructor joins gloo's worker threads.
            # A worker still freeing a finished Work whose captured thread-
            # local state holds a Python object needs the GIL for that: a
            # deadlock (seen once: CI hung in a torch-batched test). So let
            # every Work run (barrier) and the workers free them (the GIL
            # released) before any destructor can join them.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a broken group is destroyed anyway
                pass
            gc.collect()
            time.sleep(0.05)
            dist.destroy_process_group()
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            self._made = None
        return False


def backward_with_sync_triggered(ddp, loss) -> None:
    """``loss.backward()`` reduced although its forward ran under
    ``no_sync()``, the way ``Accelerator.trigger_sync_in_backward`` forces it:
    ``require_backward_grad_sync = True`` and ``reducer.prepare_for_backward([])``."""
    ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])
    try:
        loss.backward()
    finally:
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = False
