"""What a config key changes, and the fingerprint of what a run trains.

Every key of the job config is in one of three classes:

- ``convergence``: changes what is trained: the model, the data and its order, the seed, the
  tokens per optimizer step, the optimizer, the LR schedule (including ``training.steps``, which
  sets the decay), clipping, the starting weights. Two runs that differ here are different runs.
- ``numerics``: the same arithmetic, rounded differently: dtypes, compile, deterministic kernels,
  the optimizer's kernel, the device. Runs agree to the precision's tolerance, not bitwise.
- ``execution``: how the same arithmetic is laid out and observed: parallel degrees and schedules,
  microbatching at a fixed global batch, activation checkpointing, checkpoints, metrics,
  validation, profiling. Quadra's parity tests hold these to float tolerance of one process.

The run's fingerprint hashes the convergence keys and their values, so that two configs with the
same fingerprint train the same model (up to numerics). tests/integration/test_fingerprint.py fails when a key
of the schema is not classified here: a new key forces the decision; tests/integration/test_fingerprint_behaviour.py
checks each key's class by what another value does to a short run (a new key needs a check there, or
a stated reason why no CPU run can exercise it).

Pure Python (no torch), so the launcher and ``python -m engine.config diff`` use it in a second.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CONVERGENCE, NUMERICS, EXECUTION = "convergence", "numerics", "execution"

_CLASSES: dict[str, dict[str, tuple[str, ...]]] = {
    CONVERGENCE: {
        "model": ("name", "flavor", "args_path", "tokenizer_path", "vocab_size", "tie_embeddings"),
        "data": ("path", "text_column", "split", "streaming", "shuffle", "mixture"),
        "training": ("steps", "global_batch_size", "seq_len", "max_norm", "seed"),
        "optimizer": ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "muon_lr", "muon_momentum",
                      "muon_nesterov", "muon_ns_steps", "muon_ns_coefficients", "muon_adjust_lr", "param_groups"),
        "lr_scheduler": ("warmup_steps", "decay_type", "decay_ratio", "min_lr"),
        "checkpoint": ("initial_load_path", "initial_load_model_only", "initial_load_lr", "initial_load_data"),
        # Which updates are applied: a skipped step trains nothing, so the same data gives another model.
        "step_health": ("on_nonfinite", "loss_spike_sigma", "grad_norm_spike_sigma", "window"),
        "document_mask": ("enable", "restart_positions"),  # what each token attends to, its positions
        # z-loss and the multi-token-prediction terms are added to the objective.
        "loss": ("z_loss_weight", "mtp_weight"),
    },
    NUMERICS: {
        "job": ("device",),
        "training": ("deterministic", "mixed_precision_param", "mixed_precision_reduce"),
        "optimizer": ("implementation", "muon_ns_dtype"),
        "data": ("sequence_order_seed",),  # the same step's sums over sequences in another order
        "compile": ("enable", "backend"),
        "loss": ("chunk_tokens",),
        # float8 matmuls round inputs, weights and gradients; the master weights stay high precision.
        "float8": ("enable", "recipe", "filter_fqns"),
    },
    EXECUTION: {
        "job": ("config_file", "dump_folder", "description", "print_config", "dry_run", "dry_run_gpu"),
        "validation": ("enable", "path", "freq", "steps"),
        "eval": ("enable", "tasks", "freq", "limit"),  # observes the model, trains nothing
        "training": ("local_batch_size", "gc_freq", "stop_after_step"),
        "parallelism": (
            "dp_replicate", "dp_shard", "cp", "cp_rotate_method", "cp_load_balance", "tp", "pp", "pp_schedule",
            "pp_microbatch_size", "pp_stages_per_rank", "pp_layers_per_stage", "pp_split_points",
            "pp_input_weight", "pp_output_weight", "ep", "fsdp_reshard_after_forward",
            "grad_sync_each_microbatch", "sequence_parallel", "loss_parallel", "async_tp",
        ),
        "comm": ("backend", "init_timeout_seconds", "hang_timeout_seconds"),
        # When to give up: changes no update a run applies, only whether it goes on.
        "step_health": ("max_consecutive_skips",),
        "checkpoint": ("enable", "folder", "interval", "keep_latest_k", "async_mode", "load_step"),
        "metrics": ("log_freq", "enable_tensorboard", "save_tb_folder", "peak_tflops", "log_all_ranks",
                    "time_attribution", "enable_wandb", "wandb_project", "wandb_entity", "wandb_run_name",
                    "wandb_tags"),
        "activation_checkpoint": ("mode", "selective_ac_option"),
        # the same float8 values all-gathered as float8 instead of cast after a high-precision all-gather
        "float8": ("fsdp_all_gather",),
        "profiling": ("enable", "start_step", "num_steps", "traces_folder", "memory_snapshot"),
        "record": ("step", "folder"),  # observes one step, changes none
        # The groups are the outer data-parallel dimension: a layout (tests/integration/test_fault_tolerance.py).
        "fault_tolerance": ("enable", "group_size", "replica_id", "min_replica_size", "lighthouse",
                            "quorum_timeout_seconds"),
    },
}

KEY_CLASS: dict[str, str] = {
    f"{section}.{key}": kind
    for kind, sections in _CLASSES.items() for section, keys in sections.items() for key in keys
}


# Convergence keys of features added after runs were fingerprinted: at these values (the feature off)
# they stay out of the hash, so a run that does not use the feature keeps the fingerprint it had
# before the key existed (its checkpoints resume without a "changed fingerprint" warning).
NEUTRAL_WHEN = {"document_mask.enable": False, "document_mask.restart_positions": False,
                "optimizer.muon_momentum": 0.95, "optimizer.muon_nesterov": True, "optimizer.muon_ns_steps": 5,
                "optimizer.muon_ns_coefficients": "3.4445,-4.7750,2.0315",
                "optimizer.muon_adjust_lr": "match_rms_adamw", "optimizer.param_groups": [],
                "loss.z_loss_weight": 0.0, "loss.mtp_weight": 0.0}

# Convergence keys that act only when another key has a value: otherwise they stay out of the hash.
# optimizer.muon_lr (added with a non-neutral default, 2e-2: no value reproduces the Muon runs before
# it, whose matrices took optimizer.lr) would else change the fingerprint of every AdamW run.
ACTIVE_WHEN = {"optimizer.muon_lr": ("optimizer.name", "Muon")}

GLOBAL_BATCH = "training.global_batch_size"
# What sets the global batch when training.global_batch_size = -1 (local_batch_size x dp degree).
SET_GLOBAL_BATCH = ("training.local_batch_size", "parallelism.dp_replicate", "parallelism.dp_shard",
                    "fault_tolerance.group_size")


def key_class(key: str) -> str:
    """The class of ``section.key``.

    Raises:
        KeyError: a key no class lists (add it to ``_CLASSES``).
    """
    try:
        return KEY_CLASS[key]
    except KeyError:
        raise KeyError(f"config key {key} has no class in engine/config/fingerprint.py") from None


def flatten(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{"section.key": value} of a config as TOML tables ({section: {key: value}})."""
    return {f"{section}.{key}": value for section, table in config.items() for key, value in table.items()}


