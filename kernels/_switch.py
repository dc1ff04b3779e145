"""The one truthiness rule for environment switches, in the package every
other one imports (fastddp.settings and the native builds use it; nothing
else spells the words).

Case and surrounding blanks ignored: unset or empty is the variable's
default; ``0 false off no`` is off; ``1 true on yes`` is on; a variable
with words of its own (``require``, ``raise``, ``warn``) accepts those too;
anything else is a ``ValueError`` that names the variable and the accepted
values."""

from __future__ import annotations

import os

__all__ = ["OFF_WORDS", "ON_WORDS", "parse_switch", "interpreter_requested"]

OFF_WORDS = ("0", "false", "off", "no")
ON_WORDS = ("1", "true", "on", "yes")


def parse_switch(name: str, text: str, words: tuple = ()):
    """``text`` (stripped, not empty) -> False (an off word), True (an on
    word) or one of ``words``; else a ValueError naming ``name``."""
    low = text.strip().lower()
    if low in OFF_WORDS:
        return False
    if low in ON_WORDS:
        return True
    if low in words:
        return low
    raise ValueError(f"fastddp: {name}={text!r} is not a valid value; accepted (any case): "
                     f"{', '.join(OFF_WORDS)} (off), {', '.join(ON_WORDS)} (on)"
                     + (f", {', '.join(words)}" if words else "") + ", or unset")


def interpreter_requested(environ=None) -> bool:
    """``TRITON_INTERPRET`` is Triton's variable, read by Triton's own rule
    (``triton.knobs``' getenv_bool: an on word or ``y`` turns the
    interpreter on, anything else leaves it off): fastddp reads it the same
    way so that both agree, and never refuses it."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "").strip().lower() in ON_WORDS + ("y",)
