"""Which parameters are ready, and what that means this iteration.

The bookkeeping behind the reducer's countdown, as torch's reducer keeps it:
the ready marks, the unused-parameter protocol (graph walk from the outputs,
the used-map all-reduce, torch's lazy "globally unused" rule), static-graph
hook counting (learnt in the first backward, checked after), the ready order
recorded for the one bucket rebuild, and the errors a user can act on.
:meth:`Readiness.reset` starts an iteration; :meth:`Readiness.abort` drops a
failed one so the next starts clean.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import groups

__all__ = ["PinnedStaging", "Readiness", "UsedMap"]


class Readiness:
    def __init__(self, names: Sequence[str], pg, device, *, static: bool, find_unused: bool,
                 should_rebuild: Callable[[], bool], on_first_hook: Callable[[], None] | None = None):
        n = len(names)
        self.names, self.pg, self.device = list(names), pg, device
        self.rank, self.world = groups.rank(pg), groups.size(pg)
        self.static = static
        self.dynamic_find_unused = find_unused and not static
        self.should_rebuild = should_rebuild
        self.on_first_hook = on_first_hook
        self.expect_hooks = False
        self.marked = bytearray(n)
        self.marked_unused = False
        self.unused: list[int] = []
        self.foreign: list[torch.Tensor] = []  # the last walk's leaves that are not DDP's params
        self.used_map = UsedMap(n, pg, device)
        self.local_used = self.used_map.local  # the hooks' marks: the same bytearray for good
        self.hook_counts = [0] * n        # static graph: hooks per param in the first backward
        self.per_iter_counts: list[int] = []
        self.ready_order: list[int] = []  # for the one bucket rebuild
        self.collect_order = False
        self.armed_first = 0              # backwards armed: the first of their forward (debug: ranks agree)
        self.armed_extra = 0              # and the extra ones (a second backward through the outputs)
        self.num_bwd_calls = 0            # torch's num_bwd_calls_: backwards that fired a hook
        self.first_hook_called = False

    # torch counts backward passes, not forwards: a forward re-run inside
    # backward (non-reentrant checkpoint around the whole module) must not end
    # the first iteration early.
    @property
    def static_first_iteration(self) -> bool:
        return self.static and self.num_bwd_calls <= 1

    @property
    def static_after_first_iteration(self) -> bool:
        return self.static and self.num_bwd_calls > 1

    @property
    def track_used(self) -> bool:
        return self.dynamic_find_unused or self.static_first_iteration

    @property
    def require_finalize(self) -> bool:
        """torch's require_finalize_: this backward marked some parameter
        ready and its end-of-backward finalize has not run."""
        return self.expect_hooks and any(self.marked)

    # ------------------------------------------------------------ iteration
    def reset(self, outputs: Sequence[torch.Tensor], index_of: dict[int, int]) -> None:
        """A backward that DDP reduces is coming (after its forward)."""
        self._arm(extra=False, unused=(lambda: self._search_unused(outputs, index_of)))

    def rearm(self, unused: list[int]) -> None:
        """Another backward through the outputs of an already reduced forward
        (``retain_graph=True``): reduce it too, with that forward's unused
        params.  The ready order was learnt from its first backward."""
        self._arm(extra=True, unused=lambda: list(unused))

    def _arm(self, extra: bool, unused: Callable[[], list[int]]) -> None:
        self.expect_hooks = True
        self.first_hook_called = False
        self.marked = bytearray(len(self.names))
        self.marked_unused = False
        if extra:
            self.armed_extra += 1
        else:
            self.armed_first += 1
        if self.dynamic_find_unused:
            self.used_map.forget()
            self.unused = unused()
        if self.static:
            self.per_iter_counts = list(self.hook_counts)
        self.collect_order = not extra and self.should_rebuild()

    def _search_unused(self, outputs, index_of) -> list[int]:
        """Params whose AccumulateGrad node is not reachable from the outputs."""
        seen, reached = set(), set()
        self.foreign = []
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                i = index_of.get(id(var))
                if i is not None:
                    reached.add(i)
                else:
                    self.foreign.append(var)  # not DDP's: an input, another module's, or changed after wrapping
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None and nxt not in seen)
        return [i for i in range(len(self.names)) if i not in reached]

    def on_hook(self, index: int, has_grad: bool) -> list[int]:
        """One post-accumulate hook fired: the indices to mark ready now."""
        if not self.first_hook_called:
            self.first_hook_called = True
            self.num_bwd_calls += 1
            if self.on_first_hook is not None and self.expect_hooks:
                self.on_first_hook()
        if self.track_used and has_grad:
            self.local_used[index] = 1
        if self.static_first_iteration:
            self.hook_counts[index] += 1
            return []
        if not self.expect_hooks:
            # no_sync(), eval, or a backward through ``ddp.module``'s own
            # forward (a deliberate local step): local, as torch.  A second
            # backward through a DDP forward's outputs was re-armed by
            # :meth:`rearm` before any hook of it fired.
            return []
        out = []
        if not self.marked_unused:
            self.marked_unused = True
            out.extend(self.unused)
        if self.static:
            left = self.per_iter_counts[index]
            if left <= 0:
                self.abort()
                raise RuntimeError(
                    "Your training graph has changed in this iteration, e.g., one parameter is "
                    "unused in first iteration, but then got used in the second iteration. this "
                    "is not compatible with static_graph set to True. "
                    f"fastddp: parameter {self.names[index]!r} (index {index}) produced more "
                    "gradients in this backward than in the first iteration. Pass "
                    "static_graph=False (with find_unused_parameters=True if some parameters "
                    "are unused in some iterations).")
            self.per_iter_counts[index] = left - 1
            if left > 1:
                return out
        if self.collect_order:
            self.ready_order.append(index)
        out.append(index)
        return out

    def mark(self, index: int) -> None:
        if self.marked[index]:
            self.abort()
            raise RuntimeError(
                "Expected to mark a variable ready only once. "
                f"fastddp: parameter {self.names[index]!r} (index {index}) was marked ready twice in "
                "one iteration: several autograd hooks fired for it. This happens when a parameter "
                "is used outside forward(), when parameters are shared across concurrent "
                "forward/backward passes, or when reentrant backward passes (checkpoint with "
                "use_reentrant=True) reuse it. If your graph does not change between iterations, "
                "pass static_graph=True.")
        self.marked[index] = 1

    # ---------------------------------------------------------- unused map
    def all_reduce_used_map(self) -> None:
        self.used_map.all_reduce()

    def learn_static_unused(self) -> None:
        """static_graph, end of the first backward: the params that never fired."""
        self.all_reduce_used_map()
        self.unused = [i for i, c in enumerate(self.hook_counts) if c == 0]

    def globally_unused(self, index: int) -> bool:
        """torch's lazy rule: a param used locally is used globally; otherwise
        wait for the all-reduced used-map (once) and look there.  With
        static_graph the map of the first iteration holds for good."""
        if self.local_used[index]:
            return False
        used = self.used_map.global_used
        if used is None:
            if not self.used_map.fresh:
                return False  # no map was reduced: nothing is known to be unused
            used = self.used_map.read_back()
        return used[index] == 0

    def finish(self) -> None:
        """The iteration's buckets are reduced."""
        self.expect_hooks = False
        self.first_hook_called = False
        m = self.used_map
        if self.static and m.fresh and 0 in self.local_used:
            m.read_back()  # the first iteration's map holds for good
        m.settle()  # never let the next iteration's map race this one
        if self.dynamic_find_unused:
            m.clear()
        if self.static_after_first_iteration and self.should_rebuild():
            self.ready_order.extend(self.unused)

    def abort(self) -> None:
        """An error is being raised in this iteration: nothing of it (armed
        hooks, marks, a partial ready order) may leak into the next one."""
        self.expect_hooks = False
        self.first_hook_called = False
        self.ready_order = []

    # --------------------------------------------------------------- errors
    def unfinished_error(self) -> RuntimeError:
        missing = [i for i in range(len(self.names)) if not self.marked[i]]
        names = ", ".join(f"{self.names[i]!r} (index {i})" for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        if self.static:
            hint = ("With static_graph=True the set of parameters used must be the same in every "
                    "iteration as in the first one: your graph has changed (a parameter used in "
                    "the first iteration is unused now). Pass static_graph=False with "
                    "find_unused_parameters=True if the graph changes between iterations.")
        else:
            hint = ("You can enable unused parameter detection by passing the keyword argument "
                    "`find_unused_parameters=True` to `fastddp.DistributedDataParallel` (as with "
                    "torch's DDP), and by making sure all `forward` function outputs participate "
                    "in calculating loss. (A parameter replaced in the module after wrapping, or "
                    "set to requires_grad=False, also stops getting gradients: wrap the model again.)")
        return RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. "
            "This error indicates that your module has parameters that were not used in producing "
            f"loss. {hint} Parameters that did not receive a gradient on rank {self.rank}: "
            f"{names}{more}.")

    def check_agreement(self) -> None:
        """Debug mode: every rank compares which params were marked ready
        before any bucket is reduced, so a rank whose graph differs raises
        here instead of leaving its peers blocked in a collective."""
        if self.world == 1:
            return
        marked = torch.tensor([self.armed_first, self.armed_extra, *self.marked], dtype=torch.int64,
                              device=self.device)
        if groups.is_registered(self.pg) and groups.backend_name(self.pg) == "gloo":
            dist.monitored_barrier(group=self.pg, wait_all_ranks=True)
        every = [torch.empty_like(marked) for _ in range(self.world)]
        groups.all_gather(every, marked, self.pg)
        every = [e.cpu() for e in every]
        counts = [tuple(e[:2].tolist()) for e in every]
        if len(set(counts)) > 1:
            self.abort()
            raise RuntimeError(
                f"fastddp (debug mode): the ranks disagree on how many backwards DDP reduces: "
                f"{', '.join(f'rank {r}: {a} + {b} extra' for r, (a, b) in enumerate(counts))} so far. A backward "
                "through the outputs of a DDP forward is averaged, a second one over the same forward "
                "(retain_graph=True) too, so every rank must run the same forwards and backwards "
                "(no rank-dependent extra backward, no_sync() on every rank or none); otherwise "
                "buckets of different backwards are averaged together.")
        every = [e[2:] for e in every]
        for r in range(self.world):
            diff = (every[r] != every[0]).nonzero().flatten().tolist()
            if diff:
                self.abort()
                state = lambda rank, i: "ready" if every[rank][i] else "no gradient"  # noqa: E731
                desc = ", ".join(f"{self.names[i]!r} ({state(0, i)} on rank 0, {state(r, i)} on rank {r})"
                                 for i in diff[:10])
                raise RuntimeError(
                    f"fastddp (debug mode): the ranks disagree on which parameters received a "
                    f"gradient in this backward: {desc}. Without find_unused_parameters=True "
                    "every rank must use the same parameters each iteration (otherwise a rank "
                    "waits forever in a bucket's all-reduce). Pass "
                    "find_unused_parameters=True, or make the graphs agree.")


