"""``CrossSite``: the optimizer wrapper that turns a fastddp DDP module into
cross-site training (docs/cross-site.md).

Every step: the module's gradients are averaged exactly over the ranks of
each host (after ``warmup_steps`` exact steps over the whole group), and the
inner optimizer steps.  After every ``sync_every`` steps past the warm-up:
an outer sync (:mod:`.outer`) averages the pseudo-gradient between the hosts
in ``wire`` and takes the outer step, overlapped with the next inner steps,
its result applied ``delay`` steps later (the inner progress kept).

The delay is decided at run time, by every rank alike: 1 for the first sync
(which is thereby timed), then the fewest steps that covered the slowest
rank's last exchange at the slowest rank's step time, never more than
``sync_every`` (the next sync starts from the applied result).
"""

from __future__ import annotations

import atexit
import collections
import math
import time
import weakref

import torch
import torch.distributed as dist

from .. import groups, kernels
from ..reduction.sitelocal import SiteState, site_local_hook
from .outer import Layout, OuterSync
from .sites import resolve_sites
from .wire import BLOCK, FORMATS, make_wire

__all__ = ["CrossSite"]


WARMUP_WIRES = ("exact",) + FORMATS


def _check(sync_every, warmup_steps, wire, outer_lr, outer_momentum, delay, sync_timeout_s, warmup_wire) -> None:
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"fastddp.CrossSite: sync_every={sync_every!r} must be an int >= 1 (inner steps "
                         "between outer syncs)")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"fastddp.CrossSite: warmup_steps={warmup_steps!r} must be an int >= 0 (exact "
                         "steps over every rank before the first outer sync)")
    if warmup_wire not in WARMUP_WIRES:
        raise ValueError(f"fastddp.CrossSite: warmup_wire={warmup_wire!r} must be one of "
                         f"{', '.join(WARMUP_WIRES)} ('exact': torch's default path, its bits; a format: "
                         "the hierarchical reduction with that wire between hosts)")
    if wire not in FORMATS:
        raise ValueError(f"fastddp.CrossSite: wire={wire!r} is not a format the outer sync carries; "
                         f"choose one of {', '.join(FORMATS)}")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError(f"fastddp.CrossSite: outer_lr={outer_lr!r} must be a finite number > 0 (1.0 with "
                         "outer_momentum=0 is plain averaging)")
    if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
        raise ValueError(f"fastddp.CrossSite: outer_momentum={outer_momentum!r} must be in [0, 1)")
    if delay != "auto" and not (isinstance(delay, int) and not isinstance(delay, bool) and 1 <= delay <= sync_every):
        raise ValueError(f"fastddp.CrossSite: delay={delay!r} must be 'auto' or an int from 1 to "
                         f"sync_every ({sync_every}): the steps after a sync's start at which its result is applied")
    if not (isinstance(sync_timeout_s, (int, float)) and sync_timeout_s > 0):
        raise ValueError(f"fastddp.CrossSite: sync_timeout_s={sync_timeout_s!r} must be a number of seconds > 0")


def _agree(pg, values: dict) -> None:
    """Every rank was built with the same settings (one MAX all-reduce of the
    values and their negatives, at construction): else a clear error on every
    rank, naming the setting, instead of syncs that never pair up."""
    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    both = torch.cat([mine, -mine])
    groups.all_reduce(both, pg, op=torch.distributed.ReduceOp.MAX)
    hi, lo = both[:len(keys)], -both[len(keys):]
    bad = [f"{k} (from {lo[i].item():g} to {hi[i].item():g})" for i, k in enumerate(keys) if hi[i] != lo[i]]
    if bad:
        raise ValueError(f"fastddp.CrossSite: the ranks were built with different settings: {', '.join(bad)} "
                         f"(this is rank {groups.rank(pg)}): every rank must pass the same arguments and "
                         "hold the same model")


