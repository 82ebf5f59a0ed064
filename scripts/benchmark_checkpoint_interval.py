#!/usr/bin/env python
"""What frequent checkpoints cost: ``checkpoint.interval`` 10 vs 100 with async saves, through ./run_train.sh.

Trains the debug model (2 CPU processes, FSDP) for ``--steps`` steps with ``checkpoint.async_mode =
async`` at each interval, the runs of the two intervals alternating (``--rounds`` each), and reads the
goodput ledger every launch writes to metrics.jsonl (engine/observe/goodput.py): the loop's time is
``productive_s`` (the steps, including their slowdown by a save writing in the background) plus
``checkpoint_s`` (the time the loop stood still for saves: staging the state to CPU memory, waiting
for the previous save). Both intervals save the final step, waited for. Prints per interval the
medians of the loop time, the stalls and the saves, and the ratio of the loop times.

    python scripts/benchmark_checkpoint_interval.py --steps 30 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def measure(interval: int, steps: int, seq_len: int) -> dict:
    """One launch; -> {"loop_s", "checkpoint_s", "saves"} of its goodput record."""
    with tempfile.TemporaryDirectory() as folder:
        args = [
            os.path.join(REPO, "run_train.sh"), "--job.dump_folder", folder, "--job.print_config", "false",
            "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--metrics.log_freq", "10",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
            "--checkpoint.enable", "true", "--checkpoint.async_mode", "async",
            "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k", "2",
        ]
        env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", PYTHON=os.environ.get("PYTHON", sys.executable))
        subprocess.run(args, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            (goodput,) = [r for r in map(json.loads, f) if r.get("kind") == "goodput"]
    saves = len(range(interval, steps, interval)) + 1  # the interval's saves and the final one
    return {"loop_s": goodput["productive_s"] + goodput["checkpoint_s"], "checkpoint_s": goodput["checkpoint_s"],
            "saves": saves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="launches per interval, alternating")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--intervals", type=int, nargs=2, default=[10, 100])
    args = parser.parse_args()
    results: dict[int, list[dict]] = {interval: [] for interval in args.intervals}
    for round_ in range(args.rounds):
        order = args.intervals if round_ % 2 == 0 else args.intervals[::-1]
        for interval in order:
            results[interval].append(measure(interval, args.steps, args.seq_len))
    median = {i: {k: statistics.median(r[k] for r in rs) for k in ("loop_s", "checkpoint_s")}
              for i, rs in results.items()}
    print(f"debug model, 2 CPU processes, {args.steps} steps, async saves, medians of {args.rounds} launches each")
    print(f"{'interval':>8} {'saves':>5} {'loop s':>8} {'stalls s':>9} {'stall per save s':>17}")
    for interval, m in median.items():
        saves = results[interval][0]["saves"]
        print(f"{interval:>8} {saves:>5} {m['loop_s']:>8.2f} {m['checkpoint_s']:>9.2f} "
              f"{m['checkpoint_s'] / saves:>17.3f}")
    a, b = args.intervals
    print(f"loop time, interval {a} / interval {b}: {median[a]['loop_s'] / median[b]['loop_s']:.3f}")


if __name__ == "__main__":
    main()
