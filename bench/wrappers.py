"""The wrappers the end-to-end runner compares, by name.

A wrapper turns a plain model (already on its device, identical on every
rank) into the thing the training step calls::

    factory(model, process_group, options) -> (wrapped_model, note)

``note`` is a short free-text remark for the report ("" when there is none).
A factory raises (any exception) when the wrapper cannot be built here; the
runner then reports the wrapper as ``unavailable: <reason>`` and carries on.

=================  ===========================================================
name               what
=================  ===========================================================
local              the model itself, no DDP: the compute floor
comm-floor         local + ONE all-reduce per step, at the end of backward, of a
                   buffer as large as the gradients (no copies, no per-
                   parameter hooks): what moving these bytes and syncing the
                   ranks costs any DDP; a bound, not a trainer (its gradients
                   stay local)
torch              torch.nn.parallel.DistributedDataParallel, defaults
torch-batched      ... batched_grad_copy=True; on a torch whose DDP lacks that
                   argument (2.11) a labelled stand-in: torch DDP + its C++
                   ALLREDUCE comm hook, which divides each bucket by W before
                   the SUM as batched_grad_copy does (same gradients; torch's
                   per-parameter copies instead of one foreach copy)
torch-view         ... gradient_as_bucket_view=True
torch-fp16         ... + default_hooks.fp16_compress_hook
torch-bf16         ... + default_hooks.bf16_compress_hook (torch allows it on
                   NCCL only; not in the CPU default set)
fastddp            fastddp.DistributedDataParallel, defaults
fastddp-batched    ... batched_grad_copy=True
fastddp-view       ... gradient_as_bucket_view=True
fastddp-fp16       ... + register_comm_hook(None, fastddp.hooks.fp16_compress_hook)
fastddp-bf16       ... + register_comm_hook(None, fastddp.hooks.bf16_compress_hook)
fastddp-bf16acc    ... + fastddp.hooks.bf16_fp32acc_hook (bf16 wire, fp32 sum; opt-in)
fastddp-fp8        ... + fastddp.hooks.fp8_compress_hook, FP8CompressionState() (opt-in)
fastddp-hier-W     ... + fastddp.hooks.hierarchical_hook, HierarchicalState(wire=W) for W
                   in fp32, bf16, fp8: exact inside a host, W between hosts (opt-in;
                   for ``--link netns:RATE --ranks-per-host L``; unavailable on a
                   fastddp without them)
fastddp-autoprec   ... + fastddp.hooks.auto_precision_hook, AutoPrecisionState(lowest="fp8"):
                   the wire format chosen from measured steps, then the bucket
                   layout tuned for it (opt-in; stepped alone until both settle,
                   as fastddp-auto until its buckets settle)
replicate          torch's FSDP2-based ``replicate``
                   (torch.distributed._composable.replicate_with_fsdp), applied
                   per block then on the root as torchtitan's apply_replicate
                   does (:func:`replicate_blocks` says what a block is); fp32
replicate-bf16     ... with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16):
                   params and compute fp32, gradients all-reduced in bf16
fastddp-capN       ... bucket_cap_mb=N for N in SWEEP_CAPS_MB (opt-in rows of the
                   bucket sweep, ``python -m tools.bucket_sweep``)
fastddp-auto       ... bucket_cap_mb="auto" (opt-in row; tunes in its first ~25
                   steps: time it with --warmup 30 to see the settled layout)
=================  ===========================================================

Simulated interconnect (``--simulate-bandwidth``): the runner passes a
:class:`~fastddp.bench.simwire.SimulatedWire` (a process group wrapping the
real one) as ``process_group`` to every factory, so every wrapper's
collectives, torch's C++ reducer's included, cross the same wire; with no
simulation ``process_group`` is None (the default group).

Nothing here runs at import: the registry is built by :func:`registry`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DEFAULT_WRAPPERS",
    "CommFloor",
    "WrapperOptions",
    "WrapperSpec",
    "build_wrapper",
    "registry",
    "torch_has_batched_grad_copy",
    "wire_bytes_counter",
]

#: Wrappers a run without ``--wrappers`` compares, in table order.
DEFAULT_WRAPPERS = (
    "local", "comm-floor",
    "torch", "torch-batched", "torch-view", "torch-fp16",
    "fastddp", "fastddp-batched", "fastddp-view", "fastddp-fp16", "fastddp-bf16",
    "replicate", "replicate-bf16",
)

#: Added to the default set on CUDA (torch refuses its bf16 hook off NCCL).
CUDA_EXTRA_WRAPPERS = ("torch-bf16",)

@dataclass(frozen=True)
class WrapperOptions:
    """What every factory gets besides the model and the process group."""

    bucket_cap_mb: float | None = None
    """Passed to both DDPs (None: their default, 25 MiB)."""
    device_ids: list[int] | None = None
    """``[local_rank]`` on CUDA, None on CPU."""
    wire: Any = None
    """The :class:`~fastddp.bench.simwire.SimulatedWire` (also the factories'
    ``process_group``) when ``--simulate-bandwidth`` is on."""


Factory = Callable[[nn.Module, Any, WrapperOptions], "tuple[nn.Module, str]"]


@dataclass(frozen=True)
class WrapperSpec:
    """A named wrapper and how it compares."""

    name: str
    family: str
    """``local``, ``floor``, ``torch``, ``replicate`` or ``fastddp``."""
    option: str
    """``default``, ``batched``, ``view``, ``fp16`` or ``bf16``."""
    factory: Factory = field(repr=False)
    baselines: tuple[str, ...] = ()
    """Torch wrappers this one's overhead is divided by, first present wins."""
    wire_itemsize: int | None = None
    """Bytes per gradient element on the wire (None: the parameter's own)."""
    tunes: bool = False
    """It tunes itself over its first steps (``auto_precision_hook``,
    ``bucket_cap_mb="auto"``): the runner steps it alone until it settles,
    and the quick main job leaves it out."""


