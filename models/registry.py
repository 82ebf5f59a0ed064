"""A small explicit model registry: one `ModelSpec` per model family, looked up by `model.name`.

A family is one folder, ``models/<family>/``, holding everything about it: arguments and flavors,
the module, the parallelize plan, start-up checks, the Hugging Face adapter and what the planner
needs (parameter shapes, FLOPs per token, activation width, expert routing); its ``ModelSpec`` names
each. engine/ knows families only through this module (tests/unit/test_architecture.py checks it).

Registering a name twice raises, and an unknown name or flavor raises with the list of known ones,
so a typo in `[model]` fails at start-up with the fix in the message. The registry, the flavors and
the start-up checks import no torch: the model class and its parallelize plan are named as
"module:attribute" and imported on first use (:func:`load_ref`), so the launcher's pre-flight can
resolve and check a model in a fraction of a second.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = [
    "ModelArgs",
    "ModelSpec",
    "register_model_spec",
    "get_model_spec",
    "get_model_args",
    "list_model_names",
    "load_ref",
    "hf_spec_for_model_type",
    "DEFAULT_MODEL_NAME",
]

DEFAULT_MODEL_NAME = "llama"  # the default of the `model.name` setting (engine/config/schema.py)


@runtime_checkable
class ModelArgs(Protocol):
    """What the engine needs from a model's hyper-parameter dataclass (e.g. `LlamaModelArgs`)."""

    def validate(self) -> None:
        """Raise ValueError if the arguments are not self-consistent."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to build and parallelize one model family.

    Attributes:
        name: registry key, matched against `model.name`.
        model_cls: `nn.Module` class constructed as `model_cls(model_args)`, or its
            "module:attribute" name (imported by :func:`load_ref` when first built).
        flavors: flavor name (`model.flavor`) -> ModelArgs instance.
        parallelize_plan: the family's `parallelisms.parallelize.ParallelizePlan`, or its
            "module:attribute" name (e.g. `models.common.parallelize:LLAMA_PLAN`): its tensor-parallel
            plan and, with routed experts, its `ExpertPlan`, as data; the shared driver
            (parallelisms/parallelize.py) applies TP/EP/CP/AC/compile/FSDP with it, in place.
            Pipeline stages are cut by the engine (parallelisms/pipeline.py) from the `layers` dict.
        validate_parallelism_fn: `fn(model_args, parallelism_cfg, *, seq_len, device_type,
            compile_enabled)` raising ValueError when `[parallelism]` cannot shard this model (e.g.
            heads not divisible by tp); must import no torch, since the launcher's pre-flight and
            every rank call it before building anything.
        hf_adapter: a `models.common.hf.HFAdapter` (or its "module:attribute" name): config.json and weight
            names in both directions; None when the family has no Hugging Face equivalent.
        param_shapes: `fn(model_args) -> list[models.common.planning.ParamSpec]`, every parameter with its
            shape and placement under the family's plan, in module order (torch-free; the planner's
            per-rank bytes and the dry run's check against the real plan rest on it).
        flops_per_token: `fn(model_args, seq_len) -> float`, training FLOPs per token (forward +
            backward, PaLM App. B; active parameters only for MoE), torch-free, for the planner's MFU.
        ffn_width: `fn(model_args) -> int`, hidden width of a token's feed-forward activations (the
            planner's activation bytes; MoE: top_k routed + shared experts).
        expert_routing: `fn(model_args) -> models.common.planning.ExpertRouting`, for families that route
            tokens to experts (the planner's ep degrees and all-to-all bytes); None for dense ones.
        attention_activations: `fn(model_args) -> models.common.planning.AttentionActivations`, what one
            attention layer keeps for backward per token (the planner's activation bytes); None
            means LLaMA's attention (``models.common.planning.gqa_attention_activations``).
        ffn_activations: `fn(model_args, layer) -> models.common.planning.FeedForwardActivations`, what
            block ``layer``'s feed-forward keeps per token; None means every block is
            ``ffn_width`` wide and routes nothing.
        prediction_blocks: `fn(model_args) -> tuple[int, ...]`, the block (layer) ids of further
            prediction depths on the last stage, each a block with its own input and loss head
            (DeepSeek-V3's multi-token prediction); None: none.
    All callables may be given as "module:attribute" names (:meth:`ModelSpec.get`).
    """

    name: str
    model_cls: Any
    flavors: dict[str, Any]
    parallelize_plan: Any
    validate_parallelism_fn: Callable | None = None
    hf_adapter: Any = None
    param_shapes: Any = None
    flops_per_token: Any = None
    ffn_width: Any = None
    expert_routing: Any = None
    attention_activations: Any = None
    ffn_activations: Any = None
    prediction_blocks: Any = None

    def get(self, field: str) -> Any:
        """The object spec field ``field`` names (:func:`load_ref`).

        Raises:
            ValueError: the family does not give it (one line naming the family and the field).
        """
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"model.name = {self.name!r} gives no ModelSpec.{field}; add it to "
                             f"models/{self.name}/__init__.py")
        return load_ref(value)


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


def load_ref(ref: Any) -> Any:
    """The object a spec field names: `ref` itself, or the attribute of a "module:attribute" string.

    Raises:
        ImportError / AttributeError: the name does not resolve.
    """
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def hf_spec_for_model_type(model_type, where: str) -> ModelSpec:
    """The registered family whose Hugging Face adapter reads ``config.json``'s ``model_type``.

    Raises:
        ValueError: no family reads it; the message lists the model types that are read.
    """
    known = {}
    for name in sorted(_REGISTRY):
        spec = _REGISTRY[name]
        if spec.hf_adapter is not None:
            for kind in load_ref(spec.hf_adapter).model_types:
                known[kind] = spec
    if model_type not in known:
        raise ValueError(f"{where}: model_type = {model_type!r} is not supported; from-hf converts "
                         f"{', '.join(repr(k) for k in known)} checkpoints")
    return known[model_type]
