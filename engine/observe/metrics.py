"""Training metrics: console line (engine/observe/console.py), TensorBoard scalars, a metrics.jsonl file and
W&B (engine/observe/sinks.py).

The trainer drives one ``MetricsLogger`` per rank::

    metrics = MetricsLogger(cfg.metrics, run_folder, rank=rank, is_logging_rank=rank == 0,
                            flops_per_token=flops_per_token, training_steps=cfg.training.steps,
                            device=device, devices_per_dp_rank=cp * tp * pp)
    for step in range(start + 1, steps + 1):
        ...                                   # time the step, including waiting for data
        metrics.record_step(tokens=n_tokens_this_rank, step_seconds=dt, data_seconds=dt_data)
        if metrics.should_log(step):
            metrics.log(step, {"loss": loss, "grad_norm": grad_norm, "lr": lr})
    metrics.close()

``log`` must be called on every rank (it resets the per-interval counters and CUDA peak-memory
statistics everywhere); only the logging rank writes. Throughput counts only the recorded step
times, so validation and checkpoint time between steps do not lower tokens/s (nor enter the ETA).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from typing import Any

import torch

from engine.observe.console import console_line, format_value
from engine.observe.flops import compute_mfu, compute_tflops, get_peak_flops
from engine.observe.hardware import lookup_gpu
from engine.observe.sinks import WandbSink, drop_records_from

logger = logging.getLogger("quadra")

_GIB = float(2**30)


def device_memory_stats(device: torch.device | str, reset: bool = True) -> dict[str, float]:
    """Memory figures of ``device`` in GiB (2**30 bytes).

    CUDA: ``mem_peak_allocated_gib`` / ``mem_peak_reserved_gib`` (peaks since the last reset; the
    peaks are reset afterwards when ``reset``) and ``mem_alloc_retries`` (cudaMalloc retries
    after a cache flush: > 0 means the allocator is near OOM). CPU: ``mem_max_rss_gib``, the
    process's maximum resident set size from ``getrusage`` (lifetime peak, cannot be reset).
    Other device types: an empty dict.
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = {
            "mem_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB,
            "mem_alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
        }
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return stats
    if device.type == "cpu":
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports kilobytes, macOS bytes.
        rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
        return {"mem_max_rss_gib": rss_bytes / _GIB}
    return {}


def _to_float(key: str, value: Any) -> float | None:
    """Accept Python numbers, 0-d/1-element tensors and None; anything else is a TypeError."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {key!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, a scalar tensor or None, got {type(value).__name__}")


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """Strict JSON has no NaN/Infinity: write those as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


# Keys computed by the logger; the trainer may not pass them.
_COMPUTED_KEYS = (
    "step", "kind", "tok_per_s_per_dev", "tflops_per_dev", "mfu_pct", "data_pct",
    "step_time_s", "eta_s", "mem_peak_allocated_gib", "mem_peak_reserved_gib",
    "mem_alloc_retries", "mem_max_rss_gib",
)


