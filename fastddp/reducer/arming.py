"""Arming: which readiness hooks run in an iteration, and the hooks themselves.

One readiness hook per parameter: the native countdown
(:mod:`fastddp._native`, a C++ post hook on each AccumulateGrad, as torch's
reducer has) where it builds, else Python post-accumulate hooks.  Each
iteration this module alone decides how they run (:class:`HookMode`):

* ``FAST`` -- nothing is tracked: the native countdown counts each bucket
  down and calls Python once per bucket (on the CPU it may also copy each
  gradient into its bucket slot as it arrives: the early copy);
* ``PY``   -- every hook calls Python (unused parameters, static graph, the
  rebuild's ready order, debug checks, a second backward, the bucket tuner);
* ``IDLE`` -- no_sync backwards that track nothing: the hooks do nothing.
"""

from __future__ import annotations

import enum

import torch

from .. import _native, compile as _compile, kernels
from .chain import IssueChain

__all__ = ["HookMode", "Arming", "EARLY_COPY_MIN_NUMEL"]


EARLY_COPY_MIN_NUMEL = 16384
"""On the CPU, a bucket whose tensors hold at least this many elements on
average (64 KiB of fp32) has each gradient copied into it as it arrives;
smaller ones keep the one pack (world 1, 600 tensors of 16 KiB: 0.95-0.98x
torch's view path with early copies, 0.89 without)."""


class HookMode(enum.IntEnum):
    """How the readiness hooks run this iteration (the native module's modes)."""

    PY = _native.PY
    FAST = _native.FAST
    IDLE = _native.IDLE


def native_slots_ok(bucket) -> bool:
    """The native data path serves the bucket (``Countdown.pack``): dense,
    real fp32/fp64 on the CPU with the plain-torch kernels (not the Triton
    interpreter), the parameters of the bucket's dtype, the views tiling the
    flat buffer (what the Python pack's one op on the whole buffer needs)."""
    if bucket.sparse or bucket.complex or bucket.flat.device.type != "cpu":
        return False
    if bucket.flat.dtype not in (torch.float32, torch.float64) or kernels.backend(bucket.flat.device) != "reference":
        return False
    lay = bucket.layout
    return lay.dense and lay.total == bucket.flat.numel() and all(p.dtype == bucket.flat.dtype for p in bucket.params)


def _py_hook(body, index: int):
    def hook(_param):
        body(index)
    return _compile.eager(hook)  # compiled autograd: called eagerly, in place


def _ca_hook(body, index: int):
    def hook(_grad_inputs, _grad_outputs):  # compiled autograd's node post hook
        body(index)
    return _compile.eager(hook)


