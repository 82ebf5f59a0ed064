"""What a rank prints: the "quadra" logger's handler with its ``[rank<r>]`` prefix, and the console
lines of the metrics (engine/observe/metrics.py): each logged step's ``step: 12  loss: 5.4321  ...
eta: 0:01:23`` and each validation's ``step: 12  val_loss: x  val_perplexity: y``."""

from __future__ import annotations

import logging
import sys
from typing import Any

# Console format of the scalars the trainer usually passes; others use ".4g".
USER_FORMATS = {"loss": ".4f", "grad_norm": ".4f", "lr": ".4e"}


def init_logging(rank: int, level: int = logging.INFO, quiet: bool = False) -> logging.Logger:
    """Send the "quadra" logger to stdout with a ``[rank<r>] `` prefix and set ``level``.

    ``quiet``: only warnings and errors (ranks other than 0, whose info lines repeat rank 0's).

    Idempotent: calling it again (e.g. in tests) replaces the handler it added before. The logger
    still propagates to the root logger, so pytest's ``caplog`` sees its records.
    """
    quadra_logger = logging.getLogger("quadra")
    for handler in list(quadra_logger.handlers):
        if getattr(handler, "_quadra_handler", False):
            quadra_logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler._quadra_handler = True  # type: ignore[attr-defined]
    handler.setFormatter(
        logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    quadra_logger.addHandler(handler)
    quadra_logger.setLevel(max(level, logging.WARNING) if quiet else level)
    return quadra_logger


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` with unbounded hours (e.g. 83.4 -> "0:01:23", 90000 -> "25:00:00")."""
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    """Format ``value`` with ``spec`` (a format spec such as ".4f"); None -> "n/a"."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def console_line(record: dict[str, Any], user_keys: list[str]) -> str:
    """``step: 12  loss: 5.4321  ...  eta: 0:01:23`` (two spaces between pairs) of a logged step's
    record (``MetricsLogger.log``): the caller's ``user_keys`` (loss, grad_norm and lr first), then
    throughput, TFLOPS, MFU, peak memory, data wait and ETA."""
    ordered = [k for k in USER_FORMATS if k in user_keys]
    ordered += [k for k in user_keys if k not in USER_FORMATS]
    parts = [f"step: {record['step']}"]
    parts += [f"{k}: {format_value(record[k], USER_FORMATS.get(k, '.4g'))}" for k in ordered]
    tps = record["tok_per_s_per_dev"]
    parts.append(f"tok/s/dev: {'n/a' if tps is None else f'{round(tps):,}'}")
    parts.append(f"tflops: {format_value(record['tflops_per_dev'], '.2f')}")
    parts.append(f"mfu: {format_value(record['mfu_pct'], '.2f', '%')}")
    # CUDA: peak reserved (what the caching allocator took from the device, the figure that
    # hits OOM); CPU: the process's max RSS.
    mem = record.get("mem_peak_reserved_gib", record.get("mem_max_rss_gib"))
    parts.append(f"mem: {format_value(mem, '.2f', 'GiB')}")
    parts.append(f"data: {format_value(record['data_pct'], '.1f', '%')}")
    eta = record["eta_s"]
    parts.append(f"eta: {'n/a' if eta is None else format_duration(eta)}")
    return "  ".join(parts)
