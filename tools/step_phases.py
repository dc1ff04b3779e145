"""Where a step's time goes: forward, backward (with the reduction) and
optimizer, wall clock and the process's CPU time, for torch's DDP and
fastddp's paths side by side on 2 gloo ranks.

    python -m tools.step_phases --link netns:10 --rows torch,fastddp --steps 60
    python -m tools.step_phases --link local --rows torch-fp16,fastddp-bf16acc

Every row wraps its own copy of one model (``fastddp.bench.models``) and
trains on the same batches; the rows step in turn, the order reversed every
step, each step behind a barrier.  Rank 0 prints each row's median per phase
and, for the first row against each other one, the paired step-time ratio
(geometric mean of per-step ratios, 90% t interval).  The CPU column is
``time.process_time()`` of the whole rank process (the gloo threads
included): on shared cores, CPU a row adds is time another thread waits for.
The training thread's own CPU per phase (``time.thread_time()``) is printed
as the paired difference from the first row, in ms with a 90% interval.
``--link netns:RATE`` runs the ranks in two network namespaces over a
``tc tbf`` link (root, iproute2: ``tools.netlink``); ``--link local`` on
loopback.  Rows: ``torch``, ``torch-view`` (gradient_as_bucket_view),
``torch-fp16`` (its fp16 hook), ``fastddp``, ``fastddp-batched``,
``fastddp-view``, ``fastddp-bf16acc``, ``fastddp-fp16``, ``fastddp-fp8``,
``fastddp-autoprec`` (lowest fp8; ``--warmup 30`` times it after its trial), and
two per-bucket mixes for the question whether formats chosen per bucket pay
(issue 31): ``fastddp-fp8-first32`` (the first bucket reduced in fp32, the
rest in fp8) and ``fastddp-fp8-last32`` (the last one in fp32); the fastddp rows
read ``FASTDDP_*`` settings from the environment, and ``ROW:N`` builds a
fastddp row with ``FASTDDP_IN_PLACE_NUMEL=N`` (``fastddp:0``: the in-place
reduction off, a before/after in one run); ``ROW@end`` builds a two-phase
row (``fastddp-fp8``, ``fastddp-bf16acc``) with phase 2 at the end of
backward instead of on its thread (the schedule before it, in one run).
``local`` trains the model alone (no DDP, no communication).

``--timeline ROW`` prints rank 0's last timed step of ROW event by event;
on a netns link with the bytes its interface had sent by each event and a
line saying when the step's first and last bytes left and at what share of
the carried rate (:class:`tools.timeline.LinkTrace`).

On a netns link each fastddp row also gets its floor per step, printed as
``ROW step / floor`` with its terms (docs/benchmarking.md, "A step's
floor on the link"): forward + max(first bucket ready + bytes sent at the
carried rate, the ``local`` row's backward) + optimizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from tools.timeline import LINK_EVERY_S, LinkTrace, Timeline, link_use, sent_at

ROWS = ("local", "torch", "torch-view", "torch-fp16", "fastddp", "fastddp-batched", "fastddp-view", "fastddp-bf16acc",
        "fastddp-fp16", "fastddp-fp8", "fastddp-fp8-first32", "fastddp-fp8-last32", "fastddp-autoprec")
PHASES = ("fwd", "bwd", "opt", "step", "cpu")
THREAD = ("fwd", "bwd", "opt")
"""Phases whose CPU time on the training thread alone (``time.thread_time``,
gloo's threads left out) is also recorded, as ``thread-fwd`` and so on: a
host cost of a few hundred microseconds shows there with an interval of
~0.1 ms in a few hundred steps, where wall clock on shared cores cannot
separate it."""


def _wrap(name: str, module):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastddp
    import fastddp.hooks as fh
    from fastddp import settings

    if name.endswith("@end"):  # a two-phase row with phase 2 at the end of backward (no phase-2 thread)
        ddp = _wrap(name[:-4], module)
        mode = ddp.reducer.mode
        if "two-phase" in getattr(mode, "formats", ()):  # a two-phase hook at two ranks: pinned to its two phases
            mode.freeze("the @end row")  # nothing measured yet: its first candidate, the two phases
            mode = mode.candidate("two-phase")
        engine = getattr(mode, "engine", None)
        if engine is None or engine.phase_two is None:
            raise SystemExit(f"step_phases: {name[:-4]} runs no phase-2 thread; @end applies to "
                             "fastddp-fp8 and fastddp-bf16acc")
        engine.phase_two = None
        return ddp
    name, _, least = name.partition(":")
    if least:  # fastddp...:N -- FASTDDP_IN_PLACE_NUMEL=N for this row alone
        old = os.environ.get("FASTDDP_IN_PLACE_NUMEL")
        os.environ["FASTDDP_IN_PLACE_NUMEL"] = least
        settings.reload()
        try:
            return _wrap(name, module)
        finally:
            del os.environ["FASTDDP_IN_PLACE_NUMEL"]
            if old is not None:
                os.environ["FASTDDP_IN_PLACE_NUMEL"] = old
            settings.reload()
    if name == "local":  # the model alone: no DDP, no communication (the floor's compute term)
        return module
    if name.startswith("torch"):
        ddp = TorchDDP(module, gradient_as_bucket_view=name == "torch-view")
        if name == "torch-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    ddp = fastddp.DistributedDataParallel(module, batched_grad_copy=name == "fastddp-batched",
                                          gradient_as_bucket_view=name == "fastddp-view")
    hook = {"fastddp-bf16acc": fh.bf16_fp32acc_hook, "fastddp-fp16": fh.fp16_compress_hook}.get(name)
    if name.startswith("fastddp-fp8"):
        hook = fh.fp8_compress_hook
    if name == "fastddp-autoprec":  # its trial takes ~20 steps: give it a --warmup past them
        ddp.register_comm_hook(fh.AutoPrecisionState(lowest="fp8"), fh.auto_precision_hook)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def mix_buckets(name: str, ddp) -> None:
    """Before each step of a ``fastddp-fp8-*32`` row: its first (or last)
    bucket reduced by the plain fp32 all-reduce, the others by fp8.  Set on
    the reducer's buckets directly (a probe, not a product path: no public
    API mixes formats), again after torch's rebuild gives new buckets; fp8
    has no early copy, so the fp32 bucket gathers its grads in its own pack."""
    if not name.endswith("32") or not name.startswith("fastddp-fp8-"):
        return
    from fastddp import reduction

    buckets = [b for b in ddp.reducer.buckets if not b.sparse]
    b = buckets[0] if name == "fastddp-fp8-first32" else buckets[-1]
    if not isinstance(b.reduction, reduction.AllReduce):
        b.reduction = reduction.choose(None, None, False, True, trial=False)[0]  # plain: no trial of its own


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``b[i] / a[i]`` with a 90% t interval."""
    m, lo, hi = difference([math.log(x) for x in a], [math.log(y) for y in b])
    return math.exp(m), math.exp(lo), math.exp(hi)


