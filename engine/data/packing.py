"""Packing documents into fixed-length training windows, addressed by global window position.

Documents become [BOS] + tokens + [EOS] and are concatenated into one token stream; a tokenizer
whose BOS is its EOS (one separator, like GPT-2's <|endoftext|>) gives [BOS] + tokens, so every
document boundary holds one separator either way. Window w is
stream[w*S : w*S + S + 1] (S = seq_len): consecutive windows overlap by one token so that every
token but the very first is a label once; n = (len(stream) - 1) // S windows per epoch (the ragged
tail is dropped). The data is an infinite sequence of global positions p = 0, 1, 2, ...;
p lies in epoch p // n and maps to window order_epoch[p % n]. Packing without cross-document
masking follows GPT-2/GPT-3 practice (Brown et al. 2020, arXiv:2005.14165, section 2.3).

Window sources implement the same small interface (`ensure`, `gather`, `epoch_of`): `MapWindows`
here holds the whole stream (int32) and can shuffle per epoch; engine/data/streaming.py's
`StreamWindows` tokenizes a streaming dataset on the fly, strictly in order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence

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
