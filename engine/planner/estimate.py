"""Predicted step time and MFU of a layout on a GPU, from its FLOPs, communication and bubble.

    compute   = FLOPs per rank / (peak_flops · efficiency)      FLOPs: 6N + attention per token
                (the family's ``ModelSpec.flops_per_token``, PaLM App. B) × tokens of the step / ranks,
                × 4/3 under full AC (the forward runs twice), × (1 + 1/(3N)) for every N-th block,
                × (1 + share of the recomputed matmuls / 3) under selective "op"
    exposed   = (tp + cp + ep + pp wire bytes) / link            (on the critical path)
    overlap   = max(0, dp wire bytes / link - compute)           (FSDP/DDP prefetch hides the rest)
    step_time = compute / (1 - bubble) + exposed + overlap
    MFU       = FLOPs per token × tokens per step / (step_time × ranks × peak_flops)   (PaLM App. B)

With ``[float8] enable`` on a GPU with a float8 peak, the float8 linears' share of the FLOPs
(engine/planner/float8.py) divides by the float8 peak in ``compute``, and MFU is taken against the
float8 peak (the ceiling such a step could reach), so it reads lower than the same step's bf16 MFU.

``link`` is NVLink when the dim's group lies inside one node, else the inter-node network
(engine/observe/hardware.py; Layout.group_within_node). ``efficiency`` (default 0.6) is the share of
peak a dense bf16 matmul-bound step reaches before communication and bubbles — MFU 38-43 % at
Llama 3 405B scale (Grattafiori et al. 2024, Table 4) with its comm and bubble; an assumption, overridable.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planner.comm import comm_bytes
from engine.planner.float8 import float8_flops_per_token
from engine.planner.memory import MemoryEstimate, estimate_memory
from engine.planner.schedule import layout_bubble

DEFAULT_EFFICIENCY = 0.6
_OVERLAPPED = ("dp_shard_cp", "dp_shard", "dp_replicate", "dp_shard_mod_ep", "dp_cp")


@dataclass
class LayoutEstimate:
    """Everything predicted for one layout (units: bytes, seconds)."""

    layout: object
    memory: MemoryEstimate
    comm: dict[str, dict]
    bubble: float
    step_time_s: float
    compute_s: float
    mfu: float
    fits: bool
    gpu_memory_bytes: int

    def as_dict(self) -> dict:
        """The JSON record of the issue: degrees, memory_bytes_per_rank, comm_bytes_per_step_per_rank
        (per mesh dim: payload and ring wire bytes), bubble, step_time_s, mfu, fits."""
        lay = self.layout
        return {
            "degrees": lay.degrees,
            "local_batch_size": lay.local_batch_size, "grad_accum": lay.grad_accum,
            "pp_microbatches": lay.pp_microbatches,
            "pp_schedule": lay.cfg.parallelism.pp_schedule if lay.pp > 1 else None,
            "activation_checkpoint": "/".join(lay.ac) if lay.ac[0] == "selective" else lay.ac[0],
            "memory_bytes_per_rank": self.memory.as_dict(),
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "comm_bytes_per_step_per_rank": {d: {"payload": int(v["payload"]), "wire": int(v["wire"])}
                                             for d, v in sorted(self.comm.items())},
            "bubble": self.bubble, "step_time_s": self.step_time_s, "compute_s": self.compute_s,
            "mfu": self.mfu, "fits": self.fits,
        }


def training_flops_per_token(layout) -> float:
    """Training FLOPs per token of the whole model (the metric MFU uses), torch-free: the family's
    ``ModelSpec.flops_per_token`` (6N + attention; for MoE the active parameters only)."""
    return layout.model_spec.get("flops_per_token")(layout.model_args, layout.seq_len)


def recompute_factor(layout) -> float:
    """Training FLOPs with recomputation over those without (module docstring): the forward (a third
    of 6N) runs again for the recomputed blocks; under "op" only the recomputed matmuls count (wk,
    wo, w3: every second one, parallelisms/activation_checkpoint.py), their share of a block's matmul
    FLOPs; "op_all_matmuls" recomputes no matmul (element-wise ops are not counted)."""
    mode, option = layout.ac
    if mode == "full":
        return 4 / 3
    if mode == "selective" and option.isdigit():
        return 1 + 1 / (3 * int(option))
    if mode == "selective" and option == "op":
        from engine.planner.activations import matmul_input_widths, matmul_output_widths

        widths = matmul_output_widths(layout)  # per-token outputs; FLOPs are output × input width
        inputs = matmul_input_widths(layout)
        flops = [w * i for w, i in zip(widths, inputs)]
        return 1 + sum(flops[1::2]) / sum(flops) / 3
    return 1.0


def estimate(layout, gpu, gpus_per_node: int, efficiency: float = DEFAULT_EFFICIENCY) -> LayoutEstimate:
    """Predict memory, communication, bubble, step time and MFU of ``layout`` on ``gpu``."""
    memory = estimate_memory(layout)
    comm = comm_bytes(layout)
    bubble = layout_bubble(layout)
    tokens = layout.global_batch_size * layout.seq_len
    flops = training_flops_per_token(layout) * tokens
    f8_flops = float8_flops_per_token(layout) * tokens if gpu.float8_peak_flops else 0.0
    # [float8]: the float8 linears' matmuls at the float8 peak, the rest at bf16's (engine/planner/float8.py)
    compute = ((flops - f8_flops) / gpu.peak_flops + f8_flops / (gpu.float8_peak_flops or 1.0)) \
        / layout.world_size * recompute_factor(layout) / efficiency
    exposed = overlapped = 0.0
    for dim, v in comm.items():
        link = gpu.nvlink_bytes_per_s if layout.group_within_node(dim, gpus_per_node) else gpu.internode_bytes_per_s
        if dim in _OVERLAPPED:
            overlapped += v["wire"] / link
        else:
            exposed += v["wire"] / link
    step = compute / (1 - bubble) + exposed + max(0.0, overlapped - compute)
    # float8 on: against the float8 peak, as the trainer's logged MFU (engine/observe/hardware.py)
    mfu = flops / (step * layout.world_size * gpu.mfu_peak_flops(layout.cfg.float8.enable))
    return LayoutEstimate(layout, memory, comm, bubble, step, compute, mfu,
                          memory.total <= gpu.usable_bytes, gpu.memory_bytes)
