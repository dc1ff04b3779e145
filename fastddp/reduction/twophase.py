"""The two-phase engine: all-to-all of the W shards -> each rank sums its
shard locally in fp32 -> all-gather of the sums, bucket by bucket, chunked.

One engine serves every two-phase wire format; a format is a codec
(:class:`ShardWire`: its buffers, how a piece of its shard is summed, its
staging) plus the mode's pack and unpack::

    issue     (when the bucket is ready) stage the shard-major wire into
              chunk-major pieces if chunked; ONE all-to-all per piece (a
              codec may send more than one tensor per piece); the codec's
              extra collectives (async)
    phase 2   per piece, wait its all-to-all, sum this rank's slice of every
              rank's shard (ONE launch, fp32, in rank order), all-gather the
              sums (async).  On CUDA (NCCL: a wait is a stream wait) it is
              queued right after the bucket's all-to-all, on the comm engine's
              second side stream, so it runs during backward.  Where a wait
              blocks the host (gloo) a thread of the mode's own
              (:class:`PhaseTwo`) runs it as soon as the all-to-all is in,
              also during backward, issuing the all-gathers on a group of its
              own (a gloo twin of the module's group; the hierarchical
              wire's last round on a twin of its inside group: each group
              sees its collectives in one order on every rank).  Without a
              twin (a group that is not the whole world) or under the Triton
              interpreter (not thread-safe) it runs at the end of backward,
              for every bucket in flight, in bucket order.
    finish    wait this bucket's all-gathers piece by piece (each handed to
              the codec as it lands), its extras, and unstage

A step's collectives are never issued from a collective's callback thread
(collectives issued from callbacks could reach the ranks in different
orders): the backward thread issues every all-to-all on the module's group,
the phase-2 thread (or the end-of-backward callback) every later round, each
in bucket order, and :class:`ShardStep` is completed by ``wait()`` on the
end-of-backward thread.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from .. import groups, settings
from ..comm import Pending

__all__ = ["CHUNK_BYTES", "MAX_CHUNKS", "chunk_bounds", "ShardWire", "ShardStep", "PhaseTwo", "TwoPhaseEngine"]


#: Bytes each way per collective call of a two-phase reduction's chunked
#: phases.  On a TCP link gloo's one big all-to-all carries 55-60% of a ring
#: all-reduce's rate and one big all-gather ~70%; the same bytes as calls of
#: ~1 MiB issued together carry 90% and 97-100%.  CPU tensors (gloo) only:
#: NCCL pipelines its own chunks, so CUDA buckets keep one call per phase (no
#: staging copies).  A state's ``chunk_bytes`` (or FASTDDP_CHUNK_BYTES)
#: overrides it for both (0: one call per phase).
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 32


def chunk_bounds(shard: int, world: int, elem_bytes: int, align: int,
                 device: torch.device | None = None, target: int | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` pieces of a shard of ``shard`` elements, each ``align``-aligned,
    so that one collective call moves about ``target`` bytes each way (None:
    the setting, else :data:`CHUNK_BYTES` on the CPU and one piece on CUDA).
    Depends only on the sizes and the setting, so every rank cuts the same
    pieces and issues the same calls.  One piece: the phases run unchunked
    (no staging)."""
    if target is None:
        target = settings.get().chunk_bytes
        if target is None:
            target = CHUNK_BYTES if device is None or device.type == "cpu" else 0
    units = shard // align
    each_way = (world - 1) * shard * elem_bytes
    if world < 2 or target <= 0 or units < 2 or each_way <= target:
        return [(0, shard)]
    n = min(MAX_CHUNKS, units, -(-each_way // target))
    per = -(-units // n) * align
    return [(a, min(a + per, shard)) for a in range(0, shard, per)]


class ShardWire:
    """One bucket's buffers for a two-phase format (the codec's half of the
    engine).  ``bounds``: the pieces of the shard; ``nbytes``: payload bytes
    per step.

    The engine runs a wire as ``rounds`` rounds of collectives: round 0 at
    the bucket's issue, round ``r`` once round ``r - 1``'s Works are done
    (piece ``k`` waits for piece ``k`` where both rounds have as many pieces,
    else for all of them).  A flat wire has two: the all-to-all, then the
    shard sum and the all-gather (:meth:`send_recv`, :meth:`reduce_piece`).
    A wire may give more (:meth:`run`), and declare the first
    ``early_rounds`` cheap to wait for: those are run when the NEXT bucket
    is issued, on the backward thread, instead of at the end of backward
    (every rank issues the next bucket at the same point of its
    collectives, so the order stays the same on every rank)."""

    world: int
    bounds: list[tuple[int, int]]
    nbytes: int
    rounds = 2
    early_rounds = 1

    def pieces(self, r: int) -> int:
        """Pieces of round ``r``."""
        return len(self.bounds)

    def run(self, r: int, k: int, pg, health) -> list:
        """Round ``r``, piece ``k``: its collectives' Works (the pieces it
        waits for are done)."""
        # loops, not comprehensions: a comprehension is a frame of its own before Python 3.12
        works = []
        if r == 0:
            for o, i in self.send_recv(k):
                works.append(groups.all_to_all_single(o, i, pg))
        else:
            for o, i in self.reduce_piece(k, health):
                works.append(groups.all_gather_into_tensor(o, i, pg))
        return works

    def send_recv(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Piece ``k``'s all-to-all calls: ``(output, input)`` pairs."""
        raise NotImplementedError

    def reduce_piece(self, k: int, health) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Piece ``k``'s all-to-all is in: sum this rank's slice; return the
        all-gather calls, ``(output, input)`` pairs."""
        raise NotImplementedError

    def stage_out(self) -> None:
        """Before the all-to-alls (chunked wires: shard-major -> chunk-major)."""

    def stage_in(self) -> None:
        """After the all-gathers (chunked wires: chunk-major -> shard-major)."""

    def finish_piece(self, k: int) -> None:
        """Piece ``k``'s last round is complete (its Works waited for), the
        later pieces' maybe not: what the codec can do with it now."""

    def start_extra(self, pg) -> list:
        """Collectives issued beside the all-to-alls (their Works)."""
        return []

    def zero(self) -> None:
        """join()'s shadow: what this rank sends stands for zeros."""
        raise NotImplementedError


class ShardStep:
    """One bucket's two-phase reduction in flight, duck-typed as the Future
    :meth:`~fastddp.comm.Comm.wait` completes: ``wait()`` finishes it on the
    calling thread (the end-of-backward callback)."""

    __slots__ = ("engine", "wire", "bucket", "pg", "works", "iteration", "health", "extra", "ran", "error",
                 "queued")
    # works: per round run so far, per piece, its Works; ran: set once the
    # phase-2 thread has run every round (None: no thread); error: what it
    # raised; queued: CUDA, (the comm stream, the event after its rounds on
    # the second-phase stream): a round with no collective, a local sum, is
    # ordered by it alone

    def __init__(self, engine, wire, bucket, pg, iteration, health):
        self.engine, self.wire, self.bucket, self.pg = engine, wire, bucket, pg
        self.works, self.iteration, self.health, self.extra = [], iteration, health, []
        self.ran, self.error, self.queued = None, None, None

    @property
    def done(self) -> bool:
        return len(self.works) == self.wire.rounds

    def advance(self) -> None:
        """Run the next round (waiting for what it depends on)."""
        wire, r = self.wire, len(self.works)
        n = wire.pieces(r)
        prev = self.works[-1] if self.works else []
        out = []
        for k in range(n):
            deps = prev[k] if len(prev) == n else [w for ws in prev for w in ws] if k == 0 else []
            for w in deps:
                groups.wait(w)
            out.append(wire.run(r, k, self.pg, self.health))
        self.works.append(out)

    def wait(self, timeout=None) -> bool:
        self.engine.finish(self)
        return True

    def value(self):
        return None


class PhaseTwo:
    """The rounds after the first, run by a thread as soon as they can start
    (gloo: a wait blocks the host), on ``group``: a gloo twin of the module's
    group, so that the rounds never interleave with the module group's
    collectives in an order that could differ between ranks.  One per module
    group, shared by every mode on it (two DDP modules reduced in one
    backward submit in the one order the backward thread issues their
    all-to-alls, the same on every rank), made once and kept for the
    process's life, as the group is.  Steps are run in the order submitted,
    each round by round.  The twin is made at the first step submitted,
    not when the mode is built: every rank submits its first step at the
    same point of the same backward, and a rank whose settings differ (a
    hook registered on one rank only) reaches the first forward's
    settings check (:mod:`fastddp.agree`) instead of waiting in
    ``new_group`` for a rank that never calls it."""

    _ONE: dict = {}  # id(pg) -> (pg, PhaseTwo)

    def __init__(self, pg):
        self.pg = pg
        self.group = None  # the twin, made by the first submit
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, pg, device, backend: str) -> "PhaseTwo | None":
        """The one for ``pg`` (its twin group made collectively at the first
        submit: every rank of the world runs the same backward), or
        None where the rounds stay on the end-of-backward thread: not the
        CPU, the Triton interpreter (not thread-safe), a group of one rank, or
        a group that is not the whole world (``new_group`` needs every rank
        of the world)."""
        from .. import groups

        cpu = device is None or torch.device(device).type == "cpu"
        if (not cpu or backend == "interpret" or pg is None or not groups.is_registered(pg)
                or not dist.is_gloo_available() or groups.size(pg) < 2
                or groups.size(pg) != dist.get_world_size()):
            return None
        got = cls._ONE.get(id(pg))
        if got is None or got[0] is not pg:
            got = cls._ONE[id(pg)] = (pg, cls(pg))
        return got[1]

    def submit(self, step: ShardStep) -> None:
        if self.group is None:
            from .. import groups

            self.group = dist.new_group(groups.global_ranks(self.pg), backend="gloo")
        step.ran, step.pg = threading.Event(), self.group
        if self._thread is None:
            self._thread = threading.Thread(target=PhaseTwo._run, args=(self._queue,), daemon=True,
                                            name="fastddp-phase2")
            self._thread.start()
        self._queue.put(step)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while True:
            step = q.get()
            try:
                while not step.done:
                    step.advance()
            except BaseException as e:  # raised where the bucket is waited for
                step.error = e
            finally:
                step.ran.set()


class TwoPhaseEngine:
    """The engine a two-phase mode holds (not a base it inherits): every
    input is an argument -- the bucket's :class:`ShardWire` (the codec's
    buffers, built by the mode at its pack), the step's context, the health
    flag -- and the engine keeps only what spans buckets: the wires by
    bucket, the steps in flight, the phase-2 thread.  Every rank packs,
    issues and finishes the buckets in the same order."""

    __slots__ = ("chunk_bytes", "eager", "open", "wires", "phase_two", "events")

    def __init__(self, chunk_bytes: int | None = None, eager: bool | None = None):
        self.chunk_bytes = chunk_bytes
        #: phase 2 at issue (True), at the end of backward (False), or where the
        #: device makes waits stream waits (None: CUDA)
        self.eager = eager
        self.open: list[ShardStep] = []  # in issue order
        self.wires: dict[int, ShardWire] = {}  # by bucket index: what the mode's pack filled
        self.phase_two: PhaseTwo | None = None  # set by the mode's builder where a thread runs phase 2
        self.events: dict = {}  # CUDA: by bucket index, the event after its rounds (made once, reused)

    def pieces(self, bucket_index: int) -> int:
        """How many pieces bucket ``bucket_index``'s phases run in (0: not sized yet)."""
        w = self.wires.get(bucket_index)
        return 0 if w is None else len(w.bounds)

    def bounds(self, shard: int, world: int, elem_bytes: int, align: int, device) -> list:
        """The pieces a wire of ``shard`` elements per rank is cut into (:func:`chunk_bounds`)."""
        return chunk_bounds(shard, world, elem_bytes, align, device, self.chunk_bytes)

    def start(self, ctx, bucket, wire: ShardWire, health) -> Pending:
        """Issue ``wire``'s first round for ``bucket`` (its later rounds: on
        the phase-2 thread, at once where waits are stream waits, or at the
        end of backward); ``health``: the flag the shard sums report into
        (None: join()'s shadow, which reports nothing)."""
        # a step left open by an abandoned iteration is dropped: its
        # all-to-all completed (every rank issued it) and nobody waits for it
        kept = [s for s in self.open if s.iteration == ctx.iteration and s.bucket.index < bucket.index]
        for s in self.open:
            if s.ran is not None and s not in kept:
                s.ran.wait()  # the thread may still use the buffers this bucket reuses
        self.open = kept
        eager = self.eager if self.eager is not None else ctx.comm.cuda
        threaded = self.phase_two is not None and not eager
        if not eager and not threaded:  # the earlier buckets' cheap rounds, before this bucket's collectives
            for s in self.open:
                while len(s.works) < s.wire.early_rounds:
                    s.advance()
        pg = ctx.comm.pg
        wire.stage_out()
        step = ShardStep(self, wire, bucket, pg, ctx.iteration, health)
        step.advance()
        step.extra = wire.start_extra(pg)
        self.open.append(step)
        if threaded:
            self.phase_two.submit(step)
        elif eager:
            with ctx.comm.phase2_context():
                while not step.done:
                    step.advance()
            if ctx.comm.cuda:  # finish orders the unpack after ALL of its rounds, not only its collectives
                ev = self.events.get(bucket.index)
                if ev is None:
                    ev = self.events[bucket.index] = torch.cuda.Event()
                ctx.comm.phase2_mark(ev)
                step.queued = (ctx.comm.stream, ev)  # the stream finish (and the unpack) runs on
        return ctx.comm.hook(step, wire.nbytes)

    def shadow(self, ctx, wire: ShardWire, bucket) -> Pending:
        """join(): ``wire`` (the bucket's, sized by the mode) on zeros."""
        wire.zero()
        return self.start(ctx, bucket, wire, None)

    def finish(self, step: ShardStep) -> None:
        """Until ``step`` has run its last round: the next round of every open
        step not done (in issue order, round by round); then wait for
        ``step``'s last Works and extras.  With a phase-2 thread: until it has
        run ``step``'s rounds (what it raised is raised here)."""
        if step.ran is not None:
            step.ran.wait()
            if step.error is not None:
                self.open.remove(step)
                raise step.error
        else:
            for s in self.open:  # every bucket's cheap rounds first: the last one's slow hop starts now
                while len(s.works) < s.wire.early_rounds:
                    s.advance()
            while not step.done:
                for s in self.open:
                    if not s.done:
                        s.advance()
        if step.queued is not None:  # the comm stream after the rounds' kernels too (not the current
            stream, ev = step.queued  # device's current stream: the module's device may be another)
            stream.wait_event(ev)
        for k, ws in enumerate(step.works[-1]):  # piece by piece: each handed to the codec as it lands
            for w in ws:
                groups.wait(w)
            step.wire.finish_piece(k)
        for w in step.extra:
            groups.wait(w)
        step.wire.stage_in()
        self.open.remove(step)

    def reset(self) -> None:
        """A rebuild: every bucket's wire is sized anew."""
        self.open, self.wires, self.events = [], {}, {}
