"""``auto_precision_hook``: the wire format chosen from measured steps.

One bucket mode that owns the allowed formats' modes (built as
:func:`~fastddp.reduction.choose` builds them for their own hooks) and
hands every call to the one in use.  It decides and switches only at the
forward boundary (:meth:`AutoPrecision.boundary`: the synchronising forward
of ``ctx.iteration``, where the bucket tuner decides too), which every rank
reaches at the same point, never inside a pack; the format of iteration
``i + 1`` is fixed at iteration ``i``'s boundary, so the native hooks' early
copy, armed before ``i + 1``'s backward, follows the format that will pack
it.  When it measures and what it picks is a part of its own,
:class:`~.schedule.ChoiceSchedule`, through these phases::

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

from ..autotune.phase import Phase
from .base import Reduction
from .handover import ResidualHandover
from .kinds import Kind
from .schedule import ChoiceSchedule
from .stepclock import StepClock, decision_group

__all__ = ["ORDER", "LOWEST_INDEX", "AutoPrecision"]

#: every format, most precise first (a flat format before its hierarchical form)
ORDER = ("fp32", "hier-fp32", "bf16", "hier-bf16", "fp8", "hier-fp8")
LOWEST_INDEX = {"fp32": 2, "bf16": 4, "fp8": 6}  # formats allowed for each ``lowest``: ORDER[:n]


class AutoPrecision(Reduction):
    """The allowed formats' modes, one at a time (see the module docstring):
    this mode hands every call to the candidate in use and switches at the
    boundary; when to measure and what to pick is its
    :class:`~.schedule.ChoiceSchedule`.  ``label``: what it chooses (its
    stats key, its log lines); ``differs``: whether a bucket would be reduced
    differently by the candidates (given, a plan where none is settles on the
    first without a trial)."""

    kind = Kind.AUTO
    fused = True

    def __init__(self, state, modes: dict, device=None, where: str = "", label: str = "auto_precision",
                 differs=None):
        self.state, self.modes, self.formats, self.where = state, modes, list(modes), where
        self.label = label
        self.cur_name = self.next_name = self.formats[0]
        self.clock = StepClock(device, state.clock)
        self.schedule = ChoiceSchedule(state, self.formats, self.clock, label, differs)
        # auto precision times the reduction window; another choice (in place) moves work before the
        # first pack (the early copies), so it times from the synced forward (``ctx.forward_at``)
        self._from_forward = label != "auto_precision"
        self._it = 0                 # the iteration whose packs run now
        self._clock_due = None       # (iteration, format): its window starts at its first pack
        self._prepared = None        # the bucket whose pack_native declined: its pack() is next
        self.residuals = ResidualHandover()  # error feedback across a change of format
        self.side, self.decided_on = decision_group(None, None)  # the host default; build() sets CUDA's

    cur = property(lambda self: self.modes[self.cur_name], doc="The mode that packs this iteration.")
    phase = property(lambda self: self.schedule.phase)
    measuring = property(lambda self: self.schedule.phase.measuring,
                         doc="Waiting for its trial or in it: bucket_cap_mb='auto' waits until it is done.")
    layout_epoch = property(lambda self: self.schedule.layout_epoch,
                            doc="Bumped when a re-measure picks another wire (a layout tuned for the old is tuned again).")
    tunes_buckets = property(lambda self: self.state.tune_buckets)
    scaling = property(lambda self: self.cur.scaling)
    wire_dtype = property(lambda self: self.cur.wire_dtype)

    @property
    def side(self):
        """The decision group the schedule MAX-reduces on (stepclock.decision_group)."""
        return self.schedule.side

    @side.setter
    def side(self, group) -> None:
        self.schedule.side = group

    @property
    def decided_on(self) -> str:
        return self.schedule.decided_on

    @decided_on.setter
    def decided_on(self, where: str) -> None:
        self.schedule.decided_on = where

    def candidate(self, name: str) -> Reduction:
        """The mode of format ``name`` (one of :attr:`formats`)."""
        return self.modes[name]

    def steady(self, ctx) -> Reduction | None:
        """The candidate ``ctx``'s buckets go to where nothing of this mode's own runs around them (settled,
        unwatched, untimed, no switch or residual pending): the native issue chain may run it; else None."""
        idle = self._clock_due is None and not self.residuals.pending and ctx.iteration not in self.clock.marks
        sch = self.schedule  # (attribute reads: this runs every step, and a property is a frame)
        ok = sch.phase is Phase.SETTLED and sch.watch is None and self._it == ctx.iteration
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
        if self.schedule.looked == ctx.iteration:  # (an attribute read per pack; the call only then)
            self.schedule.look(ctx, bucket)
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
        self.schedule.rebuilt()

    # ----------------------------------------------------------- steps
    def _enter(self, ctx) -> None:
        """The boundary of iteration ``ctx.iteration``: switch to the format
        fixed for it; the schedule reads finished windows and decides the next
        one; time this one where the schedule reads it."""
        it = self._it = ctx.iteration
        if self.next_name != self.cur_name:
            self._switch(it)
        self.next_name, timed = self.schedule.enter(ctx, self.cur_name)
        if timed:
            if self._from_forward:  # timed only where a window is read
                self.clock.start(it, self.cur_name, ctx.forward_at)
            else:
                self._clock_due = (it, self.cur_name)

    def _switch(self, it: int) -> None:
        """Make :attr:`next_name` current; the residuals follow as
        :class:`~.handover.ResidualHandover` says."""
        self.residuals.switch(it, self.cur, self.modes[self.next_name], self.cur_name, self.next_name,
                              trial=self.schedule.phase == Phase.TRIAL)
        self.cur_name = self.next_name

    def freeze(self, why: str) -> None:
        """join(): the best format measured so far (else the most precise),
        from the next iteration on; no more collectives of its own."""
        self.next_name = self.schedule.freeze(why, self._it, self.next_name)

    # ------------------------------------------------------------ report
    def stats(self) -> dict:
        sched = self.schedule.report()
        settled = self.schedule.phase in (Phase.SETTLED, Phase.FROZEN)
        return {self.label: {
            "state": sched["state"], "measuring": sched["measuring"], "current": self.cur_name,
            "chosen": self.next_name if settled else None,
            "candidates": list(self.formats), "lowest": self.state.lowest,
            "error_feedback": self.state.error_feedback, "tune_buckets": self.state.tune_buckets,
            "topology": self.where,
            "settled_at_step": sched["settled_at_step"], "trial_steps": sched["trial_steps"],
            "decisions": sched["decisions"], "residual": list(self.residuals.events),
            "watch": sched["watch"], "decided_on": sched["decided_on"], "windows_not_ready": self.clock.not_ready,
            "trial": sched["trial"],
        }}
