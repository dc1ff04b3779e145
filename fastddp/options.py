"""One options object for everything fastddp adds to torch's DDP arguments.

:class:`Options` is a frozen dataclass, one field per option, a docstring
each.  It is taken in three places, and a field set nearer the module wins:

1. the constructor: ``DDP(model, options=fastddp.Options(wire="bf16"))``;
2. ``fastddp.configure(fastddp.Options(...))`` (or its keywords), for code
   that builds the module with torch's signature (Lightning, accelerate);
3. the environment (``FASTDDP_*``: :mod:`fastddp.settings` maps each
   variable onto its field).

A field left None is "not set here": the next place decides, and where none
does, the built-in default applies (the exact fp32 all-reduce, torch's caps,
no finite check, measured chunking and in-place reduction, detected hosts).

The wire format is a named recipe (:data:`WIRES`), as torchao names its
float8 recipes: the name says what crosses the wire and the line beside it
the trade-off.  A comm hook registered later (``register_comm_hook(state,
fastddp.hooks.X)``, torch's API) replaces the recipe, as it would replace
torch's default all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["Options", "WIRES", "parse_auto_precision", "parse_bucket_cap", "parse_check_finite"]

#: The wire recipes: name -> (the one-line trade-off, the auto setting's
#: lowest precision or None, the fixed format or None).
WIRES = {
    "exact": ("fp32 all-reduce: torch's DDP bits (the default)", None, None),
    "auto": ("measured at run time: fp32 or bf16 summed in fp32, whichever steps faster "
             "(never below bf16); the answer where the link is unknown", "bf16", None),
    "auto-fp8": ("measured as auto, block-scaled fp8 allowed too: the most a slow link gains, "
                 "fp8's rounding kept by error feedback", "fp8", None),
    "auto-fp32": ("measured as auto among exact formats only (the flat all-reduce or, across "
                  "hosts, its hierarchical form)", "fp32", None),
    "bf16": ("bf16 on the wire summed in fp32, error feedback: half the bytes, one rounding "
             "per step however many ranks", None, "bf16"),
    "fp8": ("block-scaled e4m3 summed in fp32, error feedback, 1-D parameters in fp32: "
            "about a quarter of the bytes", None, "fp8"),
}

_CHECK_FINITE = {False: "off", True: "raise", "raise": "raise", "warn": "warn", "off": "off"}
_AUTO_PRECISION = ("fp32", "bf16", "fp8")
from .kernels._switch import OFF_WORDS as _OFF  # the one truthiness rule


def parse_check_finite(value, what: str = "check_finite") -> str | None:
    """``check_finite`` as passed (False, True, ``"raise"``, ``"warn"``,
    ``"off"``, None) -> None, ``"raise"`` or ``"warn"``; else a clear error."""
    if value is None:
        return None
    try:
        got = _CHECK_FINITE[value]
    except (KeyError, TypeError):  # TypeError: an unhashable value
        raise ValueError(f"fastddp: {what} must be one of False, True, 'raise', 'warn', 'off' "
                         f"or None, got {value!r}") from None
    return None if got == "off" else got


def parse_bucket_cap(value, what: str = "bucket_cap_mb"):
    """``"auto"`` (any case), a number of MiB >= 0 (or its text), or None; else a clear error."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{what} must be a number of MiB or 'auto', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of MiB or 'auto', got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of MiB >= 0 or 'auto', got {value!r}")
    return value


