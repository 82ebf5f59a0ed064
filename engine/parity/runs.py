"""One parity run: the engine's own launcher (``python -m engine.launch``, what ``./run_train.sh``
execs: pre-flight, then torchrun) with a layout's overrides, then what the run wrote: the loss and
grad norm of every step from its metrics.jsonl, and the final weights from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_TAIL_LINES = 15


@dataclass
class RunResult:
    """What a parity run left.

    Attributes:
        folder: its run folder; history: [(loss, grad_norm)] per step (metrics.jsonl);
        seconds: wall time of the launch (start-up included); error: the launcher's last lines when
        it failed (exit status != 0), else None; checkpoint: the final ``step-N`` folder or None.
    """

    folder: str
    history: list = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    checkpoint: str | None = None


def parity_overrides(folder: str, steps: int, replay: bool = False) -> dict:
    """Settings every parity run gets on top of the user's: its own folder, ``steps`` steps (with
    ``replay``: training.steps stays, the run stops after step ``steps`` by itself), every step
    logged to metrics.jsonl, a checkpoint after the last step only (its weights are compared), and
    nothing that costs time without being compared (TensorBoard, validation, time attribution)."""
    return {
        "job.dump_folder": folder,
        "job.print_config": "false",
        **({} if replay else {"training.steps": steps}),
        "metrics.log_freq": 1,
        "metrics.enable_tensorboard": "false",
        "metrics.time_attribution": "false",
        "validation.enable": "false",
        "checkpoint.enable": "true",
        "checkpoint.folder": "checkpoint",  # inside the parity run's folder, whatever the config says
        "checkpoint.interval": steps,
        "checkpoint.keep_latest_k": 1,
        "checkpoint.async_mode": "disabled",
        "checkpoint.load_step": -1,
    }


def to_argv(overrides: dict) -> list[str]:
    """``{"section.key": value}`` -> ``["--section.key", "value", ...]`` (lists comma-joined)."""
    argv: list[str] = []
    for key, value in overrides.items():
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        argv += [f"--{key}", text]
    return argv


def _number(value) -> float:
    """A logged value as a float: metrics.jsonl writes a non-finite one as null (JSON has no NaN)."""
    return float("nan") if value is None else float(value)


def read_history(folder: str, first_step: int = 1) -> list[tuple[float, float]]:
    """[(loss, grad_norm)] of every step from ``first_step`` on in ``folder``/metrics.jsonl (rank 0
    writes it), step order; a step logged twice (a resumed run) keeps its last record; a non-finite
    value (logged as null) reads as NaN."""
    path = os.path.join(folder, "metrics.jsonl")
    steps: dict[int, tuple[float, float]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("kind") == "train" and int(record["step"]) >= first_step:
                    steps[int(record["step"])] = (_number(record["loss"]), _number(record["grad_norm"]))
    return [steps[s] for s in sorted(steps)]


def launch(base_argv: list[str], overrides: dict, world_size: int, folder: str, *,
           env: dict | None = None, timeout: float | None = None) -> RunResult:
    """Run ``python -m engine.launch`` on ``world_size`` local processes; return its :class:`RunResult`.

    Args:
        base_argv: the user's config arguments (``--job.config_file``, overrides); ``overrides`` are
            added after them (the layout's and :func:`parity_overrides`'); ``folder`` must be new.
        env: extra environment (e.g. ``QUADRA_TEST_DEFECT``) for the ranks; a None value removes
            the variable.
        timeout: seconds before the run is stopped and reported as failed.
    """
    os.makedirs(folder, exist_ok=True)
    argv = [sys.executable, "-m", "engine.launch", *base_argv, *to_argv(overrides)]
    run_env = {**os.environ, "NGPU": str(world_size), "NNODES": "1", **(env or {})}
    run_env = {name: value for name, value in run_env.items() if value is not None}  # None: removed
    if "OMP_NUM_THREADS" not in os.environ:
        run_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    log_path = os.path.join(folder, "launch.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:  # timed out, or this process was interrupted: the launcher stops its ranks on SIGTERM
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result = RunResult(folder, read_history(folder), time.perf_counter() - start)
    if status != 0:
        with open(log_path) as f:
            lines = [line.rstrip() for line in f if line.strip()]
        why = "timed out" if status is None else f"exit status {status}"
        result.error = f"{why}; {log_path}:\n" + "\n".join(lines[-LOG_TAIL_LINES:])
    checkpoints = os.path.join(folder, "checkpoint")
    steps = [int(n[5:]) for n in os.listdir(checkpoints) if n.startswith("step-") and n[5:].isdigit()] \
        if os.path.isdir(checkpoints) else []
    result.checkpoint = os.path.join(checkpoints, f"step-{max(steps)}") if steps else None
    return result