# -- factories -----------------------------------------------------------------

def _local(model, process_group, options):
    return model, "no DDP"


class CommFloor(nn.Module):
    """``module`` plus one SUM all-reduce per backward, per parameter dtype,
    of a preallocated buffer holding as many elements as the gradients, run
    by an autograd-engine callback queued when backward reaches the outputs.

    It leaves every cost out that a DDP could in principle avoid (copies into
    buckets, per-parameter hooks, scaling) and keeps the one it cannot: the
    bytes on the wire and the wait for the slowest rank.  Its overhead over
    ``local`` bounds what any wrapper sending the same bytes can reach where
    backward cannot hide communication (ranks sharing every core); where it
    can (a GPU, idle cores, a slow network), overlapping wrappers may beat
    it.  The gradients themselves are not averaged."""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        numel: dict[torch.dtype, int] = {}
        device = None
        for p in module.parameters():
            if p.requires_grad:
                numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
                device = p.device
        self._flats = [torch.zeros(n, dtype=dt, device=device) for dt, n in numel.items()]
        self._queued = False

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._queued = False
            leaves = torch.utils._pytree.tree_flatten(out)[0]
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._arm)
        return out

    def _arm(self, _grad):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        for flat in self._flats:
            dist.all_reduce(flat, group=self.process_group)


def _comm_floor(model, process_group, options):
    return CommFloor(model, process_group), "bound: one all-reduce, no copies"


