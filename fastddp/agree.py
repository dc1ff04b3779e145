"""Every rank's DDP settings agree: checked at construction and at the
first synchronising forward, before the settings shape any collective.

The bucket caps, ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view`` (on the CPU it decides which gradients are
reduced where they are, one collective each), the buffer broadcast, mixed
precision, ``check_finite``, the delayed parameters, fastddp's options (the
constructor's, ``fastddp.configure()``'s and the ``FASTDDP_*`` environment's,
which is a host's: a variable exported on one machine only is the likely
case), the registered comm hook and its state, and fastddp itself (its
version and a checksum of its sources: a host left on another checkout) all
decide which collectives a step issues and how large they are.  Where two
ranks differ, their collectives do not pair up: gloo aborts the process
("Received data size doesn't match expected size") or a rank waits until the
group's timeout (30 minutes by default); torch's DDP does the same.  Here
one all-gather of a checksum per setting (int64s) finds the difference, and
every rank raises the same error naming each differing setting and its
value on each rank; the values themselves travel only then.

At construction (with ``init_sync``, beside the model's own check, before
the reducer's registration makes any group) it sees the arguments and the
options; at the first forward whose backward is reduced it sees the comm
hook too, and runs where ``init_sync=False`` skipped the first.  It runs
even where nothing changed since construction: a rank cannot know alone
that no other rank registered a hook (skipping on the ranks with none
would leave the others' gather unanswered), and deciding together would
cost the same one all-gather.  That check is once per reducer; an
evaluation forward on rank 0 alone, before training, issues nothing.
Inside ``join()`` it runs at the first forward whatever it syncs, mirrored
by a rank that joined before it
(:meth:`fastddp.join.DDPJoinHook.main_hook`): in a ``Join`` context every
forward is collective on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
import zlib
from pathlib import Path

import torch

from . import groups
from ._version import __version__

__all__ = ["settings", "check", "once"]

#: id -> weakref of each reducer whose ranks agreed (a reducer rebuilt by
#: _set_static_graph or unpickling is checked again, at its own first
#: forward); a dict lookup, not a WeakSet's Python-level one: it runs every forward
_AGREED: dict = {}


@functools.lru_cache(maxsize=None)
def _sources_crc() -> int:
    """A checksum of fastddp's Python sources and kernels' (read once per
    process, ~1 MB): two hosts with different checkouts of one version differ."""
    from . import kernels

    crc = 0
    for top in (Path(__file__).parent, Path(kernels.__file__).parent):
        for f in sorted(top.rglob("*.py")):
            crc = zlib.crc32(f.read_bytes(), zlib.crc32(f.relative_to(top).as_posix().encode(), crc))
    return crc


def _canon(v) -> str:
    """A value as text that is equal on two ranks exactly when the value
    means the same there: plain values by ``repr`` (numbers as floats), containers and
    dataclasses field by field, a function by its qualified name, a tensor
    (an exempt parameter) by its shape, anything else a rank holds its own
    of (a process group, a clock object) by its type."""
    if v is None or isinstance(v, (bool, str)):
        return repr(v)
    if isinstance(v, (int, float)):
        return repr(float(v))  # 25 and 25.0 MiB are one cap
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_canon(x) for x in v) + ")"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(_canon(x) for x in v)) + "}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return type(v).__name__ + "(" + ", ".join(
            f"{f.name}={_canon(getattr(v, f.name))}" for f in dataclasses.fields(v)) + ")"
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return type(v).__name__


def settings(ddp) -> list[tuple[str, str]]:
    """``(name, value)`` of every setting that shapes the module's
    collectives, in a fixed order, the values as :func:`_canon` writes them."""
    cfg, reducer = ddp.config, ddp.__dict__.get("reducer")  # (construction checks before the reducer is built)
    out = [("fastddp version", f"{__version__}, sources {_sources_crc():08x}"),
           ("bucket_cap_mb", cfg.bucket_cap_mb), ("bucket_cap_mb_list", cfg.bucket_cap_mb_list),
           ("bucket_cap_mb='auto'", cfg.auto_bucket_cap),
           ("find_unused_parameters", ddp.find_unused_parameters), ("static_graph", ddp.static_graph or cfg.static_graph),
           ("gradient_as_bucket_view", ddp.gradient_as_bucket_view),
           ("forward_sync_buffers (broadcast_buffers)", ddp.forward_sync_buffers),
           ("skip_all_reduce_unused_params", ddp.skip_all_reduce_unused_params),
           ("mixed_precision", cfg.mixed_precision), ("check_finite", cfg.check_finite),
           ("delay_all_reduce_named_params", cfg.delay_params)]
    out += [(f"options.{f.name}", getattr(cfg.options, f.name)) for f in dataclasses.fields(cfg.options)]
    if reducer is not None:
        out += [("comm hook", reducer.comm_hook), ("comm hook state", reducer.comm_hook_state)]
    return [(name, _canon(value)) for name, value in out]


def _who(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def once(ddp) -> None:
    """:func:`check`, the first time for the module's reducer."""
    r = ddp.reducer
    seen = _AGREED.get(id(r))
    if seen is None or seen() is not r:
        check(ddp)
        for k in [k for k, w in _AGREED.items() if w() is None]:  # the dead reducers' entries
            del _AGREED[k]
        _AGREED[id(r)] = weakref.ref(r)


def check(ddp) -> bool:
    """The all-gather and, where the ranks differ, the error (on every rank
    alike).  True: they agree (the caller records it; the check runs once)."""
    pg = ddp.process_group
    world = groups.size(pg)
    if world == 1:
        return True
    mine = settings(ddp)
    names = "\n".join(n for n, _ in mine)
    # the first checksum covers the list itself (another fastddp may check other settings)
    sums = [zlib.crc32(names.encode())] + [zlib.crc32(v.encode()) for _, v in mine]
    t = torch.tensor(sums, dtype=torch.int64, device=ddp.device)
    assert t.numel() <= 64, "fastddp.agree compares at most 63 settings"
    # a fixed length: a rank whose fastddp compares more settings still gathers the same size
    t = torch.cat([t, t.new_zeros(64 - t.numel())])
    everyone = [torch.empty_like(t) for _ in range(world)]
    groups.all_gather(everyone, t, pg)
    rows = torch.stack(everyone).cpu()
    differ = (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()
    if not differ:
        return True
    from .verify import gather_texts  # every rank takes part: the values, only now

    texts = gather_texts([v for _, v in mine], pg, ddp.device, world)
    if 0 in differ:  # another list of settings: the first one, the version, says whose
        by_version: dict[str, list[int]] = {}
        for r in range(world):
            by_version.setdefault(texts[r][0], []).append(r)
        detail = ("the ranks run different fastddp: they compare different lists of settings (version and "
                  "sources: " + ", ".join(f"{v} on {_who(rs)}" for v, rs in by_version.items()) + ")")
    else:
        parts = []
        for i in differ:
            by_value: dict[str, list[int]] = {}
            for r in range(world):
                by_value.setdefault(texts[r][i - 1], []).append(r)
            parts.append(f"{mine[i - 1][0]} is " + ", ".join(f"{v} on {_who(rs)}" for v, rs in by_value.items()))
        detail = "; ".join(parts)
    raise RuntimeError(
        f"fastddp: the ranks' DistributedDataParallel settings differ, so their collectives would not "
        f"pair up (a hang or a crash inside the backend): {detail}. Give every rank the same fastddp, "
        "the same constructor arguments, fastddp.Options / fastddp.configure() and FASTDDP_* environment, and "
        "register the same comm hook on every rank.")
