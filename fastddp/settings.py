"""Every environment variable fastddp reads, parsed once, in one place.

| variable | type | default | what it does |
|---|---|---|---|
| `FASTDDP_DEBUG` | switch | off | debug mode: cross-rank checks of the bucket order and the module each step |
| `TORCH_DISTRIBUTED_DEBUG` | OFF, INFO, DETAIL | OFF | torch's; DETAIL also turns on fastddp's debug mode |
| `FASTDDP_NVTX` | switch | off | named ranges (record_function; NVTX on CUDA) around each reducer phase |
| `FASTDDP_CHECK_FINITE` | switch, raise, warn | off | health check without a `check_finite` argument (on: raise) |
| `FASTDDP_BUCKET_CAP_MB` | MiB >= 0, auto | unset | bucket cap where the constructor gets no `bucket_cap_mb(_list)` |
| `FASTDDP_AUTO_PRECISION` | fp32, bf16, fp8, off | off | where no comm hook is registered: the wire format chosen from measurement, none below this precision (`auto_precision_hook`) |
| `FASTDDP_CHUNK_BYTES` | bytes >= 0 | unset | bytes each way per two-phase call (unset: the mode's; 0: unchunked) |
| `FASTDDP_IN_PLACE_NUMEL` | auto, elements >= 0 | auto | on the CPU, the plain all-reduce reduces each gradient of at least this many elements where it is, in `.grad` (0: never; auto: gradients of 1048576 elements or more, where paired steps measure it faster) |
| `FASTDDP_NATIVE` | switch, require | on | native readiness hooks (off: Python hooks; require: a failed build raises) |
| `FASTDDP_RANKS_PER_HOST` | whole number | unset | the hierarchical reduction's topology: this many consecutive ranks per host (unset: detected) |
| `LOCAL_WORLD_SIZE` | whole number | unset | torchrun's: ranks on this host (checked against the detected topology) |
| `GROUP_RANK` | whole number | unset | torchrun's: this host's (node's) rank, the host key of the detected topology |
| `CXX` | command | unset | C++ compiler of the native build without ninja (unset: c++ or g++ on PATH) |
| `FASTDDP_EXIT_DRAIN_S` | seconds >= 0 | 0.5 | the most the exit drain waits (`fastddp._exit`; 0: no drain) |
| `PYTORCH_DDP_USE_SIDE_STREAM` | switch | on | torch's: copy inputs to `device_ids` on a side stream |
| `DDP_SET_LAST_BUCKET_CAP` | switch | off | torch's: the last bucket gets the small first-bucket cap too |

One rule for every switch, case and surrounding blanks ignored: unset or
empty is the variable's default; ``0 false off no`` is off; ``1 true on yes``
is on; a variable with words of its own (``require``, ``raise``, ``warn``)
accepts those too.  Anything else is a ``ValueError`` that names the variable
and the accepted values, raised where the settings are first needed (a DDP
construction), as is a number that does not parse or is out of range.

Read once: :func:`get` parses the environment the first time something asks
and returns that frozen :class:`Settings` from then on; :func:`reload` parses
it again (tests that change a variable call it after the change).

:func:`configure` is the programmatic form of the options a constructor that
keeps torch's signature cannot pass; where both are set, :func:`configure`
wins over the environment (:func:`default`), and a constructor argument wins
over both.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
import threading
from typing import Any, Callable

__all__ = ["NativeMode", "Settings", "configure", "configured", "default", "effective", "get", "options_from_environment", "parse",
           "parse_auto_precision", "parse_bucket_cap", "parse_check_finite", "reload"]

from .kernels._switch import OFF_WORDS, ON_WORDS, parse_switch  # the one truthiness rule
from .options import Options, parse_auto_precision, parse_bucket_cap, parse_check_finite, wire_of_auto_precision


class NativeMode(enum.Enum):
    """``FASTDDP_NATIVE``: whether the compiled readiness hooks are built and
    whether a failed build is an error."""

    OFF = "off"
    ON = "on"
    REQUIRE = "require"


# ------------------------------------------------------------------ the parsers
def _accepted(words) -> str:
    return ", ".join(words)


def _switch(name: str, text: str, words: tuple = ()):
    """The one truthiness rule (``text`` is stripped and not empty):
    :func:`fastddp.kernels._switch.parse_switch`."""
    return parse_switch(name, text, words)


def _native(name: str, text: str) -> NativeMode:
    v = _switch(name, text, ("require",))
    return NativeMode.REQUIRE if v == "require" else NativeMode.ON if v else NativeMode.OFF


def _check_finite_env(name: str, text: str) -> str | None:
    v = _switch(name, text, ("raise", "warn"))
    return "raise" if v is True else None if v is False else v


def _torch_debug(name: str, text: str) -> str:
    up = text.upper()
    if up not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"fastddp: {name}={text!r} is not a valid value; accepted (any case): "
                         "OFF, INFO, DETAIL, or unset")
    return up


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"fastddp: {name}={text!r} is not a number of seconds >= 0 (0: off)")
    return value


def _whole(name: str, text: str, accepted: str) -> int:
    """A whole number >= 0, else a ValueError naming the variable and ``accepted``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"fastddp: {name}={text!r} is not {accepted}")
    return value


