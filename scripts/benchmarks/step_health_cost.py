"""What step health costs on the step time: the trainer of another git revision against this one.

    python scripts/benchmarks/step_health_cost.py --baseline-rev main --rounds 30 [--section.key value ...]

Three trainers of the same config train side by side in one process, one step each per round, in
rotating order (engine/train/step_health.py is the code measured):

- ``baseline``: ``engine/train/trainer.py`` of ``--baseline-rev`` (reads loss and grad norm after the
  update, judges nothing);
- ``checked``: this tree, spike checks on (``loss_spike_sigma`` = ``grad_norm_spike_sigma`` = 6,
  ``window`` 128): the read moves before the update and every step is judged;
- ``skipped``: this tree with every step's gradient made non-finite (``on_nonfinite = "skip"``): the
  update is withheld, a capsule and a metrics record are written.

Prints the median step time of each (after ``--warmup`` rounds), its spread (p25-p75) and the ratios
to ``baseline``. Run it on an otherwise idle machine (scripts/benchmarks/harness.py's rule).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _baseline_trainer(rev: str, folder: str):
    """The Trainer class of ``engine/train/trainer.py`` at git revision ``rev``."""
    source = subprocess.run(["git", "-C", REPO, "show", f"{rev}:engine/train/trainer.py"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(folder, "baseline_trainer.py")
    with open(path, "w") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location("baseline_trainer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default="main")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args, overrides = parser.parse_known_args()

    from engine.config import load_config
    from engine.train.trainer import Trainer
    from engine.testing.faults import inject

    folder = tempfile.mkdtemp(prefix="step_health_cost_")
    base = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--job.print_config", "false",
            "--training.steps", str(args.rounds + args.warmup + 1), "--validation.enable", "false",
            "--metrics.enable_tensorboard", "false", "--metrics.time_attribution", "false", *overrides]
    variants = {
        "baseline": (_baseline_trainer(args.baseline_rev, folder), []),
        "checked": (Trainer, ["--step_health.loss_spike_sigma", "6", "--step_health.grad_norm_spike_sigma", "6"]),
        "skipped": (Trainer, ["--step_health.on_nonfinite", "skip", "--step_health.max_consecutive_skips", "0"]),
    }
    trainers = {}
    for name, (cls, extra) in variants.items():
        cfg = load_config(base + ["--job.dump_folder", os.path.join(folder, name), *extra])
        cfg.validate()
        trainers[name] = cls(cfg)
    inject(trainers["skipped"], {step: "nan_grad" for step in range(1, args.rounds + args.warmup + 1)})
    times = {name: [] for name in trainers}
    names = list(trainers)
    gc.disable()
    for round_ in range(args.rounds + args.warmup):
        for name in names[round_ % 3:] + names[:round_ % 3]:  # rotate who goes first
            start = time.perf_counter()
            trainers[name].train_step()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
    gc.enable()
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        q = statistics.quantiles(t, n=4)
        print(f"{name:9s} median {medians[name] * 1e3:8.2f} ms  p25-p75 {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f} ms  "
              f"ratio to baseline {medians[name] / medians['baseline']:.3f}")
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