def difference(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of ``b[i] - a[i]`` with a 90% t interval."""
    d = [y - x for x, y in zip(a, b)]
    m = statistics.fmean(d)
    h = 1.7 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
    return m, m - h, m + h


class FirstBucket:
    """When a fastddp row's first bucket of a step is ready: its mode's
    first ``pack_native`` / ``pack`` call after :meth:`arm` (the moment the
    countdown reaches zero for a bucket, before its pack runs), on the
    host clock.  Set on the mode instance, so the reducer's calls (and the
    native countdown's, through them) go through it.  Where the native
    issue chain packs in C++ (fastddp/reducer/chain.py), the chain's own
    stamp of the same moment is read instead."""

    def __init__(self, mode, chain=None):
        self._at, self._chain = None, chain
        for name in ("pack_native", "pack"):
            real = getattr(mode, name)

            def timed(*a, _real=real, **k):
                if self._at is None:
                    self._at = time.perf_counter()
                return _real(*a, **k)
            setattr(mode, name, timed)

    @property
    def at(self) -> float | None:
        if self._at is None and self._chain is not None and self._chain.ok:
            return self._chain.native.chain_first_ready()
        return self._at

    def arm(self) -> None:
        self._at = None


def tx_bytes() -> int | None:
    """Bytes this rank's interface has sent (``GLOO_SOCKET_IFNAME``'s kernel
    counter, :func:`tools.netlink.read_counters`), or None off a netns link."""
    from tools.netlink import LinkError, read_counters

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return None
    try:
        return read_counters(ifname)[0]
    except LinkError:
        return None


class _NoTimeline:
    """No ``--timeline``: nothing wrapped, nothing recorded."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def mark(self):
        pass

    def note(self, what):
        pass


