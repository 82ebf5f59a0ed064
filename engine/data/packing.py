"""Packing documents into fixed-length training windows, addressed by global window position.

Documents become [BOS] + tokens + [EOS] and are concatenated into one token stream; a tokenizer
whose BOS is its EOS (one separator, like GPT-2's <|endoftext|>) gives [BOS] + tokens, so every
document boundary holds one separator either way. Window w is
stream[w*S : w*S + S + 1] (S = seq_len): consecutive windows overlap by one token so that every
token but the very first is a label once; n = (len(stream) - 1) // S windows per epoch (the ragged
tail is dropped). The data is an infinite sequence of global positions p = 0, 1, 2, ...;
p lies in epoch p // n and maps to window order_epoch[p % n]. Packing without cross-document
masking follows GPT-2/GPT-3 practice (Brown et al. 2020, arXiv:2005.14165, section 2.3).

Two window sources implement the same small interface (`ensure`, `gather`, `epoch_of`):
`MapWindows` holds the whole stream (int32) and can shuffle per epoch; `StreamWindows` tokenizes a
streaming dataset on the fly, strictly in order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from engine.data.tokenizer import Tokenizer



def pack_documents(text_batches: Iterable[list[str]], tokenizer: Tokenizer) -> torch.Tensor:
    """One int32 token stream: [BOS] + tokens + [EOS] per document ([BOS] + tokens when BOS is EOS),
    in document order.

    Returns:
        int32 tensor [total tokens] (4 bytes per token).
    """
    parts = []
    eos = tokenizer.eos_id != tokenizer.bos_id
    for texts in text_batches:
        ids = tokenizer.encode_batch(texts, bos=True, eos=eos)
        parts.append(torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.int32))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)


def iter_stream_windows(
    text_batches: Iterable[list[str]], tokenizer: Tokenizer, seq_len: int
) -> Iterator[torch.Tensor]:
    """Windows (int32 [seq_len + 1]) of the packed stream, in order, tokenizing lazily.

    Yields exactly the windows `pack_documents` + cutting would give, without holding the stream.
    """
    carry = torch.empty(0, dtype=torch.int32)
    for texts in text_batches:
        tokens = torch.cat([carry, pack_documents([texts], tokenizer)])
        n = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
        for i in range(n):
            yield tokens[i * seq_len : i * seq_len + seq_len + 1]
        # The next window starts at n*S: keep that tail (it holds fewer than S + 1 tokens).
        carry = tokens[n * seq_len :]


def epoch_seed(seed: int, epoch: int) -> int:
    """32-bit generator seed of the window order of `epoch` (the same on every rank and layout).

    Hashed because torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so
    packing (seed, epoch) into one integer would make seeds that differ above bit 31 collide.
    """
    digest = hashlib.sha256(f"quadra-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _too_short(where: str, n_tokens: int, seq_len: int) -> ValueError:
    return ValueError(
        f"{where}: the packed token stream has {n_tokens} tokens (BOS/EOS included), fewer than "
        f"training.seq_len + 1 = {seq_len + 1}, so not one window fits; lower training.seq_len "
        "or add data"
    )


class MapWindows:
    """Random access to the windows of an in-memory token stream.

    Args:
        stream: int32 tensor [tokens], see `pack_documents`.
        seq_len: S, tokens per training sequence.
        shuffle: visit windows in a per-epoch permutation (torch.randperm seeded by seed, epoch).
        seed: shuffle seed (training.seed).
        infinite: positions past the first epoch wrap into later epochs; else they do not exist.
        where: e.g. "data.path='x.jsonl'", for error messages.

    Raises:
        ValueError: fewer than seq_len + 1 tokens.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, *, shuffle: bool, seed: int,
                 infinite: bool, where: str):
        self.stream = stream
        self.seq_len = seq_len
        self.shuffle = shuffle
        self.seed = seed
        self.infinite = infinite
        self.windows_per_epoch = (len(stream) - 1) // seq_len if len(stream) > 0 else 0
        if self.windows_per_epoch <= 0:
            raise _too_short(where, len(stream), seq_len)
        self._orders: dict[int, torch.Tensor] = {}
        self._offsets = torch.arange(seq_len + 1)

    def order(self, epoch: int) -> torch.Tensor:
        """Window indices (int64 [n]) in the order epoch `epoch` visits them."""
        if epoch not in self._orders:
            n = self.windows_per_epoch
            if self.shuffle:
                gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
                order = torch.randperm(n, generator=gen)
            else:
                order = torch.arange(n)
            if len(self._orders) >= 2:  # a microbatch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return self._orders[epoch]

    def epoch_of(self, position: int) -> int:
        return position // self.windows_per_epoch

    def ensure(self, position: int) -> bool:
        """Whether global window `position` exists (always, when infinite)."""
        return self.infinite or position < self.windows_per_epoch

    def gather(self, positions: Sequence[int]) -> torch.Tensor:
        """The windows at global `positions`: int32 [len(positions), seq_len + 1]."""
        n = self.windows_per_epoch
        idx = [int(self.order(p // n)[p % n]) for p in positions]
        starts = torch.tensor(idx, dtype=torch.int64) * self.seq_len
        return self.stream[starts[:, None] + self._offsets]


class StreamWindows:
    """Sequential access to the windows of a streaming dataset (read and tokenized on the fly).

    Positions must be requested in non-decreasing order; windows before the requested ones are
    read and dropped, so reaching position p costs tokenizing everything up to p in the current
    epoch (after one full pass the epoch length is known and whole epochs are skipped unread).
    At most the windows between the oldest requested position and the newest are buffered.

    Args:
        open_batches: returns a fresh iterator over document text batches (one epoch).
        tokenizer, seq_len, infinite, where: as for `MapWindows`.
    """

    def __init__(self, open_batches: Callable[[], Iterator[list[str]]], tokenizer: Tokenizer,
                 seq_len: int, *, infinite: bool, where: str):
        self._open = open_batches
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._where = where
        self.windows_per_epoch: int | None = None  # known after one full pass
        self.rewind()

    def rewind(self, windows_per_epoch: int | None = None) -> None:
        """Restart reading at position 0 (e.g. before loading a data state)."""
        if windows_per_epoch is not None and windows_per_epoch > 0:
            self.windows_per_epoch = windows_per_epoch
        self._buffer: deque[tuple[int, torch.Tensor]] = deque()
        self._windows: Iterator[torch.Tensor] | None = None
        self._next_position = 0  # position of the next window read from the stream
        self._epoch = 0
        self._in_epoch = 0  # windows read so far in the current epoch

    def epoch_of(self, position: int) -> int:
        """Epoch of `position`; before the epoch length is known, the epoch being read (0)."""
        if self.windows_per_epoch:
            return position // self.windows_per_epoch
        return self._epoch

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._in_epoch = 0
        self._next_position = epoch * (self.windows_per_epoch or 0)
        self._windows = iter_stream_windows(self._open(), self._tokenizer, self.seq_len)

    def _read_one(self) -> bool:
        """Append the next window to the buffer; False at the end of the data (not infinite)."""
        while True:
            if self._windows is None:
                self._start_epoch(self._epoch)
            window = next(self._windows, None)
            if window is not None:
                self._buffer.append((self._next_position, window))
                self._next_position += 1
                self._in_epoch += 1
                return True
            if self._in_epoch == 0:
                raise ValueError(
                    f"{self._where}: the packed token stream holds fewer than training.seq_len + 1 "
                    f"= {self.seq_len + 1} tokens, so not one window fits; lower training.seq_len "
                    "or add data"
                )
            if self.windows_per_epoch not in (None, self._in_epoch):
                raise ValueError(
                    f"{self._where}: the streaming dataset changed length between epochs or since "
                    f"the saved data state ({self.windows_per_epoch} then {self._in_epoch} "
                    "windows); keep the data (and tokenizer) fixed during a run"
                )
            self.windows_per_epoch = self._in_epoch
            if not self.infinite:
                return False
            self._windows = None
            self._epoch += 1

    def ensure(self, position: int) -> bool:
        """Read ahead until global window `position` is buffered; False if the data ends first."""
        while self._next_position <= position:
            if not self._read_one():
                return False
        return True

    def gather(self, positions: Sequence[int]) -> torch.Tensor:
        """The windows at global `positions` (ascending): int32 [len(positions), seq_len + 1]."""
        first = positions[0]
        while self._buffer and self._buffer[0][0] < first:
            self._buffer.popleft()  # windows of other dp ranks, or already consumed
        n = self.windows_per_epoch
        if not self._buffer and n and first // n > self._epoch:
            # Skip whole epochs unread: their length is known (e.g. after a resume).
            self._start_epoch(first // n)
        oldest = self._buffer[0][0] if self._buffer else self._next_position
        if oldest > first:
            raise RuntimeError(f"StreamWindows: position {first} was already passed; call rewind() first")
        if not self.ensure(max(positions)):
            raise IndexError(f"{self._where}: window position {max(positions)} is past the end of the data")
        wanted = set(positions)
        by_position = {p: w for p, w in self._buffer if p in wanted}
        return torch.stack([by_position[p] for p in positions])
