"""How far float8 training's loss strays from float32's: the debug model, 100 steps, one CPU process.

    PYTHONPATH=. python scripts/benchmarks/float8_loss.py [--steps 100] [--out DIR] [--only RUN] [--report]

``--only`` trains one run (several processes can share the ``--out`` folder), ``--report`` prints the
table from the runs' metrics.jsonl found there, without training.

Trains train_configs/debug_model.toml with the suite's flavor debugmodel_tiny (every block linear
float8: its dims are multiples of 16; the output head float32) from the same weights on the same
batches: float32, float8 tensorwise and float8 rowwise (torchao, parallelisms/float8.py), at sequence
length 64 to keep a run within minutes on a CPU (float8 casts and ``_scaled_mm`` are slow there).
Prints each run's loss at a few steps and the band: the largest relative difference of float8's loss
from float32's over all steps, and over the last 10 steps' mean. engine/docs/float8.md quotes its
output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

RUNS = {"float32": {}, "float8 tensorwise": {"float8.enable": "true"},
        "float8 rowwise": {"float8.enable": "true", "float8.recipe": "rowwise"}}


def train(steps: int, folder: str, overrides: dict) -> list[float]:
    """The losses of one run of the debug config with ``overrides``, one per step."""
    from scripts.benchmarks.runs import build_trainer

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
            "--job.dump_folder", folder, "--job.device", "cpu", "--training.steps", str(steps),
            "--model.flavor", "debugmodel_tiny", "--training.seq_len", "64", "--validation.enable", "false",
            "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
    for key, value in overrides.items():
        argv += [f"--{key}", value]
    trainer = build_trainer(argv)
    try:
        return [record["loss"] for record in trainer.train()]
    finally:
        trainer.close()


def logged_losses(folder: str) -> list[float]:
    """The training losses a run logged (``metrics.jsonl``, one per step, engine/parity/runs.py), or []."""
    from engine.parity.runs import read_history

    return [loss for loss, _ in read_history(folder)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="", help="run folders (default: a temporary folder)")
    parser.add_argument("--only", choices=list(RUNS), help="train this run only")
    parser.add_argument("--report", action="store_true", help="print the table of the runs in --out")
    args = parser.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="float8_loss_")
    if not args.report:
        for name, overrides in RUNS.items():
            if args.only in (None, name):
                train(args.steps, os.path.join(root, name.replace(" ", "_")), overrides)
    losses = {name: logged_losses(os.path.join(root, name.replace(" ", "_"))) for name in RUNS}
    losses = {name: values for name, values in losses.items() if len(values) == args.steps}
    if "float32" not in losses or len(losses) < 2:
        print(f"complete runs in {root}: {sorted(losses)} (the table needs float32 and a float8 run)")
        return
    ref = losses["float32"]
    shown = sorted({1, 10, 25, 50, 75, args.steps} & set(range(1, args.steps + 1)))
    print("| run | " + " | ".join(f"step {s}" for s in shown) + " | max rel. diff | last-10 mean rel. diff |")
    print("|---" * (len(shown) + 3) + "|")
    for name, values in losses.items():
        worst = max(abs(a - b) / b for a, b in zip(values, ref))
        tail = abs(statistics.fmean(values[-10:]) - statistics.fmean(ref[-10:])) / statistics.fmean(ref[-10:])
        cells = " | ".join(f"{values[s - 1]:.4f}" for s in shown)
        print(f"| {name} | {cells} | {worst:.1e} | {tail:.1e} |")


if __name__ == "__main__":
    main()