def measure(rows: list[str], model: str, steps: int, warmup: int = 3, timeline: str | None = None) -> dict | None:
    """Run inside every rank (the process group is up); rank 0 returns the
    per-step samples, the others None.  ``timeline``: a row whose last timed
    step is recorded event by event (:class:`tools.timeline.Timeline`)."""
    import torch
    import torch.distributed as dist

    from fastddp.bench.models import model_zoo

    spec = model_zoo()[model]
    torch.manual_seed(0)
    base = spec.build()
    wrapped = {}
    for name in rows:
        m = _wrap(name, __import__("copy").deepcopy(base))
        wrapped[name] = (m, torch.optim.SGD(m.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    samples = {n: {p: [] for p in PHASES + tuple(f"thread-{q}" for q in THREAD)} for n in rows}
    first = {n: FirstBucket(wrapped[n][0].reducer.mode, wrapped[n][0].reducer.arming.chain)
             for n in rows if n.startswith("fastddp")}
    on_link = tx_bytes() is not None
    if on_link:  # the rate the link carries, for the floor's wire term (the same figure on every rank)
        from tools.netlink import probe_link

        gbit = probe_link()["measured_gbit"]
        for n in rows:
            samples[n]["carried_gbit"] = gbit
    tt = time.thread_time
    probe = Timeline() if timeline else _NoTimeline()
    trace = LinkTrace(tx_bytes) if timeline and on_link else None  # the timeline step's bytes, as they leave
    with probe:
        for i in range(warmup + steps):
            x, y = spec.make_batch(gen, torch.device("cpu"))
            for name in (rows if i % 2 == 0 else rows[::-1]):
                ddp, opt = wrapped[name]
                mix_buckets(name, ddp)
                dist.barrier()
                if name in first:
                    first[name].arm()
                b0 = tx_bytes() if on_link else None
                traced = trace is not None and name == timeline and i == warmup + steps - 1
                if name == timeline:
                    probe.mark()
                    if traced:
                        trace.start(probe.t0)
                c0, t0, h0 = time.process_time(), time.perf_counter(), tt()
                loss = spec.loss(ddp(x), y)
                t1, h1 = time.perf_counter(), tt()
                probe.note("forward end")
                loss.backward()
                t2, h2 = time.perf_counter(), tt()
                probe.note("backward end")
                opt.step()
                opt.zero_grad(set_to_none=True)
                t3, c3, h3 = time.perf_counter(), time.process_time(), tt()
                probe.note("optimizer end")
                if traced:
                    trace.stop()
                    samples[name]["link_trace"] = list(trace.samples)
                if name == timeline and i >= warmup:
                    samples[name]["timeline"] = list(probe.events)  # the last timed step's
                b3 = tx_bytes() if on_link else None
                if i >= warmup:
                    for p, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, c3 - c0)):
                        samples[name][p].append(v * 1e3)
                    for q, v in zip(THREAD, (h1 - h0, h2 - h1, h3 - h2)):
                        samples[name][f"thread-{q}"].append(v * 1e3)
                    if name in first and first[name].at is not None:
                        samples[name].setdefault("first", []).append((first[name].at - t1) * 1e3)
                    if on_link:
                        samples[name].setdefault("sent", []).append(b3 - b0)
    for name in rows:  # the measuring modes' decisions (auto precision, the in-place rule, bf16acc at two
        # ranks): a trial or re-measure inside the timed steps shows here
        st = wrapped[name][0].stats() if name.startswith("fastddp") else {}
        made = [f"step {d['step']}: {d['chosen']} ({d['trigger']}; {d.get('reason', '')})" for v in st.values()
                if isinstance(v, dict) for d in v.get("decisions", ())]
        if made:
            samples[name]["decisions"] = made
    return samples if dist.get_rank() == 0 else None


