"""The section dataclasses of the job config: every TOML key, its type, default and one-line doc.

One dataclass per TOML section (``[training]`` -> :class:`TrainingSection`). Each field carries
``metadata={"doc": ...}`` (shown by ``--help``) and, for enum-like strings, ``"choices"`` (the
allowed values, checked at load time and by ``JobConfig.validate``). Field types are limited to
``str``, ``int``, ``float``, ``bool`` and ``list[str]`` (a TOML array of strings; comma-separated or a TOML array on
the command line) so that a TOML value or one CLI token maps onto each.

Loading, validation and serialisation live in :mod:`engine.config`; components receive one of
these section objects (e.g. ``cfg.optimizer``), never the whole ``JobConfig``. Treat them as
read-only after loading.
"""

# No `from __future__ import annotations`: the loader reads `dataclasses.Field.type` and needs
# the real classes (str/int/float/bool), not their string names.
from dataclasses import dataclass, field

from models.registry import DEFAULT_MODEL_NAME  # torch-free


def _opt(default, doc: str, choices: tuple | None = None, int_ok: bool = False):
    """A dataclass field with its ``--help`` doc and, optionally, its allowed values.

    ``int_ok`` lets a ``str`` field take a TOML integer (stored as its decimal string); used for
    ``activation_checkpoint.selective_ac_option``, whose values are "op" or an integer N.
    """
    metadata = {"doc": doc}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if int_ok:
        metadata["int_ok"] = True
    if isinstance(default, list):  # list[str] fields: a fresh list per config object
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class JobSection:
    """``[job]``: what to read, where to write, which device."""

    config_file: str = _opt("", "TOML file to read (CLI: --job.config_file PATH)")
    dump_folder: str = _opt("", 'run folder; "" means outputs/<config file stem> (or outputs/default)')
    description: str = _opt("", "free-text description of the run, printed at start")
    device: str = _opt("auto", "auto|cpu|cuda (auto: cuda:LOCAL_RANK when CUDA exists, else cpu)",
                       choices=("auto", "cpu", "cuda"))
    print_config: bool = _opt(True, "print the resolved config (as TOML) at start on rank 0")
    dry_run: bool = _opt(False, "build the real model and plan on the meta device under a fake process group of "
                         "NGPU x NNODES ranks (one process, no GPU), print the planner's report, exit "
                         "(./run_train.sh --dry_run)")
    dry_run_gpu: str = _opt("", "hardware table GPU the dry run checks the fit against (engine/observe/hardware.py); "
                            "empty: the detected GPU, else H100-80GB")


@dataclass
class ModelSection:
    """``[model]``: which registered model and flavor, and its tokenizer."""

    name: str = _opt(DEFAULT_MODEL_NAME, "registered model name (see models/)")
    flavor: str = _opt("debugmodel", "model size preset within the model's flavors, e.g. debugmodel, 8B")
    args_path: str = _opt("", "model arguments instead of the flavor: a folder written by convert_checkpoint.py "
                              "from-hf (or a checkpoint step folder), or its quadra.json")
    tokenizer_path: str = _opt("assets/tokenizer/shakespeare.model",
                               "SentencePiece .model file, or a Hugging Face tokenizer.json (BOS/EOS from the "
                               "tokenizer_config.json beside it)")
    vocab_size: int = _opt(-1, "-1: the flavor's vocab size; set it to train with a larger tokenizer")
    tie_embeddings: bool = _opt(False, "share tok_embeddings and output weights (a model.args_path record decides "
                                       "for itself; true with an untied one is refused)")


@dataclass
class DataSection:
    """``[data]``: the training corpus."""

    path: str = _opt("assets/data/shakespeare/train.jsonl",
                     "local file or folder (jsonl, json, txt, parquet), a hub dataset name, or a folder "
                     "prepared by scripts/prepare_data.py (memory-mapped: O(1) start-up and resume)")
    text_column: str = _opt("text", "column/field holding the document text")
    split: str = _opt("train", "split name for hub datasets")
    streaming: bool = _opt(False, "stream the dataset instead of loading it into memory")
    shuffle: bool = _opt(True, "map-style only: shuffle packed windows each epoch (seeded by training.seed)")
    mixture: list[str] = _opt([], 'weighted prepared folders read instead of data.path, e.g. ["out/web:0.7", '
                                  '"out/code:0.3"] (CLI: out/web:0.7,out/code:0.3); weights are normalised, '
                                  'interleaved by global position; tokens per set go to metrics.jsonl')
    sequence_order_seed: int = _opt(0, "> 0: every training microbatch's sequences are reordered by one fixed "
                                       "permutation drawn from this seed: the same step in exact arithmetic (each "
                                       "loss term is a sum over sequences), its sums in another float order; "
                                       "scripts/parity.py measures a precision's noise floor with it; 0: off")


