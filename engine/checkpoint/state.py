"""What a checkpoint holds and how it is put back: model parts + optimizer, RNG, LR, compatibility.

Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``): keys are canonical FQNs such as ``layers.3.attention.wq.weight`` whatever the
wrappers (FSDP2, DDP, TP, activation checkpointing, compile), and sharded parameters stay DTensors,
so DCP reshards them when the checkpoint is loaded under other parallel degrees.

All model parts of this rank (one, or one per local pipeline stage) and the optimizer(s) over them
are handled as one module: an ``nn.ModuleDict`` ``{"0": part0, "1": part1, ...}``. Its FQNs start
with the part index, which depends on the layout, so :class:`ModelAndOptimizer` strips that index on
the way out and puts it back on the way in. Stage modules keep the global layer keys (``layers.N``),
so the stripped keys are unique and the same under every layout.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

MODEL_KEY = "model"  # top-level keys of the DCP state dict (DCP flattens nested keys with ".")
OPTIMIZER_KEY = "optimizer"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def quiet_single_process():
    """Silence DCP's "assuming the intent is to save in a single process" warning: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _strip(state: dict[str, Any], depth: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Remove the part index from keys: ``0.layers.1.w`` (depth 0) or ``state.0.layers.1.w.exp_avg``
    (depth 1) -> (stripped dict, stripped key -> original key)."""
    stripped: dict[str, Any] = {}
    back: dict[str, str] = {}
    for key, value in state.items():
        parts = key.split(".", depth + 1)
        short = ".".join(parts[:depth] + parts[depth + 1:])
        if short in stripped:  # two parts own the same FQN: the stage split is broken
            raise RuntimeError(f"model parts share the state key {short!r}; stage modules must own "
                               "disjoint layers that keep their global names")
        stripped[short] = value
        back[short] = key
    return stripped, back


def _restore(state: dict[str, Any], back: dict[str, str]) -> dict[str, Any]:
    return {back[key]: value for key, value in state.items()}


class ModelAndOptimizer:
    """The model parts of this rank and the optimizer(s) over them, as one DCP-ready state.

    Args:
        model_parts: modules this rank trains (plain, FSDP2/DDP/TP-wrapped, compiled, AC-wrapped).
        optimizers: one optimizer over all parts, or one per part.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: torch.optim.Optimizer | Iterable):
        self.container = nn.ModuleDict({str(i): part for i, part in enumerate(model_parts)})
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        self.optimizers = tuple(optimizers)
        self._model_back: dict[str, str] = {}
        self._optim_back: dict[str, str] = {}

    def model_state_dict(self) -> dict[str, Any]:
        """{FQN: tensor or DTensor} of every part; the tensors are the live parameters (no copy)."""
        state, self._model_back = _strip(get_model_state_dict(self.container), depth=0)
        return state

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """{"model": {FQN: tensor}, "optimizer": {"state.FQN.exp_avg": ..., "param_groups.FQN.lr": ...}}.

        A fresh optimizer gets its state initialized first (a zero-gradient step at lr 0, by
        ``get_state_dict``), so only call this to save, or to build the template of a full load.
        """
        model, optim = get_state_dict(self.container, self.optimizers, options=_OPTIONS)
        model, self._model_back = _strip(model, depth=0)
        optim, self._optim_back = _strip(optim, depth=1)
        return {MODEL_KEY: model, OPTIMIZER_KEY: optim}

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a model state filled in place by ``dcp.load`` (keys of ``model_state_dict``)."""
        set_model_state_dict(self.container, _restore(state, self._model_back))

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Put back a full state filled in place by ``dcp.load`` (the dict ``state_dict`` gave)."""
        set_state_dict(
            self.container,
            self.optimizers,
            model_state_dict=_restore(state[MODEL_KEY], self._model_back),
            optim_state_dict=_restore(state[OPTIMIZER_KEY], self._optim_back),
            options=_OPTIONS,
        )


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch RNG states: CPU, and the current CUDA device's when on CUDA."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def optimizer_settings(optimizers) -> list[list[dict]]:
    """Each param group's settings (lr, betas, eps, weight_decay, ..., not its params), per optimizer."""
    return [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            for opt in optimizers]


def restore_optimizer_settings(optimizers, settings: list[list[dict]]) -> None:
    """Put back settings taken with ``optimizer_settings`` (over those a loaded state brought)."""
    for opt, groups in zip(optimizers, settings):
        for group, saved in zip(opt.param_groups, groups):
            group.update(saved)


def changed_settings(old_toml: str, new_toml: str) -> list[str]:
    """``section.key: old -> new`` for every config key whose value differs between two config TOMLs."""
    old, new = tomllib.loads(old_toml), tomllib.loads(new_toml)
    return [f"{s}.{k}: {old[s][k]!r} -> {v!r}" for s, table in new.items() for k, v in table.items()
            if s in old and k in old[s] and old[s][k] != v]


def reapply_lr(lr_scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each param group's lr from the schedule at the restored ``last_epoch``.

    The loaded optimizer carries the lr the *saved* schedule chose for the next step; recomputing it
    exactly as ``LambdaLR.step`` does gives the same float when the schedule is unchanged and makes a
    changed schedule (e.g. a longer ``training.steps``) take effect from the first resumed step.
    """
    epoch = lr_scheduler.last_epoch
    groups = lr_scheduler.optimizer.param_groups
    lrs = [base * fn(epoch) for base, fn in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    lr_scheduler._last_lr = lrs  # what get_last_lr() reports (the trainer logs it)


def first_model_mismatch(metadata, model_state: dict[str, Any], prefix: str = MODEL_KEY) -> str | None:
    """Compare this rank's model keys and global shapes with a DCP checkpoint's metadata.

    Args:
        metadata: ``torch.distributed.checkpoint.Metadata`` of the checkpoint.
        model_state: {FQN: tensor or DTensor} of this rank's parts (``DTensor.shape`` is global).
        prefix: top-level key the model was saved under.

    Returns:
        None, or one sentence naming the first (sorted) key this model has that the checkpoint lacks
        or stores with another shape.
    """
    saved = metadata.state_dict_metadata
    for fqn in sorted(model_state):
        entry = saved.get(f"{prefix}.{fqn}")
        shape = tuple(model_state[fqn].shape)
        if entry is None or not hasattr(entry, "size"):
            return f"the checkpoint has no model weight {fqn!r} (shape {list(shape)}) that this model has"
        if tuple(entry.size) != shape:
            return (f"model weight {fqn!r} has shape {list(entry.size)} in the checkpoint but "
                    f"{list(shape)} in this model")
    return None


def saved_model_keys(metadata, prefix: str = MODEL_KEY) -> list[str]:
    """Sorted FQNs of the model weights stored in a DCP checkpoint's metadata."""
    start = prefix + "."
    return sorted(key[len(start):] for key in metadata.state_dict_metadata if key.startswith(start))
