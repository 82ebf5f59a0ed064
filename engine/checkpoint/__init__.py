"""Checkpoints with torch Distributed Checkpoint (DCP) at run time: exact resume, resume under other
degrees, atomic folders, async saves. The one-process tools built on them are engine/convert/.

Modules: ``state`` (what a checkpoint holds: model parts + optimizer as canonical FQNs, RNG, LR,
and the checks that a checkpoint fits), ``files`` (the ``step-N`` folders: atomic rename, markers,
scanning, pruning; torch-free, the launcher's pre-flight uses it), ``manifest`` (the size and
checksum of every file, recorded at save and checked at load; torch-free), ``selection`` (which
checkpoint to load and where to fall back to; torch-free), ``manager`` (:class:`CheckpointManager`:
when to save, save, stop) with ``loading`` (its load side: verify, agree across ranks, fall back).

The names below are imported on first use (PEP 562), so that ``engine.checkpoint.files`` stays
importable without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"CheckpointError": "files", "CheckpointManager": "manager"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"engine.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
