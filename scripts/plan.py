#!/usr/bin/env python
"""Rank parallel layouts of a model on a cluster: per-rank memory, communication, bubble, step time, MFU.

    ./scripts/plan.py --model llama --flavor 70B --gpus 64 --gpus_per_node 8 --gpu H100-80GB \\
        --seq_len 8192 --global_batch_size 512 [--json plan.json]

Every candidate passes the launcher's own pre-flight; the formulas are engine/planner/ (tested
against the real plan and against CPU runs in tests/unit/test_planner*.py). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own status)
        self.exit(2, f"plan error: {message}; see --help\n")


def _args(argv):
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    from models import list_model_names  # torch-free

    p.add_argument("--model", default="llama", help=f"registered model name ({', '.join(list_model_names())})")
    p.add_argument("--flavor", required=True, help="model flavor, e.g. 8B, 70B, 405B, 16B, 30B-A3B")
    p.add_argument("--gpus", type=int, required=True, help="world size (GPUs)")
    p.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node (TP stays inside one)")
    p.add_argument("--gpu", default="H100-80GB", help="hardware table entry: A100-40GB, A100-80GB, H100-80GB, "
                   "H200-141GB, B200-180GB")
    p.add_argument("--seq_len", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--global_batch_size", type=int, default=512, help="sequences per optimizer step")
    p.add_argument("--config", default="", help="a TOML config to start from (its degrees are replaced)")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="override the GPU's dense bf16 TFLOP/s")
    p.add_argument("--hbm_gib", type=float, default=0.0, help="override the GPU's memory (GiB)")
    p.add_argument("--nvlink_gbps", type=float, default=0.0, help="override intra-node GB/s per GPU")
    p.add_argument("--internode_gbps", type=float, default=0.0, help="override inter-node GB/s per GPU")
    p.add_argument("--efficiency", type=float, default=0.6, help="share of peak FLOP/s compute reaches (0-1]")
    p.add_argument("--top", type=int, default=15, help="layouts to print")
    p.add_argument("--json", default="", help="write every layout's record to this JSON file")
    return p.parse_args(argv)


def _refuse(message: str) -> int:
    """Print ``plan error: <message>`` (one line) to stderr; returns the exit status, 2."""
    print(f"plan error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    for flag in ("gpus", "gpus_per_node", "seq_len", "global_batch_size", "top"):
        if getattr(a, flag) < 1:
            return _refuse(f"--{flag} {getattr(a, flag)} must be >= 1")
    if a.gpus % a.gpus_per_node and a.gpus > a.gpus_per_node:
        return _refuse(f"--gpus {a.gpus} is not a multiple of --gpus_per_node {a.gpus_per_node}; use whole nodes")
    if not 0 < a.efficiency <= 1:
        return _refuse(f"--efficiency {a.efficiency} must be in (0, 1]")
    if a.json and os.path.isdir(a.json):
        return _refuse(f"--json {a.json} is a folder; give a file path, e.g. {os.path.join(a.json, 'plan.json')}")
    folder = os.path.dirname(os.path.abspath(a.json)) if a.json else ""
    if a.json and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        return _refuse(f"--json {a.json}: folder {folder} does not exist or is not writable; "
                       "create it or choose another path")
    if a.config and not os.path.isfile(a.config):
        return _refuse(f"--config {a.config}: no such file; pass a TOML file, e.g. train_configs/llama3_8b.toml")
    import models  # noqa: F401  (registers the model families)
    from models.registry import get_model_spec, list_model_names

    if a.model not in list_model_names():
        return _refuse(f"--model {a.model!r} is not a registered model; use one of {', '.join(list_model_names())}")
    spec = get_model_spec(a.model)
    if a.flavor not in spec.flavors:
        return _refuse(f"--flavor {a.flavor!r} is not a flavor of {a.model}; use one of {', '.join(spec.flavors)}")
    from engine.config import ConfigError, load_config
    from engine.observe.hardware import HardwareError, get_gpu
    from engine.planner.report import table, write_json
    from engine.planner.search import ROWS, plan

    try:
        gpu = get_gpu(a.gpu, peak_tflops=a.peak_tflops, hbm_gib=a.hbm_gib, nvlink_gbps=a.nvlink_gbps,
                      internode_gbps=a.internode_gbps)
        argv = ["--job.config_file", a.config] if a.config else []
        cfg = load_config(argv + [
            "--model.name", a.model, "--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len),
            "--training.global_batch_size", str(a.global_batch_size),
            "--training.local_batch_size", "1",  # each candidate layout chooses its own (engine/planner/search.py)
            "--training.mixed_precision_param", "bfloat16", "--job.device", "cuda",
        ])
        cfg.validate()
    except (ConfigError, HardwareError, ValueError) as error:
        return _refuse(str(error))
    result = plan(cfg, a.gpus, gpu, a.gpus_per_node, a.efficiency)
    records = [e.as_dict() for e in result.ranked]
    print(f"{a.model} {a.flavor} on {a.gpus} x {gpu.name} ({a.gpus_per_node} per node), seq_len {a.seq_len}, "
          f"global batch {a.global_batch_size} sequences; {len(records)} layouts, "
          f"{sum(r['fits'] for r in records)} fit")
    from engine.planner.float8 import float8_summary

    float8_line = float8_summary(result.ranked[0].layout, gpu, search=True) if result.ranked else None
    if float8_line:
        print(float8_line)
    print(table(records, a.top))
    print(f"\ndecision matrix: row {result.row}: {ROWS.get(result.row, 'nothing fits')}")
    print(result.reason)
    if a.json:
        write_json(a.json, {"model": a.model, "flavor": a.flavor,
                            "cluster": {"gpus": a.gpus, "gpus_per_node": a.gpus_per_node, "gpu": gpu.name},
                            "seq_len": a.seq_len, "global_batch_size": a.global_batch_size,
                            "decision": {"row": result.row, "name": ROWS.get(result.row), "reason": result.reason},
                            "layouts": records})
        print(f"wrote {len(records)} layouts to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
