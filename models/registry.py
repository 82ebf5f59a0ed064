"""A small explicit model registry: one `ModelSpec` per model family, looked up by `model.name`.

DESIGN.md rule of thumb 5: registering a name twice raises, and an unknown name or flavor raises
with the list of known ones, so a typo in `[model]` fails at start-up with the fix in the message.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch.nn as nn

__all__ = [
    "ModelArgs",
    "ModelSpec",
    "register_model_spec",
    "get_model_spec",
    "get_model_args",
    "list_model_names",
]


@runtime_checkable
class ModelArgs(Protocol):
    """What the engine needs from a model's hyper-parameter dataclass (e.g. `LlamaModelArgs`)."""

    def validate(self) -> None:
        """Raise ValueError if the arguments are not self-consistent."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Return (parameter count, training FLOPs per token) of `model` at `seq_len` tokens."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to build and parallelize one model family.

    Attributes:
        name: registry key, matched against `model.name`.
        model_cls: `nn.Module` class constructed as `model_cls(model_args)`.
        flavors: flavor name (`model.flavor`) -> ModelArgs instance.
        parallelize_fn: `fn(model, parallel_dims, cfg) -> model` applying TP/CP/AC/compile/FSDP,
            or None while the model has no parallel plan yet.
        pipeline_fn: splits a model into pipeline stages, or None if PP is not supported.
        validate_parallelism_fn: `fn(model_args, parallelism_cfg, *, seq_len, device_type,
            compile_enabled)` raising ValueError when `[parallelism]` cannot shard this model (e.g.
            heads not divisible by tp); the trainer calls it on every rank before building anything.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    parallelize_fn: Callable | None
    pipeline_fn: Callable | None = None
    validate_parallelism_fn: Callable | None = None


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Add `spec` to the registry under `spec.name`.

    Raises:
        ValueError: if the name is already registered (two models must not share a name), or the
            spec has no flavors.
    """
    if spec.name in _REGISTRY:
        raise ValueError(
            f"model spec {spec.name!r} is already registered; pick another `ModelSpec.name` "
            f"(registered: {sorted(_REGISTRY)})"
        )
    if not spec.flavors:
        raise ValueError(f"model spec {spec.name!r} has no flavors; give at least one ModelArgs")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """Return the spec registered under `name` (the `model.name` setting).

    Raises:
        ValueError: unknown name; the message lists the known names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model.name={name!r}; set model.name to one of {sorted(_REGISTRY)}"
        ) from None


def get_model_args(name: str, flavor: str) -> Any:
    """Return a private copy of the ModelArgs of `flavor` of model `name`.

    A copy, so that the trainer may change e.g. `vocab_size` without touching the registry.

    Raises:
        ValueError: unknown `model.name` or `model.flavor`; the message lists the known values.
    """
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ValueError(
            f"unknown model.flavor={flavor!r} for model.name={name!r}; "
            f"set model.flavor to one of {sorted(spec.flavors)}"
        )
    return copy.deepcopy(spec.flavors[flavor])


def list_model_names() -> list[str]:
    """Sorted names of all registered models."""
    return sorted(_REGISTRY)
