"""Construction-time checks that every rank wraps the same model.

torch's DDP compares parameter shapes across ranks (``_verify_params_across_
process_group``) and hangs or aborts on the rest.  Here the parameters' count,
shapes, dtypes, strides AND names are compared (same shapes registered in a
different order would otherwise pair the wrong tensors silently), and so are
the buffers that DDP broadcasts (a shape mismatch there aborts a gloo rank
inside the broadcast, or truncates silently).  The error names the first
mismatching tensor, what it is on each side, and the ranks.

The metadata travels as int64 tensors on the module's device (NCCL works
whatever the current CUDA device is) in two all-gathers; names travel only
in the failure case, so the message can show both.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from . import groups

__all__ = ["verify_across_ranks", "check_no_new_parameters", "gather_texts", "ModuleWatch"]


def check_no_new_parameters(module: torch.nn.Module, known: Sequence[torch.Tensor], ignore) -> None:
    """Parameters added to the module after it was wrapped are never reduced:
    say so (the front checks at the bucket rebuild, and at every forward in
    debug mode)."""
    ids = {id(p) for p in known}
    new = [n for n, p in module.named_parameters()
           if p.requires_grad and n not in ignore and id(p) not in ids]
    if new:
        raise RuntimeError(
            f"fastddp: parameter(s) {new[:10]} were added to the module (or replaced, or set to "
            "requires_grad=True) after it was wrapped in DistributedDataParallel; their gradients "
            "would never be averaged across ranks. Create every parameter before wrapping the "
            "model (or wrap it again).")


class ModuleWatch:
    """What the wrapped module looked like: the checks that keep a later
    change of it (a frozen parameter unfrozen, a parameter added or replaced,
    a parameter's shape, dtype or device changed) from giving local, silently
    unaveraged or misplaced gradients.  torch's DDP is silent on all of them."""

    def __init__(self, module: torch.nn.Module, known: Sequence[torch.Tensor], names: Sequence[str],
                 ignore, rank: int, check_dtype: bool = True):
        self.module, self.known, self.names, self.ignore, self.rank = module, list(known), list(names), ignore, rank
        self.check_dtype = check_dtype  # mixed_precision swaps the dtype during forward/backward
        self.meta = [(p.shape, p.dtype, p.device) for p in self.known]
        ids = {id(p) for p in self.known}
        # trainable-later candidates: cheap enough to look at every forward
        self.frozen = [(n, p) for n, p in module.named_parameters()
                       if not p.requires_grad and n not in ignore and id(p) not in ids]
        self.outside: set[int] = set()  # leaves seen in the graph that are not the module's

    def check_frozen(self) -> None:
        """Every forward: a parameter frozen when the model was wrapped and
        trainable now would get local gradients (fine-tuning's unfreeze)."""
        for n, p in self.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"fastddp: parameter {n!r} had requires_grad=False when the model was wrapped in "
                    f"DistributedDataParallel and requires grad now (rank {self.rank}); DDP does not "
                    "average its gradients, so the ranks would train it apart. Wrap the model again "
                    "after unfreezing (or wrap it with every parameter that will train set to "
                    "requires_grad=True, freezing it with a zero learning rate instead).")

    def check(self) -> None:
        """The full comparison (bucket rebuild, every forward in debug mode)."""
        check_no_new_parameters(self.module, self.known, self.ignore)
        self.check_frozen()
        for n, p, (shape, dtype, device) in zip(self.names, self.known, self.meta):
            now = (p.shape, p.dtype if self.check_dtype else dtype, p.device)
            if now != (shape, dtype, device):
                raise RuntimeError(
                    f"fastddp: parameter {n!r} is now {tuple(p.shape)} {p.dtype} on {p.device} "
                    f"(rank {self.rank}) but was {tuple(shape)} {dtype} on {device} when the model was "
                    "wrapped in DistributedDataParallel; its gradient bucket was laid out for that. "
                    "Change the module (.to(), .half(), .data = ...) before wrapping it, or wrap it again.")

    def check_leaves(self, leaves: Sequence[torch.Tensor]) -> None:
        """find_unused_parameters: the graph walk met leaves that require grad
        and are not DDP's parameters; one of the module's (added, replaced or
        unfrozen after wrapping) would get local gradients."""
        fresh = [t for t in leaves if id(t) not in self.outside]
        if not fresh:
            return
        mine = {id(p): n for n, p in self.module.named_parameters() if n not in self.ignore}
        bad = [mine[id(t)] for t in fresh if id(t) in mine]
        if bad:
            raise RuntimeError(
                f"fastddp: parameter(s) {bad[:10]} of the wrapped module produced this forward's "
                f"outputs on rank {self.rank} but are not among the parameters DDP averages: they were "
                "added, replaced (module.x = nn.Parameter(...)) or set to requires_grad=True after the "
                "model was wrapped in DistributedDataParallel. Their gradients would stay local to "
                "each rank. Change the module before wrapping it, or wrap it again.")
        self.outside.update(id(t) for t in fresh)


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
           torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
           torch.bool)
