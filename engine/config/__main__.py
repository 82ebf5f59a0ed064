"""``python -m engine.config [--job.config_file X.toml] [--section.key value ...]``: load and check a
config in one process without torch; prints the merged config as TOML, its warnings on stderr, or
one ``config error:`` line and exit status 2. (The set-up rules that need the world size run in the
launcher's pre-flight, engine/launch/launcher.py.)"""

from __future__ import annotations

import sys

from engine.config import ConfigError, config_to_toml, load_config


def main(argv: list[str] | None = None) -> int:
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
