"""Checkpoints with torch Distributed Checkpoint (DCP): exact resume, resume under other degrees,
atomic folders, async saves, and one-process tools.

Modules: ``state`` (what a checkpoint holds: model parts + optimizer as canonical FQNs, RNG, LR,
and the checks that a checkpoint fits), ``files`` (the ``step-N`` folders: atomic rename, markers,
scanning, pruning), ``manager`` (:class:`CheckpointManager`: when to save, save, load, stop),
``tools`` (export / import single-file weights, seed checkpoints).
"""

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager"]