class UsedMap:
    """The used-parameter map and its all-reduce (torch's ``local_used_map_``
    and ``local_used_map_dev_``), allocated once, at the first reduction.

    ``local`` holds this rank's marks (1: the param got a gradient); the
    reduced map tells, for a param unused here, whether another rank used
    it.  A step queues the map's upload and its all-reduce and nothing else:
    the host reads the reduced map back (one blocking copy) only when asked,
    i.e. when some param was unused on this rank (torch's rule), so a step
    that used every param never waits for the device.
    """

    __slots__ = ("local", "pg", "device", "global_used", "fresh", "work", "_zeros", "_local_u8",
                 "_map", "_staging")

    def __init__(self, n: int, pg, device):
        self.local = bytearray(n)  # never replaced: ``_local_u8`` views its memory
        self.pg, self.device = pg, torch.device(device)
        self.global_used: list[int] | None = None  # the reduced map, once read back
        self.fresh = False  # a map was reduced and not read back yet
        self.work = None
        self._zeros = bytes(n)
        self._map: torch.Tensor | None = None
        self._staging: PinnedStaging | None = None

    @property
    def tensor(self) -> torch.Tensor | None:
        """The map on the params' device (None before the first reduction)."""
        return self._map

    def _allocate(self) -> None:
        n = len(self.local)
        self._local_u8 = torch.frombuffer(self.local, dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        self._map = torch.zeros(n, dtype=torch.int32, device=self.device)
        if self.device.type == "cuda":
            self._staging = PinnedStaging(n, pinned=True, event=torch.cuda.Event())

    def all_reduce(self) -> None:
        """Queue the upload of ``local`` and the map's all-reduce."""
        if self._map is None:
            self._allocate()
        # The previous reduction writes the map (still pending only after an
        # aborted iteration): the upload must follow it.  A stream wait on
        # NCCL; finish() made the same wait otherwise.  A read-back is a
        # blocking copy, done by now.  The map is never freed: no record_stream.
        self.settle()
        if self._staging is None:
            self._map.copy_(self._local_u8)  # CPU: the map itself is the persistent buffer
        else:
            self._staging.upload(self.local, self._local_u8, self._map,
                                 torch.cuda.current_stream(self._map.device))
        self.work = groups.all_reduce(self._map, self.pg, async_op=True)
        self.global_used, self.fresh = None, True

    def settle(self) -> None:
        """Wait for the reduction (a stream wait on NCCL; gloo: blocks)."""
        if self.work is not None:
            work, self.work = self.work, None
            groups.wait(work)

    def read_back(self) -> list[int]:
        """The reduced map on the host: one blocking copy on CUDA."""
        self.settle()
        if self.global_used is None:
            self.global_used = self._map.tolist()
        self.fresh = False
        return self.global_used

    def forget(self) -> None:
        """A new iteration: nothing is known of its map yet."""
        self.global_used, self.fresh = None, False

    def clear(self) -> None:
        """No marks for the next iteration (in place: ``_local_u8`` views them)."""
        self.local[:] = self._zeros
        self.forget()


class PinnedStaging:
    """The host buffer the map is uploaded from, with ``non_blocking=True``.

    The copy engine reads it whenever the queued copy runs, possibly steps
    after the host queued it (the host runs ahead of the device), so the host
    must not rewrite it while an earlier upload may still read it.  It is
    rewritten only when the marks differ from what it holds: with the same
    params used every step (all of them, most often) it never is, and every
    upload reads the same values whenever it runs.  Before a rewrite, the
    event recorded after the last upload is queried (no sync) and waited for
    only if that upload has not run yet.  The used set changed, so this step
    or the previous one had a param unused here, and such a step reads the
    reduced map back (a blocking copy queued after its upload), which in the
    common case has completed the upload already.
    """

    __slots__ = ("buffer", "_holds", "_copied")

    def __init__(self, n: int, *, pinned: bool, event):
        self.buffer = torch.zeros(n, dtype=torch.int32, pin_memory=pinned)
        self._holds = bytearray(n)  # what ``buffer`` holds
        self._copied = event        # recorded after each upload out of ``buffer``

    def upload(self, local: bytearray, local_u8: torch.Tensor, dst: torch.Tensor, stream) -> None:
        """Queue ``dst <- local`` on ``stream`` (the current one)."""
        if local != self._holds:
            if not self._copied.query():
                self._copied.synchronize()
            self.buffer.copy_(local_u8)
            self._holds[:] = local
        dst.copy_(self.buffer, non_blocking=True)
        self._copied.record(stream)
