"""Window sources over prepared sets (engine/data/prepared.py): memory-mapped, O(1) per window.

``PreparedWindows`` serves the windows of one prepared set with the interface of
engine/data/packing.py's sources (``windows_per_epoch``, ``infinite``, ``epoch_of``, ``ensure``,
``gather``). Its stream is the packed stream of engine/data/packing.py (the same tokens for the same
documents and tokenizer), so window w is ``stream[w*S : w*S + S + 1]`` exactly as there, and
without shuffle the windows equal the raw-file path's. With shuffle, epoch e visits window
``perm_e(i)`` at its i-th position (engine/data/order.py's ``WindowPermutation``, O(1) per index),
which differs from the raw path's ``torch.randperm``. Opening costs O(shards): read the manifest,
compare file sizes and the verification record of the checksums (engine/data/checksums.py; the
first open of a file version hashes it), memory-map the shards (no token is read; resident memory
grows only with the pages the windows touch).

``MixtureWindows`` interleaves several prepared sets by global position (engine/data/order.py's
``MixtureSchedule``); each set keeps its own position, epochs and shuffle.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence

import numpy as np
import torch

from engine.data.checksums import verify_files
from engine.data.order import MixtureSchedule, WindowPermutation
from engine.data.prepared import (PreparedDataError, content_id, is_prepared, open_checked, parse_mixture,
                                  tokenizer_identity)

logger = logging.getLogger("quadra.data")
RAW_DATA = "raw files or a hub dataset"  # what a loader state without a ``data`` entry was saved reading


def describe_data(identity: str) -> str:
    """A loader state's ``data`` entry (a source's ``identity``, or RAW_DATA) in words."""
    if identity.startswith("prepared:"):
        return f"a prepared set (content {identity.split(':', 1)[1]})"
    if identity.startswith("mixture:"):
        return f"a data.mixture of {identity.count('prepared:')} prepared set(s)"
    return identity


def _open_shards(folder: str, manifest: dict, where: str) -> list[np.ndarray]:
    shards = []
    for entry in manifest["shards"]:
        path = os.path.join(os.path.expanduser(folder), entry["file"])
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise PreparedDataError(f"{where}: {entry['file']} is not a readable .npy shard ({err}); prepare the "
                                    "folder again") from None
        if array.ndim != 1 or array.dtype != np.dtype(manifest["dtype"]) or len(array) != entry["tokens"]:
            raise PreparedDataError(f"{where}: {entry['file']} holds {array.dtype} {array.shape}, the manifest "
                                    f"{manifest['dtype']} ({entry['tokens']},); prepare the folder again")
        shards.append(array.view(np.ndarray))  # the same mapping, without np.memmap's per-slice overhead
    return shards


class PreparedWindows:
    """Random access to the windows of one prepared set (see the module docstring).

    Args:
        folder: the prepared folder.
        tokenizer: the run's tokenizer; the set must have been made with the same one.
        seq_len: S. shuffle, seed, infinite: as engine/data/packing.py's ``MapWindows``.
        stream: this set's index in a mixture (part of the shuffle key; 0 alone).
        setting: the config key for messages.

    Raises:
        PreparedDataError: missing/mis-sized/corrupted/unreadable files, another tokenizer, fewer than
            S + 1 tokens.
    """

    def __init__(self, folder: str, tokenizer, *, seq_len: int, shuffle: bool, seed: int, infinite: bool,
                 stream: int = 0, setting: str = "data.path", identity: dict | None = None):
        where = f"{setting}={folder!r}"
        self.manifest = open_checked(folder, setting, identity or tokenizer_identity(tokenizer))
        verify_files(folder, self.manifest, where)  # hashed once per file version, then trusted
        self.shards = _open_shards(folder, self.manifest, where)
        self._starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.num_tokens = int(self._starts[-1])
        self.seq_len, self.shuffle, self.seed, self.infinite, self.stream = seq_len, shuffle, seed, infinite, stream
        self.windows_per_epoch = (self.num_tokens - 1) // seq_len if self.num_tokens > 0 else 0
        if self.windows_per_epoch <= 0:
            raise PreparedDataError(f"{where}: the set holds {self.num_tokens} tokens, fewer than training.seq_len "
                                    f"+ 1 = {seq_len + 1}, so not one window fits; lower training.seq_len or add data")
        self.identity = f"prepared:{content_id(self.manifest)}"
        self._perms: dict[int, WindowPermutation] = {}

    def epoch_of(self, position: int) -> int:
        return position // self.windows_per_epoch

    def ensure(self, position: int) -> bool:
        """Whether global window ``position`` exists (always, when infinite)."""
        return self.infinite or position < self.windows_per_epoch

    def window_indices(self, positions: np.ndarray) -> np.ndarray:
        """Window index (int64) read at each global position."""
        n = self.windows_per_epoch
        epochs, within = np.divmod(np.asarray(positions, dtype=np.int64), n)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs).tolist():
            if epoch not in self._perms:
                if len(self._perms) >= 4:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = WindowPermutation(n, seed=self.seed, stream=self.stream, epoch=epoch)
            mask = epochs == epoch
            out[mask] = self._perms[epoch](within[mask])
        return out

    def _read(self, start: int, out: np.ndarray) -> None:
        """Copy tokens [start, start + len(out)) of the stream into ``out`` (across shards)."""
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < len(out):
            offset = start + done - int(self._starts[k])
            piece = self.shards[k][offset: offset + len(out) - done]
            out[done: done + len(piece)] = piece
            done += len(piece)
            k += 1

    def gather(self, positions: Sequence[int]) -> torch.Tensor:
        """The windows at global ``positions``: int32 [len(positions), seq_len + 1]."""
        starts = self.window_indices(np.asarray(list(positions), dtype=np.int64)) * self.seq_len
        k = int(np.searchsorted(self._starts, starts.min(), side="right")) - 1
        if starts.max() + self.seq_len + 1 <= self._starts[k + 1]:  # all in shard k: one fancy index
            rows = (starts - self._starts[k])[:, None] + np.arange(self.seq_len + 1)
            return torch.from_numpy(self.shards[k][rows].astype(np.int32))
        out = np.empty((len(starts), self.seq_len + 1), np.int32)
        for row, start in enumerate(starts.tolist()):
            self._read(start, out[row])
        return torch.from_numpy(out)


class MixtureWindows:
    """Several prepared sets interleaved by global position with fixed weights (module docstring).

    ``windows_per_epoch`` is None (a mixture has no single epoch); ``epoch_of(p)`` is the largest
    epoch any set has reached before position p (how often the most repeated set was read).

    Args:
        sources: the sets (``PreparedWindows``, built with stream = their index), names: for metrics.
        weights: positive, one per set.
    """

    def __init__(self, sources: list[PreparedWindows], weights: list[float], names: list[str]):
        self.sources, self.names = sources, names
        self.schedule = MixtureSchedule(weights)
        self.infinite = all(s.infinite for s in sources)
        self.windows_per_epoch = None
        self.seq_len = sources[0].seq_len
        self.identity = "mixture:" + ",".join(f"{s.identity}*{k}" for s, k in zip(sources, self.schedule.counts))

    def epoch_of(self, position: int) -> int:
        counts = self.schedule.count_before(position)
        return max(c // s.windows_per_epoch for c, s in zip(counts, self.sources))

    def ensure(self, position: int) -> bool:
        """Whether ``position`` exists: always when infinite, else while no set is past its first epoch."""
        counts = self.schedule.count_before(position + 1)
        return self.infinite or all(c <= s.windows_per_epoch for c, s in zip(counts, self.sources))

    def gather(self, positions: Sequence[int]) -> torch.Tensor:
        """The windows at global ``positions``: int32 [len(positions), seq_len + 1]."""
        source, local = self.schedule.locate(np.asarray(list(positions), dtype=np.int64))
        out = torch.empty((len(source), self.seq_len + 1), dtype=torch.int32)
        for i, windows in enumerate(self.sources):
            rows = np.nonzero(source == i)[0]
            if len(rows):
                out[torch.from_numpy(rows)] = windows.gather(local[rows].tolist())
        return out

    def tokens_by_source(self, position: int) -> dict[str, int]:
        """Label tokens (S per window) each set contributed to the global positions [0, position)."""
        return {name: count * self.seq_len for name, count in zip(self.names, self.schedule.count_before(position))}


def _metric_names(paths: list[str]) -> list[str]:
    """Short names of the mixture's sets for metric keys: the folder names (made unique)."""
    names = []
    for i, path in enumerate(paths):
        name = re.sub(r"[^A-Za-z0-9_]+", "_", path.rstrip("/").rsplit("/", 1)[-1]) or f"set{i}"
        names.append(name if name not in names else f"{name}_{i}")
    return names


