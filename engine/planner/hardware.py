"""A small GPU table: peak dense bf16 FLOP/s, HBM bytes and link bandwidths, overridable.

Peak FLOP/s are the vendors' dense (no sparsity) bf16 tensor-core figures, the ones engine/flops.py
uses for MFU. Bandwidths are per GPU and per direction, in bytes/s: NVLink from the NVIDIA datasheets
(A100 SXM 600 GB/s bidirectional = 300 GB/s each way; H100/H200 900 GB/s = 450; B200 1.8 TB/s =
900), inter-node from one 200 Gb/s (A100) or 400 Gb/s (H100/H200/B200) InfiniBand NIC per GPU, the
DGX/HGX reference designs (25 and 50 GB/s). Every value can be overridden from the command line
(scripts/plan.py ``--peak_tflops``, ``--hbm_gib``, ``--nvlink_gbps``, ``--internode_gbps``).
"""

from __future__ import annotations

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
        name: table key, e.g. "H100-80GB".
        peak_flops: dense bf16 FLOP/s.
        memory_bytes: HBM capacity in bytes.
        nvlink_bytes_per_s: intra-node bandwidth per GPU, one direction (bytes/s).
        internode_bytes_per_s: network bandwidth per GPU between nodes, one direction (bytes/s).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float

    @property
    def usable_bytes(self) -> int:
        """``memory_bytes`` less the :data:`HEADROOM` share: what a layout may plan on, bytes."""
        return usable(self.memory_bytes)


def usable(memory_bytes: int) -> int:
    """Bytes of a GPU with ``memory_bytes`` that a layout may plan on (:data:`HEADROOM` kept free)."""
    return int(memory_bytes * (1 - HEADROOM))


GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("A100-40GB", 312e12, 40 * GIB, 300e9, 25e9),
    "A100-80GB": GPU("A100-80GB", 312e12, 80 * GIB, 300e9, 25e9),
    "H100-80GB": GPU("H100-80GB", 989e12, 80 * GIB, 450e9, 50e9),
    "H200-141GB": GPU("H200-141GB", 989e12, 141 * GIB, 450e9, 50e9),
    "B200-180GB": GPU("B200-180GB", 2250e12, 180 * GIB, 900e9, 50e9),
}


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
    """The table entry for a ``torch.cuda.get_device_name()`` string with its memory, e.g. "NVIDIA
    H100 80GB HBM3" -> H100-80GB; None when no family matches."""
    upper = device_name.upper()
    for family in ("B200", "H200", "H100", "A100"):
        if family in upper:
            candidates = [g for k, g in GPUS.items() if k.startswith(family)]
            if "40GB" in upper:
                candidates = [g for g in candidates if "40GB" in g.name] or candidates
            return candidates[-1]
    return None
