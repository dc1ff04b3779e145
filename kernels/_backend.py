"""Backend capabilities, detected once and cached (STYLE.md: one module,
behind a guarded Triton import)."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_status() -> tuple[bool, bool, str]:
    """(triton importable, interpreter on, reason-if-not)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, False, f"triton not importable: {exc!r}"
    return True, interpret, ""


def triton_available() -> bool:
    return _triton_status()[0]


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET was set (it is read when @triton.jit runs,
    i.e. when fastddp.kernels is imported)."""
    ok, interp, _ = _triton_status()
    return ok and interp


def backend(device: torch.device | str | None = None) -> str:
    """The backend that serves contiguous tensors on ``device`` (default CPU):
    ``"triton"``, ``"interpret"`` or ``"reference"``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ok, interp, _ = _triton_status()
    if dev.type == "cuda":
        return "triton" if ok and not interp else ("interpret" if ok else "reference")
    return "interpret" if ok and interp else "reference"


def reset_backend() -> None:
    """Forget the cached capability probe (tests use it to isolate themselves)."""
    _triton_status.cache_clear()
