"""``python -m engine.config [--job.config_file X.toml] [--section.key value ...]``: load and check a
config in one process without torch; prints the merged config as TOML, its warnings on stderr, or
one ``config error:`` line and exit status 2. (The set-up rules that need the world size run in the
launcher's pre-flight, engine/launch/launcher.py.)

``python -m engine.config diff A.toml B.toml [--section.key value ...]``: compare two configs (the
overrides apply to B) after defaults are filled in; prints each differing key with its class
(engine/config/fingerprint.py) and the two fingerprints, then either "execution only: the same run"
(exit 0) or the convergence and numerics changes (exit 1). A config that does not load: exit 2.
"""

from __future__ import annotations

import sys

from engine.config import ConfigError, config_to_toml, load_config
from engine.config.fingerprint import CONVERGENCE, EXECUTION, NUMERICS, changes, fingerprint, load_tables


def _tables(argv: list[str]) -> dict:
    cfg = load_config(argv)
    cfg.validate()
    return load_tables(config_to_toml(cfg))


def diff(argv: list[str]) -> int:
    """The ``diff`` command (see the module docstring); returns the exit status."""
    if len(argv) < 2 or argv[0].startswith("--") or argv[1].startswith("--"):
        print("usage: python -m engine.config diff A.toml B.toml [--section.key value ...] "
              "(the overrides apply to B)", file=sys.stderr)
        return 2
    try:
        old = _tables(["--job.config_file", argv[0]])
        new = _tables(["--job.config_file", argv[1], *argv[2:]])
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    found = changes(old, new)
    width = max((len(key) for key, *_ in found), default=0)
    for key, kind, before, after in found:
        print(f"{key:<{width}}  {kind:<11}  {before!r} -> {after!r}")
    print(f"fingerprints: {fingerprint(old)} -> {fingerprint(new)}")
    differing = [(key, kind) for key, kind, *_ in found if kind != EXECUTION]
    if not differing:
        print("execution only: the same run")
        return 0
    for kind in (CONVERGENCE, NUMERICS, "unclassified"):
        keys = [key for key, k in differing if k == kind]
        if keys:
            print(f"{kind} changes: {', '.join(keys)}")
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["diff"]:
        return diff(argv[1:])
    try:
        cfg = load_config(argv)
        cfg.validate()
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    for warning in cfg.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    print(config_to_toml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
