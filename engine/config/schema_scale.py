"""The job config's sections for running at scale: the parallel layout and its process groups
(``[parallelism]``, ``[comm]``), surviving failures (``[checkpoint]``, ``[fault_tolerance]``) and the
memory and speed levers (``[activation_checkpoint]``, ``[compile]``, ``[float8]``).

Fields are declared as in :mod:`engine.config.schema` (its ``_opt`` helper: default, ``--help`` doc,
allowed values); :class:`engine.config.loading.JobConfig` gathers these sections with the others.
"""

# No `from __future__ import annotations`: the loader reads `dataclasses.Field.type` and needs
# the real classes (str/int/float/bool), not their string names.
from dataclasses import dataclass

from engine.config.schema import _opt


@dataclass
class ParallelismSection:
    """``[parallelism]``: every parallel degree; their product must equal world_size."""

    dp_replicate: int = _opt(1, "data-parallel replicas (DDP, or HSDP with dp_shard > 1)")
    dp_shard: int = _opt(-1, "FSDP sharding degree; -1: the rest of the world size")
    cp: int = _opt(1, "context-parallel degree (sequence split)")
    cp_rotate_method: str = _opt("ring", "how K/V reach every cp rank: ring (P2P, Liu et al.) or allgather",
                                 choices=("ring", "allgather"))
    cp_load_balance: bool = _opt(True, "head-tail split: rank i holds chunks i and 2·cp-1-i (equal causal work)")
    tp: int = _opt(1, "tensor-parallel degree")
    pp: int = _opt(1, "pipeline-parallel degree")
    pp_schedule: str = _opt("1F1B", "pipeline schedule by torch.distributed.pipelining name: GPipe, 1F1B, "
                            "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    pp_microbatch_size: int = _opt(1, "sequences per pipeline microbatch (local_batch_size / this = microbatches)")
    pp_stages_per_rank: int = _opt(-1, "-1: 1 for single-stage schedules, 2 for multi-stage ones")
    pp_layers_per_stage: int = _opt(-1, "> 0: stages hold this many layers (sets the stage count)")
    pp_split_points: list[str] = _opt([], 'explicit stage boundaries, e.g. ["layers.4", "layers.8"]')
    pp_input_weight: float = _opt(1.0, "layers the embedding counts as when splitting stages evenly")
    pp_output_weight: float = _opt(1.0, "layers the final norm + output head count as when splitting")
    ep: int = _opt(1, "expert-parallel degree (MoE models)")
    fsdp_reshard_after_forward: str = _opt("default", "default|always|never",
                                           choices=("default", "always", "never"))
    grad_sync_each_microbatch: bool = _opt(
        True, "with gradient accumulation: reduce gradients after every microbatch (false: only after "
              "the last; FSDP then keeps parameters and gradients unsharded for the whole step)")
    sequence_parallel: bool = _opt(True, "with tp > 1: norms run on sequence shards, all-reduces become "
                                         "all-gather + reduce-scatter (less activation memory)")
    loss_parallel: bool = _opt(True, "with tp > 1 and loss.chunk_tokens = 0: cross entropy on vocab-sharded logits "
                               "(no full logits per rank); the fused loss always keeps the vocab sharded")
    async_tp: bool = _opt(False, "with tp > 1: overlap TP collectives with matmuls (needs CUDA, compile, "
                                 "sequence_parallel)")


@dataclass
class CommSection:
    """``[comm]``: process-group setup."""

    backend: str = _opt("auto", "auto|nccl|gloo (auto: nccl on CUDA, gloo on CPU)",
                        choices=("auto", "nccl", "gloo"))
    init_timeout_seconds: int = _opt(300, "timeout for process-group init and collectives, seconds (collectives "
                                     "wait at least hang_timeout_seconds + 60, so that the hang watchdog speaks first)")
    hang_timeout_seconds: int = _opt(600, "from the end of the first step, a rank that makes no progress (a step, "
                                     "a save, a validation) for this long ends the attempt as hung, every rank's "
                                     "stack in <run folder>/hangs/; 0: off")


@dataclass
class CheckpointSection:
    """``[checkpoint]``: save and resume with torch Distributed Checkpoint (engine/checkpoint/manager.py)."""

    enable: bool = _opt(False, "save checkpoints, and resume from the newest complete one at start (a damaged "
                               "one, failing its recorded sizes/checksums or unreadable, is named and skipped)")
    folder: str = _opt("checkpoint", "checkpoint folder (holds step-N folders), relative to the run folder")
    interval: int = _opt(500, "save every N steps (and after the last step)")
    keep_latest_k: int = _opt(0, "keep the newest K complete checkpoints, delete older ones; 0 keeps all")
    async_mode: str = _opt("disabled", "disabled: training waits for each save; async: write in a "
                                       "background thread while training continues",
                           choices=("disabled", "async"))
    load_step: int = _opt(-1, "resume from step-N of the folder (refused if damaged); -1: the newest complete "
                              "checkpoint that verifies")
    initial_load_path: str = _opt("", "a DCP checkpoint folder to start from when the folder holds none "
                                      "(e.g. another run's step-N)")
    initial_load_model_only: bool = _opt(True, "from initial_load_path load model weights only "
                                               "(fresh optimizer, schedule and data at step 0)")
    initial_load_lr: str = _opt("continue", "with initial_load_model_only = false: continue the checkpoint's step "
                                            "and LR schedule, or restart both at step 0 (e.g. a context-extension "
                                            "phase with its own warmup)", choices=("continue", "restart"))
    initial_load_data: str = _opt("continue", "with initial_load_model_only = false: continue after the tokens the "
                                              "checkpoint consumed (also at another training.seq_len), or restart "
                                              "at the first window", choices=("continue", "restart"))


@dataclass
class FaultToleranceSection:
    """``[fault_tolerance]``: torchft replica groups (engine/train/fault_tolerance.py): the outer data-parallel
    dimension is ``group_size`` groups that fail, rejoin and heal from a live peer while the others step on."""

    enable: bool = _opt(False, "train as torchft replica groups (pip install -e \".[ft]\"); parallelism.dp_replicate "
                               "must be 1: the groups are the replicas (HSDP across groups, FSDP2 inside one)")
    group_size: int = _opt(2, "number of replica groups; the ranks of one launch (NGPU x NNODES) are one group, "
                              "or, with replica_id = -1, NGPU is split evenly over the groups of this node")
    replica_id: int = _opt(-1, "this launch's group, 0 .. group_size-1; -1: the launcher starts every group on "
                               "this node (and a lighthouse when none is given)")
    min_replica_size: int = _opt(1, "a step commits only when at least this many groups took part")
    lighthouse: str = _opt("", "the lighthouse's address (http://host:port); empty: $TORCHFT_LIGHTHOUSE, else, "
                               "with replica_id = -1, a lighthouse started by the launcher")
    quorum_timeout_seconds: int = _opt(60, "how long a step waits for the quorum and its collectives across groups, "
                                           "seconds")


@dataclass
class ActivationCheckpointSection:
    """``[activation_checkpoint]``: recompute activations in backward to save memory."""

    mode: str = _opt("none", "none|full|selective", choices=("none", "full", "selective"))
    selective_ac_option: str = _opt("op", '"op" (per-op, TorchTitan\'s: recompute every 2nd matmul), "op_all_matmuls" '
                                    '(per-op, keep every matmul) or an integer N (every N-th block)',
                                    int_ok=True)


@dataclass
class CompileSection:
    """``[compile]``: torch.compile of each transformer block."""

    enable: bool = _opt(False, "torch.compile the model blocks")
    backend: str = _opt("inductor", "torch.compile backend: inductor (generated kernels), aot_eager (the same "
                        "forward and backward graphs run by eager kernels: a debugging aid), eager (Dynamo's "
                        "graph only)", choices=("inductor", "aot_eager", "eager"))


@dataclass
class Float8Section:
    """``[float8]``: float8 linears through torchao (parallelisms/float8.py; ``pip install -e ".[float8]"``)."""

    enable: bool = _opt(False, "swap the chosen nn.Linear layers for torchao Float8Linear (float8 matmuls, "
                               "high-precision master weights and checkpoints)")
    recipe: str = _opt("tensorwise", "torchao recipe: tensorwise (one dynamic scale per tensor) or rowwise "
                       "(one per row, power-of-2 scales)", choices=("tensorwise", "rowwise"))
    filter_fqns: list[str] = _opt(["output", "router.gate"], "linears whose name contains any of these stay in high "
                                  "precision (as does any linear with a dim not divisible by 16); MoE experts are "
                                  "never converted")
    fsdp_all_gather: bool = _opt(False, "tensorwise with FSDP: cast the weight shards to float8 before the all-gather "
                                        "(half of bf16's bytes), scales precomputed after each optimizer step")