def build_mixture(entries: list[str], tokenizer, *, seq_len: int, shuffle: bool, seed: int,
                  infinite: bool) -> MixtureWindows:
    """The ``data.mixture`` sets (``["path:weight", ...]``, each a prepared folder) and their schedule.

    Raises:
        PreparedDataError, ValueError: a bad entry, a folder that is not a prepared set, or as
            ``PreparedWindows``.
    """
    parsed = parse_mixture(entries)
    identity = tokenizer_identity(tokenizer)
    sources = []
    for i, (path, _) in enumerate(parsed):
        if not is_prepared(path):
            raise PreparedDataError(f"data.mixture entry {path!r} is not a prepared folder (no manifest.json); "
                                    "prepare it with scripts/prepare_data.py")
        sources.append(PreparedWindows(path, tokenizer, seq_len=seq_len, shuffle=shuffle, seed=seed,
                                       infinite=infinite, stream=i, setting="data.mixture", identity=identity))
    mixture = MixtureWindows(sources, [w for _, w in parsed], _metric_names([p for p, _ in parsed]))
    for (path, weight), name, count, source in zip(parsed, mixture.names, mixture.schedule.counts, sources):
        logger.info("data.mixture: %s (%s) weight %g -> %d of every %d windows; %d tokens, %d windows per epoch",
                    path, name, weight, count, mixture.schedule.block, source.num_tokens, source.windows_per_epoch)
    return mixture