def fingerprint(config: dict[str, dict[str, Any]]) -> str:
    """16 hex digits of the SHA-256 of the convergence keys and values of ``config`` (TOML tables,
    e.g. ``tomllib.loads(config_to_toml(cfg))``), canonical JSON with sorted keys; unknown keys
    are ignored, and so are the keys of :data:`NEUTRAL_WHEN` at their neutral value and those of
    :data:`ACTIVE_WHEN` when the key they act under has another value. A run passes its resolved
    ``training.global_batch_size`` (never -1), since -1 means local_batch_size x dp and so depends on
    the layout."""
    flat = flatten(config)
    values = {key: value for key, value in flat.items() if KEY_CLASS.get(key) == CONVERGENCE
              and not (key in NEUTRAL_WHEN and value == NEUTRAL_WHEN[key])
              and not (key in ACTIVE_WHEN and flat.get(ACTIVE_WHEN[key][0]) != ACTIVE_WHEN[key][1])}
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def run_fingerprint(config_toml: str, global_batch_size: int) -> str:
    """The fingerprint of a run: :func:`fingerprint` of its config TOML with
    ``training.global_batch_size`` replaced by the resolved global batch (sequences per step)."""
    tables = load_tables(config_toml)
    tables.setdefault("training", {})["global_batch_size"] = int(global_batch_size)
    return fingerprint(tables)


def convergence_changes(old_toml: str, new_toml: str) -> list[tuple[str, str, Any, Any]]:
    """:func:`changes` between two config TOMLs, convergence keys only."""
    return [change for change in changes(load_tables(old_toml), load_tables(new_toml)) if change[1] == CONVERGENCE]


def load_tables(config_toml: str) -> dict[str, dict[str, Any]]:
    """The TOML tables ({section: {key: value}}) of a config TOML (e.g. ``config_to_toml(cfg)``)."""
    return tomllib.loads(config_toml)


def changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[tuple[str, str, Any, Any]]:
    """[(key, class, old value, new value)] of every key whose value differs, in schema order of
    ``new`` then keys only ``old`` has; a key missing on one side has the value None there. Keys of
    no class get the class "unclassified"."""
    flat_old, flat_new = flatten(old), flatten(new)
    keys = list(flat_new) + [key for key in flat_old if key not in flat_new]
    classes = dict(KEY_CLASS)
    if -1 in (flat_old.get(GLOBAL_BATCH), flat_new.get(GLOBAL_BATCH)):
        # global_batch_size = -1 is local_batch_size x dp: then they set the tokens per step.
        classes.update({key: CONVERGENCE for key in SET_GLOBAL_BATCH})
    return [(key, classes.get(key, "unclassified"), flat_old.get(key), flat_new.get(key))
            for key in keys if flat_old.get(key) != flat_new.get(key)]


def describe(diff: list[tuple[str, str, Any, Any]]) -> str:
    """``key: old -> new`` of each change, joined by "; " (for one-line messages)."""
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, _, old, new in diff)
