"""Range and consistency checks of a loaded config (``JobConfig.validate`` reports them together).

Each check is ``(bad?, key, value, rule and fix)``; only the checks that need nothing but the config
live here. Those that need the world size or the data (degree products, batch divisibility by dp,
dataset paths) run at start-up on every rank (ParallelDims, the data loader, the trainer).
"""

from __future__ import annotations

import re
from typing import Any

from engine.config.extras import missing_extra
from engine.config.schema_scale import CheckpointSection
from engine.config.toml_format import toml_value


def loss_problems(loss, p) -> list[tuple[bool, str, Any, str]]:
    """``[loss]``'s checks, (bad?, key, value, rule and fix) each; ``p``: the ``[parallelism]`` section."""
    z = loss.z_loss_weight
    return [
        (loss.chunk_tokens < 0, "loss.chunk_tokens", loss.chunk_tokens,
         "must be >= 0 tokens (0: the unfused loss over full logits; e.g. 256)"),
        (not 0 <= loss.mtp_weight < float("inf"), "loss.mtp_weight", loss.mtp_weight,
         "must be a finite number >= 0 (0: no multi-token-prediction loss; DeepSeek-V3 used 0.3, then 0.1)"),
        (z < 0, "loss.z_loss_weight", z, "must be >= 0 (0: off; PaLM used 1e-4)"),
        (z > 0 and p.tp > 1 and p.loss_parallel and loss.chunk_tokens == 0, "loss.z_loss_weight", z,
         "with tp > 1 needs the fused loss (loss.chunk_tokens > 0, vocab-sharded) "
         "or parallelism.loss_parallel = false"),
    ]


def fault_tolerance_problems(ft, p) -> list[str]:
    """``[fault_tolerance]``'s checks as lines; ``p``: the ``[parallelism]`` section. Nothing when it is off."""
    if not ft.enable:
        return []
    checks = [
        (ft.group_size < 1, "fault_tolerance.group_size", ft.group_size, "must be >= 1 replica groups"),
        (not -1 <= ft.replica_id < max(ft.group_size, 1), "fault_tolerance.replica_id", ft.replica_id,
         f"must be -1 (every group on this node) or 0 .. group_size-1 = {ft.group_size - 1}"),
        (not 1 <= ft.min_replica_size <= max(ft.group_size, 1), "fault_tolerance.min_replica_size",
         ft.min_replica_size, f"must be in 1 .. group_size = {ft.group_size}"),
        (ft.quorum_timeout_seconds <= 0, "fault_tolerance.quorum_timeout_seconds", ft.quorum_timeout_seconds,
         "must be > 0 seconds"),
        (p.dp_replicate != 1, "parallelism.dp_replicate", p.dp_replicate,
         "must be 1 with fault_tolerance.enable: the replica groups are the replicas; set "
         f"fault_tolerance.group_size = {p.dp_replicate} instead"),
    ]
    lines = [f"{key} = {toml_value(value)}: {fix}" for bad, key, value, fix in checks if bad]
    missing = missing_extra("fault_tolerance.enable", "torchft", "ft")
    return lines + ([missing] if missing else [])


