#!/usr/bin/env python
"""Measured pipeline bubble vs the GPipe formula (K-1)/(M+K-1), through ./run_train.sh.

For each microbatch count M, trains the debug model with K = --stages pipeline ranks (GPipe, one
stage each, microbatch size 1, so M = local_batch_size) for a few steps and reads the logged
``pp_bubble_fraction`` (1 - stage compute seconds / forward-backward seconds, mean over the steps
after the first) from metrics.jsonl. Needs K free cores for meaningful numbers (the bubble of
ranks that share a core is contention, not schedule).

    python scripts/benchmark_pp_bubble.py --stages 2 --microbatches 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's

from parallelisms.pipeline_timing import gpipe_bubble_fraction  # noqa: E402


def measure(stages: int, microbatches: int, steps: int, schedule: str, seq_len: int) -> float:
    """Mean logged bubble fraction of steps 2..steps (step 1 includes warm-up)."""
    with tempfile.TemporaryDirectory() as folder:
        args = [
            os.path.join(REPO, "run_train.sh"),
            "--job.dump_folder", folder, "--job.print_config", "false",
            "--parallelism.pp", str(stages), "--parallelism.dp_shard", "1",
            "--parallelism.pp_schedule", schedule, "--parallelism.pp_microbatch_size", "1",
            "--training.local_batch_size", str(microbatches), "--training.global_batch_size", str(microbatches),
            "--training.seq_len", str(seq_len), "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
        ]
        env = dict(os.environ, NGPU=str(stages), OMP_NUM_THREADS="1")
        subprocess.run(args, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            bubbles = [r["pp_bubble_fraction"] for r in map(json.loads, f) if r.get("kind") == "train"]
    later = bubbles[1:] or bubbles
    return sum(later) / len(later)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks K (one stage each)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8], help="values of M")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--schedule", default="GPipe")
    args = parser.parse_args()
    print(f"{'M':>4} {'measured':>9} {'GPipe (K-1)/(M+K-1)':>20}   (K = {args.stages}, {args.schedule})")
    for m in args.microbatches:
        measured = measure(args.stages, m, args.steps, args.schedule, args.seq_len)
        print(f"{m:>4} {measured:>9.3f} {gpipe_bubble_fraction(args.stages, m):>20.3f}", flush=True)


if __name__ == "__main__":
    main()
