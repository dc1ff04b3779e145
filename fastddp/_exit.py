"""A clean interpreter exit while communication threads still hold Python objects.

The abort this prevents (``terminate called without an active exception`` on a
rank after the script's last line, exit status -6) has two causes, each read
from a core dump; in both a thread of the process group releases, after the
waiting main thread has been woken, an object whose release takes the GIL:

* a comm hook's ``Future.then`` callback is owned by C++
  (``torch::jit::PythonFunctionGuard``) and is released on the thread that
  completed the future -- for gloo, one of the process group's worker
  threads -- *after* the future is marked complete;
* a finished collective (``AsyncWork``) holds its tensors, and gloo's worker
  drops its reference only after marking the work complete.  A ``barrier``
  also holds the works that were in flight when it was issued: a training
  script's ``dist.all_reduce(total); dist.barrier()``, then its return, left
  the all-reduce's tensor, whose Python object had meanwhile been freed by
  the main thread (so that the tensor now owns it), to be released by
  ``~AsyncBarrierWork`` on the worker thread, which takes the GIL to drop it
  (``TensorImpl::decref_pyobject``).  On a 2-core VM like CI's, 5 of 125
  two-rank runs of ``examples/train.py`` (fastddp's default path, with
  ``destroy_process_group``: the DDP module still holds the group) aborted so.

The main thread, woken by the completion, can run on to the end of the script
and into interpreter finalisation first; from then on CPython ends any other
thread that asks for the GIL with ``pthread_exit``, whose forced unwind passes
through a ``noexcept`` destructor, and the C++ runtime calls
``std::terminate``.  torch's own DDP does the same (it is torch's code path);
nothing in a hook or the reducer can order those releases before the wake-up.

What can be ordered is the exit: atexit handlers run before finalisation starts,
while every thread may still take the GIL.  :func:`drain` (registered once,
by :func:`install`, which every ``DistributedDataParallel`` construction
calls) releases the GIL in short sleeps until
no other thread of the process has been runnable for several consecutive
samples of ``/proc/self/task/*/stat`` -- a thread waiting for the GIL is woken
by every sleep, so it cannot stay asleep while the GIL is free -- and no thread
that ``threading`` did not start is inside Python code (a callback that waits
with the GIL released, say for another collective), or a bounded time has
passed (spinning OpenMP workers keep a thread runnable; then the wait ends at
the bound).  Cost: about 10 ms at exit on an idle process, never more
than ``FASTDDP_EXIT_DRAIN_S`` (default 0.5 s).  Where ``/proc`` is not
available the sleep runs for a fixed 50 ms instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from . import settings

_QUIET_SAMPLES = 5  # consecutive samples with no other thread runnable
_SAMPLE_S = 0.002
_FALLBACK_S = 0.05
_installed = False
_lock = threading.Lock()


def _other_threads_runnable(me: int) -> bool | None:
    """True if a thread of this process other than ``me`` is running or runnable;
    None if ``/proc`` cannot tell."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended between listdir and open
            continue
        # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'
        end = stat.rfind(b")")
        if stat[end + 2:end + 3] == b"R":
            return True
    return False


def _foreign_thread_in_python() -> bool:
    """True if a thread that ``threading`` did not start (a communication
    library's worker running a callback) is inside Python code, e.g. a hook
    callback waiting with the GIL released: it will want the GIL back."""
    own = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    return any(ident not in own for ident in sys._current_frames())


def drain(budget_s: float | None = None) -> str:
    """Let other threads finish what needs the GIL before finalisation.

    Returns how it ended ("quiet", "budget" or "fallback"), for tests and
    debugging.
    """
    budget = settings.get().exit_drain_s if budget_s is None else budget_s
    if budget <= 0:
        return "budget"
    me = threading.get_native_id()
    deadline = time.monotonic() + budget
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(_SAMPLE_S)  # the GIL is free while sleeping: a waiting thread takes it
        busy = _other_threads_runnable(me)
        if busy is None:
            time.sleep(max(0.0, min(_FALLBACK_S, deadline - time.monotonic())))
            return "fallback"
        quiet = 0 if busy or _foreign_thread_in_python() else quiet + 1
        if quiet >= _QUIET_SAMPLES:
            return "quiet"
    return "budget"


def install() -> None:
    """Register :func:`drain` to run at exit (once per process).  Reads
    ``FASTDDP_EXIT_DRAIN_S`` now, so that a bad value fails here, not at exit."""
    global _installed
    settings.get()
    with _lock:
        if _installed:
            return
        atexit.register(drain)
        _installed = True


def installed() -> bool:
    """Whether :func:`install` has registered the drain in this process."""
    return _installed