def _torch(model, process_group, options, hook: str | None = None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(
        model, device_ids=options.device_ids, process_group=process_group,
        bucket_cap_mb=options.bucket_cap_mb, **kwargs)
    if hook is not None:
        fn = getattr(default_hooks, f"{hook}_compress_hook")
        ddp.register_comm_hook(process_group, fn)
        return ddp, f"default_hooks.{fn.__name__}"
    return ddp, ""


def torch_has_batched_grad_copy() -> bool:
    """Whether this torch's DDP constructor takes ``batched_grad_copy`` (2.13+)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "batched_grad_copy" in inspect.signature(DistributedDataParallel.__init__).parameters


def _torch_batched(model, process_group, options):
    if torch_has_batched_grad_copy():
        return _torch(model, process_group, options, batched_grad_copy=True)
    # Stand-in: batched_grad_copy = copy the grads unscaled, divide the bucket
    # by W, all-reduce SUM.  torch's reducer copies unscaled whenever a comm
    # hook is registered, and its built-in C++ ALLREDUCE hook divides by W
    # then sums: the same bits, without a Python hook's per-bucket cost.
    ddp, note = _torch(model, process_group, options)
    label = f"stand-in: torch {torch.__version__.split('+')[0]} has no batched_grad_copy; "
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return ddp, label + "DDP + builtin ALLREDUCE hook (divides by W, as batched)"


def _fastddp(model, process_group, options, hook: str | None = None, **kwargs):
    import fastddp  # noqa: F401 - ImportError means unavailable

    cls = getattr(fastddp, "DistributedDataParallel", None)
    if cls is None:
        raise ImportError("fastddp has no DistributedDataParallel yet")
    fn, state = None, None
    if hook is not None:
        from fastddp import hooks

        # "fp16" -> fp16_compress_hook; a full hook name ("bf16_fp32acc_hook") as it is
        fn = getattr(hooks, hook if hook.endswith("_hook") else f"{hook}_compress_hook", None)
        if fn is None:
            raise ImportError(f"fastddp.hooks has no {hook} hook yet")
        if fn.__name__ == "fp8_compress_hook":
            state = hooks.FP8CompressionState(process_group)  # block 256, error feedback, 1-D exempt
    ddp = cls(model, device_ids=options.device_ids, process_group=process_group,
              bucket_cap_mb=options.bucket_cap_mb, **kwargs)
    notes = []
    if fn is not None:
        ddp.register_comm_hook(state, fn)
        notes.append(f"hooks.{fn.__name__}")
    return ddp, "; ".join(notes)


def _fastddp_hier(model, process_group, options, wire: str):
    """fastddp with the hierarchical reduction, ``wire`` between hosts; its
    hook and state are looked up here, so an older fastddp reports the row
    unavailable instead of failing at import."""
    from fastddp import hooks

    fn, state_cls = getattr(hooks, "hierarchical_hook", None), getattr(hooks, "HierarchicalState", None)
    if fn is None or state_cls is None:
        missing = "hierarchical_hook" if fn is None else "HierarchicalState"
        raise ImportError(f"fastddp.hooks has no {missing} yet (the hierarchical reduction is not in "
                          "this fastddp)")
    ddp, _ = _fastddp(model, process_group, options)
    # a simulated wire reaches the state as its group; without one the state takes the module's
    state = state_cls(wire=wire) if process_group is None else state_cls(wire=wire, process_group=process_group)
    ddp.register_comm_hook(state, fn)
    return ddp, f"hooks.hierarchical_hook, wire={wire}"


def _fastddp_autoprec(model, process_group, options, lowest: str):
    """fastddp with the wire format chosen from measured steps, down to ``lowest``."""
    from fastddp import hooks

    ddp, _ = _fastddp(model, process_group, options)
    state = hooks.AutoPrecisionState(lowest=lowest) if process_group is None else \
        hooks.AutoPrecisionState(lowest=lowest, process_group=process_group)
    ddp.register_comm_hook(state, hooks.auto_precision_hook)
    return ddp, f"hooks.auto_precision_hook, lowest={lowest}"


def replicate_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules ``replicate`` is applied to before the root: the model's
    repeated unit, as torchtitan wraps each transformer block.

    * the children of the first ``nn.ModuleList`` in module order (the
      layers of an ``nn.TransformerEncoder``), else
    * the children of a root ``nn.Sequential`` that own parameters, else
    * none (the root alone).

    Each block is one FSDP parameter group: one copy-in, one all-reduce and
    one copy-out per backward, so the rule sets replicate's bucket count."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    if isinstance(model, nn.Sequential):
        return [c for c in model if any(True for _ in c.parameters())]
    return []


def _replicate(model, process_group, options, reduce_dtype: torch.dtype | None = None):
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError as exc:  # the row reads "unavailable: ..."
        raise ImportError(f"torch {torch.__version__} has no replicate_with_fsdp.replicate "
                          f"({exc})") from None
    if process_group is not None:
        # DeviceMesh.from_group looks the group up in c10d's registry, which a
        # Python ProcessGroup (the simulated wire) is not in; --link netns runs
        # replicate over a real rate-limited link instead.
        raise RuntimeError("replicate needs a DeviceMesh, which cannot be built on the simulated "
                           "wire (a Python process group c10d does not register); use --link netns:RATE")
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    blocks = replicate_blocks(model)
    for block in blocks:
        replicate(block, mp_policy=policy)
    replicate(model, mp_policy=policy)  # mesh: a 1-D mesh over the default group
    note = f"replicate on {len(blocks)} blocks + root"
    if reduce_dtype is not None:
        note += f", reduce_dtype={str(reduce_dtype).replace('torch.', '')}"
    return model, note


#: The fixed caps of the bucket sweep (``python -m tools.bucket_sweep``): opt-in rows ``fastddp-capN``.
SWEEP_CAPS_MB = (1, 5, 10, 25, 50, 100)


def _fastddp_cap(model, process_group, options, cap_mb: float | str):
    """fastddp at ``bucket_cap_mb=cap_mb`` whatever ``--bucket-cap-mb`` says
    (the sweep's rows and fastddp-auto)."""
    import dataclasses

    ddp, _ = _fastddp(model, process_group, dataclasses.replace(options, bucket_cap_mb=cap_mb))
    if cap_mb == "auto":
        return ddp, "bucket_cap_mb='auto' (tuned alone, back to back, before the rounds)"
    return ddp, f"bucket_cap_mb={cap_mb:g}"


def registry() -> dict[str, WrapperSpec]:
    """Every wrapper by name (a fresh dict on every call)."""
    P = functools.partial
    specs = [
        WrapperSpec("local", "local", "default", _local),
        WrapperSpec("comm-floor", "floor", "default", _comm_floor, baselines=("torch",)),
        WrapperSpec("torch", "torch", "default", _torch),
        WrapperSpec("torch-batched", "torch", "batched", _torch_batched),
        WrapperSpec("torch-view", "torch", "view", P(_torch, gradient_as_bucket_view=True)),
        WrapperSpec("torch-fp16", "torch", "fp16", P(_torch, hook="fp16"), wire_itemsize=2),
        WrapperSpec("torch-bf16", "torch", "bf16", P(_torch, hook="bf16"), wire_itemsize=2),
        WrapperSpec("fastddp", "fastddp", "default", _fastddp, baselines=("torch", "replicate")),
        WrapperSpec("fastddp-batched", "fastddp", "batched", P(_fastddp, batched_grad_copy=True),
                    baselines=("torch-batched", "replicate")),
        WrapperSpec("fastddp-view", "fastddp", "view", P(_fastddp, gradient_as_bucket_view=True),
                    baselines=("torch-view", "replicate")),
        WrapperSpec("fastddp-fp16", "fastddp", "fp16", P(_fastddp, hook="fp16"),
                    baselines=("torch-fp16",), wire_itemsize=2),
        WrapperSpec("fastddp-bf16", "fastddp", "bf16", P(_fastddp, hook="bf16"),
                    baselines=("torch-bf16", "torch-fp16", "replicate-bf16"), wire_itemsize=2),
        # opt-in: the low-precision reductions torch's DDP has no twin for (peers: its 16-bit hooks)
        WrapperSpec("fastddp-bf16acc", "fastddp", "bf16acc", P(_fastddp, hook="bf16_fp32acc_hook"),
                    baselines=("torch-fp16", "torch-bf16", "replicate-bf16"), wire_itemsize=2),
        WrapperSpec("fastddp-fp8", "fastddp", "fp8", P(_fastddp, hook="fp8_compress_hook"),
                    baselines=("torch-fp16", "torch-bf16", "replicate-bf16"), wire_itemsize=1),
        # opt-in: the hierarchical reduction, for two hosts of several ranks (--ranks-per-host)
        *(WrapperSpec(f"fastddp-hier-{w}", "fastddp", f"hier-{w}", P(_fastddp_hier, wire=w),
                      baselines=("torch", "torch-fp16"), wire_itemsize=size)
          for w, size in (("fp32", None), ("bf16", 2), ("fp8", 1))),
        WrapperSpec("fastddp-autoprec", "fastddp", "autoprec", P(_fastddp_autoprec, lowest="fp8"),
                    baselines=("torch", "torch-fp16"), tunes=True),
        WrapperSpec("replicate", "replicate", "default", _replicate),
        WrapperSpec("replicate-bf16", "replicate", "bf16", P(_replicate, reduce_dtype=torch.bfloat16),
                    wire_itemsize=2),
        WrapperSpec("fastddp-auto", "fastddp", "auto", P(_fastddp_cap, cap_mb="auto"),
                    baselines=("torch", "replicate"), tunes=True),
    ]
    # opt-in: fastddp at each fixed cap of the bucket sweep (compared with fastddp-auto there)
    specs += [WrapperSpec(f"fastddp-cap{c:g}", "fastddp", f"cap{c:g}", P(_fastddp_cap, cap_mb=c),
                          baselines=("torch",)) for c in SWEEP_CAPS_MB]
    from .compile_wrappers import specs as compile_specs  # torch-compile, fastddp-compile (opt-in rows)

    specs += compile_specs(WrapperSpec, _torch, _fastddp)
    return {s.name: s for s in specs}


def build_wrapper(name: str, model: nn.Module, process_group, options: WrapperOptions) -> tuple[nn.Module, str]:
    """Wrap ``model`` as wrapper ``name``; raises when it cannot be built."""
    specs = registry()
    if name not in specs:
        raise KeyError(f"unknown wrapper {name!r}; known: {', '.join(specs)}")
    return specs[name].factory(model, process_group, options)


# -- bytes on the wire -----------------------------------------------------------

def wire_bytes_counter(spec: WrapperSpec, module: nn.Module, options: WrapperOptions) -> Callable[[], int] | None:
    """A cumulative bytes-on-the-wire counter for a built wrapper, when one can
    be read (the simulated wire's, for every wrapper but ``local``, under
    simulation; else fastddp's ``bytes_on_wire`` statistic); None: compute
    it from the params."""
    if options.wire is not None and spec.family != "local":
        wire = options.wire
        return lambda: wire.bytes_sent
    if spec.family == "fastddp":
        return lambda: int(module.stats().get("bytes_on_wire", 0))  # fastddp's public statistic
    return None


def computed_wire_bytes(spec: WrapperSpec, params) -> int:
    """Bytes one step all-reduces, from the parameters: numel of every param
    requiring grad x the wire element size.  0 for ``local``."""
    if spec.family == "local":
        return 0
    total = 0
    for p in params:
        if p.requires_grad:
            total += p.numel() * (spec.wire_itemsize or p.element_size())
    return total
