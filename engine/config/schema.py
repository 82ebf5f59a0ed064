"""The section dataclasses of the job config: every TOML key, its type, default and one-line doc.

One dataclass per TOML section (``[training]`` -> :class:`TrainingSection`): here the run, the model,
the data and the training recipe (optimizer, schedule, loss); the sections for running at scale are in
:mod:`engine.config.schema_scale`, those for watching a run in :mod:`engine.config.schema_observe`, both
declared with :func:`_opt` below. Each field carries ``metadata={"doc": ...}`` (shown by ``--help``) and,
for enum-like strings, ``"choices"`` (the allowed values, checked at load time and by
``JobConfig.validate``). Field types are limited to
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
class LossSection:
    """``[loss]``: how the token-sum cross entropy is computed (models/common/linear_cross_entropy.py) and
    what further terms the objective adds (multi-token prediction, arXiv 2412.19437 §2.2)."""

    z_loss_weight: float = _opt(0.0, "PaLM's z-loss (Chowdhery et al. 2022, Sec. 5): adds weight x logsumexp(logits)^2 "
                                "per token to the loss (e.g. 1e-4); 0: off")
    chunk_tokens: int = _opt(256, "> 0: fused output projection + cross entropy over chunks of this many tokens, "
                             "so at most [chunk_tokens, vocab / tp] logits exist at a time; 0: full logits (unfused)")
    mtp_weight: float = _opt(0.0, "multi-token prediction (models with MTP modules, e.g. deepseek_v3's "
                             "num_nextn_predict_layers): objective = main + mtp_weight × mean over depths; "
                             "0: main only")


@dataclass
class DocumentMaskSection:
    """``[document_mask]``: attention within each packed document (models/common/document_mask.py)."""

    enable: bool = _opt(False, "block-causal attention: a token attends only to earlier tokens of its own document "
                               "(Llama 3's mask across documents; documents begin at the tokenizer's BOS)")
    restart_positions: bool = _opt(False, "RoPE positions restart at 0 at each document (Megatron-LM's "
                                          "--reset-position-ids); with enable it changes only rounding (RoPE "
                                          "scores depend on relative positions)")