def range_problems(cfg) -> list[str]:
    """Range and consistency checks; each entry is (bad?, key, value, rule and fix)."""
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    p, ac = cfg.parallelism, cfg.activation_checkpoint
    option = ac.selective_ac_option
    ac_ok = option in ("op", "op_all_matmuls") or (re.fullmatch(r"[0-9]+", option) is not None and int(option) > 0)
    checks: list[tuple[bool, str, Any, str]] = [
        (t.steps <= 0, "training.steps", t.steps, "must be > 0; set the number of optimizer steps"),
        (t.local_batch_size <= 0, "training.local_batch_size", t.local_batch_size,
         "must be > 0 sequences per rank per microbatch"),
        (t.global_batch_size == 0 or t.global_batch_size < -1, "training.global_batch_size",
         t.global_batch_size, "must be -1 (local_batch_size * dp) or a positive number of sequences"),
        (t.global_batch_size > 0 and t.global_batch_size % max(t.local_batch_size, 1) != 0,
         "training.global_batch_size", t.global_batch_size,
         f"must be a multiple of training.local_batch_size = {t.local_batch_size}"),
        (t.seq_len <= 0, "training.seq_len", t.seq_len, "must be > 0 tokens"),
        (t.gc_freq < 0, "training.gc_freq", t.gc_freq, "must be >= 0 (0 leaves Python's GC on)"),
        (t.stop_after_step == 0 or t.stop_after_step < -1, "training.stop_after_step", t.stop_after_step,
         "must be -1 (train to training.steps) or a step >= 1"),
        (cfg.model.vocab_size == 0 or cfg.model.vocab_size < -1, "model.vocab_size",
         cfg.model.vocab_size, "must be -1 (the flavor's size) or a positive vocabulary size"),
        (o.lr <= 0, "optimizer.lr", o.lr, "must be > 0"),
        (not 0 <= o.beta1 < 1, "optimizer.beta1", o.beta1, "must be in [0, 1)"),
        (not 0 <= o.beta2 < 1, "optimizer.beta2", o.beta2, "must be in [0, 1)"),
        (o.eps <= 0, "optimizer.eps", o.eps, "must be > 0"),
        (o.weight_decay < 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0"),
        (s.warmup_steps < 0, "lr_scheduler.warmup_steps", s.warmup_steps, "must be >= 0"),
        (not 0 <= s.decay_ratio <= 1, "lr_scheduler.decay_ratio", s.decay_ratio, "must be in [0, 1]"),
        (s.min_lr < 0, "lr_scheduler.min_lr", s.min_lr, "must be >= 0"),
        (o.lr > 0 and s.min_lr > o.lr, "lr_scheduler.min_lr", s.min_lr,
         f"must not exceed optimizer.lr = {o.lr}; set it in [0, optimizer.lr]"),
        *evaluation_problems(cfg.validation, cfg.eval),
        (p.dp_shard == 0 or p.dp_shard < -1, "parallelism.dp_shard", p.dp_shard,
         "must be -1 (the rest of the world size) or >= 1"),
        (cfg.comm.init_timeout_seconds <= 0, "comm.init_timeout_seconds",
         cfg.comm.init_timeout_seconds, "must be > 0 seconds"),
        (cfg.comm.hang_timeout_seconds < 0, "comm.hang_timeout_seconds", cfg.comm.hang_timeout_seconds,
         "must be >= 0 seconds (0: no hang watchdog; e.g. 600)"),
        (cfg.metrics.log_freq <= 0, "metrics.log_freq", cfg.metrics.log_freq, "must be > 0 steps"),
        (cfg.metrics.peak_tflops < 0, "metrics.peak_tflops", cfg.metrics.peak_tflops,
         "must be >= 0 (0: look up the GPU)"),
        (not ac_ok, "activation_checkpoint.selective_ac_option", ac.selective_ac_option,
         'must be "op" (TorchTitan\'s per-op policy), "op_all_matmuls" (keep every matmul output) '
         'or a positive integer N (checkpoint every N-th block), e.g. "2"'),
        (cfg.record.step < 0, "record.step", cfg.record.step, "must be >= 0 (0: off; K: record optimizer step K)"),
        (cfg.record.step > 0 and not cfg.record.folder.strip(), "record.folder", cfg.record.folder,
         'must name a folder, e.g. "record"'),
    ]
    fp64 = (t.mixed_precision_param == "float64", t.mixed_precision_reduce == "float64")
    checks.append((fp64[0] != fp64[1], "training.mixed_precision_reduce", t.mixed_precision_reduce,
                   "and mixed_precision_param must both be float64 (the float64 reference mode computes "
                   "and reduces everything in float64) or neither; set both to \"float64\""))
    checks.append((fp64[0] and cfg.compile.enable, "compile.enable", True,
                   "is not verified in the float64 reference mode; set compile.enable = false"))
    checks.append((cfg.record.step > 0 and cfg.compile.enable, "compile.enable", True,
                   "cannot be recorded (record.step > 0): module hooks do not run inside compiled blocks; "
                   "set compile.enable = false for the recorded run"))
    checks.append((p.pp > 1 and not p.grad_sync_each_microbatch, "parallelism.grad_sync_each_microbatch", False,
                   "has no effect with pp > 1 (the pipeline schedule reduces gradients once per step "
                   "itself); leave it true"))
    prof = cfg.profiling
    checks += [
        (prof.enable and prof.start_step < 1, "profiling.start_step", prof.start_step, "must be >= 1 (a 1-based step)"),
        (prof.enable and prof.num_steps < 1, "profiling.num_steps", prof.num_steps, "must be >= 1"),
    ]
    checks += checkpoint_problems(cfg.checkpoint) + step_health_problems(cfg.step_health)
    for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
        degree = getattr(p, name)
        checks.append((degree < 1, f"parallelism.{name}", degree, "must be >= 1 (1 disables it)"))
    checks += optimizer_problems(o) + loss_problems(cfg.loss, p)
    return ([f"{key} = {toml_value(value)}: {fix}" for bad, key, value, fix in checks if bad] + _mixture_problems(cfg)
            + fault_tolerance_problems(cfg.fault_tolerance, p) + _param_group_problems(o))


def evaluation_problems(v, e) -> list[tuple[bool, str, Any, str]]:
    """Range checks of ``[validation]`` (``v``) and ``[eval]`` (``e``), as :func:`range_problems`' entries."""
    return [
        (v.enable and v.freq <= 0, "validation.freq", v.freq,
         "must be > 0 steps when validation.enable = true"),
        (v.steps == 0 or v.steps < -1, "validation.steps", v.steps,
         "must be -1 (whole split) or a positive number of batches"),
        (e.enable and e.freq <= 0, "eval.freq", e.freq, "must be > 0 steps when eval.enable = true"),
        (e.enable and not e.tasks, "eval.tasks", e.tasks,
         "must name at least one task file when eval.enable = true (scripts/eval_task.py writes one)"),
        (e.limit == 0 or e.limit < -1, "eval.limit", e.limit,
         "must be -1 (every example) or a positive number of examples per task"),
    ]


def optimizer_problems(o) -> list[tuple[bool, str, Any, str]]:
    """Range checks of the Muon keys of ``[optimizer]`` (engine/train/muon.py)."""
    coefficients = o.muon_ns_coefficients.split(",")
    number = r"\s*[-+]?[0-9.]+(e[-+]?[0-9]+)?\s*"
    numbers = len(coefficients) == 3 and all(re.fullmatch(number, c) for c in coefficients)
    return [
        (not o.muon_lr > 0, "optimizer.muon_lr", o.muon_lr, "must be > 0, e.g. 2e-2"),
        (not 0 <= o.muon_momentum < 1, "optimizer.muon_momentum", o.muon_momentum, "must be in [0, 1), e.g. 0.95"),
        (not 1 <= o.muon_ns_steps < 100, "optimizer.muon_ns_steps", o.muon_ns_steps, "must be in [1, 100), e.g. 5"),
        (not numbers, "optimizer.muon_ns_coefficients", o.muon_ns_coefficients,
         'must be three comma-separated numbers a,b,c, e.g. "3.4445,-4.7750,2.0315"'),
    ]


def _param_group_problems(o) -> list[str]:
    """``optimizer.param_groups`` syntax (whether each rule matches a parameter is checked by the pre-flight)."""
    from engine.config.param_groups import ParamGroupError, parse_rules

    try:
        parse_rules(list(o.param_groups), o.name)
    except ParamGroupError as error:
        return [str(error)]
    return []


def _mixture_problems(cfg) -> list[str]:
    """``data.mixture`` syntax (whether the folders are prepared sets is checked at start-up)."""
    from engine.data.prepared import PreparedDataError, parse_mixture

    try:
        parse_mixture(cfg.data.mixture)
    except PreparedDataError as error:
        return [str(error)]
    return []


def wsd_decay_steps(decay_ratio: float, training_steps: int) -> int:
    """Number of final linear-decay steps D of the WSD schedule (engine/train/lr_scheduler.py)."""
    if decay_ratio <= 0:
        return 0
    # round, not ceil: 0.1 * 30 is 3.0000000000000004 in floating point. A positive ratio
    # always gets at least one decay step so that the last step reaches min_lr.
    return max(1, round(decay_ratio * training_steps))


def effective_warmup_steps(warmup_steps: int, decay_type: str, decay_ratio: float, training_steps: int) -> int:
    """The warmup W the schedule uses: ``lr_scheduler.warmup_steps`` clamped to the run.

    A warmup as long as the run or longer (a smoke run of a few steps with a production config) is
    shortened to ``training_steps`` (as TorchTitan does): the lr rises until the last step. For wsd,
    whose point is the final decay, it is shortened to leave the D decay steps. The schedule
    (engine/train/lr_scheduler.py) uses it, and :func:`config_warnings` warns about it before launch.
    """
    if warmup_steps < 0 or training_steps < 1:
        return warmup_steps  # refused by range_problems (and by the schedule)
    limit = training_steps
    if decay_type == "wsd":
        limit = training_steps - wsd_decay_steps(decay_ratio, training_steps)
    return min(warmup_steps, max(limit, 0))


def config_warnings(cfg) -> list[str]:
    """Settings that work but are unusual: warned about once at launch, never refused."""
    t, s = cfg.training, cfg.lr_scheduler
    warnings = []
    warmup = effective_warmup_steps(s.warmup_steps, s.decay_type, s.decay_ratio, t.steps)
    if t.steps > 0 and warmup != s.warmup_steps:
        leaves = f", leaving the last {t.steps - warmup} for the wsd decay" if s.decay_type == "wsd" else ""
        warnings.append(
            f"lr_scheduler.warmup_steps = {s.warmup_steps} does not fit in training.steps = {t.steps}: "
            f"warming up over {warmup} steps instead{leaves}"
        )
    prof = cfg.profiling
    if prof.enable and prof.start_step > t.steps > 0:
        warnings.append(f"profiling.start_step = {prof.start_step} is after the last step (training.steps = "
                        f"{t.steps}): nothing will be traced")
    if cfg.record.step > t.steps > 0:
        warnings.append(f"record.step = {cfg.record.step} is after the last step (training.steps = {t.steps}): "
                        "nothing will be recorded")
    return warnings


def checkpoint_problems(c: CheckpointSection) -> list[tuple[bool, str, Any, str]]:
    """Range checks of ``[checkpoint]`` (whether paths exist is checked at start-up, on every rank)."""
    return [
        (c.interval <= 0, "checkpoint.interval", c.interval, "must be > 0 steps between saves"),
        (c.keep_latest_k < 0, "checkpoint.keep_latest_k", c.keep_latest_k,
         "must be >= 0 (0 keeps every checkpoint)"),
        (c.load_step < -1, "checkpoint.load_step", c.load_step,
         "must be -1 (the newest checkpoint) or a saved step >= 0"),
        (c.enable and not c.folder.strip(), "checkpoint.folder", c.folder,
         'must name a folder, e.g. "checkpoint"'),
        (not c.enable and c.load_step != -1, "checkpoint.load_step", c.load_step,
         "is only used with checkpoint.enable = true; enable checkpointing or leave load_step = -1"),
        (not c.enable and c.initial_load_path != "", "checkpoint.initial_load_path", c.initial_load_path,
         'is only used with checkpoint.enable = true; enable checkpointing or set it to ""'),
        (c.initial_load_lr != "continue" and (c.initial_load_model_only or not c.initial_load_path),
         "checkpoint.initial_load_lr", c.initial_load_lr,
         "applies to a full load only: set checkpoint.initial_load_path and initial_load_model_only = false"),
        (c.initial_load_data != "continue" and (c.initial_load_model_only or not c.initial_load_path),
         "checkpoint.initial_load_data", c.initial_load_data,
         "applies to a full load only: set checkpoint.initial_load_path and initial_load_model_only = false"),
    ]


def step_health_problems(h) -> list[tuple[bool, str, Any, str]]:
    """Range checks of ``[step_health]`` (engine/train/step_health.py)."""
    return [
        (not h.loss_spike_sigma >= 0, "step_health.loss_spike_sigma", h.loss_spike_sigma,
         "must be >= 0 standard deviations (0 turns the loss spike check off), e.g. 6.0"),
        (not h.grad_norm_spike_sigma >= 0, "step_health.grad_norm_spike_sigma", h.grad_norm_spike_sigma,
         "must be >= 0 standard deviations (0 turns the gradient norm spike check off), e.g. 6.0"),
        (h.window < 2, "step_health.window", h.window,
         "must be >= 2 accepted steps (a standard deviation needs two values), e.g. 128"),
        (h.max_consecutive_skips < 0, "step_health.max_consecutive_skips", h.max_consecutive_skips,
         "must be >= 0 skipped steps in a row (0: never stop for skips), e.g. 5"),
    ]