def _bytes(name: str, text: str) -> int:
    return _whole(name, text, "a whole number of bytes >= 0 (0 turns chunking off)")


def _count(name: str, text: str) -> int:
    """A whole number >= 0 (torchrun's LOCAL_WORLD_SIZE, GROUP_RANK; ranks per host; elements)."""
    return _whole(name, text, "a whole number >= 0")


def _in_place(name: str, text: str) -> int | None:
    """``auto`` (None: the plain all-reduce measures whether it pays) or elements >= 0."""
    if text.lower() == "auto":
        return None
    return _whole(name, text, "a whole number >= 0 or auto (auto: measured; 0: never)")


def _cap(name: str, text: str):
    return parse_bucket_cap(text, name)


def _auto_precision(name: str, text: str) -> str | None:
    return parse_auto_precision(text, name)


def _text(name: str, text: str) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class _Variable:
    name: str
    field: str
    parse: Callable[[str, str], Any]
    default: Any


VARIABLES = (
    _Variable("FASTDDP_DEBUG", "debug", _switch, False),
    _Variable("TORCH_DISTRIBUTED_DEBUG", "torch_debug", _torch_debug, "OFF"),
    _Variable("FASTDDP_NVTX", "nvtx", _switch, False),
    _Variable("FASTDDP_CHECK_FINITE", "check_finite", _check_finite_env, None),
    _Variable("FASTDDP_BUCKET_CAP_MB", "bucket_cap_mb", _cap, None),
    _Variable("FASTDDP_AUTO_PRECISION", "auto_precision", _auto_precision, None),
    _Variable("FASTDDP_CHUNK_BYTES", "chunk_bytes", _bytes, None),
    _Variable("FASTDDP_IN_PLACE_NUMEL", "in_place_numel", _in_place, None),
    _Variable("FASTDDP_NATIVE", "native", _native, NativeMode.ON),
    _Variable("FASTDDP_RANKS_PER_HOST", "ranks_per_host", _count, None),
    _Variable("LOCAL_WORLD_SIZE", "local_world_size", _count, None),
    _Variable("GROUP_RANK", "group_rank", _count, None),
    _Variable("CXX", "cxx", _text, None),
    _Variable("FASTDDP_EXIT_DRAIN_S", "exit_drain_s", _seconds, 0.5),
    _Variable("PYTORCH_DDP_USE_SIDE_STREAM", "use_side_stream", _switch, True),
    _Variable("DDP_SET_LAST_BUCKET_CAP", "set_last_bucket_cap", _switch, False),
)
"""Every variable of the table above: its name, its :class:`Settings` field,
its parser and its default (the value where it is unset or empty)."""
_BY_NAME = {v.name: v for v in VARIABLES}


def parse(name: str, raw: str | None):
    """The one parser: variable ``name``'s value for the text ``raw`` (None:
    unset).  Unset or blank -> the default; else the variable's type, or a
    ``ValueError`` naming the variable and what it accepts."""
    var = _BY_NAME[name]
    text = "" if raw is None else raw.strip()
    return var.default if not text else var.parse(name, text)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One snapshot of the environment, one field per variable (see the table)."""

    debug: bool = False
    """``FASTDDP_DEBUG``."""
    torch_debug: str = "OFF"
    """``TORCH_DISTRIBUTED_DEBUG``, upper case."""
    nvtx: bool = False
    """``FASTDDP_NVTX``."""
    check_finite: str | None = None
    """``FASTDDP_CHECK_FINITE``: None, ``"raise"`` or ``"warn"``."""
    bucket_cap_mb: float | str | None = None
    """``FASTDDP_BUCKET_CAP_MB``: MiB, ``"auto"`` or None (unset)."""
    auto_precision: str | None = None
    """``FASTDDP_AUTO_PRECISION``: the lowest precision of the measured choice, or None (off)."""
    chunk_bytes: int | None = None
    """``FASTDDP_CHUNK_BYTES``: bytes, or None (unset: the mode chooses)."""
    in_place_numel: int | None = None
    """``FASTDDP_IN_PLACE_NUMEL``: on the CPU, gradients of at least this
    many elements are all-reduced where they are (0: never); None (unset or
    ``auto``): where paired trial steps measure it faster than one collective
    per bucket (:func:`fastddp.reduction.choices.in_place_choice`)."""
    native: NativeMode = NativeMode.ON
    """``FASTDDP_NATIVE``."""
    ranks_per_host: int | None = None
    """``FASTDDP_RANKS_PER_HOST``: the hierarchical reduction's explicit
    topology (consecutive ranks share a host), or None (detected)."""
    local_world_size: int | None = None
    """``LOCAL_WORLD_SIZE`` (set by torchrun): ranks on this host."""
    group_rank: int | None = None
    """``GROUP_RANK`` (set by torchrun): this host's (node's) rank."""
    cxx: str | None = None
    """``CXX``, or None (unset)."""
    exit_drain_s: float = 0.5
    """``FASTDDP_EXIT_DRAIN_S``."""
    use_side_stream: bool = True
    """``PYTORCH_DDP_USE_SIDE_STREAM``."""
    set_last_bucket_cap: bool = False
    """``DDP_SET_LAST_BUCKET_CAP``."""

    @property
    def debug_mode(self) -> bool:
        """fastddp's debug mode: ``FASTDDP_DEBUG`` on or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
        return self.debug or self.torch_debug == "DETAIL"

    @classmethod
    def from_environment(cls, environ=None) -> "Settings":
        env = os.environ if environ is None else environ
        return cls(**{v.field: parse(v.name, env.get(v.name)) for v in VARIABLES})


