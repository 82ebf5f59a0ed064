"""The one GPU table: peak dense bf16 FLOP/s, HBM bytes and link bandwidths, overridable (torch-free).

MFU (engine/observe/flops.py, PaLM App. B) reads the peaks by the device's name; the layout planner
(engine/planner/, ``--dry_run``, scripts/plan.py) reads the rows whose memory and links are known.
Peak FLOP/s are the vendors' dense (no 2:4 sparsity) bf16 tensor-core figures from their datasheets,
and in a second column their dense float8 figures (``fp8``; none for GPUs without float8 matmuls:
Ampere, MI250).
Bandwidths are per GPU and per direction, in bytes/s: NVLink from the NVIDIA datasheets (A100 SXM
600 GB/s bidirectional = 300 GB/s each way; H100/H200 900 GB/s = 450; B200 1.8 TB/s = 900),
inter-node from one 200 Gb/s (A100) or 400 Gb/s (H100/H200/B200) InfiniBand NIC per GPU, the
DGX/HGX reference designs (25 and 50 GB/s). Every value can be overridden from the command line
(scripts/plan.py ``--peak_tflops``, ``--hbm_gib``, ``--nvlink_gbps``, ``--internode_gbps``; for MFU
``metrics.peak_tflops``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GIB = 1024**3
# Share of a GPU's memory a layout may not plan on: the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation, which the planner does not model (the capacity torch reports is already
# about 1 % under the nominal one: 79.2 GiB on an H100 80GB). A layout fits when its per-rank total
# is at most ``GPU.usable_bytes``.
HEADROOM = 0.05


@dataclass(frozen=True)
class GPU:
    """One accelerator model.

    Attributes:
        name: table key, e.g. "H100-80GB" (a row the planner can use) or "L4" (peak only).
        peak_flops: dense bf16 FLOP/s.
        memory_bytes: HBM capacity in bytes; None when the table has only the peak.
        nvlink_bytes_per_s: intra-node bandwidth per GPU, one direction (bytes/s), or None.
        internode_bytes_per_s: network bandwidth per GPU between nodes, one direction (bytes/s), or None.
        patterns: tokens matched case-insensitively as whole words in ``torch.cuda.get_device_name()``
            ("A40" does not match "RTX A4000", nor "B200" match "GB200"); default: ``(name,)``.
        memory_token: when set, the row only matches names that contain it (e.g. "40GB").
        float8_peak_flops: dense float8 (e4m3) tensor-core FLOP/s, or None where the GPU has no
            float8 matmul (the planner's FLOPs of ``[float8]`` linears run at it).
    """

    name: str
    peak_flops: float
    memory_bytes: int | None = None
    nvlink_bytes_per_s: float | None = None
    internode_bytes_per_s: float | None = None
    patterns: tuple[str, ...] = ()
    memory_token: str = ""
    float8_peak_flops: float | None = None

    @property
    def usable_bytes(self) -> int:
        """``memory_bytes`` less the :data:`HEADROOM` share: what a layout may plan on, bytes."""
        return usable(self.memory_bytes)

    def mfu_peak_flops(self, float8: bool) -> float:
        """The peak MFU divides by, FLOP/s: the float8 peak when ``[float8]`` is on and this GPU has
        float8 matmuls (the ceiling a step with float8 linears could reach: TorchTitan and the
        planner report float8 runs against it), else the bf16 peak. The planner
        (engine/planner/estimate.py) and the trainer's logged MFU (engine/observe/flops.py) both use it."""
        return self.float8_peak_flops if float8 and self.float8_peak_flops else self.peak_flops

    @property
    def plannable(self) -> bool:
        """Whether memory and both bandwidths are known (the planner needs them)."""
        return None not in (self.memory_bytes, self.nvlink_bytes_per_s, self.internode_bytes_per_s)

    def matches(self, device_name: str) -> bool:
        """Whether ``device_name`` (as the driver reports it) is this GPU (see ``patterns``)."""
        if self.memory_token and self.memory_token.upper() not in device_name.upper():
            return False
        return any(re.search(rf"(?<![a-z0-9]){re.escape(p)}(?![a-z0-9])", device_name, re.IGNORECASE)
                   for p in self.patterns or (self.name,))


def usable(memory_bytes: int) -> int:
    """Bytes of a GPU with ``memory_bytes`` that a layout may plan on (:data:`HEADROOM` kept free)."""
    return int(memory_bytes * (1 - HEADROOM))


def _row(name: str, tflops: float, gib: int | None = None, nvlink_gbps: float | None = None,
         internode_gbps: float | None = None, patterns: tuple[str, ...] = (), memory_token: str = "",
         fp8: float | None = None) -> GPU:
    return GPU(name, tflops * 1e12, gib * GIB if gib else None, nvlink_gbps * 1e9 if nvlink_gbps else None,
               internode_gbps * 1e9 if internode_gbps else None, patterns, memory_token,
               fp8 * 1e12 if fp8 else None)


# In match order: the first row whose patterns occur in the device name wins, so a multi-word pattern
# ("H100 NVL") comes before its prefix ("H100"). GPUs without bf16 (V100, T4) are deliberately absent:
# MFU prints n/a there unless metrics.peak_tflops is set. AWS's A10G is listed at the A10's figure.
GPU_TABLE: tuple[GPU, ...] = (
    # NVIDIA Blackwell
    _row("GB200", 2500.0, fp8=5000.0),
    _row("B200-180GB", 2250.0, 180, 900, 50, patterns=("B200",), fp8=4500.0),
    _row("B100", 1750.0, fp8=3500.0),
    # NVIDIA Hopper (H100 SXM reports e.g. "NVIDIA H100 80GB HBM3")
    _row("GH200", 989.0, fp8=1979.0),
    _row("H200 NVL", 835.0, fp8=1671.0),
    _row("H200-141GB", 989.0, 141, 450, 50, patterns=("H200",), fp8=1979.0),
    _row("H100 NVL", 835.0, fp8=1671.0),
    _row("H100 PCIe", 756.0, fp8=1513.0),
    _row("H100-80GB", 989.0, 80, 450, 50, patterns=("H100",), fp8=1979.0),
    _row("H800 PCIe", 756.0, fp8=1513.0),
    _row("H800", 989.0, fp8=1979.0),
    _row("H20", 148.0, fp8=296.0),
    # NVIDIA Ampere / Ada
    _row("A100-40GB", 312.0, 40, 300, 25, patterns=("A100",), memory_token="40GB"),
    _row("A100-80GB", 312.0, 80, 300, 25, patterns=("A100",)),
    _row("A800", 312.0),
    _row("A30", 165.0),
    _row("A40", 149.7),
    _row("A10G", 125.0),
    _row("A10", 125.0),
    _row("L40S", 362.0, fp8=733.0),
    _row("L40", 181.0, fp8=362.0),
    _row("L4", 121.0, fp8=242.0),
    # AMD Instinct (reported as e.g. "AMD Instinct MI300X")
    _row("MI325X", 1307.4, fp8=2614.9),
    _row("MI300X", 1307.4, fp8=2614.9),
    _row("MI300A", 980.6, fp8=1961.2),
    _row("MI250X", 383.0),
    _row("MI250", 362.1),
)

# The planner's rows by name (memory and links known).
GPUS: dict[str, GPU] = {g.name: g for g in GPU_TABLE if g.plannable}


def lookup_gpu(device_name: str, *, plannable: bool = False) -> GPU | None:
    """The first table row that ``device_name`` matches (only rows with memory and links when
    ``plannable``), or None."""
    return next((g for g in GPU_TABLE if (g.plannable or not plannable) and g.matches(device_name)), None)


class HardwareError(ValueError):
    """An unknown GPU name or a non-positive override."""


def get_gpu(name: str, *, peak_tflops: float = 0.0, hbm_gib: float = 0.0, nvlink_gbps: float = 0.0,
            internode_gbps: float = 0.0) -> GPU:
    """The table's entry for ``name`` (case-insensitive), with overrides. A family name stands for its
    one entry ("H100" = "H100-80GB"); a family with several memory sizes ("A100") is refused as
    ambiguous.

    Args:
        peak_tflops: dense bf16 TFLOP/s; hbm_gib: memory in GiB; nvlink_gbps / internode_gbps: GB/s
            per GPU per direction. 0 keeps the table's value.

    Raises:
        HardwareError: an unknown or ambiguous name (lists the known ones) or a negative override.
    """
    key = next((k for k in GPUS if k.lower() == name.lower()), None)
    family = [k for k in GPUS if k.upper().startswith(name.upper() + "-")]
    if key is None and len(family) > 1:
        raise HardwareError(f"--gpu {name!r} is ambiguous; use {' or '.join(family)}")
    key = key or (family[0] if family else None)
    if key is None:
        raise HardwareError(f"--gpu {name!r} is not in the hardware table; use one of {', '.join(GPUS)} "
                            "(or one of them with --peak_tflops/--hbm_gib/--nvlink_gbps/--internode_gbps overrides)")
    for flag, value in (("peak_tflops", peak_tflops), ("hbm_gib", hbm_gib), ("nvlink_gbps", nvlink_gbps),
                        ("internode_gbps", internode_gbps)):
        if value < 0:
            raise HardwareError(f"--{flag} {value} must be >= 0 (0 keeps the table's value)")
    gpu = GPUS[key]
    return replace(
        gpu,
        peak_flops=peak_tflops * 1e12 or gpu.peak_flops,
        memory_bytes=int(hbm_gib * GIB) or gpu.memory_bytes,
        nvlink_bytes_per_s=nvlink_gbps * 1e9 or gpu.nvlink_bytes_per_s,
        internode_bytes_per_s=internode_gbps * 1e9 or gpu.internode_bytes_per_s,
    )


def gpu_from_device_name(device_name: str) -> GPU | None:
    """The planner's row for a ``torch.cuda.get_device_name()`` string, with its memory, e.g. "NVIDIA
    H100 80GB HBM3" -> H100-80GB; None when no such row matches."""
    return lookup_gpu(device_name, plannable=True)
