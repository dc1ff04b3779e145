"""``auto_precision_hook``: the wire format chosen from measured steps.

One bucket mode that owns the allowed formats' modes (built as
:func:`~fastddp.reduction.choose` builds them for their own hooks) and
hands every call to the one in use.  It decides and switches only at the
forward boundary (:meth:`AutoPrecision.boundary`: the synchronising forward
of ``ctx.iteration``, where the bucket tuner decides too), which every rank
reaches at the same point, never inside a pack; the format of iteration
``i + 1`` is fixed at iteration ``i``'s boundary, so the native hooks' early
copy, armed before ``i + 1``'s backward, follows the format that will pack
it::

    waiting   until torch's one bucket rebuild is done (``ctx.rebuilt``), in the
              most precise format; bucket_cap_mb="auto" (asked for, or turned
              on by ``tune_buckets`` where the caps are torch's default) waits
              for the choice and then tunes the layout for the chosen format
    trial     one warm-up round, then paired rounds (every format one step,
              order rotated); each round's times MAX-reduced over the ranks
              (one all-reduce, at the same iteration on every rank) into
              :class:`~fastddp.autotune.precision.PrecisionSearch`
    settled   the pick; every ``watch_steps`` steps one all-reduce of the
              window's median step, issued without waiting and read at the
              next iteration, into :class:`~fastddp.autotune.precision.Watch`;
              a sustained change starts the trial again (bounded); no window
              while bucket_cap_mb="auto" tries layouts (a new baseline after)
    frozen    join(): no collectives of its own any more

A step's time is its reduction window: the first bucket's pack to the last
bucket's unpack (what a wire format changes; forward, optimizer and
``no_sync`` micro-batches are outside it).  CPU: ``time.perf_counter``.
CUDA: two timing events on the stream that packs and unpacks, read two
iterations later.  The host never waits for the device once settled: the
watch reads an event only if ``query()`` says it has completed (a window
still queued is left out, as a missing step), and the decisions' few floats
are MAX-reduced on a gloo group of the same ranks (made once, at
registration), host memory to host memory, not on NCCL with a copy back.
The trial, a tuning phase of a few dozen steps like the bucket tuner's
probes, waits for its events (``synchronize``) so that no round is lost.
A group that is not the whole world cannot get a gloo twin (``new_group``
needs every rank of the world): its decisions go over NCCL and copy to the
host, one wait per round or window, and ``stats()`` says so.
"""

from __future__ import annotations

import logging
import math
import statistics

from ..autotune.phase import Phase
from ..autotune.precision import PrecisionSearch, Watch, rotation
from .kinds import Kind
from .base import Reduction
from .handover import ResidualHandover
from .stepclock import StepClock, decision_group, max_over_ranks, max_over_ranks_later

__all__ = ["ORDER", "LOWEST_INDEX", "AutoPrecision"]

log = logging.getLogger("fastddp.autotune")

#: every format, most precise first (a flat format before its hierarchical form)
ORDER = ("fp32", "hier-fp32", "bf16", "hier-bf16", "fp8", "hier-fp8")
LOWEST_INDEX = {"fp32": 2, "bf16": 4, "fp8": 6}  # formats allowed for each ``lowest``: ORDER[:n]
_WAIT, _TRIAL, _SETTLED, _FROZEN = Phase.WAITING, Phase.TRIAL, Phase.SETTLED, Phase.FROZEN


