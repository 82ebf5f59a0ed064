"""``python -m engine.train --job.config_file X.toml [--section.key value ...]``: each rank's entry
point under torchrun (engine/train/main.py)."""

import os
import sys

from engine.train.main import main

if __name__ == "__main__":
    status = main()
    # Everything is written and the process group is gone; skip interpreter teardown, where gloo's and
    # DCP's C++ threads were seen to abort the process at random ("terminate called without an
    # active exception", SIGABRT) after a clean run, turning a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
