"""``bucket_cap_mb="auto"``: bucket caps tuned online, in the first steps,
from measured overlap.

What is tuned: the first bucket's cap and the cap of the rest, i.e. torch's
``bucket_cap_mb_list=[first, rest]`` (``bucket_cap_mb=rest`` when equal).
Every layout tried is one torch's rebuild would make with those caps, from
the same ready order, so the gradients are those of that fixed setting.

How, step by step (a step = a forward that synchronises and its backward;
``no_sync`` forwards are not steps here)::

    wait    until torch's one bucket rebuild has happened (static_graph: after
            the second backward) and the bucket mode measures nothing of its
            own (auto_precision_hook's trial: the layout is tuned for the
            chosen format), torch's default layout (1 / 25 MiB) meanwhile
    probe   one step with torch's default layout: each parameter's ready
            time (host clock; CUDA events on CUDA)
    model   timeline MAX-reduced over ranks; a few all-reduces of 4 KiB ..
            4 MiB timed once (latency alpha, time per byte beta, MAX over
            ranks); each grid layout's exposed communication predicted by a
            serial-wire replay of the timeline (:func:`predict`)
    trials  torch's default first, then the model's best, then (CPU ranks on
            a copy-speed link, unless pruned) the fewest buckets, then hill-climbing
            on the rest cap (and the first cap) around the best measured:
            TRIAL_STEPS steps each, TRIAL_STEPS more (up to MAX_TRIAL_STEPS)
            while a layout's steps spread by more than SPREAD_OK; cost = the
            median of the faster half of the per-step MAX over ranks of
            forward start -> all gradients reduced (a step is only ever made
            slower by what else runs on the machine); a layout whose
            calibrated prediction is far above the best measured is never
            tried (calibrated by the smallest measured - predicted gap, so
            the pruning errs towards trying); a layout replaces the best only
            if it is faster by more than the noise
    settled the best; where no layout beat the incumbent by the noise, on
            the CPU the link picks among those within it (copy speed: the
            fewest buckets; a wire: the model's pick, priced with the
            per-bucket cost its trials show, where its predicted gain
            exceeds the noise, else the incumbent); installed at a step
            boundary; a log line on rank 0

Every decision is taken from values all-reduced (MAX) over the group, by the
same deterministic code on every rank: the ranks change buckets at the same
step, so their collectives stay in lockstep.  Buckets change only between
steps, through the reducer's rebuild path.

Cost: one all-reduce of ``TRIAL_STEPS`` floats per layout tried, one of a
float per parameter and ~12 small timed all-reduces once, a device sync per
tuning step on CUDA; nothing once settled.

The parts: :mod:`.option` (the argument), :mod:`.model` (the cost model and
the candidate grid, pure), :mod:`.search` (the trials fed with costs, pure),
:mod:`.driver` (:class:`Tuner`: clocks, collectives, the reducer's callbacks).
"""

from .driver import MICROBENCH_BYTES, MICROBENCH_REPS, Tuner, TunerHost
from .model import FIRST_CAPS_MB, HOST_PER_BUCKET_S, REST_CAPS_MB, Candidate, candidates, predict, wire_bytes
from .option import parse_cap, resolve_cap
from .search import (COPY_SPEED_GBPS, MAX_LAYOUTS, MAX_TRIAL_STEPS, MAX_TUNING_STEPS, PRUNE, REL_NOISE,
                     SPREAD_OK, TRIAL_STEPS, Search)

__all__ = ["COPY_SPEED_GBPS", "FIRST_CAPS_MB", "HOST_PER_BUCKET_S", "Candidate", "MAX_LAYOUTS", "MAX_TRIAL_STEPS",
           "MAX_TUNING_STEPS", "MICROBENCH_BYTES", "MICROBENCH_REPS", "PRUNE", "REL_NOISE", "REST_CAPS_MB",
           "SPREAD_OK", "Search", "TRIAL_STEPS", "Tuner", "TunerHost", "candidates", "parse_cap", "predict",
           "resolve_cap", "wire_bytes"]
