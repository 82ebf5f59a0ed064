"""From ``[model]`` settings or a checkpoint's record to a family's arguments (torch-free).

A run's architecture comes from ``model.flavor`` or ``model.args_path`` (a model record written
into every checkpoint's quadra.json and by the Hugging Face converter), then ``model.vocab_size``,
``model.tie_embeddings`` and the run's ``seq_len``; :func:`resolve_model` does it once for the
launcher's pre-flight and every rank. The families themselves are found through models/registry.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from models.registry import ModelSpec, get_model_args, get_model_spec

__all__ = ["RECORD_FILE", "model_record", "args_from_record", "read_json", "load_model_record",
           "first_args_difference", "base_model_args", "resolve_model_args", "resolve_model",
           "long_context_warning"]

RECORD_FILE = "quadra.json"  # a checkpoint folder's marker; its "model" entry is the model record


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
