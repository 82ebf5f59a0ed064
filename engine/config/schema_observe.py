"""The job config's sections for watching a run: logged metrics (``[metrics]``), profiler traces and
memory snapshots (``[profiling]``), and one step's recorded activations and gradients (``[record]``).

Fields are declared as in :mod:`engine.config.schema` (its ``_opt`` helper: default, ``--help`` doc,
allowed values); :class:`engine.config.loading.JobConfig` gathers these sections with the others.
"""

# No `from __future__ import annotations`: the loader reads `dataclasses.Field.type` and needs
# the real classes (str/int/float/bool), not their string names.
from dataclasses import dataclass

from engine.config.schema import _opt


@dataclass
class MetricsSection:
    """``[metrics]``: console, TensorBoard and Weights & Biases logging."""

    log_freq: int = _opt(10, "log metrics every N steps")
    enable_tensorboard: bool = _opt(True, "write TensorBoard event files")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, relative to the run folder")
    peak_tflops: float = _opt(0.0, "the peak MFU divides by; 0: look up the GPU in a table (its float8 peak with "
                                    "[float8] on); on CPU MFU prints n/a")
    log_all_ranks: bool = _opt(False, "print step and info lines on every rank, not only rank 0 (files: rank 0)")
    time_attribution: bool = _opt(True, "on logged steps, split the step time into data, compute, exposed "
                                        "communication per mesh dim, bubble and optimizer (time_*_s keys)")
    enable_wandb: bool = _opt(False, "also log every metrics.jsonl record to Weights & Biases (rank 0; WANDB_MODE="
                                     "offline works without network; needs pip install -e \".[wandb]\")")
    wandb_project: str = _opt("quadra", "W&B project")
    wandb_entity: str = _opt("", "W&B entity (team or user); empty: the account's default")
    wandb_run_name: str = _opt("", "W&B run name; empty: the run folder's name")
    wandb_tags: list[str] = _opt([], "W&B run tags")


@dataclass
class ProfilingSection:
    """``[profiling]``: torch.profiler traces of chosen steps and CUDA memory snapshots
    (engine/observe/profiling.py)."""

    enable: bool = _opt(False, "trace steps start_step .. start_step + num_steps - 1 with torch.profiler")
    start_step: int = _opt(3, "first traced step (1-based; later than 1 keeps start-up cost out of the trace)")
    num_steps: int = _opt(1, "traced steps, in one trace file per rank")
    traces_folder: str = _opt("profile_traces", "trace folder, relative to the run folder (rank<r>_step<a>-<b>.json)")
    memory_snapshot: bool = _opt(False, "CUDA: record allocations and dump a snapshot after the traced steps "
                                        "and on out-of-memory (open at https://pytorch.org/memory_viz)")


@dataclass
class RecordSection:
    """``[record]``: one step's activations and gradients on every rank, for ``./scripts/parity.py
    --locate`` (engine/observe/record.py)."""

    step: int = _opt(0, "> 0: during this optimizer step every rank records each named module's forward input and "
                        "output and, after backward, each parameter's reduced gradient; 0: off")
    folder: str = _opt("record", "where the records go (rank-<r>.pt), relative to the run folder")
