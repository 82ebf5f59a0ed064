"""Convert between a DCP checkpoint folder and a torch.save file or a Hugging Face model folder.

    # DCP step folder (saved under any layout) -> {name: full tensor} in one file
    python scripts/convert_checkpoint.py to-torch outputs/debug_model/checkpoint/step-100 model.pt [--dtype bfloat16]

    # such a file -> a model-only DCP checkpoint that a run can start from under any layout
    python scripts/convert_checkpoint.py from-torch model.pt weights_dcp
    ./run_train.sh --checkpoint.initial_load_path weights_dcp

    # Hugging Face folder (config.json + *.safetensors; Llama-2/3/3.1/3.2, Mixtral, Qwen3, Qwen3-MoE,
    # DeepSeek-V3, its FP8 weights dequantized) -> DCP + model arguments
    python scripts/convert_checkpoint.py from-hf path/to/Llama-3.2-1B outputs/llama32/seed
    ./run_train.sh --checkpoint.initial_load_path outputs/llama32/seed --model.args_path outputs/llama32/seed \
        --model.tokenizer_path outputs/llama32/seed/tokenizer.json

    # DCP step folder -> model.safetensors (+ index above --max-shard-size), config.json, generation_config.json
    python scripts/convert_checkpoint.py to-hf outputs/llama32/checkpoint/step-1000 hf_out [--dtype bfloat16]

Runs in one process without a process group (no torchrun). Exit status 2 with a one-line message on
bad input. The work is done by engine/convert/tools.py and engine/convert/hf.py.
"""

from __future__ import annotations

import argparse
import os
import sys

# Allow `python scripts/convert_checkpoint.py` from the repo root without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's

DTYPE_NAMES = ("bfloat16", "float16", "float32")  # engine/convert/tools.py DTYPES, without importing torch
# The path each command reads: checked before torch is imported (seconds), so a typo fails at once.
SOURCES = {"to-torch": "checkpoint_dir", "from-torch": "input", "from-hf": "hf_dir", "to-hf": "checkpoint_dir"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_torch = sub.add_parser("to-torch", help="DCP checkpoint folder -> one torch.save file of model weights")
    to_torch.add_argument("checkpoint_dir", help="a checkpoint folder, e.g. outputs/run/checkpoint/step-100")
    to_torch.add_argument("output", help="the .pt file to write")
    to_torch.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                          help="cast floating-point weights (default: keep the saved float32)")
    from_torch = sub.add_parser("from-torch", help="torch.save file of model weights -> DCP checkpoint folder")
    from_torch.add_argument("input", help="a .pt file holding {name: tensor}")
    from_torch.add_argument("checkpoint_dir", help="the folder to create (must not exist)")
    from_hf = sub.add_parser("from-hf", help="Hugging Face model folder -> model-only DCP checkpoint folder")
    from_hf.add_argument("hf_dir", help="a folder with config.json and model*.safetensors (Llama family, "
                                        "Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3 in bf16 or FP8)")
    from_hf.add_argument("checkpoint_dir", help="the folder to create (must not exist)")
    to_hf = sub.add_parser("to-hf", help="DCP checkpoint folder -> Hugging Face model folder (safetensors)")
    to_hf.add_argument("checkpoint_dir", help="a checkpoint folder, e.g. outputs/run/checkpoint/step-100")
    to_hf.add_argument("hf_dir", help="the folder to create (must not exist)")
    to_hf.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                       help="dtype of the written weights (default: keep the saved float32)")
    to_hf.add_argument("--max-shard-size", default="5GB",
                       help="split the weights into shards of at most this size, e.g. 5GB, 500MB (default 5GB)")
    args = parser.parse_args(argv)
    source = getattr(args, SOURCES[args.command])
    if not os.path.exists(source):
        print(f"error: {SOURCES[args.command]} {source}: no such file or folder", file=sys.stderr)
        return 2
    from engine.convert.tools import export_model_weights, import_model_weights

    try:
        if args.command in ("from-hf", "to-hf"):
            return _hugging_face(args)
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


def _hugging_face(args: argparse.Namespace) -> int:
    from engine.convert.hf import export_hf_model, import_hf_model, parse_size

    if args.command == "from-hf":
        out = import_hf_model(args.hf_dir, args.checkpoint_dir)
        folder = args.checkpoint_dir
        print(f"wrote model-only checkpoint {folder}: {out['name']} model, {out['parameters']:,} parameters in "
              f"{out['tensors']} float32 tensors; model arguments in {folder}/quadra.json")
        if out["dequantized"]:
            print(f"dequantized {out['dequantized']} FP8 weights (128x128 block scales) to float32; to-hf writes "
                  "this model unquantized")
        run = os.path.join(os.path.dirname(os.path.abspath(folder)), "run")
        command = (f"./run_train.sh --checkpoint.initial_load_path {folder} --model.args_path {folder} "
                   f"--job.dump_folder {run}")
        if out["name"] != "llama":
            command += f" --model.name {out['name']}"
        if out["tokenizer"]:
            command += f" --model.tokenizer_path {folder}/{out['tokenizer']}"
        else:
            command += (" --model.tokenizer_path TOKENIZER (the model folder has no tokenizer.json: train one with "
                        "scripts/train_tokenizer.py --data_path CORPUS --format hf --vocab_size N, "
                        "N at most the model's vocab_size)")
        print(f"continue pretraining from it (any layout):\n  {command}")
    else:
        out = export_hf_model(args.checkpoint_dir, args.hf_dir, args.dtype, parse_size(args.max_shard_size))
        print(f"wrote {args.hf_dir}: {out['name']} model, {out['tensors']} tensors ({out['bytes']:,} bytes) in "
              f"{out['shards']} safetensors file(s), config.json, generation_config.json"
              + (f", tokenizer from {out['tokenizer']}" if out["tokenizer"] else " (no tokenizer.json to copy)"))
        if out["unquantized_from"]:
            print(f"the imported folder was {out['unquantized_from'].get('quant_method')} quantized; written "
                  f"unquantized ({args.dtype or 'float32'}, no quantization_config in config.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