class Arming:
    """The readiness hooks of one reducer and their mode per iteration.

    ``body(index)``: a parameter's hook in Python; ``on_bucket(b)``: the native
    countdown finished bucket ``b``; ``on_twice(index)``: the native
    countdown saw a parameter marked twice.  The reducer passes these through
    weak references (the C++ side holds them: no cycle back to it)."""

    def __init__(self, params, body, on_bucket, on_twice):
        self.fast = False  # armed, nothing tracked: the Python hooks skip the lock
        self.handles: list = []
        self.native = None
        self._views, self._any = None, False  # the early copy's views (None: find them again)
        self._views_key = None  # the mode's views_key they were found for
        self.chain, self.chaining = None, False  # the native issue chain; armed this iteration
        mod = _native.countdown_module()
        if mod is None:
            self.handles = [p.register_post_accumulate_grad_hook(_py_hook(body, i))
                            for i, p in enumerate(params)]
            return

        def on_hook(index: int, twice: bool) -> None:
            on_twice(index) if twice else body(index)

        self.native = mod.Countdown(params, on_bucket, on_hook, [_ca_hook(body, i) for i in range(len(params))])

    # ----------------------------------------------------------- per plan
    def set_buckets(self, bucket_of: list[int], buckets):
        """A new plan: parameter ``i`` counts down bucket ``bucket_of[i]``;
        the native data path gets the slots of the buckets it can serve.
        Returns the native module where it serves one (the step context's
        ``native``), else None: no call per bucket where it serves none (a GPU)."""
        self.forget_views()
        if self.native is None:
            return None
        self.native.set_buckets(bucket_of)
        self.native.clear_slots(len(buckets))
        served = [b for b in buckets if native_slots_ok(b)]
        for b in served:
            self.native.set_slots(b.index, b.indices, b.views, b.flat)
        return self.native if served else None

    def forget_views(self) -> None:
        """The buckets or their mode changed: the early copy's views are found again at the next arm."""
        self._views, self._any = None, False

    # ------------------------------------------------------ per iteration
    def arm(self, ready, buckets, mode, ctx, *, debug: bool, probe: bool, join_pending: bool,
            world: int, view_mode: bool, timed: bool = False) -> None:
        """Before a synced backward: FAST where nothing is tracked, else PY
        (and the native hooks follow replaced nodes: :meth:`refresh`).
        ``timed``: the bucket tuner times this step's issue (no issue chain,
        whose Python runs after the waits)."""
        self.fast = not (ready.track_used or ready.static or ready.unused or ready.collect_order or debug)
        if self.native is None:
            return
        fast = self.fast and not probe
        early, divide = self._early(buckets, mode, ctx, join_pending, world) if fast else (-1.0, 0.0)
        chain = (self.chain.decide(buckets, mode, ctx, fast=fast and not timed, join_pending=join_pending)
                 if self.chain is not None else (False, 0, 1.0))
        # (and refresh(): the nodes this forward's graph holds); a grad that is its view already is
        # divided by W in place as it arrives where the mode multiplies (torch's per-view div_)
        self.native.arm(HookMode.FAST if fast else HookMode.PY, [b.size for b in buckets], early, divide,
                        view_mode, *chain, True, float(world) if early > 0 and divide <= 0 else 0.0)
        self.chaining = chain[0]

    def attach_chain(self, pg, on_chain) -> None:
        """The native issue chain (:mod:`.chain`) on ``pg``; ``on_chain(b)``:
        the reducer takes the iteration over."""
        if self.native is not None:
            self.chain = IssueChain(self.native, pg, on_chain)

    def _early(self, buckets, mode, ctx, join_pending: bool, world: int) -> tuple[float, float]:
        """The native hooks' early copy this iteration (on the CPU, where the
        mode allows it): each gradient goes into its bucket slot as it
        arrives, scaled as the mode's pack would, read while still in cache
        instead of by the bucket's one pack after the last gradient; with
        gradient_as_bucket_view the fresh gradient is then freed (``.grad``
        becomes the view), as torch's.  On a GPU the one fused pack launch is
        the point and nothing is copied early.  Returns ``(early, divide)``
        for ``Countdown.arm`` (early -1: none, 0: a plain copy, else the
        scale; divide > 0: divide by it instead)."""
        if self._views is None or self._views_key != mode.views_key:
            self._views, self._views_key = self._find_views(buckets, mode, ctx, world), mode.views_key
            self._any = any(v is not None for v in self._views)
            self.native.set_views(self._views)
        if not self._any or join_pending:
            return -1.0, 0.0  # join's divisor is known only after its forward all-reduce
        return mode.early_copy(world) or (-1.0, 0.0)  # a mode may copy early in some iterations only

    @staticmethod
    def _find_views(buckets, mode, ctx, world: int) -> list:
        views: list = [None] * sum(b.size for b in buckets)
        if mode.early_copy(world) is None:
            return views
        for b in buckets:
            if (not b.sparse and not b.complex and b.flat.device.type == "cpu"
                    and b.flat.numel() >= EARLY_COPY_MIN_NUMEL * b.size):
                own = mode.in_place(ctx, b)  # reduced where they are: no copy
                for k, (i, p, v) in enumerate(zip(b.indices, b.params, b.views)):  # (= grad_views: not complex)
                    views[i] = v if v.dtype == p.dtype and k not in own else None
        return views

    def every_hook(self) -> None:
        """Every hook to Python until the next arm (a second backward, an error)."""
        self.fast = False
        if self.native is not None:
            self.native.set_mode(HookMode.PY)

    def finished(self, idle: bool) -> None:
        """The iteration is reduced (or none has run yet: the reducer is
        new): until the next armed forward, hooks that track nothing
        (``idle``) skip Python, so no_sync() steps before the first synced
        one cost no Python call per gradient either (torch's hook returns at
        once there too)."""
        self.fast = False
        if self.native is not None:
            self.native.set_mode(HookMode.IDLE if idle else HookMode.PY)

    # ------------------------------------------------------------- marks
    def counting(self) -> bool:
        """The native countdown holds this iteration's marks."""
        return self.native is not None and self.native.mode() == HookMode.FAST

    def marks(self) -> bytearray:
        return bytearray(self.native.marked())

    @property
    def early_any(self) -> bool:
        """Some bucket takes the early copy (found at the last arm)."""
        return self._any

    def filled(self, b: int) -> int:
        """How many of bucket ``b``'s grads the early copy put in place."""
        return self.native.filled(b) if self._any else 0

    def early_filled(self, bucket) -> bytes:
        """Per position in ``bucket``: its grad was copied early this iteration."""
        marks = self.native.filled_marks()
        return bytes(marks[i] for i in bucket.indices)

    # ---------------------------------------------------------- lifetime
    def refresh(self) -> int:
        """After each forward: the native hooks follow AccumulateGrad nodes
        that torch replaced (a parameter's data changed dtype or device);
        Python's post-accumulate hooks live on the tensor and need nothing.
        Returns how many moved."""
        return self.native.refresh() if self.native is not None else 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.native is not None:
            self.native.remove()
