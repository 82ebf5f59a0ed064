"""One config value's checks: the type of a TOML (or in-memory) value and the parsing of a command-line
string for a schema field (declared by :mod:`engine.config.schema`'s ``_opt``), and each field's allowed
``choices``.

:mod:`engine.config.loading` applies them to every key it reads and :meth:`JobConfig.validate` to every
key of a config; both raise :class:`ConfigError`, the one error a bad config gives. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from engine.config.toml_format import cli_value, toml_value

__all__ = ["ConfigError", "check_value", "field_default", "parse_cli_value"]

_TRUE_WORDS = ("true", "1", "yes")
_FALSE_WORDS = ("false", "0", "no")


class ConfigError(ValueError):
    """A bad config: unknown section/key, wrong type, value out of range, unreadable TOML, bad CLI."""


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value, also for list fields (which use a default_factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_value(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Type-check a TOML (or in-memory) value for field ``f`` (named ``key``, "section.key") and its
    ``choices``; ints widen to float, an ``int_ok`` str field takes an int as its decimal string.

    Returns:
        The value, converted as above.

    Raises:
        ConfigError: wrong type (a bool is never an int), a non-finite float, or a value outside
            ``choices``; the message names the key, the value and an example of the fix.
    """
    typ = f.type
    ok = False
    # bool is a subclass of int in Python; TOML `true` must never pass as 1.
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            ok = math.isfinite(value)
    elif typ == list[str]:
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        if ok:
            value = list(value)
    elif typ is str:
        ok = isinstance(value, str)
        if not ok and f.metadata.get("int_ok") and isinstance(value, int) and not isinstance(value, bool):
            value, ok = str(value), True
    if not ok:
        shown = toml_value(value) if isinstance(value, (bool, int, float, str)) else repr(value)
        expected = "a finite float (ints are accepted)" if typ is float else f"a{'n' * (typ is int)} {typ.__name__}"
        raise ConfigError(f"{key} = {shown} has type {type(value).__name__}, expected {expected}. "
                          f"Fix: write e.g. {key} = {toml_value(field_default(f))}")
    return _check_choice(key, value, f)


def parse_cli_value(key: str, text: str, f: dataclasses.Field) -> Any:
    """Convert one command-line string to the type of field ``f`` (named ``key``) and check its ``choices``.

    Bools take true/false, 1/0, yes/no; a ``list[str]`` takes :func:`_cli_list`'s forms.

    Raises:
        ConfigError: text that is not of the type (a non-finite float included), or a value
            outside ``choices``.
    """
    typ = f.type
    try:
        if typ is bool:
            word = text.strip().lower()
            if word not in _TRUE_WORDS + _FALSE_WORDS:
                raise ValueError(text)
            value: Any = word in _TRUE_WORDS
        elif typ == list[str]:
            value = _cli_list(text)
        elif typ is float:
            # float() takes "nan"/"inf"; no hyperparameter here means either, so refuse them.
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(text)
        else:
            value = typ(text)  # int(...) rejects "1.5" and "true"; str is the identity
    except ValueError:
        words = " (true/false, 1/0, yes/no)" if typ is bool else ""
        raise ConfigError(f"{key} = {text!r} from the command line is not a valid {typ.__name__}"
                          f"{words}. Fix: e.g. --{key} {cli_value(field_default(f))}") from None
    return _check_choice(key, value, f)


def _cli_list(text: str) -> list[str]:
    """A ``list[str]`` from the command line: comma-separated (``layers.4,layers.8``), or a TOML array
    as ``--help`` and the config show it (``'["output", "router.gate"]'``; ``[]`` for none).

    Raises:
        ValueError: a bracketed value that is not a TOML array of strings.
    """
    if not text.strip().startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        raise ValueError(text) from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(text)
    return value


def _check_choice(key: str, value: Any, f: dataclasses.Field) -> Any:
    """Raise ConfigError when ``f`` has ``choices`` metadata and ``value`` is not one of them."""
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} = {value!r} is not an allowed value. "
                          f"Fix: use one of {'|'.join(choices)}")
    return value