@dataclass
class ValidationSection:
    """``[validation]``: periodic evaluation on a held-out split."""

    enable: bool = _opt(False, "run validation during training")
    path: str = _opt("assets/data/shakespeare/validation.jsonl", "validation corpus (same formats as data.path)")
    freq: int = _opt(100, "evaluate every N steps")
    steps: int = _opt(10, "global batches (training.global_batch_size sequences each, the same windows "
                          "whatever the layout) per evaluation (-1: the whole split)")


@dataclass
class EvalSection:
    """``[eval]``: downstream multiple-choice tasks scored by log-likelihood during training, as
    lm-evaluation-harness scores them (engine/train/downstream.py; task files: engine/data/eval_tasks.py)."""

    enable: bool = _opt(False, "evaluate the tasks every freq steps and at the end (acc, acc_norm per task)")
    tasks: list[str] = _opt([], 'local task files (jsonl of {"context", "choices", "gold"}), each "path" or '
                                '"name=path" (name: the file stem); scripts/eval_task.py converts lm_eval tasks')
    freq: int = _opt(1000, "evaluate every N steps")
    limit: int = _opt(-1, "examples per task (the first N); -1: all")


@dataclass
class TrainingSection:
    """``[training]``: step count, batch geometry (sequences, tokens), precision, seeding."""

    steps: int = _opt(100, "optimizer steps to train")
    local_batch_size: int = _opt(8, "sequences per rank per microbatch")
    global_batch_size: int = _opt(-1, "sequences per optimizer step over all dp ranks; "
                                      "-1 = local_batch_size * dp (no accumulation)")
    seq_len: int = _opt(256, "tokens per sequence")
    max_norm: float = _opt(1.0, "gradient clipping norm; <= 0 disables clipping")
    seed: int = _opt(0, "random seed for init, data order and dropout")
    deterministic: bool = _opt(False, "use deterministic algorithms (slower)")
    mixed_precision_param: str = _opt("float32", "dtype of parameters in compute: float32|bfloat16|float64 "
                                      "(float64: the reference mode, everything in float64, with reduce float64)",
                                      choices=("float32", "bfloat16", "float64"))
    mixed_precision_reduce: str = _opt("float32", "dtype of gradient reduction: float32|bfloat16|float64",
                                       choices=("float32", "bfloat16", "float64"))
    gc_freq: int = _opt(50, "run gc.collect() every N steps (0: leave Python's GC on)")
    stop_after_step: int = _opt(-1, "stop after this step, the LR schedule still spanning training.steps "
                                    "(./scripts/parity.py --replay); -1: train to training.steps")


@dataclass
class StepHealthSection:
    """``[step_health]``: what a step with a non-finite or spiking loss / gradient norm does
    (engine/train/step_health.py)."""

    on_nonfinite: str = _opt("stop", "a non-finite loss or gradient norm: stop (exit 1 naming the step) or skip "
                                     "the update (batch consumed, LR schedule advances)", choices=("stop", "skip"))
    loss_spike_sigma: float = _opt(0.0, "skip a step whose loss exceeds the window mean by this many standard "
                                        "deviations (0: off)")
    grad_norm_spike_sigma: float = _opt(0.0, "skip a step whose gradient norm (before clipping) exceeds the window "
                                             "mean by this many standard deviations (0: off)")
    window: int = _opt(128, "recent accepted steps the spike statistics cover (checked once half of it is filled)")
    max_consecutive_skips: int = _opt(5, "stop the run after this many skipped steps in a row (0: never)")


