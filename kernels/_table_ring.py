"""The pointer-table slots of one layout binding, and how they reach the device.

On a synchronous device (CPU: the interpreter runs each launch before the
call returns) a binding has one table, rewritten in place.  On an
asynchronous one (CUDA) a launch reads its table when the GPU runs it, which
may be several steps after the host queued it, so a table is never rewritten
while a launch that read it, or the copy that filled it, may still run:

* **Slots are found by content.**  Fresh gradients every step
  (``zero_grad(set_to_none=True)`` with bucket views) are ``record_stream``ed,
  so the caching allocator hands their blocks out again only once the GPU
  has run the pack that read them: their addresses cycle through about one
  set per step of GPU lag.  A slot keeps its content until it is recycled,
  so when a set comes back its slot is reused as it is: no write, no copy,
  and reusing it while launches still read it is safe because nothing
  changes.
* **A new content goes into an idle slot** (``Event.query()``: no host wait),
  the least recently used one, which keeps the contents most likely to come
  back.  While every slot is in flight the ring grows, by doubling (one
  pinned and one device allocation per growth), up to :data:`MAX_SLOTS`: a
  steady state stops growing once the ring covers the GPU's lag and then
  allocates nothing.
* Only past :data:`MAX_SLOTS` slots in flight does the host wait, for the
  least recently used slot (``table_waits``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._counters import bump as _bump

# Slots per binding on an asynchronous device.  The host runs ahead of the GPU
# until CUDA's launch queue (about a thousand pending launches) fills; a
# small model's step is of the order of a hundred launches, so the host can be
# ~10 steps ahead with every bucket's table rewritten each step.  16 slots
# cover that without a wait; one slot costs (5 + tensors) * 8 bytes pinned
# and the same on the device.
MAX_SLOTS = 16


class CudaQueue:
    """Tables, streams and events of a CUDA device.  (Tests stand in an
    emulated asynchronous device for CPU tensors through :data:`ASYNC_QUEUES`.)"""

    @staticmethod
    def tables(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` tables of ``width`` int64: pinned host staging and device copies."""
        host = torch.empty((rows, width), dtype=torch.int64, pin_memory=True)
        return host, torch.empty((rows, width), dtype=torch.int64, device=device)

    @staticmethod
    def stream(device: torch.device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def event():
        return torch.cuda.Event()


#: device type -> how its tables are queued; a device type not here is synchronous
ASYNC_QUEUES = {"cuda": CudaQueue}


@dataclass
class Slot:
    host: torch.Tensor          # int64 [width]; pinned on CUDA
    dev: torch.Tensor           # == host on a synchronous device
    key: tuple | None = None    # the content, while it is valid
    fallback: list = field(default_factory=list)  # the tensors this content leaves to torch
    used: int = -1              # the ring's clock at its last use
    events: dict = field(default_factory=dict)  # stream handle -> event recorded after its last launch
    upload: object = None       # event recorded after the copy into ``dev``
    ordered: set = field(default_factory=set)   # streams known to run after that copy

    def __post_init__(self):
        self.host_np = self.host.numpy()

    def idle(self) -> bool:
        """No launch that read this slot may still run (each launch's event is
        recorded after it, on the stream that also ran the slot's copy)."""
        return all(ev.query() for ev in self.events.values())


class TableRing:
    """The slots of one binding; every method is called with the binding's lock held."""

    def __init__(self, width: int, device: torch.device):
        self.width = width
        self.device = device
        self.queue = ASYNC_QUEUES.get(device.type)
        self.slots: list[Slot] = []
        self.by_key: dict[tuple, Slot] = {}
        self.cur: Slot | None = None
        self.clock = 0

    def stream(self):
        """The stream of the call in progress; None on a synchronous device."""
        return None if self.queue is None else self.queue.stream(self.device)

    def find(self, key: tuple) -> Slot | None:
        """The slot that holds exactly this content (asynchronous devices only)."""
        return self.by_key.get(key) if self.queue is not None else None

    def use(self, slot: Slot, stream) -> None:
        """Launches on ``stream`` are about to read ``slot`` as it is."""
        if stream is not None and stream.cuda_stream not in slot.ordered:
            stream.wait_event(slot.upload)  # a stream new to this table: after its copy (no host wait)
            slot.ordered.add(stream.cuda_stream)
        self._touch(slot)

    def write(self, vals: list[int], key: tuple | None, fallback: list[int], stream) -> Slot:
        """Put ``vals`` into a slot no launch can still read and queue its copy."""
        # _take returns only a slot whose launches have all run (or, at the cap,
        # after waiting for them): its pinned staging is no longer being copied
        # and no queued kernel reads its device table, so neither is overwritten
        # under a launch that was queued with it.
        slot = self._take()
        if slot.key is not None:
            del self.by_key[slot.key]
        slot.host_np[:] = vals
        slot.fallback = fallback
        if stream is not None:
            slot.dev.copy_(slot.host, non_blocking=True)
            if slot.upload is None:
                slot.upload = self.queue.event()
            slot.upload.record(stream)
            slot.ordered = {stream.cuda_stream}
            slot.key = key
            self.by_key[key] = slot
        _bump("table_uploads")
        self._touch(slot)
        return slot

    def after_launch(self, stream) -> None:
        """Record that the current slot was read by work on ``stream``."""
        if stream is not None and self.cur is not None:
            events = self.cur.events
            ev = events.get(stream.cuda_stream)
            if ev is None:
                ev = events[stream.cuda_stream] = self.queue.event()
            ev.record(stream)

    def _touch(self, slot: Slot) -> None:
        self.clock += 1
        slot.used = self.clock
        self.cur = slot

    def _take(self) -> Slot:
        """A slot safe to rewrite: the least recently used idle one, else one of
        a grown ring, else (at the cap) the least recently used after a wait."""
        if self.queue is None:
            if not self.slots:
                table = torch.empty(self.width, dtype=torch.int64)
                self.slots.append(Slot(table, table))  # the launch reads it before the call returns
            return self.slots[0]
        by_age = sorted(self.slots, key=lambda s: s.used)
        for slot in by_age:
            if slot.idle():
                return slot
        if len(self.slots) < MAX_SLOTS:
            return self._grow()
        _bump("table_waits")
        oldest = by_age[0]
        for ev in oldest.events.values():
            ev.synchronize()  # genuinely in flight: MAX_SLOTS tables are queued
        return oldest

    def _grow(self) -> Slot:
        """Double the ring (at least one slot) in one pinned and one device
        allocation; returns one of the new slots, all of them idle."""
        rows = min(max(1, len(self.slots)), MAX_SLOTS - len(self.slots))
        host, dev = self.queue.tables(rows, self.width, self.device)
        new = [Slot(host[r], dev[r]) for r in range(rows)]
        self.slots.extend(new)
        return new[0]
