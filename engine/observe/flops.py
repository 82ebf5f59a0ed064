"""Peak accelerator FLOPS and model FLOPS utilization (MFU).

MFU as defined by PaLM (Chowdhery et al. 2022, App. B): achieved model FLOPs per second (the
FLOPs the model needs per token, forward + backward, times tokens per second, excluding
activation recomputation) divided by the device's peak dense FLOPS.
"""

from __future__ import annotations

import logging

import torch

from engine.observe.hardware import GPU_TABLE, lookup_gpu

logger = logging.getLogger("quadra")

# (pattern, dense bf16 TFLOPS) in match order: a view of the one GPU table (engine/observe/hardware.py).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = tuple(
    {p: g.peak_flops / 1e12 for g in GPU_TABLE for p in g.patterns or (g.name,)}.items())


def lookup_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 TFLOPS of the GPU table's first row that ``device_name`` matches (whole tokens,
    case-insensitive: "NVIDIA A100-SXM4-80GB" matches "A100"). Returns None when nothing matches."""
    gpu = lookup_gpu(device_name)
    return None if gpu is None else gpu.peak_flops / 1e12


def get_peak_flops(
    device_type: str, device_name: str | None, override_tflops: float, *, warn_unknown: bool = True,
    float8: bool = False,
) -> float | None:
    """Peak dense FLOPS (FLOP/s, not TFLOPS) of one device that MFU divides by, or None when unknown:
    bf16's, or with ``float8`` (``[float8] enable``) the float8 (e4m3) peak of a GPU that has one
    (``GPU.mfu_peak_flops``, engine/observe/hardware.py).

    Args:
        device_type: torch device type of the training device ("cuda", "cpu", ...).
        device_name: e.g. "NVIDIA H100 80GB HBM3"; None means ask ``torch.cuda.get_device_name()``
            (only for device_type "cuda").
        override_tflops: ``metrics.peak_tflops``; > 0 wins over the table on any device (also CPU),
            0 means look it up.
        float8: the float8 peak where the table has one (a GPU without float8 matmuls: bf16's).
        warn_unknown: log a warning for a GPU missing from the table (off on non-logging ranks).

    Returns:
        FLOP/s, or None on CPU (without override) and for GPUs missing from the table (with a
        warning that names ``metrics.peak_tflops``).

    Raises:
        ValueError: ``override_tflops < 0``.
    """
    if override_tflops < 0:
        raise ValueError(
            f"metrics.peak_tflops={override_tflops} must be >= 0 (0: look the GPU up in the table)"
        )
    if override_tflops > 0:
        return override_tflops * 1e12
    if device_type != "cuda":
        # No meaningful "peak" for CPUs: MFU is reported as n/a unless the user sets one.
        return None
    if device_name is None:
        device_name = torch.cuda.get_device_name()
    gpu = lookup_gpu(device_name)
    if gpu is None:
        if warn_unknown:
            logger.warning(
                "peak FLOPS of %r unknown: MFU will print n/a; set metrics.peak_tflops to the "
                "device's dense bf16 TFLOPS to report it",
                device_name,
            )
        return None
    return gpu.mfu_peak_flops(float8)


def compute_tflops(flops_per_token: float, tokens_per_second_per_device: float) -> float:
    """Achieved model TFLOPS per device = flops_per_token * tokens/s/device / 1e12.

    ``flops_per_token`` is the training cost (forward + backward, 6N + attention: the family's
    ``ModelSpec.flops_per_token``, models/common/shapes.py ``training_flops_per_token``).
    """
    return flops_per_token * tokens_per_second_per_device / 1e12


def compute_mfu(
    flops_per_token: float, tokens_per_second_per_device: float, peak_flops: float | None
) -> float | None:
    """Model FLOPS utilization in percent (PaLM, App. B), or None when ``peak_flops`` is unknown.

    mfu = 100 * flops_per_token [FLOP/token] * tokens_per_second_per_device [token/s]
          / peak_flops [FLOP/s]
    """
    if peak_flops is None or peak_flops <= 0:
        return None
    return 100.0 * flops_per_token * tokens_per_second_per_device / peak_flops