@dataclass
class OptimizerSection:
    """``[optimizer]``: AdamW (Loshchilov & Hutter 2019) or Muon hyperparameters, and param group rules."""

    name: str = _opt("AdamW", "AdamW|Adam|Muon (Muon: Muon on hidden weight matrices, AdamW with the keys above "
                     "on the rest; engine/train/muon.py)", choices=("AdamW", "Adam", "Muon"))
    lr: float = _opt(8e-4, "peak learning rate (reached at the end of warmup); with Muon, of the AdamW part")
    beta1: float = _opt(0.9, "Adam first-moment decay")
    beta2: float = _opt(0.95, "Adam second-moment decay")
    eps: float = _opt(1e-8, "Adam denominator epsilon")
    weight_decay: float = _opt(0.1, "decoupled weight decay")
    implementation: str = _opt("auto", "auto|fused|foreach|for-loop (auto: fused where torch has the "
                               "kernel for the parameters' device and dtype, else foreach)",
                               choices=("auto", "fused", "foreach", "for-loop"))
    # Muon's defaults: momentum, Nesterov, steps and coefficients from Keller Jordan's Muon post (as
    # torch.optim.Muon's); the lr adjustment from Moonlight (Liu et al. 2025, Sec. 2.2).
    # Measured on the debug model (engine/docs/optimizers.md; scripts/benchmarks/muon_lr.py): Muon's matrices
    # train best at ~25x AdamW's lr, so they get their own lr (Jordan et al. 2024 and Moonlight do too).
    muon_lr: float = _opt(2e-2, "Muon: peak lr of the Muon-updated matrices, scaled per matrix by muon_adjust_lr "
                          "(optimizer.lr stays the AdamW part's: embedding, head, norms)")
    muon_momentum: float = _opt(0.95, "Muon momentum (Jordan et al. 2024; Liu et al. 2025)")
    muon_nesterov: bool = _opt(True, "Muon: Nesterov momentum (Jordan et al. 2024)")
    muon_ns_steps: int = _opt(5, "Muon: Newton-Schulz iterations (Jordan et al. 2024)")
    muon_ns_coefficients: str = _opt("3.4445,-4.7750,2.0315", "Muon: Newton-Schulz quintic coefficients a,b,c "
                                     "(Jordan et al. 2024)")
    muon_adjust_lr: str = _opt("match_rms_adamw", "Muon lr per matrix: match_rms_adamw (0.2 sqrt(max(A,B)), "
                               "Liu et al. 2025: reuse AdamW's lr and weight decay) or original "
                               "(sqrt(max(1,A/B)), Jordan et al. 2024)", choices=("match_rms_adamw", "original"))
    muon_ns_dtype: str = _opt("bfloat16", "Muon: dtype of the Newton-Schulz iteration (bfloat16 as torch.optim.Muon; "
                              "float64 for the float64 reference mode)", choices=("bfloat16", "float32", "float64"))
    param_groups: list[str] = _opt([], 'rules "PATTERN [lr_mult=F] [weight_decay=F] [optimizer=muon|adamw]", '
                                   "first match wins, PATTERN an fnmatch over parameter names "
                                   "(engine/config/param_groups.py)")


@dataclass
class LRSchedulerSection:
    """``[lr_scheduler]``: linear warmup then decay (units: optimizer steps)."""

    warmup_steps: int = _opt(10, "steps of linear warmup from ~0 to optimizer.lr")
    decay_type: str = _opt("linear", "LR decay after warmup: constant|linear|cosine|wsd",
                           choices=("constant", "linear", "cosine", "wsd"))
    decay_ratio: float = _opt(0.2, "wsd only: fraction of training.steps spent in the final decay")
    min_lr: float = _opt(0.0, "LR at the end of decay")


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
class ActivationCheckpointSection:
    """``[activation_checkpoint]``: recompute activations in backward to save memory."""

    mode: str = _opt("none", "none|full|selective", choices=("none", "full", "selective"))
    selective_ac_option: str = _opt("op", '"op" (per-op, TorchTitan\'s: recompute every 2nd matmul), "op_all_matmuls" '
                                    '(per-op, keep every matmul) or an integer N (every N-th block)',
                                    int_ok=True)


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
class LossSection:
    """``[loss]``: how the token-sum cross entropy is computed (models/linear_cross_entropy.py) and
    what further terms the objective adds (multi-token prediction, arXiv 2412.19437 §2.2)."""

    z_loss_weight: float = _opt(0.0, "PaLM's z-loss (Chowdhery et al. 2022, Sec. 5): adds weight x logsumexp(logits)^2 "
                                "per token to the loss (e.g. 1e-4); 0: off")
    chunk_tokens: int = _opt(256, "> 0: fused output projection + cross entropy over chunks of this many tokens, "
                             "so at most [chunk_tokens, vocab / tp] logits exist at a time; 0: full logits (unfused)")
    mtp_weight: float = _opt(0.0, "multi-token prediction (models with MTP modules, e.g. deepseek_v3's "
                             "num_nextn_predict_layers): objective = main + mtp_weight × mean over depths; "
                             "0: main only")


@dataclass
class CompileSection:
    """``[compile]``: torch.compile of each transformer block."""

    enable: bool = _opt(False, "torch.compile the model blocks")
    backend: str = _opt("inductor", "torch.compile backend: inductor (generated kernels), aot_eager (the same "
                        "forward and backward graphs run by eager kernels: a debugging aid), eager (Dynamo's "
                        "graph only)", choices=("inductor", "aot_eager", "eager"))


@dataclass
class DocumentMaskSection:
    """``[document_mask]``: attention within each packed document (models/document_mask.py)."""

    enable: bool = _opt(False, "block-causal attention: a token attends only to earlier tokens of its own document "
                               "(Llama 3's mask across documents; documents begin at the tokenizer's BOS)")
    restart_positions: bool = _opt(False, "RoPE positions restart at 0 at each document (Megatron-LM's "
                                          "--reset-position-ids); with enable it changes only rounding (RoPE "
                                          "scores depend on relative positions)")


@dataclass
class RecordSection:
    """``[record]``: one step's activations and gradients on every rank, for ``./scripts/parity.py
    --locate`` (engine/observe/record.py)."""

    step: int = _opt(0, "> 0: during this optimizer step every rank records each named module's forward input and "
                        "output and, after backward, each parameter's reduced gradient; 0: off")
    folder: str = _opt("record", "where the records go (rank-<r>.pt), relative to the run folder")


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
