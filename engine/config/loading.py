"""Job configuration: TOML file + ``--section.key`` command-line overrides -> :class:`JobConfig`.

Precedence is command line > TOML file > dataclass default. Keys are strict: an unknown section
or key, a value of the wrong type, or an enum value outside its allowed set raises
:class:`ConfigError` with a "did you mean" suggestion or the fix. The sections and their keys are
defined (with their docs) in :mod:`engine.config.schema`, :mod:`engine.config.schema_scale` and
:mod:`engine.config.schema_observe`; ``--help`` lists every one of them.

Typical use::

    cfg = load_config()            # argv defaults to sys.argv[1:]
    cfg.validate()                 # checks that need nothing but the config itself
    build_optimizer(params, cfg.optimizer)   # components get their own section only
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from engine.config.toml_format import toml_value
from engine.config.validation import config_warnings, range_problems
from engine.config.value_checks import ConfigError, check_value, field_default, parse_cli_value
from engine.config.schema import (
    DataSection, DocumentMaskSection, EvalSection, JobSection, LossSection, LRSchedulerSection, ModelSection,
    OptimizerSection, StepHealthSection, TrainingSection, ValidationSection,
)
from engine.config.schema_observe import MetricsSection, ProfilingSection, RecordSection
from engine.config.schema_scale import (
    ActivationCheckpointSection, CheckpointSection, CommSection, CompileSection, FaultToleranceSection, Float8Section,
    ParallelismSection,
)

__all__ = [
    "CONFIG_KEYS", "JobConfig", "config_to_dict", "config_to_toml", "format_help", "load_config",
    "resolve_dump_folder",
]

@dataclass
class JobConfig:
    """The whole job config: one attribute per TOML section. Treat as read-only after loading."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    eval: EvalSection = field(default_factory=EvalSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    step_health: StepHealthSection = field(default_factory=StepHealthSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    comm: CommSection = field(default_factory=CommSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    compile: CompileSection = field(default_factory=CompileSection)
    float8: Float8Section = field(default_factory=Float8Section)
    loss: LossSection = field(default_factory=LossSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    document_mask: DocumentMaskSection = field(default_factory=DocumentMaskSection)
    record: RecordSection = field(default_factory=RecordSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)

    @property
    def run_folder(self) -> str:
        """The run folder; see :func:`resolve_dump_folder`. One torchft replica group
        (``fault_tolerance.replica_id`` >= 0) has its own ``replica-<id>`` folder inside it: its
        metrics, checkpoints and failure records."""
        ft = self.fault_tolerance
        if ft.enable and ft.replica_id >= 0:
            return os.path.join(resolve_dump_folder(self), f"replica-{ft.replica_id}")
        return resolve_dump_folder(self)

    def validate(self) -> None:
        """Check every value that can be judged from the config alone (ranges, enums, types).

        Checks that need the world size (degree product, batch divisibility by dp) belong to
        ``ParallelDims`` and the data loader. All problems are reported together.

        Raises:
            ConfigError: one line per problem, each naming the key, the value and the fix.
        """
        # Range checks compare numbers, so they run only once every value has its declared type.
        problems = _type_problems(self) or range_problems(self)
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError(f"{len(problems)} problems:\n  " + "\n  ".join(problems))

    def warnings(self) -> list[str]:
        """What is merely unusual (e.g. a warmup longer than the run, which is clamped), one line
        each; call after :meth:`validate`."""
        return config_warnings(self)


# Section name -> dataclass, in TOML/help order; derived from JobConfig so they cannot drift.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
_FIELDS: dict[str, dict[str, dataclasses.Field]] = {
    name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()
}
# Every "section.key" name; tests pin this set so that adding or removing a key is deliberate.
CONFIG_KEYS: tuple[str, ...] = tuple(f"{s}.{k}" for s, fs in _FIELDS.items() for k in fs)


def resolve_dump_folder(cfg: JobConfig) -> str:
    """The run folder: ``job.dump_folder``, or ``outputs/<config file stem>`` when it is "".

    Without a config file the stem is ``default`` (``outputs/default``). Relative paths stay
    relative to the working directory.
    """
    # Naming the folder after the config keeps runs of different presets apart by default.
    if cfg.job.dump_folder:
        return cfg.job.dump_folder
    stem = Path(cfg.job.config_file).stem if cfg.job.config_file else "default"
    return os.path.join("outputs", stem)


# ---------------------------------------------------------------- loading


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from ``--job.config_file`` TOML plus command-line overrides.

    Args:
        argv: arguments, default ``sys.argv[1:]``. Forms: ``--section.key VALUE``,
            ``--section.key=VALUE``, and for bool keys a bare ``--section.key`` (true). Bools
            accept true/false/1/0/yes/no. ``--job.config_file PATH`` names the TOML file
            (relative paths resolve from the working directory).

    Returns:
        The config, CLI > TOML > default. Not validated: call ``cfg.validate()``.

    Raises:
        ConfigError: unknown section/key, wrong type, enum value not allowed, missing or
            unparsable TOML file, malformed argument, missing value.
        SystemExit(0): after printing :func:`format_help`, when ``-h``/``--help`` is given.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Help wins over everything else, so it works even next to a broken override.
    if "-h" in argv or "--help" in argv:
        print(format_help(_values_for_help(argv)))
        raise SystemExit(0)
    # Parse the CLI first: it names the TOML file, and its errors need no file I/O.
    cli = _parse_argv(argv)
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    path = cli.get(("job", "config_file"), "")
    if path:
        for (section, key), value in _read_toml(path).items():
            values[section][key] = value
    for (section, key), value in cli.items():
        values[section][key] = value
    # Not validated here: tools (and tests) may load, adjust, then call validate() themselves.
    return JobConfig(**{name: SECTIONS[name](**kv) for name, kv in values.items()})


def _read_toml(path: str) -> dict[tuple[str, str], Any]:
    """Read and type-check one TOML config file -> {(section, key): value}."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"job.config_file = {path!r}: file not found (relative to {os.getcwd()}). "
            "Fix: pass an existing TOML file, e.g. --job.config_file train_configs/debug_model.toml"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job.config_file = {path!r} is not valid TOML: {exc}. "
                          "Fix: correct the syntax at that line") from exc
    except OSError as exc:
        raise ConfigError(f"job.config_file = {path!r} cannot be read: {exc}. "
                          "Fix: pass a readable TOML file") from exc
    where = f"config file {path!r}"
    out: dict[tuple[str, str], Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            homes = [f"[{s}]" for s, fs in _FIELDS.items() if section in fs]
            hint = f" (it belongs under {' or '.join(homes)})" if homes else ""
            raise ConfigError(f"top-level key '{section}' in {where} is outside any section{hint}. "
                              "Fix: move it under its [section] header")
        for key, value in table.items():
            f = _lookup(section, key, where)
            out[(section, key)] = check_value(f"{section}.{key}", value, f)
    return out


def _parse_argv(argv: list[str]) -> dict[tuple[str, str], Any]:
    """Parse ``--section.key[=]VALUE`` arguments -> {(section, key): typed value}; last one wins."""
    out: dict[tuple[str, str], Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, has_eq, text = token[2:].partition("=")
        section, _, key = name.partition(".")
        if not token.startswith("--") or not section or not key:
            raise ConfigError(f"command-line argument {token!r} is not of the form --section.key VALUE "
                              "or --section.key=VALUE. Fix: e.g. --training.steps 10 (see --help)")
        f = _lookup(section, key, "command-line arguments")
        if not has_eq:
            nxt = argv[i] if i < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                # Only a bool may stand alone: `--compile.enable` means true.
                if f.type is not bool:
                    raise ConfigError(f"--{name} is missing its value ({f.type.__name__}). "
                                      f"Fix: pass --{name} VALUE or --{name}=VALUE")
                text = "true"
            else:
                text = nxt
                i += 1
        out[(section, key)] = parse_cli_value(name, text, f)
    return out


def _lookup(section: str, key: str, where: str) -> dataclasses.Field:
    """The field of ``section.key``, or ConfigError with a "did you mean" suggestion."""
    if section not in _FIELDS:
        close = difflib.get_close_matches(section, list(_FIELDS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known sections: {', '.join(_FIELDS)}"
        raise ConfigError(f"unknown section '{section}' in {where}; {hint}")
    fields = _FIELDS[section]
    if key in fields:
        return fields[key]
    # Prefer a near-miss in the same section, then the same key in another section, then anything.
    # e.g. [training] lr -> 'optimizer.lr': keys misplaced across sections are a common slip.
    close = [f"{section}.{m}" for m in difflib.get_close_matches(key, list(fields), n=1)]
    close = close or [f"{s}.{key}" for s, fs in _FIELDS.items() if key in fs]
    close = close or difflib.get_close_matches(f"{section}.{key}", CONFIG_KEYS, n=1)
    hint = (f"did you mean '{close[0]}'?" if close
            else f"keys of [{section}]: {', '.join(fields)}")
    raise ConfigError(f"unknown key '{section}.{key}' in {where}; {hint} (see --help for every key)")


# ---------------------------------------------------------------- validation


def _type_problems(cfg: JobConfig) -> list[str]:
    """Types and enum membership of every field (catches values set in code, not just loaded)."""
    problems = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for key, f in _FIELDS[section].items():
            value = getattr(obj, key)
            try:
                checked = check_value(f"{section}.{key}", value, f)
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            if f.type is str and checked != value:  # int_ok converts; code must store the str
                problems.append(f"{section}.{key} = {value!r} must be a str. Fix: use {checked!r}")
    return problems


# ---------------------------------------------------------------- serialisation and help


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` of every key, in help order (plain, TOML-serialisable values)."""
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig) -> str:
    """The config as a TOML document (every section and key); ``tomllib.loads`` round-trips it."""
    lines: list[str] = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


