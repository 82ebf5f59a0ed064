"""The loaders' builders: from the ``[data]`` and ``[validation]`` sections to one dp rank's
:class:`~engine.data.loader.PackedDataLoader` or :class:`~engine.data.loader.ValidationDataLoader`.

They pick and open the window source: raw files or a hub dataset, read with ``load_documents`` and
tokenized by ``pack_documents`` at start-up (engine/data/sources.py, engine/data/packing.py), or read
as a stream (engine/data/streaming.py); a prepared folder, memory-mapped
(engine/data/prepared_windows.py); or a weighted mixture of prepared folders (``data.mixture``).
Prepared sources are read ahead by a background thread (:data:`READ_AHEAD` microbatches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.data.batch_sizes import resolve_batch_sizes
from engine.data.loader import PackedDataLoader, ValidationDataLoader
from engine.data.packing import MapWindows, pack_documents
from engine.data.prepared import is_prepared
from engine.data.prepared_windows import PreparedWindows, build_mixture
from engine.data.sources import iter_text_batches, load_documents
from engine.data.streaming import StreamWindows, iter_stream_batches
from engine.data.tokenizer import Tokenizer

logger = logging.getLogger("quadra.data")

# Hub datasets: the validation loader reads this split (local files are a single split).
VALIDATION_SPLIT = "validation"
# Microbatches a background thread reads ahead of the training loop (prepared sources).
READ_AHEAD = 4


def _make_source(path: str, setting: str, data_cfg, tokenizer: Tokenizer, *, split: str, seq_len: int,
                 shuffle: bool, seed: int, infinite: bool) -> Callable[[], MapWindows | StreamWindows]:
    """Read `path` and return a factory of fresh window sources (the packed stream is shared)."""
    if seq_len <= 0:
        raise ValueError(f"training.seq_len={seq_len} must be > 0")
    where = f"{setting}={path!r}"
    if is_prepared(path):
        if data_cfg.streaming:
            logger.info("%s is a prepared folder: it is memory-mapped, data.streaming does not apply", where)
        source = PreparedWindows(path, tokenizer, seq_len=seq_len, shuffle=shuffle, seed=seed,
                                 infinite=infinite, setting=setting)
        logger.info("%s: prepared set of %d documents, %d tokens (%s), %d windows of seq_len + 1 = %d tokens",
                    where, source.manifest["num_documents"], source.num_tokens, source.manifest["dtype"],
                    source.windows_per_epoch, seq_len + 1)
        return lambda: source
    ds = load_documents(path, text_column=data_cfg.text_column, split=split,
                        streaming=data_cfg.streaming, setting=setting)
    if data_cfg.streaming:
        def make() -> StreamWindows:
            source = StreamWindows(lambda state: iter_stream_batches(ds, data_cfg.text_column, state), tokenizer,
                                   seq_len, infinite=infinite, where=where)
            source.ensure(0)  # fail now if not one window fits
            return source
        return make
    stream = pack_documents(iter_text_batches(ds, data_cfg.text_column, batch_size=1024), tokenizer)
    source = MapWindows(stream, seq_len, shuffle=shuffle, seed=seed, infinite=infinite, where=where)
    logger.info("%s: %d documents, %d tokens, %d windows of seq_len + 1 = %d tokens", where, len(ds),
                len(stream), source.windows_per_epoch, seq_len + 1)
    return lambda: source


def build_dataloader(data_cfg, tokenizer: Tokenizer, *, seq_len: int, local_batch_size: int,
                     global_batch_size: int, dp_rank: int, dp_degree: int, seed: int,
                     infinite: bool = True) -> PackedDataLoader:
    """The training loader of one dp rank.

    With `data_cfg.mixture` set, its prepared sets replace `data_cfg.path`.

    Args:
        data_cfg: the `[data]` section (path, text_column, split, streaming, shuffle, mixture).
        tokenizer: see engine/data/tokenizer.py; needs bos and eos ids.
        seq_len: S, tokens per sequence (training.seq_len).
        local_batch_size: L, sequences per microbatch on this rank.
        global_batch_size: G, sequences per optimizer step over all dp ranks; -1 = L * dp_degree.
        dp_rank, dp_degree: this rank's index in, and the size of, the data-parallel group.
        seed: shuffle seed (training.seed); the order of epoch e is a permutation seeded by (seed, e).
        infinite: continue into the next epoch when one ends (else stop after the last full step).

    Returns:
        a `PackedDataLoader` yielding (inputs, labels) int64 [L, S] microbatches.

    Raises:
        FileNotFoundError, ValueError: bad path, empty data, missing column, data shorter than one
            window, or batch sizes that do not divide (see `resolve_batch_sizes`).
    """
    resolve_batch_sizes(local_batch_size, global_batch_size, dp_degree)  # fail before reading data
    mixture = list(getattr(data_cfg, "mixture", []) or [])
    prepared = bool(mixture) or is_prepared(data_cfg.path)
    streaming = bool(data_cfg.streaming) and not prepared
    shuffle = bool(data_cfg.shuffle) and not streaming
    if data_cfg.shuffle and streaming:
        logger.info("data.shuffle applies to map-style data only: streaming reads documents in order")
    if mixture:
        source = build_mixture(mixture, tokenizer, seq_len=seq_len, shuffle=shuffle, seed=seed, infinite=infinite)
    else:
        source = _make_source(data_cfg.path, "data.path", data_cfg, tokenizer, split=data_cfg.split,
                              seq_len=seq_len, shuffle=shuffle, seed=seed, infinite=infinite)()
    loader = PackedDataLoader(source, seq_len=seq_len, local_batch_size=local_batch_size,
                              global_batch_size=global_batch_size, dp_rank=dp_rank,
                              dp_degree=dp_degree, seed=seed, shuffle=shuffle,
                              streaming=streaming, read_ahead=READ_AHEAD if prepared else 0,
                              sequence_order_seed=int(getattr(data_cfg, "sequence_order_seed", 0)))
    logger.info("data: global batch %d = dp %d x local %d x %d accumulation steps",
                loader.global_batch_size, dp_degree, local_batch_size, loader.grad_accum_steps)
    return loader


def build_validation_dataloader(validation_cfg, data_cfg, tokenizer: Tokenizer, *, seq_len: int,
                                local_batch_size: int, dp_rank: int, dp_degree: int) -> ValidationDataLoader:
    """The validation loader of one dp rank (see `ValidationDataLoader`).

    Reads `validation_cfg.path` (raw files, a hub dataset or a prepared folder) with
    `data_cfg.text_column` and `data_cfg.streaming`; hub datasets use the split named by
    VALIDATION_SPLIT ("validation").

    Raises:
        FileNotFoundError, ValueError: as `build_dataloader`; validation.steps not -1 or > 0; a split
            with fewer than local_batch_size * dp_degree windows (not one batch).
    """
    steps = validation_cfg.steps
    if steps == 0 or steps < -1:
        raise ValueError(f"validation.steps={steps} must be -1 (whole split) or > 0")
    if local_batch_size <= 0 or not 0 <= dp_rank < dp_degree:
        raise ValueError(f"training.local_batch_size={local_batch_size} must be > 0 and dp rank "
                         f"{dp_rank} in [0, dp degree {dp_degree})")
    make = _make_source(validation_cfg.path, "validation.path", data_cfg, tokenizer,
                        split=VALIDATION_SPLIT, seq_len=seq_len, shuffle=False, seed=0, infinite=False)
    streaming = bool(data_cfg.streaming) and not is_prepared(validation_cfg.path)
    loader = ValidationDataLoader(make, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
                                  steps=steps, streaming=streaming)
    if not make().ensure(local_batch_size * dp_degree - 1):
        raise ValueError(
            f"validation.path={validation_cfg.path!r} holds fewer than training.global_batch_size = "
            f"{local_batch_size * dp_degree} windows of {seq_len + 1} tokens, not one validation "
            "batch; use a larger split or a smaller global_batch_size/seq_len"
        )
    available = None if loader.streaming else make().windows_per_epoch // (local_batch_size * dp_degree)
    if available is not None and steps > available and dp_rank == 0:
        logger.warning("validation.steps=%d but validation.path=%r holds %d global batches of %d windows: each "
                       "validation uses those %d (set validation.steps = -1 for the whole split)", steps,
                       validation_cfg.path, available, local_batch_size * dp_degree, available)
    return loader