_lock = threading.Lock()
_snapshot: Settings | None = None


def get() -> Settings:
    """The settings, parsed from the environment the first time they are needed."""
    snap = _snapshot
    return snap if snap is not None else reload()


def reload() -> Settings:
    """Parse the environment again (after a test changed a variable) and return it."""
    global _snapshot
    with _lock:
        _snapshot = None  # a bad value is refused again at the next read, not replaced by the old snapshot
        _snapshot = Settings.from_environment()
        return _snapshot


# --------------------------------------------------- the programmatic options
_UNSET = object()
_configured = Options()  # configure()'s process-wide options (a field None: not configured)


def options_from_environment(snap: Settings | None = None) -> Options:
    """The environment's :class:`~fastddp.options.Options` (each variable onto its field)."""
    s = get() if snap is None else snap
    return Options(wire=None if s.auto_precision is None else wire_of_auto_precision(s.auto_precision),
                   ranks_per_host=s.ranks_per_host or None, bucket_cap_mb=s.bucket_cap_mb,
                   check_finite=s.check_finite, chunk_bytes=s.chunk_bytes, in_place_numel=s.in_place_numel)


def effective(options: Options | None = None) -> Options:
    """A module's options: ``options`` (the constructor's) where set, else
    :func:`configure`'s, else the environment's; None where none sets one."""
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"fastddp: options must be a fastddp.Options, got {type(options).__name__}")
    return (options or Options()).over(_configured).over(options_from_environment())


def configure(options: Options | None = None, *, check_finite=_UNSET, bucket_cap_mb=_UNSET,
              auto_precision=_UNSET) -> None:
    """Process-wide defaults for code that keeps torch's signature.
    ``fastddp.configure(fastddp.Options(...))`` replaces them all (a field
    left None: not configured); the keywords change one each (``None``
    restores the built-in default): ``fastddp.configure(check_finite="raise")``,
    ``fastddp.configure(bucket_cap_mb="auto")`` (used where the constructor
    gets neither ``bucket_cap_mb`` nor ``bucket_cap_mb_list``),
    ``fastddp.configure(auto_precision="fp8")`` (the ``auto-fp8`` wire
    recipe: modules without a comm hook reduce with ``auto_precision_hook``,
    none below that precision; a hook registered later replaces it).  Each
    wins over its environment variable; the constructor's ``options`` win
    over both."""
    global _configured
    if options is not None:
        if not isinstance(options, Options):
            raise TypeError(f"fastddp.configure: takes a fastddp.Options (or keywords), got {type(options).__name__}")
        _configured = options
    change = {}
    if check_finite is not _UNSET:
        parse_check_finite(check_finite, "fastddp.configure(check_finite=...)")
        change["check_finite"] = check_finite
    if bucket_cap_mb is not _UNSET:
        change["bucket_cap_mb"] = parse_bucket_cap(bucket_cap_mb, "fastddp.configure(bucket_cap_mb=...)")
    if auto_precision is not _UNSET:
        lowest = parse_auto_precision(auto_precision, "fastddp.configure(auto_precision=...)")
        change["wire"] = None if lowest is None else wire_of_auto_precision(lowest)
    if change:
        _configured = dataclasses.replace(_configured, **change)


def configured(option: str):
    """:func:`configure`'s value for ``option`` (None: not configured);
    ``"auto_precision"``: the lowest precision of a configured auto recipe."""
    if option == "auto_precision":
        return _configured.lowest
    return getattr(_configured, option)


def default(option: str):
    """The value a constructor that does not pass ``option`` gets:
    :func:`configure`'s, else the environment's (None: neither)."""
    eff = effective()
    if option == "auto_precision":
        return eff.lowest
    return getattr(eff, option)