class CrossSite(torch.optim.Optimizer):
    """Wraps the inner optimizer of a fastddp ``DistributedDataParallel``
    module.  Use it where the inner optimizer was used: ``step()``,
    ``zero_grad()``, ``state_dict()``; LR schedulers see the inner one's
    ``param_groups``.  Build it before the module's first forward (it
    registers the inner reduction as the module's comm hook)."""

    def __init__(self, module, optimizer: torch.optim.Optimizer, sync_every: int = 64, *,
                 warmup_steps: int = 0, wire: str = "fp8", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, error_feedback: bool = True,
                 delay: int | str = "auto", ranks_per_host: int | None = None, sync_timeout_s: float = 600.0,
                 warmup_wire: str = "exact"):
        from ..ddp import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            raise TypeError(f"fastddp.CrossSite wraps the optimizer of a fastddp.DistributedDataParallel "
                            f"module; got {type(module).__name__} (torch's DDP: use torch's "
                            "PostLocalSGDOptimizer, or swap the import)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"fastddp.CrossSite: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        _check(sync_every, warmup_steps, wire, outer_lr, outer_momentum, delay, sync_timeout_s, warmup_wire)
        self.optim, self.module = optimizer, module
        self.param_groups, self.defaults = optimizer.param_groups, optimizer.defaults
        self.sync_every, self.warmup_steps, self.wire_format = sync_every, warmup_steps, wire
        self.delay, self.sync_timeout_s = delay, float(sync_timeout_s)
        self.sites = resolve_sites(module.process_group, ranks_per_host)
        params = [p for p in module.parameters() if p.requires_grad]
        _agree(module.process_group, {
            "sync_every": sync_every, "warmup_steps": warmup_steps, "wire": FORMATS.index(wire),
            "outer_lr": outer_lr, "outer_momentum": outer_momentum, "nesterov": bool(nesterov),
            "error_feedback": bool(error_feedback), "delay": 0 if delay == "auto" else delay,
            "warmup_wire": WARMUP_WIRES.index(warmup_wire),
            "parameters": len(params), "elements": sum(p.numel() for p in params)})
        dev = params[0].device if params else torch.device("cpu")
        self.layout = Layout(params, self.sites.num_hosts, self.sites.ranks_per_host,
                             self.sites.local_rank, BLOCK)
        self.snap = torch.zeros(self.layout.padded, device=dev)
        self.theta = torch.zeros(self.layout.padded, device=dev)
        self.anchor = torch.zeros(self.layout.shard, device=dev)
        self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.wire = make_wire(wire, self.layout.shard, self.sites.num_hosts, self.sites.across, error_feedback, dev)
        if wire == "fp8":
            kernels.prepare_fp8(dev)
        self._site = SiteState(self.sites.inside, self.sites.ranks_per_host,
                               warmup_wire if warmup_steps else "exact")
        module.register_comm_hook(self._site, site_local_hook)
        self._threaded = kernels.backend(dev) != "interpret"
        self.steps = 0
        self._pending: OuterSync | None = None
        self._apply_at = 0
        self._last_exchange_s: float | None = None
        self._last_step_at: float | None = None
        self._step_times: collections.deque = collections.deque(maxlen=16)
        self._stats = {"syncs": 0, "bytes_between_hosts": 0, "last_sync_step": None, "delays": [],
                       "exchange_s_last": None, "exposed_wait_s": 0.0}
        if warmup_steps == 0:
            self._go_local()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._at_exit())

    # -------------------------------------------------------------- schedule
    def _go_local(self) -> None:
        """The warm-up is over: the anchor is the (identical) parameters."""
        self.layout.read(self.snap)
        self.anchor.detach().copy_(self.layout.mine(self.snap))
        self._site.local = True
        self.module.forward_buffers.group = self.sites.inside  # the forward's buffer broadcast stays in the host

    def _proposal(self) -> int:
        if self.delay != "auto":
            return self.delay
        if self._last_exchange_s is None or not self._step_times:
            return 1
        step_s = sorted(self._step_times)[len(self._step_times) // 2]
        return max(1, min(self.sync_every, math.ceil(self._last_exchange_s / max(step_s, 1e-9))))

    def step(self, closure=None):
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        now = time.perf_counter()
        if self._last_step_at is not None:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        self.steps += 1
        if self._pending is not None and self.steps == self._agreed_apply_at():
            self._apply()
        if self.steps == self.warmup_steps:
            self._go_local()
        elif self.steps > self.warmup_steps and (self.steps - self.warmup_steps) % self.sync_every == 0:
            self._pending = OuterSync(self, self.steps, self._proposal(), self._threaded)
            self._apply_at = 0
        return loss

    def _agreed_apply_at(self) -> int:
        """The step the sync in flight applies at (the first call after its
        start waits for the ranks' agreement on the delay)."""
        if self._apply_at == 0:
            self._apply_at = self._pending.step + self._pending.wait_agreed(self.sync_timeout_s)
        return self._apply_at

    def _apply(self) -> None:
        sync, t0 = self._pending, time.perf_counter()
        sync.finish(self.sync_timeout_s)
        self._stats["exposed_wait_s"] += time.perf_counter() - t0
        with torch.no_grad():
            views = self.layout.views(self.snap)
            params = self.layout.params
            if all(p.dtype == torch.float32 for p in params):
                torch._foreach_add_(params, views)
            else:
                for p, v in zip(params, views):
                    p.add_(v.to(p.dtype))
        self._pending = None
        self._last_exchange_s = sync.seconds
        s = self._stats
        s["syncs"] += 1
        s["bytes_between_hosts"] += sync.bytes
        s["last_sync_step"], s["exchange_s_last"] = sync.step, round(sync.seconds, 6)
        s["delays"] = (s["delays"] + [sync.delay])[-16:]

    def finish(self, average: bool = True) -> None:
        """The end of training (call it before ``destroy_process_group``): the
        sync in flight, if any, is waited for and applied; with ``average``
        the hosts' parameters are then averaged exactly (fp32, blocking), so
        every rank holds the same model to evaluate or save.  Training may go
        on after it (the next sync is due on the usual schedule)."""
        if self._pending is not None:
            self._agreed_apply_at()
            self._apply()
        if not average:
            return
        sites, lay = self.sites, self.layout
        lay.read(self.snap)
        mine = lay.mine(self.snap)
        groups.all_reduce(mine, sites.across)
        mine.div_(sites.num_hosts)
        if sites.ranks_per_host > 1:
            groups.wait(groups.all_gather_into_tensor(self.theta, mine.clone(), sites.inside_sync))
        else:
            self.theta.copy_(mine)
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in lay.params], lay.views(self.theta))
            buffers = [b for b in self.module.module.buffers()]
            if buffers:  # rank 0's buffers (BatchNorm statistics) everywhere, as DDP's construction
                dist._broadcast_coalesced(self.module.process_group, buffers, 256 << 20, 0)
        self.anchor.detach().copy_(lay.mine(self.theta))

    def _at_exit(self) -> None:
        """A sync still in flight when the interpreter exits: let it end (its
        collectives pair with the other ranks', which wait here too), so gloo's
        threads are not torn down under it (an abort at exit)."""
        if self._pending is not None and self._pending.thread is not None:
            self._pending.thread.join(self.sync_timeout_s)

    def stats(self) -> dict:
        """What the outer tier sent and when (plain data)."""
        s = dict(self._stats)
        s.update(sites=self.sites.topology.describe(), wire=self.wire_format, sync_every=self.sync_every,
                 warmup_steps=self.warmup_steps, steps=self.steps, local=self._site.local,
                 in_flight=self._pending is not None, shard_numel=self.layout.shard)
        return s

    # ------------------------------------------------------------- torch API
    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group) -> None:
        raise RuntimeError("fastddp.CrossSite: parameter groups are fixed at construction (the outer "
                           "sync's layout covers the module's parameters); build the inner optimizer "
                           "with every group first")

    def __repr__(self) -> str:
        return f"CrossSite({self.optim!r}, sync_every={self.sync_every}, wire={self.wire_format})"

    def state_dict(self) -> dict:
        """The inner optimizer's state plus this rank's outer state (its
        shard: save every rank's).  A sync in flight is waited for and its
        correction saved with the step it applies at: a resume is bit for bit."""
        sd = self.optim.state_dict()
        pending = None
        if self._pending is not None:
            self._agreed_apply_at()
            self._pending.finish(self.sync_timeout_s)
            pending = {"step": self._pending.step, "apply_at": self._apply_at, "delay": self._pending.delay,
                       "seconds": self._pending.seconds, "bytes": self._pending.bytes,
                       "correction": self.snap.clone()}
        sd["cross_site"] = {
            "steps": self.steps, "hosts": self.sites.num_hosts, "ranks_per_host": self.sites.ranks_per_host,
            "local_rank": self.sites.local_rank, "wire": self.wire_format, "numel": self.layout.numel,
            "anchor": self.anchor.detach().clone(), "outer": self.outer.state_dict(),
            "residual": None if self.wire.residual is None else self.wire.residual.clone(),
            "local": self._site.local, "pending": pending, "last_exchange_s": self._last_exchange_s,
            "stats": dict(self._stats)}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        cs = sd.pop("cross_site", None)
        if cs is None:
            raise ValueError("fastddp.CrossSite.load_state_dict: no 'cross_site' entry: this is a plain "
                             "optimizer's state_dict, not one saved by CrossSite.state_dict()")
        want = {"hosts": self.sites.num_hosts, "ranks_per_host": self.sites.ranks_per_host,
                "local_rank": self.sites.local_rank, "wire": self.wire_format, "numel": self.layout.numel}
        got = {k: cs[k] for k in want}
        if got != want:
            raise ValueError(f"fastddp.CrossSite.load_state_dict on rank {groups.rank(self.module.process_group)}: "
                             f"saved for {got}, this run is {want}: load each rank's own state_dict into "
                             "the same sites, wire and model")
        if self._pending is not None:
            self._pending.finish(self.sync_timeout_s)
        self.optim.load_state_dict(sd)
        self.steps = cs["steps"]
        self.anchor.detach().copy_(cs["anchor"])
        self.outer.load_state_dict(cs["outer"])
        if cs["residual"] is not None:
            self.wire.residual.copy_(cs["residual"])
        self._site.local = cs["local"]
        self._last_exchange_s = cs["last_exchange_s"]
        self._stats = dict(cs["stats"])
        self._pending = None
        p = cs["pending"]
        if p is not None:
            self.snap.copy_(p["correction"])
            self._pending = OuterSync.restored(self, p)
            self._apply_at = p["apply_at"]
