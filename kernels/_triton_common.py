"""What the pack and unpack kernels share: dtype codes, block sizes, and the
host-side tables a :class:`~fastddp.kernels.Layout` caches.

Tables (both int64, on the tensors' device)::

    ptr table   [5 + n_tensors]   0: data_ptr() of the flat buffer
                                  1: the scale as fp64 bits        (fp64 math)
                                  2: fp32(scale) as fp64 bits      (fp32 math)
                                  3: data_ptr() of pack's error-feedback
                                     residual (indexed like the flat
                                     buffer), 0 when there is none
                                  4: data_ptr() of pack's int32 health
                                     flag, 0 when there is none
                                  5 + i: data_ptr() of tensor i, 0 when the
                                     launcher copies that tensor with torch
    chunk table [n_chunks, 4]     (ptr-table slot of the tensor, start in the
                                   tensor, start in the flat buffer, length)

The chunk table depends only on (numels, offsets, dtypes, BLOCK): a
:class:`Plan` builds it once and every Layout of that content shares it.
The pointer table is each Layout's own (:class:`Binding`) and is rewritten
only when a pointer (the residual's and the flag's included) or the scale
changed since that layout's last call.  On CUDA it is written into a pinned
host buffer and copied with ``non_blocking=True``, into a slot of a ring
(:mod:`fastddp.kernels._table_ring`) that no launch can still be reading
(``Event.query()``); a content the ring still holds (gradients whose
addresses cycle, as fresh ones every step do) is reused without a copy, and
the host never waits unless a layout has :data:`MAX_SLOTS` tables in flight.

Alignment is decided per chunk, at run time, inside the one launch: a full
chunk whose addresses are 16-byte aligned takes the vectorised accesses, any
other chunk the masked scalar ones.

Bit-exactness (the contract of :mod:`fastddp.kernels.reference`):

* bf16 is handled as its 16 raw bits: widened with a shift, narrowed with
  round-to-nearest-even on the integer bits, because the interpreter's own
  ``.to(tl.bfloat16)`` truncates while the GPU rounds;
* fp64 -> fp16/bf16 goes through fp32 first, as torch does (``c10::Half``
  and ``c10::BFloat16`` are built from a float);
* kernels are launched with ``enable_fp_fusion=False`` (no FMA contraction):
  with a residual, ``x * scale`` and ``+ r`` round separately, as the
  reference's two torch ops do.
"""

from __future__ import annotations

import collections
import struct
import threading
from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch
import triton.language as tl

from ._strides import row_major_strides, same_memory_order
from ._table_ring import MAX_SLOTS, TableRing  # noqa: F401 (MAX_SLOTS: read by tests and benches)

# ----------------------------------------------------------------- dtype codes
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
ELSIZE = {0: 4, 1: 2, 2: 2, 3: 8}

# MODE of a launch: what is applied to the source values in the compute dtype.
MODE_CAST, MODE_MUL, MODE_DIV = 0, 1, 2

# ----------------------------------------------------------------- block sizes
# Elements per program.  The interpreter pays milliseconds per program
# instance, so it wants few, large programs; on a GPU 2K elements (16 per thread at 4
# warps) keeps many programs in flight on small buckets.  Plans are keyed by
# BLOCK, so bench/gpu_kernels.py may sweep these.
BLOCK_INTERPRET = 16384
BLOCK_GPU = 2048
NUM_WARPS_GPU = 4

_HEAD = 5  # ptr-table slots before the tensors' pointers

_dtype_of = attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_get_device = torch.Tensor.get_device
_is_cpu = attrgetter("is_cpu")
_is_contiguous = torch.Tensor.is_contiguous
_stride = torch.Tensor.stride


# The kernels keep their arithmetic inline rather than in shared @triton.jit
# helpers: under the interpreter every nested @triton.jit call re-patches
# triton.language (~2.7 ms a call, measured), which tripled the cost of a
# program instance.  The constexpr dtypes below select the code at compile time.

#: element type the kernels load/store for each dtype code (bf16 as raw bits)
STORAGE = {0: tl.float32, 1: tl.float16, 2: tl.uint16, 3: tl.float64}


