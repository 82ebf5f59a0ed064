"""Convert between a DCP checkpoint folder and one consolidated torch.save file of model weights.

    # DCP step folder (saved under any layout) -> {name: full tensor} in one file
    python scripts/convert_checkpoint.py to-torch outputs/debug_model/checkpoint/step-100 model.pt [--dtype bfloat16]

    # such a file -> a model-only DCP checkpoint that a run can start from under any layout
    python scripts/convert_checkpoint.py from-torch model.pt weights_dcp
    ./run_train.sh --checkpoint.initial_load_path weights_dcp

Runs in one process without a process group (no torchrun). Exit status 2 with a one-line message on
bad input. The work is done by engine/checkpoint/tools.py.
"""

from __future__ import annotations

import argparse
import os
import sys

# Allow `python scripts/convert_checkpoint.py` from the repo root without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint.tools import DTYPES, export_model_weights, import_model_weights  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_torch = sub.add_parser("to-torch", help="DCP checkpoint folder -> one torch.save file of model weights")
    to_torch.add_argument("checkpoint_dir", help="a checkpoint folder, e.g. outputs/run/checkpoint/step-100")
    to_torch.add_argument("output", help="the .pt file to write")
    to_torch.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                          help="cast floating-point weights (default: keep the saved float32)")
    from_torch = sub.add_parser("from-torch", help="torch.save file of model weights -> DCP checkpoint folder")
    from_torch.add_argument("input", help="a .pt file holding {name: tensor}")
    from_torch.add_argument("checkpoint_dir", help="the folder to create (must not exist)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-torch":
            count = export_model_weights(args.checkpoint_dir, args.output, args.dtype)
            print(f"wrote {count} tensors to {args.output}")
        else:
            folder = import_model_weights(args.input, args.checkpoint_dir)
            print(f"wrote model-only checkpoint {folder}; start a run from it with "
                  f"--checkpoint.initial_load_path {folder}")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