class MetricsLogger:
    """Per-rank training metrics: throughput, MFU, memory, data wait, ETA; console/TB/jsonl.

    Args:
        cfg: the ``[metrics]`` section; reads ``log_freq`` (steps, > 0), ``enable_tensorboard``,
            ``save_tb_folder``, ``peak_tflops`` (0: table lookup, see ``engine.observe.flops``) and
            ``enable_wandb`` (every record also to W&B under :attr:`wandb_run_id`, engine/observe/sinks.py).
        run_folder: the run's dump folder; receives ``metrics.jsonl`` and ``<save_tb_folder>/``.
        rank: global rank (kept for messages).
        is_logging_rank: only this rank prints, writes TensorBoard and metrics.jsonl.
        flops_per_token: training FLOPs per token (forward + backward) of the whole model.
        training_steps: total optimizer steps of the run (for the ETA and the last log).
        device: the training device; selects the memory statistics and the peak-FLOPS lookup.
        devices_per_dp_rank: devices that process the same tokens of one data-parallel rank
            (cp * tp * pp); tokens/s/device = tokens of this rank / seconds / this number.
        float8: ``[float8] enable``: MFU against the GPU's float8 peak where it has one
            (engine/observe/hardware.py ``GPU.mfu_peak_flops``, as the planner).

    Steps trained again: when the first record this logger writes is for step N, the records of
    steps N and later that an earlier launch of the folder left (it stopped after its last
    checkpoint, or the folder held another run) are dropped from metrics.jsonl, with a warning, and
    purged from TensorBoard (``SummaryWriter(purge_step=N)``, torch.utils.tensorboard docs) and W&B (the run
    rewound to step N - 1, engine/observe/sinks.py): each step appears once. A launch that logs nothing changes
    nothing. Each launch's records start with a ``"run"`` record of :attr:`run_info` (the config fingerprint).

    Raises:
        ValueError: ``metrics.log_freq`` <= 0, ``devices_per_dp_rank`` < 1,
            ``metrics.peak_tflops`` < 0.
    """

    def __init__(
        self, cfg, run_folder: str, *, rank: int, is_logging_rank: bool, flops_per_token: float,
        training_steps: int, device: torch.device | str = "cpu", devices_per_dp_rank: int = 1,
        float8: bool = False,
    ) -> None:
        if cfg.log_freq <= 0:
            raise ValueError(f"metrics.log_freq={cfg.log_freq} must be > 0 (log every N steps)")
        if devices_per_dp_rank < 1:
            raise ValueError(f"devices_per_dp_rank={devices_per_dp_rank} must be >= 1 (cp * tp * pp)")
        self.cfg = cfg
        self.rank = rank
        self.is_logging_rank = is_logging_rank
        self.flops_per_token = flops_per_token
        self.training_steps = training_steps
        self.device = torch.device(device)
        self.devices_per_dp_rank = devices_per_dp_rank
        # Every rank computes it (so records agree), only the logging rank warns about it.
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_flops = get_peak_flops(
            self.device.type, device_name, cfg.peak_tflops, warn_unknown=is_logging_rank, float8=float8
        )
        if is_logging_rank and self.peak_flops is not None:
            what = "metrics.peak_tflops" if cfg.peak_tflops > 0 else (  # else a GPU of the table
                f"{'float8' if float8 and lookup_gpu(device_name).float8_peak_flops else 'bf16'} peak of {device_name}")
            logger.info("MFU against %.1f TFLOPS per device (%s)", self.peak_flops / 1e12, what)
        self._reset_interval()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        self._jsonl = None
        self._tb = None
        self._wandb: WandbSink | None = None
        self.wandb_run_id: str | None = None  # metrics.enable_wandb: set by the trainer before the first record
        self._closed = False
        # What identifies this launch (e.g. {"fingerprint": ..., "fingerprint_change": ...}): set by
        # the trainer; written as one "run" record before the launch's first step record.
        self.run_info: dict[str, Any] = {}
        self._run_folder = run_folder
        if is_logging_rank:
            os.makedirs(run_folder, exist_ok=True)
        # metrics.jsonl and the TensorBoard writer open at the first record (``_open``): only then
        # is it known from which step this launch's records replace an earlier launch's.

    def _reset_interval(self) -> None:
        self._steps = 0
        self._tokens = 0
        self._seconds = 0.0
        self._data_seconds = 0.0

    def should_log(self, step: int) -> bool:
        """True at step 1, every ``log_freq`` steps and at the final step (1-based steps)."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == self.training_steps

    def record_step(self, *, tokens: int, step_seconds: float, data_seconds: float = 0.0) -> None:
        """Add one optimizer step to the current log interval.

        Args:
            tokens: input tokens this rank processed in the step (all microbatches).
            step_seconds: wall seconds of the whole step, data waiting included.
            data_seconds: wall seconds of it spent waiting for batches.
        """
        if tokens < 0 or step_seconds < 0 or data_seconds < 0:
            raise ValueError(
                f"record_step needs non-negative values, got tokens={tokens}, "
                f"step_seconds={step_seconds}, data_seconds={data_seconds}"
            )
        self._steps += 1
        self._tokens += tokens
        self._seconds += step_seconds
        self._data_seconds += data_seconds

    def _interval_metrics(self, step: int) -> dict[str, float | None]:
        """Throughput, MFU, data wait and ETA over the steps recorded since the last ``log``."""
        if self._steps == 0 or self._seconds <= 0:
            tps = tflops = mfu = data_pct = step_time = eta = None
        else:
            tps = self._tokens / self._seconds / self.devices_per_dp_rank
            tflops = compute_tflops(self.flops_per_token, tps)
            mfu = compute_mfu(self.flops_per_token, tps, self.peak_flops)
            data_pct = 100.0 * self._data_seconds / self._seconds
            step_time = self._seconds / self._steps
            eta = step_time * max(self.training_steps - step, 0)
        return {
            "tok_per_s_per_dev": tps, "tflops_per_dev": tflops, "mfu_pct": mfu,
            "data_pct": data_pct, "step_time_s": step_time, "eta_s": eta,
        }

    def log(self, step: int, metrics: dict[str, Any], files_only: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the log interval at ``step``: print, write TensorBoard and metrics.jsonl.

        Args:
            step: 1-based optimizer step just finished.
            metrics: scalars from the trainer, typically ``loss`` (global mean per token),
                ``grad_norm`` and ``lr``; floats, ints, scalar tensors or None (printed "n/a").
            files_only: more scalars for metrics.jsonl and TensorBoard, not printed (e.g. the
                ``time_*_s`` attribution of engine/observe/attribution.py).

        Returns:
            The full record (also on non-logging ranks): ``step``, the trainer's metrics and
            ``tok_per_s_per_dev``, ``tflops_per_dev``, ``mfu_pct``, ``data_pct``,
            ``step_time_s``, ``eta_s`` and the ``mem_*`` keys of ``device_memory_stats``
            (None where unknown).

        Raises:
            ValueError: a metric key that the logger computes itself; TypeError: a non-scalar.
        """
        files_only = files_only or {}
        clash = sorted((set(metrics) | set(files_only)) & set(_COMPUTED_KEYS))
        if clash:
            raise ValueError(f"metrics keys {clash} are computed by MetricsLogger; rename them")
        record: dict[str, Any] = {"step": step}
        record.update({k: _to_float(k, v) for k, v in metrics.items()})
        record.update({k: _to_float(k, v) for k, v in files_only.items()})
        record.update(self._interval_metrics(step))
        record.update(device_memory_stats(self.device, reset=True))
        self._reset_interval()
        if self.is_logging_rank or getattr(self.cfg, "log_all_ranks", False):
            # Other ranks print only when asked (e.g. to see every pipeline rank report the same loss).
            logger.info(console_line(record, list(metrics)))
        if self.is_logging_rank:
            self._write("train", record)
        return record

    def _open(self, step: int) -> None:
        """Open metrics.jsonl for appending and the TensorBoard writer, replacing an earlier launch's
        records of ``step`` and later (class docstring)."""
        path = os.path.join(self._run_folder, "metrics.jsonl")
        dropped = drop_records_from(path, step)
        if dropped:
            logger.warning("metrics.jsonl: dropped %d records of steps %d-%d that an earlier launch logged; "
                           "this launch trains them again", len(dropped), min(dropped), max(dropped))
        self._jsonl = open(path, "a", encoding="utf-8")
        if self.run_info:  # this launch's identity, first in its records (a "run" line)
            self._jsonl.write(json.dumps(_json_safe({"kind": "run", "step": step, **self.run_info})) + "\n")
        if self.cfg.enable_tensorboard:
            # Imported lazily: tensorboard is slow to import and only the logging rank needs it.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(self._run_folder, self.cfg.save_tb_folder),
                                     purge_step=step)
        if getattr(self.cfg, "enable_wandb", False):
            self._wandb = WandbSink(self.cfg, self._run_folder, self.wandb_run_id, dict(self.run_info),
                                    rewind_to=step - 1 if dropped else None)  # W&B's records go too

    def _write(self, kind: str, record: dict[str, Any]) -> None:
        """Append one JSON line (flushed) and the numeric values as TensorBoard scalars."""
        step = record["step"]
        if self._closed:
            return
        if self._jsonl is None:
            self._open(step)
        self._jsonl.write(json.dumps(_json_safe({"kind": kind, **record})) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(kind, _json_safe(record))

    def log_event(self, kind: str, record: dict[str, Any]) -> None:
        """One record of ``kind`` (e.g. "skipped_step"): a metrics.jsonl line and its numbers as
        TensorBoard scalars ``<kind>/<key>``; ``record`` holds ``step``. Written by the logging rank."""
        if self.is_logging_rank:
            self._write(kind, record)

    def log_validation(self, step: int, loss: float, perplexity: float) -> dict[str, Any]:
        """Report a validation result: console ``step: N  val_loss: x  val_perplexity: y``,
        TensorBoard ``validation/loss``, ``validation/perplexity`` and a jsonl line of kind
        "validation". ``loss`` is the mean per-token cross-entropy (nats), ``perplexity`` its exp.
        Returns the record {"step", "loss", "perplexity"} on every rank.
        """
        record = {
            "step": step,
            "loss": _to_float("loss", loss),
            "perplexity": _to_float("perplexity", perplexity),
        }
        if self.is_logging_rank:
            logger.info(
                f"step: {step}  val_loss: {format_value(record['loss'], '.4f')}  "
                f"val_perplexity: {format_value(record['perplexity'], '.2f')}"
            )
            self._write("validation", record)
        return record

    def log_eval(self, step: int, results: dict[str, dict[str, float]]) -> None:
        """Report downstream task results ({task: {"acc", "acc_norm", "examples"}}): console
        ``step: N  eval <task>: acc x  acc_norm y (n examples)`` per task, and one "eval" record
        with ``<task>/<metric>`` keys (TensorBoard and W&B: ``eval/<task>/<metric>``). Logging rank."""
        if not self.is_logging_rank:
            return
        for task, values in results.items():
            logger.info(f"step: {step}  eval {task}: acc {values['acc']:.4f}  acc_norm {values['acc_norm']:.4f}  "
                        f"({int(values['examples'])} examples)")
        self._write("eval", {"step": step, **{f"{task}/{metric}": value for task, values in results.items()
                                              for metric, value in values.items()}})

    def close(self) -> None:
        """Flush and close metrics.jsonl, the TensorBoard writer and the W&B run (safe to call twice)."""
        self._closed = True
        jsonl, tb, self._jsonl, self._tb = self._jsonl, self._tb, None, None
        wandb_sink, self._wandb = self._wandb, None
        try:
            if jsonl is not None:
                jsonl.close()
            if tb is not None:
                tb.close()
            if wandb_sink is not None:
                wandb_sink.close()
        except OSError as error:  # e.g. the write that failed the run fails again at the flush
            logger.warning("metrics files could not be closed: %s", error)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
