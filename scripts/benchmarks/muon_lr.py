"""Muon against AdamW over a few learning rates: the debug model, 100 steps, one CPU process.

    PYTHONPATH=. python scripts/benchmarks/muon_lr.py [--steps 100] [--out DIR] [--only RUN] [--report]
    PYTHONPATH=. python scripts/benchmarks/muon_lr.py --config debug_moe.toml --steps 50 --runs "AdamW 8e-4,Muon 2e-2"

Trains train_configs/debug_model.toml (llama) from the same weights on the same batches, validation
and checkpoints off, by default at the suite's flavor debugmodel_tiny and sequence length 64 (as
float8_loss.py: a 100-step run in minutes on a shared CPU; ``--flavor debugmodel --seq-len 256`` is
the config's own model, ~3-4x slower), with AdamW at ``optimizer.lr`` in {8e-4 (the default), 2e-3}
and Muon at ``optimizer.muon_lr`` (the lr of the Muon-updated matrices) in {8e-4, 1e-2, 2e-2, 4e-2},
the AdamW part of a Muon run (embedding, head, norms) at the default ``optimizer.lr`` (once at 2e-3). Muon's
Newton-Schulz runs in float32 (``--ns-dtype``): bfloat16 matmuls are ~20x slower on CPUs without
native bfloat16. Each run is its own folder under ``--out``: ``--only`` trains one (several
processes can share the folder, a finished run is skipped; ``--stop-after N`` trains the first N steps
of the same schedule), ``--report`` prints engine/docs/optimizers.md's table
(loss at steps 25/50/100 and the mean of the last 10 steps) from their metrics.jsonl without training.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

DEFAULT_RUNS = ("AdamW 8e-4", "AdamW 2e-3", "Muon 8e-4", "Muon 1e-2", "Muon 2e-2", "Muon 4e-2", "Muon 2e-2 2e-3")


def overrides(run: str, ns_dtype: str) -> dict:
    """Config overrides of a run named ``"<AdamW|Muon> <lr>"`` (Muon: the lr is ``muon_lr``) or
    ``"Muon <muon_lr> <lr>"`` (the AdamW part's ``optimizer.lr`` too).

    Raises:
        ValueError: a name not of that form.
    """
    name, *lrs = run.split()
    try:
        [float(lr) for lr in lrs]
    except ValueError:
        lrs = []
    if name == "AdamW" and len(lrs) == 1:
        return {"optimizer.name": "AdamW", "optimizer.lr": lrs[0]}
    if name == "Muon" and len(lrs) in (1, 2):
        extra = {"optimizer.name": "Muon", "optimizer.muon_lr": lrs[0], "optimizer.muon_ns_dtype": ns_dtype}
        return {**extra, "optimizer.lr": lrs[1]} if len(lrs) == 2 else extra
    raise ValueError(f"run {run!r} is not '<AdamW|Muon> <lr>' or 'Muon <muon_lr> <lr>', e.g. 'Muon 2e-2'")


def folder_of(root: str, run: str) -> str:
    """The run's folder under ``root`` (its name, spaces as underscores)."""
    return os.path.join(root, run.replace(" ", "_"))


def train(config: str, steps: int, folder: str, extra: dict) -> None:
    """Train one run of ``config`` (a train_configs/ file name) with ``extra`` overrides (``section.key``
    -> command-line value); it logs every step's loss to ``folder``/metrics.jsonl."""
    from scripts.benchmarks.runs import build_trainer

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", config), "--job.dump_folder", folder,
            "--job.device", "cpu", "--training.steps", str(steps), "--validation.enable", "false",
            "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
    for key, value in extra.items():
        argv += [f"--{key}", value]
    trainer = build_trainer(argv)
    try:
        trainer.train()
    finally:
        trainer.close()


def logged_losses(folder: str) -> list[float]:
    """The training losses a run logged (``metrics.jsonl``, one per step, engine/parity/runs.py), or []."""
    from engine.parity.runs import read_history

    return [loss for loss, _ in read_history(folder)]


def table(losses: dict[str, list[float]], steps: int) -> str:
    """Markdown table: run, loss at steps 25/50/``steps`` (those <= steps) and the mean of the last 10
    steps; '-' where a run (``--stop-after``) stopped before."""
    shown = sorted({25, 50, steps} & set(range(1, steps + 1)))
    lines = ["| optimizer | lr (Muon: muon_lr, lr) | " + " | ".join(f"step {s}" for s in shown)
             + " | final (mean of last 10) |", "|---" * (len(shown) + 3) + "|"]
    for run, values in losses.items():
        name, *lrs = run.split()
        lr = f"{lrs[0]}, {lrs[1] if len(lrs) > 1 else '8e-4'}" if name == "Muon" else lrs[0]
        cells = " | ".join(f"{values[s - 1]:.3f}" if s <= len(values) else "-" for s in shown)
        final = f"{statistics.fmean(values[-10:]):.3f}" if len(values) >= steps else "-"
        lines.append(f"| {name} | {lr} | {cells} | {final} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_model.toml", help="a file of train_configs/")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--flavor", default="debugmodel_tiny", help="model.flavor ('' keeps the config's)")
    parser.add_argument("--seq-len", type=int, default=64, help="training.seq_len (0 keeps the config's)")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated '<AdamW|Muon> <lr>'")
    parser.add_argument("--ns-dtype", default="float32", help="Muon's optimizer.muon_ns_dtype")
    parser.add_argument("--stop-after", type=int, default=0,
                        help="train only the first N steps of the --steps schedule (training.stop_after_step)")
    parser.add_argument("--out", default="", help="run folders (default: a temporary folder)")
    parser.add_argument("--only", help="train this run only")
    parser.add_argument("--report", action="store_true", help="print the table of the runs in --out")
    args = parser.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    root = args.out or tempfile.mkdtemp(prefix="muon_lr_")
    if not args.report:
        for run in runs:
            if args.only in (None, run) and len(logged_losses(folder_of(root, run))) < (args.stop_after or args.steps):
                extra = overrides(run, args.ns_dtype)
                if args.stop_after:
                    extra["training.stop_after_step"] = str(args.stop_after)
                if args.flavor:
                    extra["model.flavor"] = args.flavor
                if args.seq_len:
                    extra["training.seq_len"] = str(args.seq_len)
                train(args.config, args.steps, folder_of(root, run), extra)
    losses = {run: logged_losses(folder_of(root, run)) for run in runs}
    shown = {run: values for run, values in losses.items() if values}
    if shown:
        print(table(shown, args.steps))
    missing = sorted(run for run in runs if len(losses[run]) < args.steps)
    if missing:
        print(f"runs in {root} short of {args.steps} steps (their later cells are '-'): {missing}")


if __name__ == "__main__":
    main()