def summary(samples: dict) -> str:
    rows = list(samples)
    lines = [f"{'row':<17}" + "".join(f"{p + ' ms':>10}" for p in PHASES)]
    for n in rows:
        lines.append(f"{n:<17}" + "".join(f"{statistics.median(samples[n][p]):>10.2f}" for p in PHASES))
    for n in rows[1:]:
        for p in ("step", "cpu"):
            g, lo, hi = paired(samples[rows[0]][p], samples[n][p])
            lines.append(f"{n} / {rows[0]} {p}: {g:.3f} ({lo:.3f}-{hi:.3f})")
        diffs = []
        for q in THREAD:
            d, lo, hi = difference(samples[rows[0]][f"thread-{q}"], samples[n][f"thread-{q}"])
            diffs.append(f"{q} {d:+.3f} ({lo:+.3f}..{hi:+.3f})")
        lines.append(f"{n} - {rows[0]} training thread CPU ms: " + ", ".join(diffs))
    local = samples.get("local")
    for n in rows:
        fl = floor(samples[n], local)
        if fl is not None:
            g, lo, hi = paired(fl, samples[n]["step"])
            parts = {k: statistics.median(v) for k, v in floor_terms(samples[n]).items()}
            if local is not None:
                parts["local bwd"] = statistics.median(local["bwd"])
            lines.append(f"{n} step / floor: {g:.3f} ({lo:.3f}-{hi:.3f}); floor {statistics.median(fl):.2f} ms = "
                         + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                         + f" (medians; wire: the bytes sent at {samples[n]['carried_gbit']:.3f} Gbit/s carried"
                         + ("; backward's term the larger of first + wire and the local backward" if local else "")
                         + ")")
    for n in rows:
        for d in samples[n].get("decisions", []):
            lines.append(f"{n} decided at {d}")
    for n in rows:
        if samples[n].get("timeline"):
            lines.append(f"{n}: its last timed step on rank 0, event by event (ms from the step's start)")
            tr = samples[n].get("link_trace")
            lines += [f"{t * 1e3:9.2f}  {th[:18]:<18} {what}"
                      + (f"{'':{max(0, 36 - len(what))}} sent {sent_at(tr, t) / 1e6:7.2f} MB" if tr else "")
                      for t, th, what in samples[n]["timeline"]]
            use = link_use(tr, samples[n]["carried_gbit"]) if tr else None
            if use is not None:
                lines.append(link_line(use))
    return "\n".join(lines)


def link_line(use: dict) -> str:
    """:func:`tools.timeline.link_use` of a traced step, in words."""
    share = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    idle = ", ".join(f"{a * 1e3:.1f}-{b * 1e3:.1f}" for a, b in use["idle"]) or "none"
    return (f"link (this rank's interface, sampled every {LINK_EVERY_S * 1e3:g} ms): first bytes at "
            f"{use['first'] * 1e3:.1f} ms, last at "
            f"{use['last'] * 1e3:.1f} ms, {use['sent'] / 1e6:.2f} MB: {share(use['span_share'])} of the carried rate "
            f"over that span, {share(use['busy_share'])} over it less the stretches with nothing sent "
            f"(>= {use['idle_s'] * 1e3:g} ms, ms: {idle})")