def _values_for_help(argv: list[str]) -> dict[tuple[str, str], Any]:
    """The TOML file's and the command line's values, best effort (help must work with bad ones)."""
    try:
        cli = _parse_argv([a for a in argv if a not in ("-h", "--help")])
        path = cli.get(("job", "config_file"), "")
        return {**(_read_toml(path) if path else {}), **cli}
    except ConfigError:
        return {}


def format_help(current: dict[tuple[str, str], Any] | None = None) -> str:
    """The ``--help`` text: one ``--section.key  (type, default: X)  doc`` line per key; keys set by
    the config file or the command line (``current``) also show ``set: Y``."""
    current = current or {}
    lines = [
        "usage: python -m engine.train [--job.config_file FILE.toml] [--section.key VALUE ...]",
        "Each key may be set in the TOML file ([section] key = value) or on the command line as",
        "--section.key VALUE or --section.key=VALUE; a bare --section.key sets a bool to true.",
        "Precedence: command line > TOML file > default.",
    ]
    for section, fields in _FIELDS.items():
        lines += ["", f"[{section}]"]
        for key, f in fields.items():
            set_here = f", set: {toml_value(current[section, key])}" if (section, key) in current else ""
            lines.append(f"  --{section}.{key}  ({f.type.__name__}, default: "
                         f"{toml_value(field_default(f))}{set_here})  {f.metadata['doc']}")
    return "\n".join(lines)