def parse_auto_precision(value, what: str = "auto_precision") -> str | None:
    """The lowest precision of ``auto_precision_hook`` set without a hook:
    ``"fp32"``, ``"bf16"``, ``"fp8"`` (any case), or off (None, False, an
    off word, ``"off"``); else a clear error."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _AUTO_PRECISION:
            return low
        if low in _OFF or low == "":
            return None
    raise ValueError(f"fastddp: {what}={value!r} is not a valid value; accepted (any case): "
                     f"{', '.join(_AUTO_PRECISION)} (the lowest precision allowed), or off / unset")


def wire_of_auto_precision(lowest: str | None) -> str:
    """The recipe ``FASTDDP_AUTO_PRECISION`` / ``configure(auto_precision=)`` names (:data:`WIRES`)."""
    return "exact" if lowest is None else next(k for k, (_, low, _) in WIRES.items() if low == lowest)


def _whole(value, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"fastddp: Options.{what}={value!r} must be None or a whole number >= {least}")
    return value


@dataclasses.dataclass(frozen=True)
class Options:
    """What fastddp adds to torch's DDP arguments (see the module docstring:
    a field left None is decided by ``configure()``, then the environment,
    then the default).  Checked when made: a bad value raises, naming the
    field and what it accepts."""

    wire: str | None = None
    """The wire format, a recipe of :data:`WIRES`: ``"exact"`` (default),
    ``"auto"``, ``"auto-fp8"``, ``"auto-fp32"``, ``"bf16"``, ``"fp8"``.
    (``FASTDDP_AUTO_PRECISION=bf16|fp8|fp32`` names the auto recipes.)"""
    hierarchical: bool | None = None
    """``"exact"``, ``"bf16"`` and ``"fp8"`` run inside and between hosts
    (fp32 inside a host, the wire between hosts: ``hierarchical_hook``)
    where ranks span hosts; on one host they run flat, saying why once.
    The auto recipes consider the hierarchical forms by themselves."""
    ranks_per_host: int | None = None
    """Ranks per host for the hierarchical forms (None: detected from
    torchrun's environment or the host's name; ``FASTDDP_RANKS_PER_HOST``)."""
    bucket_cap_mb: float | str | None = None
    """Bucket cap where the constructor gets no ``bucket_cap_mb(_list)``:
    MiB, or ``"auto"`` (tuned from the first steps' timings;
    ``FASTDDP_BUCKET_CAP_MB``)."""
    check_finite: str | None = None
    """``"raise"`` or ``"warn"`` on a non-finite gradient, or ``"off"``
    (``True``/``False`` accepted; ``FASTDDP_CHECK_FINITE``).  The
    constructor's own ``check_finite`` argument wins over this field."""
    chunk_bytes: int | None = None
    """Bytes each way per collective call of the two-phase formats (bf16,
    fp8, hierarchical); 0: one call per phase (``FASTDDP_CHUNK_BYTES``;
    None: 1 MiB on the CPU, one call on CUDA).  A hook state's own
    ``chunk_bytes`` wins."""
    in_place_numel: int | str | None = None
    """On the CPU, the exact all-reduce reduces gradients of at least this
    many elements where they are (0: never; ``"auto"``: where paired trial
    steps measure it faster; ``FASTDDP_IN_PLACE_NUMEL``)."""

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.wire is not None:
            wire = self.wire.strip().lower() if isinstance(self.wire, str) else self.wire
            if wire not in WIRES:
                raise ValueError(f"fastddp: Options.wire={self.wire!r}; choose one of "
                                 + "; ".join(f"{k!r} ({v[0]})" for k, v in WIRES.items()))
            put("wire", wire)
        if self.hierarchical is not None and not isinstance(self.hierarchical, bool):
            raise TypeError(f"fastddp: Options.hierarchical must be True, False or None, got {self.hierarchical!r}")
        if self.ranks_per_host is not None:
            _whole(self.ranks_per_host, "ranks_per_host", 1)
        put("bucket_cap_mb", parse_bucket_cap(self.bucket_cap_mb, "fastddp: Options.bucket_cap_mb"))
        if self.check_finite is not None:
            put("check_finite", parse_check_finite(self.check_finite, "Options.check_finite") or "off")
        if self.chunk_bytes is not None:
            _whole(self.chunk_bytes, "chunk_bytes")
        n = self.in_place_numel
        if isinstance(n, str) and n.strip().lower() == "auto":
            put("in_place_numel", "auto")
        elif n is not None:
            _whole(n, "in_place_numel")

    def over(self, under: "Options") -> "Options":
        """These options where set, ``under``'s elsewhere."""
        return Options(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                          else getattr(under, f.name) for f in dataclasses.fields(self)})

    @property
    def lowest(self) -> str | None:
        """The auto recipe's lowest precision (None: not an auto recipe)."""
        return WIRES[self.wire][1] if self.wire is not None else None