_DTYPE_CODE = {t: i for i, t in enumerate(_DTYPES)}
_DIMS = 8  # shape/stride entries encoded per tensor (more dims: folded into a hash)
# row: [kind, ndim, dtype, name crc, shape x _DIMS, stride x _DIMS]
_KIND_PARAM, _KIND_BUFFER = 0, 1


def _row(kind: int, name: str, t: torch.Tensor) -> list[int]:
    shape, stride = list(t.shape), list(t.stride())
    if len(shape) > _DIMS:
        shape = shape[:_DIMS - 1] + [hash(tuple(shape[_DIMS - 1:])) & 0x7FFFFFFF]
        stride = stride[:_DIMS - 1] + [hash(tuple(stride[_DIMS - 1:])) & 0x7FFFFFFF]
    pad = [-1] * (_DIMS - len(shape))
    return ([kind, t.dim(), _DTYPE_CODE.get(t.dtype, 99), zlib.crc32(name.encode())]
            + shape + pad + stride + pad)


def _describe(row, name: str) -> str:
    nd, code = int(row[1]), int(row[2])
    dtype = _DTYPES[code] if code < len(_DTYPES) else "?"
    k = 4
    return (f"{name!r} with shape {row[k:k + min(nd, _DIMS)].tolist()}, dtype {dtype}, "
            f"strides {row[k + _DIMS:k + _DIMS + min(nd, _DIMS)].tolist()}")


def gather_texts(names: Sequence[str], pg, device, world: int) -> list[list[str]]:
    """Every rank's lines of text (failure cases only: names, values): one
    padded byte tensor each."""
    data = "\n".join(names).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    ns = [torch.empty_like(n) for _ in range(world)]
    groups.all_gather(ns, n, pg)
    cap = max(int(x.item()) for x in ns)
    buf = torch.zeros(max(cap, 1), dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    groups.all_gather(bufs, buf, pg)
    return [bytes(b[:int(m.item())].cpu().tolist()).decode().split("\n") for b, m in zip(bufs, ns)]


def verify_across_ranks(pg, params: Sequence[torch.Tensor], names: Sequence[str],
                        buffers: Sequence[torch.Tensor] = (), buffer_names: Sequence[str] = ()) -> None:
    """Raise on every rank if any rank's parameters (count, names, shapes,
    dtypes, strides) or buffers (count, names, shapes, dtypes) differ from
    rank 0's."""
    world = groups.size(pg)
    if world == 1:
        return
    dev = params[0].device
    counts = torch.tensor([len(params), len(buffers)], dtype=torch.int64, device=dev)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    groups.all_gather(all_counts, counts, pg)
    all_counts = [c.tolist() for c in all_counts]
    for r, (np_, nb) in enumerate(all_counts):
        if np_ != all_counts[0][0]:
            raise RuntimeError(
                f"fastddp: DDP expects the same model on every rank, but rank 0 has "
                f"{all_counts[0][0]} parameters that require grad and rank {r} has {np_}. Build the "
                "same model on every rank before wrapping it.")
        if nb != all_counts[0][1]:
            raise RuntimeError(
                f"fastddp: DDP expects the same model on every rank, but rank 0 has "
                f"{all_counts[0][1]} buffers and rank {r} has {nb}; DDP broadcasts buffers from "
                "rank 0. Build the same model on every rank before wrapping it.")
    all_names = list(names) + list(buffer_names)
    rows = [_row(_KIND_PARAM, n, p) for n, p in zip(names, params)]
    # a buffer's strides are not part of the contract (the broadcast copies values)
    rows += [_row(_KIND_BUFFER, n, b.contiguous())
             for n, b in zip(buffer_names, buffers)]
    meta = torch.tensor(rows, dtype=torch.int64, device=dev)
    metas = [torch.empty_like(meta) for _ in range(world)]
    groups.all_gather(metas, meta, pg)
    metas = [m.cpu() for m in metas]
    bad = None
    for r in range(1, world):
        diff = (metas[r] != metas[0]).any(dim=1).nonzero()
        if diff.numel():
            bad = (r, int(diff[0, 0]))
            break
    if bad is None:
        return
    r, i = bad
    everyone = gather_texts(all_names, pg, dev, world)  # every rank takes part
    kind = "parameter" if i < len(names) else "buffer"
    where = i if i < len(names) else i - len(names)
    a, b = _describe(metas[0][i], everyone[0][i]), _describe(metas[r][i], everyone[r][i])
    hint = ""
    if everyone[0][i] != everyone[r][i]:
        hint = (" The names differ: the modules register their tensors in a different order (or "
                "are different models); gradients would be averaged between unrelated tensors.")
    raise RuntimeError(
        f"fastddp: DDP expects the same model on every rank, but {kind} {where} is {a} on rank 0 "
        f"and {b} on rank {r}.{hint} Build the same model on every rank before wrapping it.")
