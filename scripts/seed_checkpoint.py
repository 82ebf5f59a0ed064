"""Write a run's initial model weights as step-0 of its checkpoint folder, from one process.

    python scripts/seed_checkpoint.py --job.config_file train_configs/debug_model.toml [--section.key value ...]
    NGPU=4 ./run_train.sh [the same overrides]      # any layout starts from these weights

Takes the same arguments as training (engine/train/main.py) and writes
``<run folder>/<checkpoint.folder>/step-0`` (model weights only): every later run in that folder
loads them, whatever its parallel degrees, then trains from step 0 with a fresh optimizer. Exit
status 2 with a one-line message on bad input. The work is done by engine/convert/tools.py.
"""

from __future__ import annotations

import os
import sys

# Allow `python scripts/seed_checkpoint.py` from the repo root without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's


def main(argv: list[str] | None = None) -> int:
    from engine.convert.tools import save_seed_checkpoint
    from engine.config import ConfigError, load_config

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # one process, whatever launched us
        os.environ.pop(name, None)
    try:
        cfg = load_config(argv)
        cfg.validate()
        folder = save_seed_checkpoint(cfg)
    except (ConfigError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote seed checkpoint {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