# ============================================================== host helpers


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1."""
    return type(kernel).__name__ == "InterpretedFunction"


def compute_type(a: int, b: int):
    """The compute dtype of a (source, destination) pair of dtype codes."""
    return tl.float64 if 3 in (a, b) else tl.float32


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def scale_slots(scale: float, divide: float | None, device: torch.device) -> tuple[int, int, int]:
    """(MODE, fp64 bits of the fp64 factor, fp64 bits of the fp32 factor).

    On CUDA, torch's ``div`` by a python scalar multiplies by the reciprocal
    ``opmath(1) / opmath(b)`` computed in the compute dtype; the kernels do
    the same there.  On CPU (the interpreter) torch divides, and so do they.
    """
    if divide is not None:
        if device.type == "cuda":
            r64 = 1.0 / float(divide)
            r32 = float(np.float32(1.0) / np.float32(divide))
            return MODE_MUL, _f64_bits(r64), _f64_bits(r32)
        return MODE_DIV, _f64_bits(divide), _f64_bits(float(np.float32(divide)))
    if scale != 1.0:
        return MODE_MUL, _f64_bits(scale), _f64_bits(float(np.float32(scale)))
    return MODE_CAST, 0, 0


@dataclass
class Group:
    """The tensors of one dtype: one launch."""

    kind: int                  # dtype code of these tensors
    members: list[int]         # their indices in the call's tensor list
    n_chunks: int
    chunks: torch.Tensor | None  # int64 [n_chunks * 4] view on the device


class Plan:
    """What a (layout content, dtypes, BLOCK, device) needs to launch and never
    changes: the groups and their chunk tables.  Shared by every Layout of
    that content (repeated layers give identically shaped buckets); the
    pointer tables, which do change, belong to each Layout's :class:`Binding`."""

    def __init__(self, numels: Sequence[int], offsets: Sequence[int], kinds: Sequence[int],
                 flat_kind: int, block: int, device: torch.device):
        self.device = device
        self.block = block
        self.flat_kind = flat_kind
        self.n = len(numels)
        self.numels = [int(n) for n in numels]
        self.cuda = device.type == "cuda"
        order: dict[int, list[int]] = {}
        for i, k in enumerate(kinds):
            order.setdefault(k, []).append(i)
        rows_all, spans = [], []
        for kind, members in order.items():
            rows = []
            for i in members:
                n, off = int(numels[i]), int(offsets[i])
                if n == 0:
                    continue
                starts = np.arange(0, n, block, dtype=np.int64)
                r = np.empty((starts.size, 4), dtype=np.int64)
                r[:, 0] = _HEAD + i
                r[:, 1] = starts
                r[:, 2] = off + starts
                r[:, 3] = np.minimum(block, n - starts)
                rows.append(r)
            spans.append((kind, members, sum(r.shape[0] for r in rows)))
            rows_all.extend(rows)
        table = (np.concatenate(rows_all).reshape(-1) if rows_all else np.zeros(0, dtype=np.int64))
        table_dev = torch.from_numpy(table).to(device)  # once per plan
        self.groups: list[Group] = []
        at = 0
        for kind, members, n_chunks in spans:
            view = table_dev.narrow(0, at * 4, n_chunks * 4) if n_chunks else None
            self.groups.append(Group(kind, members, n_chunks, view))
            at += n_chunks
        self.lock = threading.Lock()
        self.shared: Binding | None = None  # the binding of the public API's per-call Layouts


