"""A small explicit model registry: one `ModelSpec` per model family, looked up by `model.name`.

A family is one folder, ``models/<family>/``, holding everything about it: arguments and flavors,
the module, the parallelize plan, start-up checks, the Hugging Face adapter and what the planner
needs (parameter shapes, FLOPs per token, activation width, expert routing); its ``ModelSpec`` names
each. engine/ knows families only through this module (tests/test_architecture.py checks it).

Registering a name twice raises, and an unknown name or flavor raises with the list of known ones,
so a typo in `[model]` fails at start-up with the fix in the message. The registry, the flavors and
the start-up checks import no torch: the model class and its parallelize plan are named as
"module:attribute" and imported on first use (:func:`load_ref`), so the launcher's pre-flight can
resolve and check a model in a fraction of a second.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
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
    "resolve_model_args",
    "resolve_model",
    "base_model_args",
    "model_record",
    "args_from_record",
    "load_model_record",
    "read_json",
    "first_args_difference",
    "hf_spec_for_model_type",
    "DEFAULT_MODEL_NAME",
]

DEFAULT_MODEL_NAME = "llama"  # the default of the `model.name` setting (engine/config/schema.py)

RECORD_FILE = "quadra.json"  # a checkpoint folder's marker; its "model" entry is the model record


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


def model_record(name: str, args) -> dict:
    """The architecture of a model as JSON: ``{"name": model.name, "args": {field: value}}``.

    Written into every checkpoint's quadra.json (key "model") and by the Hugging Face converter, so a
    checkpoint says which model it holds; :func:`args_from_record` reads it back.
    """
    return {"name": name, "args": dataclasses.asdict(args)}


def args_from_record(record: dict, where: str) -> tuple[ModelSpec, Any]:
    """(spec, args dataclass) of a :func:`model_record`; ``where`` names its source in errors.

    Raises:
        ValueError: not a record, an unknown model name or argument, or arguments that fail
            ``validate()``.
    """
    if not isinstance(record, dict) or not isinstance(record.get("args"), dict) or "name" not in record:
        raise ValueError(f"{where} holds no model record ({{\"name\": ..., \"args\": {{...}}}}); point it at a "
                         "folder written by scripts/convert_checkpoint.py from-hf or a checkpoint step folder")
    spec = get_model_spec(record["name"])
    cls = type(next(iter(spec.flavors.values())))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(record["args"]) - known)
    if unknown:
        raise ValueError(f"{where}: model {record['name']!r} has no argument {unknown[0]!r} "
                         f"(known: {', '.join(sorted(known))})")
    args = cls(**record["args"])
    try:
        args.validate()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return spec, args


def read_json(file: str, fix: str, *, prefix: str = "", error_cls: type[ValueError] = ValueError):
    """The JSON value in ``file``.

    Raises:
        ``error_cls``: the file is missing, unreadable or not JSON; one line: ``prefix``, the file, the
            error and ``fix`` (what to point at instead).
    """
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as error:
        raise error_cls(f"{prefix}cannot read {file!r} ({type(error).__name__}: {error}); {fix}") from None


def load_model_record(path: str) -> dict:
    """The model record at ``path``: a checkpoint folder (its quadra.json's "model" entry) or a
    JSON file holding a record (or a quadra.json).

    Raises:
        ValueError: the path does not exist, is unreadable, or holds no record.
    """
    where = f"model.args_path = {path!r}"
    file = os.path.join(path, RECORD_FILE) if os.path.isdir(path) else path
    data = read_json(file, "point it at a folder written by scripts/convert_checkpoint.py from-hf or its quadra.json",
                     prefix=f"{where}: ")
    record = data.get("model", data) if isinstance(data, dict) else data
    args_from_record(record, where)  # validates
    return record


def first_args_difference(a, b, ignore: tuple[str, ...] = ("max_seq_len", "depth_init")) -> str | None:
    """``"field=value_a vs value_b"`` for the first architecture field where two args differ, or None.

    ``max_seq_len`` (set to training.seq_len per run) and ``depth_init`` (initialization only) are
    ignored: they change no weight's shape or value.
    """
    fields_a = dataclasses.asdict(a)
    fields_b = dataclasses.asdict(b)
    for name in sorted(set(fields_a) | set(fields_b)):
        if name not in ignore and fields_a.get(name) != fields_b.get(name):
            return f"{name}={fields_a.get(name)!r} vs {fields_b.get(name)!r}"
    return None


def base_model_args(model_cfg) -> tuple[ModelSpec, Any, str]:
    """The architecture ``[model]`` asks for, before the run's ``seq_len`` is applied.

    From ``model.args_path`` (a model record, e.g. a checkpoint converted from Hugging Face) when
    set, else from ``model.flavor``; then ``model.vocab_size`` (when not -1) and
    ``model.tie_embeddings`` (a record's own tying stays; ``true`` with an untied record is refused).

    Returns:
        (spec, args, label): label names the source in messages, e.g. "llama/debugmodel".

    Raises:
        ValueError: unknown name/flavor, an unreadable record, a record of another model.
    """
    spec: ModelSpec = get_model_spec(model_cfg.name)
    args_path = getattr(model_cfg, "args_path", "")
    changes = {}
    if args_path:
        record = load_model_record(args_path)
        if record["name"] != model_cfg.name:
            raise ValueError(f"model.args_path = {args_path!r} describes a {record['name']!r} model but "
                             f"model.name = {model_cfg.name!r}. Set model.name = {record['name']!r}.")
        _, args = args_from_record(record, f"model.args_path = {args_path!r}")
        label = f"{model_cfg.name} from {args_path}"
        if model_cfg.tie_embeddings and not args.tie_embeddings:
            raise ValueError(f"model.tie_embeddings = true but model.args_path = {args_path!r} has untied "
                             "embeddings (separate output weights). Set model.tie_embeddings = false.")
    else:
        args = get_model_args(model_cfg.name, model_cfg.flavor)
        label = f"{model_cfg.name}/{model_cfg.flavor}"
        changes["tie_embeddings"] = model_cfg.tie_embeddings
    if model_cfg.vocab_size != -1:
        if model_cfg.vocab_size < 1:
            raise ValueError(f"model.vocab_size = {model_cfg.vocab_size}: use -1 (the flavor's) or a positive size.")
        changes["vocab_size"] = model_cfg.vocab_size
    return spec, dataclasses.replace(args, **changes), label


def resolve_model_args(model_cfg, *, seq_len: int, tokenizer_vocab_size: int):
    """The model spec and its arguments for ``[model]``, checked against the tokenizer and seq_len.

    The architecture comes from :func:`base_model_args` (flavor or ``model.args_path``);
    ``model.vocab_size = -1`` keeps its vocabulary, a positive value replaces it (to train with
    another tokenizer). The model's RoPE table is sized to ``seq_len``.

    Returns:
        (ModelSpec, model args dataclass).

    Raises:
        ValueError: unknown name/flavor, a bad ``model.args_path``, or a tokenizer vocabulary larger
            than the model's embedding table. A ``seq_len`` above the model's ``max_seq_len`` is
            allowed (context extension; see :func:`long_context_warning`).
    """
    spec, args, _, _ = resolve_model(model_cfg, seq_len=seq_len, tokenizer_vocab_size=tokenizer_vocab_size)
    return spec, args


def resolve_model(model_cfg, *, seq_len: int, tokenizer_vocab_size: int):
    """:func:`resolve_model_args` with what it starts from, for callers that also record the model.

    Returns:
        (spec, args as trained, args before ``seq_len`` (what checkpoints record), label for messages).

    Raises:
        ValueError: as :func:`resolve_model_args`.
    """
    spec, base, label = base_model_args(model_cfg)
    args = base
    if tokenizer_vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer at model.tokenizer_path = {model_cfg.tokenizer_path!r} has "
            f"{tokenizer_vocab_size} tokens but model {label} has vocab_size "
            f"{args.vocab_size}. Set model.vocab_size >= {tokenizer_vocab_size} or use a smaller tokenizer."
        )
    args = dataclasses.replace(args, max_seq_len=seq_len)
    args.validate()
    return spec, args, base, label


def long_context_warning(base, seq_len: int, label: str) -> str | None:
    """One line when ``seq_len`` exceeds the ``max_seq_len`` the model ``base`` is made for (its flavor's or
    checkpoint's trained length), else None.

    Longer positions train (the RoPE tables are sized to ``seq_len``); how meaningful they are depends
    on the frequencies, which the line names (``rope_summary`` of the family's args: Llama 3.1's llama3
    scaling, DeepSeek-V3's YaRN (Peng et al. 2023, arXiv 2309.00071), or none).
    """
    if seq_len <= base.max_seq_len:
        return None
    summary = getattr(base, "rope_summary", "unknown")
    return (f"training.seq_len = {seq_len} is past the max_seq_len {base.max_seq_len} model {label} is made for "
            f"({seq_len / base.max_seq_len:g}x), positions {base.max_seq_len}..{seq_len - 1} included; "
            f"RoPE frequencies (of every position): {summary}; "
            f"checkpoints and Hugging Face exports record max_seq_len = {seq_len}")
