"""``python -m engine.launch [--section.key value ...]``: what run_train.sh execs (engine/launch/launcher.py)."""

import os
import sys

from engine.launch.launcher import main

if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