class AutoPrecision(Reduction):
    """The allowed formats' modes, one at a time (see the module docstring).
    ``label``: what it chooses (its stats key, its log lines); ``differs``:
    whether a bucket would be reduced differently by the candidates (given,
    a plan where none is settles on the first without a trial)."""

    kind = Kind.AUTO
    fused = True

    def __init__(self, state, modes: dict, device=None, where: str = "", label: str = "auto_precision",
                 differs=None):
        self.state, self.modes, self.formats, self.where = state, modes, list(modes), where
        self.label, self._differs = label, differs
        self._looked, self._seen_differ = None, False  # the iteration whose packs tell whether a bucket differs
        self.cur_name = self.next_name = self.formats[0]
        self.clock = StepClock(device, state.clock)
        # auto precision times the reduction window; another choice (in place) moves work before the
        # first pack (the early copies), so it times from the synced forward (``ctx.forward_at``)
        self._from_forward = label != "auto_precision"
        single = len(self.formats) == 1
        self.phase = _SETTLED if single else _WAIT
        self.watch = Watch() if state.watch and not single else None
        self.search: PrecisionSearch | None = None
        self.samples: dict = {}      # iteration -> (format, s), read from the clock
        self._it = 0                 # the iteration whose packs run now
        self._clock_due = None       # (iteration, format): its window starts at its first pack
        self._t0 = 0                 # first iteration of the trial
        self._reduced = 0            # trial rounds all-reduced so far
        self._win0 = self._wins = 0  # first watched iteration, windows all-reduced
        self._window = None          # the last window's MAX in flight: read at the next iteration
        self._watching = False       # settled and the layout still: windows are timed and read
        self._trigger = ""
        self._restart = False
        self._prepared = None        # the bucket whose pack_native declined: its pack() is next
        self.residuals = ResidualHandover()  # error feedback across a change of format
        self._rank = 0
        self.decisions: list = []
        self.layout_epoch = 0
        self.settled_at = None if not single else 0
        self.trial_steps = 0
        self.side, self.decided_on = decision_group(None, None)  # the host default; build() sets CUDA's

    cur = property(lambda self: self.modes[self.cur_name], doc="The mode that packs this iteration.")
    measuring = property(lambda self: self.phase.measuring,
                         doc="Waiting for its trial or in it: bucket_cap_mb='auto' waits until it is done.")
    tunes_buckets = property(lambda self: self.state.tune_buckets)
    scaling = property(lambda self: self.cur.scaling)
    wire_dtype = property(lambda self: self.cur.wire_dtype)

    def candidate(self, name: str) -> Reduction:
        """The mode of format ``name`` (one of :attr:`formats`)."""
        return self.modes[name]

    def steady(self, ctx) -> Reduction | None:
        """The candidate ``ctx``'s buckets go to where nothing of this mode's own runs around them (settled,
        unwatched, untimed, no switch or residual pending): the native issue chain may run it; else None."""
        idle = self._clock_due is None and not self.residuals.pending and ctx.iteration not in self.clock.marks
        ok = self.phase == _SETTLED and self.watch is None and self._it == ctx.iteration
        return self.cur if ok and idle and self.next_name == self.cur_name else None

    # -------------------------------------------------------- delegation
    def boundary(self, ctx) -> None:
        """The synchronising forward of ``ctx.iteration``: every decision of
        this mode is made here, where the bucket tuner makes its own (never
        inside a pack, mid-backward)."""
        if ctx.iteration != self._it:
            self._enter(ctx)

    def pack_native(self, ctx, bucket) -> bool:
        self._before_pack(ctx, bucket)
        self._prepared = None if self.cur.pack_native(ctx, bucket) else bucket.index  # else pack() follows
        return self._prepared is None

    def pack(self, ctx, bucket, grads) -> None:
        if self._prepared != bucket.index:  # called alone (a mode driven directly, delay_all_reduce)
            self._before_pack(ctx, bucket)
        self._prepared = None
        self.cur.pack(ctx, bucket, grads)

    def _before_pack(self, ctx, bucket) -> None:
        if ctx.iteration != self._it:  # a caller that runs no forward boundary (a mode driven directly)
            self._enter(ctx)
        if self._clock_due is not None:
            self.clock.start(*self._clock_due)  # the reduction window starts at the first pack
            self._clock_due = None
        if self._looked == ctx.iteration and self.phase == _WAIT and not self._seen_differ:
            self._seen_differ = self._differs(ctx, bucket)
        self.residuals.before_pack(ctx, bucket, self.cur, self.cur_name)

    def issue(self, ctx, bucket):
        return self.cur.issue(ctx, bucket)

    def unpack(self, ctx, bucket, result, track_unused: bool) -> None:
        self.cur.unpack(ctx, bucket, result, track_unused)
        self.clock.end(ctx.iteration)

    def check_result(self, bucket, result) -> None:
        self.cur.check_result(bucket, result)

    def shadow(self, ctx, bucket):
        if self.next_name != self.cur_name:  # a joined rank packs nothing: it switches here
            self._switch(ctx.iteration)
        return self.cur.shadow(ctx, bucket)

    def early_copy(self, world: int):
        return self.modes[self.next_name].early_copy(world)  # armed before the next iteration's packs

    views_key = property(lambda self: self.next_name, doc="The early copy's views follow the next format.")

    def in_place(self, ctx, bucket) -> frozenset:
        return self.modes[self.next_name].in_place(ctx, bucket)  # armed before the next iteration's packs

    def residual_of(self, bucket_index: int):
        return self.residuals.residual_of(bucket_index, self.cur)

    def carry_over(self, old_buckets, old_locate, new_buckets) -> None:
        """Every candidate moves its own state; a trial restarts (its steps
        timed other buckets), a settled watch takes a new baseline."""
        for m in self.modes.values():
            m.carry_over(old_buckets, old_locate, new_buckets)
        self.residuals.rebuilt(self._it)
        self._restart = True
        self._looked, self._seen_differ = None, False  # the new plan is looked at afresh

    # ----------------------------------------------------------- steps
    def _enter(self, ctx) -> None:
        """The boundary of iteration ``ctx.iteration``: switch to the format
        fixed for it, read finished windows, decide the next one, time it."""
        it = self._it = ctx.iteration
        self._rank = ctx.rank
        if self.next_name != self.cur_name:
            self._switch(it)
        self.samples.update(self.clock.take(it, wait=self.phase == _TRIAL))
        if self._restart:
            self._restart = False
            self.samples.clear()
            if self.phase == _TRIAL:
                self._begin_trial(it + 1, self._trigger + "; restarted: the buckets were rebuilt")
            elif self.phase == _SETTLED and self.watch is not None:
                self._drop_window()
                self._watching = False  # a new baseline from here (or once the layout settles)
        if self.phase == _WAIT and ctx.rebuilt and self._differs is not None and self._looked is None:
            self._looked = it  # this iteration's packs (the final plan's) tell whether a trial can tell anything
        elif self.phase == _WAIT and ctx.rebuilt and self._differs is not None and not self._seen_differ:
            self.phase, self.settled_at = _SETTLED, it  # every bucket the same whichever: nothing to measure
            self.decisions.append({"step": it, "chosen": self.cur_name, "trigger": "first measurement",
                                   "rounds": 0, "reason": "no bucket is reduced differently by the candidates"})
        elif self.phase == _WAIT and ctx.rebuilt:
            self._begin_trial(it + 1, "first measurement")
        elif self.phase == _TRIAL:
            self._trial(ctx, it)
        elif self.phase == _SETTLED and self.watch is not None:
            self._watch_if_still(ctx, it)
        if self.phase == _TRIAL:
            self.next_name = self._scheduled(it + 1)
        if self.phase == _TRIAL or (self.phase == _SETTLED and self._watching and not self.watch.exhausted):
            if self._from_forward:  # timed only where a window is read
                self.clock.start(it, self.cur_name, ctx.forward_at)
            else:
                self._clock_due = (it, self.cur_name)

    def _watch_if_still(self, ctx, it: int) -> None:
        """The watch runs while the layout holds still: bucket_cap_mb="auto"
        tries layouts after the format is chosen, and its steps are not the
        link's.  It starts afresh (a new baseline) once the layout settles."""
        if not ctx.layout_settled:
            if self._watching:
                self._drop_window()
                self._watching = False
            return
        if not self._watching:
            self._watching = True
            self.samples.clear()
            self.watch.restart()
            self._win0, self._wins = it + 1, 0
        self._watch(ctx, it)

    def _scheduled(self, it: int) -> str:
        """The trial's format for iteration ``it``: a warm-up round, then rotated rounds."""
        j, n = it - self._t0, len(self.formats)
        if j < 0:
            return self.cur_name
        if j < n:
            return self.formats[j]
        r, p = divmod(j - n, n)
        return rotation(self.formats, r)[p]

    def _begin_trial(self, t0: int, why: str) -> None:
        st = self.state
        self.search = PrecisionSearch(self.formats, min_rounds=st.min_rounds, max_rounds=st.max_rounds)
        self.phase, self._t0, self._reduced, self._trigger = _TRIAL, t0, 0, why
        self.samples.clear()

    def _trial(self, ctx, it: int) -> None:
        n = len(self.formats)
        while True:
            first = self._t0 + n + self._reduced * n
            if first + n - 1 > it - self.clock.lag:
                return
            order = rotation(self.formats, self._reduced)
            vals = []
            for f in self.formats:
                got = self.samples.pop(first + order.index(f), None)
                vals.append(got[1] if got is not None and got[0] == f else math.inf)
            vals = max_over_ranks(ctx, self.side, vals)
            self.search.record(dict(zip(self.formats, vals)))
            self._reduced += 1
            # rounds dropped for missing steps do not count: bound the trial all the same
            if self.search.done or self._reduced >= 2 * self.search.limit:
                self._settle(it)
                return

    def _settle(self, it: int) -> None:
        s = self.search
        pick, _, steps = s.walk()
        if self.decisions and pick != self.decisions[-1]["chosen"]:
            self.layout_epoch += 1  # another wire: a layout tuned for the old one is tuned again
        self.next_name, self.phase, self.settled_at = pick, _SETTLED, it + 1
        self.trial_steps += it + 1 - self._t0
        self.decisions.append({"step": it + 1, "chosen": pick, "trigger": self._trigger, "rounds": s.rounds,
                               "trial_from_step": self._t0, "trial_steps": it + 1 - self._t0,
                               "dropped_rounds": s.dropped, "costs_ms": s.costs_ms(), "comparisons": steps,
                               "reason": s.explain()})
        self.samples.clear()
        if self.watch is not None:
            self.watch.restart()
            self._win0, self._wins, self._watching = it + 1, 0, True
        self._log(f"chose {s.explain()}; trial of {it + 1 - self._t0} steps ({self._trigger}); from step {it + 1}")

    def _watch(self, ctx, it: int) -> None:
        if self._window is not None:  # the window MAX-reduced at the last read: complete by now
            v, self._window = self._window()[0], None
            base = self.watch.baseline
            if self.watch.feed(v):
                k = self.state.watch_steps
                self._begin_trial(it + 1, f"re-measure {self.watch.remeasures}: the step moved to "
                                          f"{v * 1e3:.2f} ms from {base * 1e3:.2f} ms for "
                                          f"{self.watch.sustain} windows of {k} steps")
                return
        if self.watch.exhausted:
            return
        k = self.state.watch_steps
        w0 = self._win0 + self._wins * k
        if w0 + k - 1 > it - self.clock.lag:
            return
        vals = [self.samples.pop(i)[1] for i in range(w0, w0 + k) if i in self.samples]
        for i in [i for i in self.samples if i < w0 + k]:
            del self.samples[i]
        self._window = max_over_ranks_later(ctx, self.side, [statistics.median(vals) if vals else math.inf])
        self._wins += 1

    def _drop_window(self) -> None:
        """A window in flight whose value no longer counts (the watch starts
        again): completed and dropped, on every rank alike."""
        if self._window is not None:
            self._window()
            self._window = None

    def _switch(self, it: int) -> None:
        """Make :attr:`next_name` current; the residuals follow as
        :class:`~.handover.ResidualHandover` says."""
        self.residuals.switch(it, self.cur, self.modes[self.next_name], self.cur_name, self.next_name,
                              trial=self.phase == _TRIAL)
        self.cur_name = self.next_name

    def freeze(self, why: str) -> None:
        """join(): the best format measured so far (else the most precise),
        from the next iteration on; no more collectives of its own."""
        if self.phase == _FROZEN:
            return
        self._drop_window()
        if self.phase in (_WAIT, _TRIAL):
            s = self.search
            self.next_name = s.pick() if s is not None and s.rounds else self.formats[0]
            self.decisions.append({"step": self._it + 1, "chosen": self.next_name, "trigger": f"{why} froze it",
                                   "rounds": s.rounds if s else 0, "reason": s.explain() if s and s.rounds
                                   else "nothing measured: the most precise format"})
            self._log(f"{why} froze the choice at {self.next_name}")
        self.phase = _FROZEN

    # ------------------------------------------------------------ report
    def _log(self, text: str) -> None:
        if self._rank == 0:
            log.info("fastddp %s: %s", self.label.replace("_", " "), text)

    def stats(self) -> dict:
        s = self.search
        return {self.label: {
            "state": self.phase.value, "measuring": self.phase.measuring, "current": self.cur_name,
            "chosen": self.next_name if self.phase in (_SETTLED, _FROZEN) else None,
            "candidates": list(self.formats), "lowest": self.state.lowest,
            "error_feedback": self.state.error_feedback, "tune_buckets": self.state.tune_buckets,
            "topology": self.where,
            "settled_at_step": self.settled_at, "trial_steps": self.trial_steps,
            "decisions": list(self.decisions), "residual": list(self.residuals.events),
            "watch": self.watch.report() if self.watch is not None else None,
            "decided_on": self.decided_on, "windows_not_ready": self.clock.not_ready,
            "trial": None if s is None else {"rounds": s.rounds, "costs_ms": s.costs_ms(),
                                             "comparisons": s.walk()[2]},
        }}
