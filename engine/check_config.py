"""``python -m engine.check_config [--job.config_file X.toml] [--section.key value ...]``

Loads and validates a config in one process, without importing torch (about 0.3 s), so that
``run_train.sh`` rejects a bad config once, with one clear line and exit status 2, before it starts
any rank. (Under torchrun, the first rank to exit on a config error gets the others killed before
they can print; checking first avoids that race.) Prints nothing when the config is valid.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from engine.config import ConfigError, load_config

    try:
        load_config(argv).validate()
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
