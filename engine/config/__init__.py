"""Job configuration: the schema (one dataclass per TOML section), loading from TOML and the command
line, range checks and warnings, and TOML writing. Imports no torch (the launcher's pre-flight reads
the config before torch is loaded).

Modules: ``schema`` (sections, their keys, defaults and docs; ``schema_scale`` and ``schema_observe`` hold
the sections for running at scale and for watching a run), ``loading`` (:class:`JobConfig`,
:func:`load_config`, ``--help``), ``value_checks`` (one value's type and allowed values, and
:class:`ConfigError`), ``validation`` (what the config alone can refuse or warn about),
``toml_format`` (values as TOML and command-line text), ``reference`` (every key as the markdown of
engine/docs/configuration.md). ``python -m engine.config [--section.key v ...]``
prints the merged config or the one-line error (exit 2).
"""

from engine.config.loading import (
    CONFIG_KEYS,
    SECTIONS,
    JobConfig,
    config_to_dict,
    config_to_toml,
    format_help,
    load_config,
    resolve_dump_folder,
)
from engine.config.value_checks import ConfigError

__all__ = [
    "CONFIG_KEYS",
    "SECTIONS",
    "ConfigError",
    "JobConfig",
    "config_to_dict",
    "config_to_toml",
    "format_help",
    "load_config",
    "resolve_dump_folder",
]