class Binding:
    """One Layout's pointer tables for one :class:`Plan`.

    A steady-state call (the same addresses and scale as the previous call of
    this layout, which the caching allocator gives a bucket's grads step after
    step) writes nothing and copies nothing.  Other contents live in a
    :class:`~fastddp.kernels._table_ring.TableRing`: a content seen before and
    still held is reused without a copy, a new one goes into a slot no launch
    can still read, and the host waits only when :data:`MAX_SLOTS` tables of
    ONE layout are all in flight.

    The tensors are also matched with their layout slots here: a tensor whose
    memory order is its slot's (contiguous for a row-major slot; the slot's
    shape and strides, dense, for a strided one) is read or written in
    memory order by the kernels; any other tensor gets a 0 in the table (its
    chunks do nothing) and is returned as a fallback, for the op layer to copy
    with torch, alone."""

    def __init__(self, plan: Plan, layout):
        self.plan = plan
        self.lock = threading.Lock()
        self._strides = list(layout.strides)
        self._strided = any(s is not None for s in self._strides)
        self._shapes = layout.shapes
        # every tensor's strides when each has its slot's (row-major slots: row-major strides)
        self._want = [row_major_strides(sh) if st is None else st for sh, st in zip(layout.shapes, self._strides)]
        self.ring = TableRing(_HEAD + plan.n, plan.device)
        self._last: list[int] | None = None
        self._stream = None  # the stream of the call in progress (CUDA)

    def match(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Indices of the tensors the kernels cannot serve in memory order."""
        if self._strided:
            if list(map(_stride, tensors)) == self._want:
                return []  # every tensor has its slot's strides (C-speed compare)
        elif all(map(_is_contiguous, tensors)):
            return []  # all row-major, as their slots: the common case
        bad = []
        for i, (t, want) in enumerate(zip(tensors, self._strides)):
            if want is None:
                ok = t.is_contiguous()
            else:
                ok = t.stride() == want or (t.shape == self._shapes[i] and
                                            same_memory_order(t.shape, t.stride(), want))
            if not ok and self.plan.numels[i]:
                bad.append(i)
        return bad

    def refresh(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], s64: int, s32: int,
                res_ptr: int = 0, flag_ptr: int = 0) -> tuple[torch.Tensor, list[int]]:
        """Bring the pointer table up to date; returns (the device table to launch
        with, the fallback tensors' indices).  ``res_ptr`` / ``flag_ptr``: pack's
        residual and health-flag addresses (0: none).  Called with ``self.lock`` held."""
        vals = [flat.data_ptr(), s64, s32, res_ptr, flag_ptr]
        vals.extend(map(_data_ptr, tensors))
        fallback = self.match(tensors)
        for i in fallback:
            vals[_HEAD + i] = 0
        ring = self.ring
        stream = self._stream = ring.stream()
        if vals == self._last:
            slot = ring.cur
            ring.use(slot, stream)
            return slot.dev, slot.fallback
        self._vet(flat, tensors)  # other tensors: vet them (numels, devices)
        key = tuple(vals) if ring.queue is not None else None
        slot = ring.find(key)
        if slot is not None:
            ring.use(slot, stream)  # a content still held: no write, no copy
        else:
            slot = ring.write(vals, key, fallback, stream)
        self._last = vals
        return slot.dev, slot.fallback

    def _vet(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Numels and devices of a new set of tensors (C-speed maps; the slow
        loop only runs to name the offender)."""
        if list(map(_numel, tensors)) != self.plan.numels:
            for i, (t, n) in enumerate(zip(tensors, self.plan.numels)):
                if t.numel() != n:
                    raise ValueError(f"tensor {i} has {t.numel()} elements but its layout slot holds {n}")
        ok = (set(map(_get_device, tensors)) <= {flat.get_device()} if self.plan.cuda
              else all(map(_is_cpu, tensors)))
        if not ok:
            for i, t in enumerate(tensors):
                if t.device != flat.device:
                    raise ValueError(f"tensor {i} is on {t.device} but the flat buffer is on {flat.device}")

    def after_launch(self) -> None:
        """Record that the current table was read by work on the current stream."""
        self.ring.after_launch(self._stream)


_LRU: "collections.OrderedDict[tuple, Plan]" = collections.OrderedDict()
_LRU_MAX = 64
_LRU_LOCK = threading.Lock()


def get_binding(op: str, layout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, block: int) -> Binding:
    """The binding of ``layout`` for these tensors' dtypes, cached in
    ``layout.cache``.  Its plan (the immutable chunk tables) is shared through
    a small LRU keyed on the layout's content; its pointer tables are the
    layout's own, except for the Layouts the public API builds per call when
    none is passed (``layout.anonymous``), which share one binding per plan so
    that they do not allocate pointer tables on every call."""
    dtypes = tuple(map(_dtype_of, tensors))
    device = flat.device
    key = (op, device, dtypes, flat.dtype, block)
    binding = layout.cache.get(key)
    if binding is not None:
        return binding
    bad = [i for i, d in enumerate(dtypes) if d not in CODE]
    if bad:
        raise TypeError(f"{op}: tensor {bad[0]} has dtype {dtypes[bad[0]]}; supported: fp32, fp16, bf16, fp64")
    kinds = tuple(CODE[d] for d in dtypes)
    lkey = key + (tuple(layout.numels), tuple(layout.offsets))
    with _LRU_LOCK:
        plan = _LRU.get(lkey)
        if plan is None:
            plan = Plan(layout.numels, layout.offsets, kinds, CODE[flat.dtype], block, device)
            _LRU[lkey] = plan
            if len(_LRU) > _LRU_MAX:
                _LRU.popitem(last=False)
        else:
            _LRU.move_to_end(lkey)
    if layout.anonymous:
        with plan.lock:
            if plan.shared is None:
                plan.shared = Binding(plan, layout)
            binding = plan.shared
    else:
        binding = Binding(plan, layout)
    if len(layout.cache) >= 8:  # a layout meets a handful of (op, dtype) combinations
        layout.cache.clear()
    layout.cache[key] = binding
    return binding


def block_for(interpreted: bool) -> int:
    """Elements per program for this launch mode (read at call time, so a
    benchmark may change the module constants)."""
    return BLOCK_INTERPRET if interpreted else BLOCK_GPU

