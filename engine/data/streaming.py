"""Windows of a streaming dataset, tokenized on the fly in order, and a resume that seeks.

``StreamWindows`` reads a ``datasets.IterableDataset`` (``data.streaming = true``) in batches of
``STREAM_BATCH_DOCS`` documents, packs them as engine/data/packing.py does ([BOS] + tokens + [EOS]
per document, one stream) and cuts window w = stream[w*S : w*S + S + 1] of each epoch, strictly in
order. Every rank reads the whole stream and keeps its own windows.

Resume. Before each batch it notes where the batch's tokens start in the epoch's stream and the
dataset's own iteration state at that point (``IterableDataset.state_dict()``, datasets >= 2.18:
shard and example index, which ``load_state_dict`` continues from at example granularity). The
loader state of window position p (engine/data/loader.py) stores the note of the batch holding
token p*S and how many of its tokens come before p*S (``stream_state``). A resume loads that
dataset state, tokenizes from that batch on and drops those tokens, so the windows are bitwise
those of the uninterrupted run, also when p*S falls inside a document. Its cost: ``datasets``
re-reads (and for the hub re-downloads) the current data file up to the saved example without
tokenizing it, plus one batch of tokenizing; no longer everything before p. A state without the
note (saved before this, or by a datasets without ``state_dict``) re-reads the epoch up to p, as
before.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from engine.data.packing import pack_documents
from engine.data.sources import check_texts
from engine.data.tokenizer import Tokenizer

STREAM_BATCH_DOCS = 256  # documents tokenized at a time (and the granularity of a resume's seek)


class _Mark(NamedTuple):
    epoch: int
    token: int  # where the batch's tokens start in the epoch's packed stream
    state: dict | None  # the dataset's iteration state before the batch (None: the epoch's start)


def iter_stream_batches(ds, text_column: str, state: dict | None = None,
                        column_setting: str = "data.text_column") -> Iterator[tuple[list[str], dict | None]]:
    """(texts, the dataset's iteration state after them) per batch of ``STREAM_BATCH_DOCS`` documents,
    from the beginning or from ``state`` (a state this function yielded). The state is None where
    ``datasets`` has no ``IterableDataset.state_dict``.

    Raises:
        ValueError: a row whose text is not a string.
    """
    selected = ds.select_columns([text_column])  # a new object: its state is this iteration's alone
    stateful = hasattr(selected, "state_dict")
    if state is not None:
        selected.load_state_dict(state)
    row = 0
    for batch in selected.iter(batch_size=STREAM_BATCH_DOCS):
        texts = batch[text_column]
        check_texts(texts, row, text_column, column_setting)
        row += len(texts)
        yield list(texts), (copy.deepcopy(selected.state_dict()) if stateful else None)


class StreamWindows:
    """Sequential access to the windows of a streaming dataset (read and tokenized on the fly).

    Positions must be requested in non-decreasing order; windows before the requested ones are
    read and dropped, so reaching position p from the start costs tokenizing everything up to p in
    the current epoch (after one full pass the epoch length is known and whole epochs are skipped
    unread); ``resume`` starts near p instead (module docstring). At most the windows between the
    oldest requested position and the newest are buffered.

    Args:
        open_batches: ``state -> iterator of (texts, state after them)`` over one epoch, from its
            beginning (state None) or from a state it gave (``iter_stream_batches``).
        tokenizer, seq_len, infinite, where: as engine/data/packing.py's ``MapWindows``.
    """

    def __init__(self, open_batches: Callable[[dict | None], Iterator[tuple[list[str], dict | None]]],
                 tokenizer: Tokenizer, seq_len: int, *, infinite: bool, where: str):
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
        self._marks: deque[_Mark] = deque()
        self._windows: Iterator[torch.Tensor] | None = None
        self._next_position = 0  # position of the next window read from the stream
        self._epoch = 0
        self._in_epoch = 0  # windows of the current epoch before the next one read

    def epoch_of(self, position: int) -> int:
        """Epoch of `position`; before the epoch length is known, the epoch being read (0)."""
        if self.windows_per_epoch:
            return position // self.windows_per_epoch
        return self._epoch

    def _locate(self, position: int) -> tuple[int, int]:
        """(epoch, token where window ``position`` starts in that epoch's stream)."""
        epoch = self.epoch_of(position)
        return epoch, (position - epoch * (self.windows_per_epoch or 0)) * self.seq_len

    def _start_epoch(self, epoch: int, at: int = 0, mark: _Mark | None = None, skip: int = 0) -> None:
        """Read epoch ``epoch`` from its window ``at``: from the beginning, or from ``mark`` dropping
        ``skip`` tokens (mark.token + skip == at * S)."""
        self._epoch, self._in_epoch = epoch, at
        self._next_position = epoch * (self.windows_per_epoch or 0) + at
        mark = mark or _Mark(epoch, 0, None)
        self._windows = self._cut(self._open(mark.state), mark, skip)

    def _cut(self, batches, mark: _Mark, skip: int) -> Iterator[torch.Tensor]:
        """The windows of ``batches`` (which start at ``mark``), ``skip`` tokens in; notes a mark per batch."""
        carry, carry_start, before = torch.empty(0, dtype=torch.int32), mark.token, mark.state
        for texts, after in batches:
            self._marks.append(_Mark(mark.epoch, carry_start + len(carry), before))
            before = after
            tokens, start = torch.cat([carry, pack_documents([texts], self._tokenizer)]), carry_start
            if skip:
                dropped = min(skip, len(tokens))
                tokens, start, skip = tokens[dropped:], start + dropped, skip - dropped
            n = (len(tokens) - 1) // self.seq_len if len(tokens) > 0 else 0
            for i in range(n):
                yield tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
            # The next window starts at n*S: keep that tail (it holds fewer than S + 1 tokens).
            carry, carry_start = tokens[n * self.seq_len:], start + n * self.seq_len

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

    def release_before(self, position: int) -> None:
        """Forget the marks no resume at ``position`` or later needs (the loader calls this per step)."""
        target = self._locate(position)
        while len(self._marks) > 1 and (self._marks[1].epoch, self._marks[1].token) <= target:
            self._marks.popleft()

    def stream_state(self, position: int) -> str:
        """JSON of where window ``position`` starts (the mark of its batch and the tokens before it
        there), read ahead to it if needed; "" when unknown (past a finite end, or a datasets
        without ``state_dict`` and the position not in an epoch's first batch)."""
        if not self.ensure(position):
            return ""
        epoch, token = self._locate(position)
        best = None
        for mark in self._marks:
            if (mark.epoch, mark.token) > (epoch, token):
                break
            best = mark
        if best is None or best.epoch != epoch or (best.state is None and best.token != 0):
            return ""
        try:
            return json.dumps({"position": position, "epoch": epoch, "token": best.token,
                               "skip": token - best.token, "dataset": best.state})
        except TypeError:  # a dataset state that is not plain data: resume by re-reading
            return ""

    def resume(self, position: int, stream: str, windows_per_epoch: int | None) -> bool:
        """Continue at global window ``position`` from ``stream_state(position)``'s note; without a
        usable note, read the epoch again from its beginning up to it. Returns whether it seeks."""
        self.rewind(windows_per_epoch)
        try:
            saved = json.loads(stream) if stream else None
        except ValueError:
            saved = None
        if not saved or saved.get("position") != position:
            return False
        epoch, token = saved["epoch"], saved["token"]
        if epoch > 0 and not self.windows_per_epoch:
            return False
        self._epoch = epoch
        at = position - epoch * (self.windows_per_epoch or 0)
        if token + saved["skip"] != at * self.seq_len or saved["skip"] < 0:
            return False
        self._start_epoch(epoch, at, _Mark(epoch, token, saved["dataset"]), saved["skip"])
        return True