def floor_terms(row: dict, local: dict | None = None) -> dict:
    """Per step, in ms, the terms of a DDP step's floor (docs/benchmarking.md):
    forward, backward's start to the first bucket's readiness, the bytes
    the step sent at the rate the link carries, the optimizer.  With a
    ``local`` row (the model alone), backward's term is the larger of
    first + wire and the local backward of the same step (a step whose
    compute outlasts the wire is bound by its compute instead)."""
    wire = [b * 8 / (row["carried_gbit"] * 1e9) * 1e3 for b in row["sent"]]
    if local is None:
        return {"fwd": row["fwd"], "first": row["first"], "wire": wire, "opt": row["opt"]}
    return {"fwd": row["fwd"], "max(first+wire, local bwd)":
            [max(f + w, b) for f, w, b in zip(row["first"], wire, local["bwd"])], "opt": row["opt"]}


def floor(row: dict, local: dict | None = None) -> list[float] | None:
    """Each step's floor (ms): the sum of :func:`floor_terms`; None for a row
    without them (torch's, or off a netns link)."""
    if "first" not in row or "sent" not in row or len(row["first"]) != len(row["step"]):
        return None
    return [sum(t) for t in zip(*floor_terms(row, local).values())]


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = measure(args.rows.split(","), args.model, args.steps, args.warmup, args.timeline)
        if out is not None:
            print(summary(out), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _local_rank(rank: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    _worker(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.step_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="local", help="local (loopback), netns (unshaped) or netns:RATE (Gbit/s)")
    p.add_argument("--rows", default="torch,fastddp",
                   help=f"comma-separated, the first is the base: {', '.join(ROWS)}; a fastddp row may end "
                        "in :N (FASTDDP_IN_PLACE_NUMEL=N for it), a two-phase row in @end (phase 2 at the "
                        "end of backward)")
    p.add_argument("--model", default="mlp25m")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3, help="steps per row before the timed ones (fastddp-autoprec: "
                   "30, past its trial)")
    p.add_argument("--json", help="write rank 0's per-step samples here")
    p.add_argument("--timeline", help="a fastddp row whose last timed step rank 0 prints event by event: the "
                   "two-phase modes' pack, issue, rounds (on each thread), finish and unpack; on a netns link "
                   "with the bytes sent by each event and when the step's bytes left")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [r for r in (r.removesuffix("@end") for r in args.rows.split(",")) if r.partition(":")[0] not in ROWS
           or (r.partition(":")[2] and (r.startswith("torch") or not r.partition(":")[2].isdigit()))]
    if bad:
        p.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    if args.timeline is not None and args.timeline not in args.rows.split(","):
        p.error(f"--timeline {args.timeline}: not one of --rows ({args.rows})")
    if args.steps < 2:
        p.error("--steps must be at least 2 (an interval needs two samples)")
    if args.worker:
        _worker(args)
        return 0
    me = [sys.executable, "-m", "tools.step_phases", "--worker", "--rows", args.rows, "--model", args.model,
          "--steps", str(args.steps), "--warmup", str(args.warmup)]
    me += ["--json", os.path.abspath(args.json)] if args.json else []
    me += ["--timeline", args.timeline] if args.timeline else []
    if args.link == "local":
        import torch.multiprocessing as mp

        mp.spawn(_local_rank, args=(args,), nprocs=2)
        return 0
    from tools.netlink import NetnsLink, check_requirements, parse_link

    check_requirements()
    with NetnsLink(parse_link(args.link)) as link:
        link.run_ranks(me, timeout_s=1800)
    return 0


if __name__ == "__main__":
    sys.exit(main())
