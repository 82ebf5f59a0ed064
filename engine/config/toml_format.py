"""Writing config values as TOML and as command-line examples (for saved configs and messages)."""

from __future__ import annotations

import math
from typing import Any


def toml_value(value: Any) -> str:
    """One scalar as TOML source: bool before int (bool is an int subclass); floats via repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else
                                                          ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return '"' + "".join(_escape(ch) for ch in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a TOML config value")


def _escape(ch: str) -> str:
    # TOML basic strings forbid raw control characters (incl. DEL), '"' and '\'.
    if ch in '"\\':
        return "\\" + ch
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\u{ord(ch):04X}"
    return ch


def cli_value(value: Any) -> str:
    # Example values in error messages: strings unquoted, as a shell user would type them.
    if isinstance(value, list):
        return ",".join(value) or '""'
    return toml_value(value) if not isinstance(value, str) else (value or '""')
