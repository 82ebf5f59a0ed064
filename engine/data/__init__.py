"""Training data: documents from local files or the hub, tokenized, packed into fixed windows,
split over data-parallel ranks, resumable and independent of the layout.

Modules: ``sources`` (reading documents with Hugging Face ``datasets``), ``tokenizer``
(SentencePiece), ``packing`` (documents -> ``seq_len + 1`` token windows), ``streaming`` (windows of
a streaming dataset and a resume that seeks), ``prepared``/``prepare``/``prepared_windows``/
``checksums``/``order``/``readahead`` (prepared, memory-mapped sets), ``loader`` (the stateful
per-rank loaders), ``builders`` (a loader from the ``[data]`` or ``[validation]`` section: its source),
``batch_sizes`` (global batch and gradient accumulation).

The names below are imported on first use (PEP 562), so that ``engine.data.batch_sizes`` and the
path checks of ``engine.data.sources`` stay usable without torch or ``datasets`` (the launcher's
pre-flight imports them).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PackedDataLoader": "loader",
    "ValidationDataLoader": "loader",
    "build_dataloader": "builders",
    "build_validation_dataloader": "builders",
    "Tokenizer": "tokenizer",
    "resolve_batch_sizes": "batch_sizes",
    "load_documents": "sources",
    "iter_text_batches": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"engine.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
