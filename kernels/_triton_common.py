"""What the pack and unpack kernels share: dtype codes, block sizes, and the
host-side plan (chunk table + pointer table) a
:class:`~fastddp.kernels.Layout` caches.

Tables (both int64, on the tensors' device)::

    ptr table   [4 + n_tensors]   0: data_ptr() of the flat buffer
                                  1: the scale as fp64 bits        (fp64 math)
                                  2: fp32(scale) as fp64 bits      (fp32 math)
                                  3: data_ptr() of pack's error-feedback
                                     residual (indexed like the flat
                                     buffer), 0 when there is none
                                  4 + i: data_ptr() of tensor i
    chunk table [n_chunks, 4]     (ptr-table slot of the tensor, start in the
                                   tensor, start in the flat buffer, length)

The chunk table depends only on (numels, offsets, dtypes, BLOCK): it is built
once per plan (the residual, indexed like the flat buffer, reuses the rows'
flat starts).  The pointer table is rewritten only when a pointer (the
residual's included) or the scale changed since the plan's last call.  On
CUDA it is written into a pinned host buffer and copied with
``non_blocking=True``; the plan keeps two
(pinned, device) slots and, before rewriting a slot, waits for the events
recorded after the launches that read it, so a pinned buffer is never
overwritten while its copy may still be in flight.

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
import math
import struct
import threading
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch
import triton.language as tl

# ----------------------------------------------------------------- dtype codes
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
ELSIZE = {0: 4, 1: 2, 2: 2, 3: 8}

# MODE of a launch: what is applied to the source values in the compute dtype.
MODE_CAST, MODE_MUL, MODE_DIV = 0, 1, 2

# ----------------------------------------------------------------- block sizes
# Elements per program.  The interpreter pays a few ms per program instance
# (~1-3 ms measured on a 2-core CPU), so it wants few, large programs; on a GPU 2K elements (16 per thread at 4
# warps) keeps many programs in flight on small buckets.  Plans are keyed by
# BLOCK, so bench/gpu_kernels.py may sweep these.
BLOCK_INTERPRET = 16384
BLOCK_GPU = 2048
NUM_WARPS_GPU = 4

_HEAD = 4  # ptr-table slots before the tensors' pointers

# The interpreter is not thread-safe: every interpreted launch takes this lock.
INTERPRET_LOCK = threading.Lock()

_dtype_of = attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_get_device = torch.Tensor.get_device
_is_cpu = attrgetter("is_cpu")


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


def needs_reference(interpreted: bool, device: torch.device) -> bool:
    """The interpreter serves CPU tensors and the compiled kernels CUDA tensors;
    anything else (CUDA tensors under TRITON_INTERPRET=1, say) takes the
    plain-torch reference."""
    return device.type != ("cpu" if interpreted else "cuda")


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
    index: np.ndarray          # the same, as an index array
    n_chunks: int
    chunks: torch.Tensor | None  # int64 [n_chunks * 4] view on the device
    flat_aligned: bool         # every offset * flat elsize is a multiple of 16 bytes
    offset_gcd: int = 0        # gcd of the non-empty members' offsets (residual alignment)

    def res_aligned(self, elsize: int) -> bool:
        """Every offset * ``elsize`` is a multiple of 16 bytes (a residual indexed like the flat buffer)."""
        return (self.offset_gcd * elsize) % 16 == 0


@dataclass
class _Slot:
    host: torch.Tensor          # int64 [3 + n]; pinned on CUDA
    host_np: np.ndarray
    dev: torch.Tensor           # == host on CPU
    events: dict = field(default_factory=dict)  # stream handle -> torch.cuda.Event


class Plan:
    """Everything a (layout, dtypes, BLOCK, device) needs to launch: groups and
    their chunk tables (immutable) and the pointer-table slots (refreshed)."""

    def __init__(self, numels: Sequence[int], offsets: Sequence[int], kinds: Sequence[int],
                 flat_kind: int, block: int, device: torch.device):
        self.device = device
        self.block = block
        self.flat_kind = flat_kind
        self.n = len(numels)
        self.numels = [int(n) for n in numels]
        self.lock = threading.Lock()
        flat_el = ELSIZE[flat_kind]
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
            n_chunks = sum(r.shape[0] for r in rows)
            live = [int(offsets[i]) for i in members if numels[i]]
            spans.append((kind, members, n_chunks, all((o * flat_el) % 16 == 0 for o in live),
                          math.gcd(*live) if live else 0))
            rows_all.extend(rows)
        table = (np.concatenate(rows_all).reshape(-1) if rows_all else np.zeros(0, dtype=np.int64))
        table_dev = torch.from_numpy(table).to(device)  # once per plan
        self.groups: list[Group] = []
        at = 0
        for kind, members, n_chunks, flat_aligned, offset_gcd in spans:
            view = table_dev.narrow(0, at * 4, n_chunks * 4) if n_chunks else None
            self.groups.append(Group(kind, members, np.asarray(members, dtype=np.int64), n_chunks, view,
                                     flat_aligned, offset_gcd))
            at += n_chunks
        self.cuda = device.type == "cuda"
        self._slots: list[_Slot] = []
        self._cur = -1
        self._last: list[int] | None = None
        self._tensor_aligned: list[bool] = [False] * len(self.groups)
        self._flat_aligned_ptr = False
        self._res_aligned_ptr = False

    # ----------------------------------------------------------- pointers
    def _new_slot(self) -> _Slot:
        if self.cuda:
            host = torch.empty(_HEAD + self.n, dtype=torch.int64, pin_memory=True)
            dev = torch.empty(_HEAD + self.n, dtype=torch.int64, device=self.device)
        else:
            host = torch.empty(_HEAD + self.n, dtype=torch.int64)
            dev = host
        return _Slot(host, host.numpy(), dev)

    def refresh(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], s64: int, s32: int,
                res_ptr: int = 0) -> torch.Tensor:
        """Bring the pointer table up to date; returns the device table to launch with.
        ``res_ptr``: pack's residual address (0: none).  Called with ``self.lock`` held."""
        vals = [flat.data_ptr(), s64, s32, res_ptr]
        vals.extend(map(_data_ptr, tensors))
        if vals == self._last:
            return self._slots[self._cur].dev
        self._vet(flat, tensors)  # new tensors: vet them once
        if not self.cuda:
            if not self._slots:
                self._slots.append(self._new_slot())
            self._cur = 0
        elif len(self._slots) < 2:
            self._slots.append(self._new_slot())
            self._cur = len(self._slots) - 1
        else:
            self._cur ^= 1
            for ev in self._slots[self._cur].events.values():
                ev.synchronize()  # the launches that read this slot are done: safe to rewrite
        slot = self._slots[self._cur]
        slot.host_np[:] = vals
        if self.cuda:
            slot.dev.copy_(slot.host, non_blocking=True)
        self._last = vals
        misaligned = (slot.host_np[_HEAD:] & 15) != 0
        self._tensor_aligned = [not misaligned[g.index].any() for g in self.groups]
        self._flat_aligned_ptr = vals[0] % 16 == 0
        self._res_aligned_ptr = res_ptr % 16 == 0
        return slot.dev

    def _vet(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Numels and devices of a new set of tensors (C-speed maps; the slow
        loop only runs to name the offender)."""
        if list(map(_numel, tensors)) != self.numels:
            for i, (t, n) in enumerate(zip(tensors, self.numels)):
                if t.numel() != n:
                    raise ValueError(f"tensor {i} has {t.numel()} elements but its layout slot holds {n}")
        ok = (set(map(_get_device, tensors)) <= {flat.get_device()} if self.cuda
              else all(map(_is_cpu, tensors)))
        if not ok:
            for i, t in enumerate(tensors):
                if t.device != flat.device:
                    raise ValueError(f"tensor {i} is on {t.device} but the flat buffer is on {flat.device}")

    def after_launch(self) -> None:
        """Record that the current slot was read by work on the current stream."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            ev = self._slots[self._cur].events.get(stream.cuda_stream)
            if ev is None:
                ev = self._slots[self._cur].events[stream.cuda_stream] = torch.cuda.Event()
            ev.record(stream)

    def aligned(self, gi: int) -> tuple[bool, bool]:
        """(tensor side 16-byte aligned, flat side 16-byte aligned) for group ``gi``."""
        return self._tensor_aligned[gi], self._flat_aligned_ptr and self.groups[gi].flat_aligned

    def res_aligned(self, gi: int, elsize: int) -> bool:
        """Group ``gi``'s residual chunks (``elsize``-byte elements) all start on 16 bytes."""
        return self._res_aligned_ptr and self.groups[gi].res_aligned(elsize)


_LRU: "collections.OrderedDict[tuple, Plan]" = collections.OrderedDict()
_LRU_MAX = 64
_LRU_LOCK = threading.Lock()


def get_plan(op: str, layout, tensors: Sequence[torch.Tensor], flat: torch.Tensor, block: int) -> Plan:
    """The plan of ``layout`` for these tensors' dtypes, cached in
    ``layout.cache``; plans are also shared through a small LRU keyed on the
    layout's content, so the per-call Layouts the public API builds when none
    is passed do not rebuild (and re-upload) their tables each call."""
    dtypes = tuple(map(_dtype_of, tensors))
    device = flat.device
    key = (op, device, dtypes, flat.dtype, block)
    plan = layout.cache.get(key)
    if plan is not None:
        return plan
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
    if len(layout.cache) >= 8:  # a layout meets a handful of (op, dtype) combinations
        layout.cache.clear()
    layout.cache[key] = plan
    return plan


def check_tensors(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], layout) -> None:
    """The launcher's own checks (the public API has done the user-facing ones)."""
    if flat.dtype not in CODE:
        raise TypeError(f"{op}: flat buffer dtype {flat.dtype} is not one of fp32/fp16/bf16/fp64")
    if not flat.is_contiguous() or flat.dim() != 1:
        raise ValueError(f"{op}: the flat buffer must be 1-D and contiguous")
    if len(tensors) != len(layout.numels):
        raise ValueError(f"{op}: layout has {len(layout.numels)} tensors, got {len(tensors)}")
    if flat.numel() < layout.total:
        raise ValueError(f"{op}: layout needs a flat buffer of >= {layout.total} elements, got {flat.numel()}")


def block_for(interpreted: bool) -> int:
    """Elements per program for this launch mode (read at call time, so a
    benchmark may change the module constants)."""
    return BLOCK_INTERPRET if interpreted else BLOCK_GPU

