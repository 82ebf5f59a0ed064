"""Stateful, data-parallel-sharded loaders of packed token windows (training and validation).

Layout-independent batching: optimizer step k consumes the global window positions
[k*G, (k+1)*G) (G = training.global_batch_size) of the position sequence described in
engine/data/packing.py. dp rank r owns the contiguous slice [k*G + r*L*A, k*G + (r+1)*L*A) and
yields it as A = G / (L*dp) microbatches of L = training.local_batch_size windows. The windows a
step trains on therefore do not depend on dp, L or A, and the loader state is one global position
plus a microbatch index.

Sources (chosen from the config by engine/data/builders.py, `build_dataloader`): raw files or a hub
dataset, tokenized at start-up (engine/data/packing.py); a prepared folder, memory-mapped
(engine/data/prepared_windows.py); or a weighted mixture of prepared folders (`data.mixture`). Prepared
sources are read ahead by a background thread (``read_ahead`` microbatches), so a step does not wait for
the disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from engine.data.batch_sizes import resolve_batch_sizes
from engine.data.order import sequence_permutation
from engine.data.packing import MapWindows
from engine.data.prepared_windows import RAW_DATA, describe_data
from engine.data.readahead import ReadAhead
from engine.data.streaming import StreamWindows

logger = logging.getLogger("quadra.data")

_STATE_KEYS = ("position", "microbatch", "global_batch_size", "local_batch_size", "dp_degree",
               "seq_len", "windows_per_epoch", "shuffle", "seed", "streaming")


def _split(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_len + 1`` token windows [N, S + 1] -> (inputs, labels), both int64 [N, S], labels shifted by one."""
    windows = windows.long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class PackedDataLoader:
    """Training batches for one dp rank; resumable, and independent of the dp layout.

    Use `next_batch()` `grad_accum_steps` times per optimizer step (or iterate the loader).

    `state_dict()` stores the global position of the next step's first window and the index of
    the next microbatch within that step, not anything per rank. Loading it continues at exactly
    the next window. A state saved at a step boundary (microbatch 0) may be loaded under another
    dp degree, local or global batch size: no window is repeated or skipped. A state saved in the
    middle of a step needs the same layout (else ValueError). With streaming data the state also
    notes where the position lies in the stream (``stream``, engine/data/streaming.py): a resume
    seeks there through the dataset's own state instead of re-tokenizing the stream up to it.

    A source with an ``identity`` (prepared sets and mixtures) adds it to the state as ``data``; a
    state without one was saved reading raw files or a hub dataset. A state of other data (another
    prepared set or mixture, or raw data into a prepared run and the other way) is refused: its
    positions address other windows, even of the same corpus, whose raw and prepared shuffles differ.

    Args:
        source: a `MapWindows`, `StreamWindows`, `PreparedWindows` or `MixtureWindows`.
        seq_len, local_batch_size, global_batch_size, dp_rank, dp_degree: see `build_dataloader`.
        seed, shuffle, streaming: recorded in the state so a mismatching resume is refused.
        read_ahead: microbatches a background thread gathers ahead (0: gather when asked); only for
            sources whose ``gather`` and ``ensure`` are pure functions of the position.
        sequence_order_seed: > 0 reorders every microbatch's sequences (``data.sequence_order_seed``).
    """

    def __init__(self, source, *, seq_len: int, local_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_degree: int, seed: int, shuffle: bool,
                 streaming: bool, read_ahead: int = 0, sequence_order_seed: int = 0):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp rank {dp_rank} is outside [0, dp degree {dp_degree})")
        self.source = source
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.global_batch_size, self.grad_accum_steps = resolve_batch_sizes(
            local_batch_size, global_batch_size, dp_degree)
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.shuffle = shuffle
        self.streaming = streaming
        self._position = 0  # global position of the next step's first window
        self._microbatch = 0  # next microbatch within that step, in [0, grad_accum_steps)
        self._logged_epoch = 0
        self.read_ahead = read_ahead
        self._reader: ReadAhead | None = None
        # data.sequence_order_seed: one fixed reordering of every microbatch's rows (engine/data/order.py)
        self._rows = sequence_permutation(local_batch_size, sequence_order_seed) if sequence_order_seed > 0 else None

    @property
    def epoch(self) -> int:
        """Epoch (0-based) of the next step's first window."""
        return self.source.epoch_of(self._position)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next microbatch of this rank: (inputs, labels), both int64 [L, seq_len].

        labels[i, t] == inputs[i, t + 1] within the window (labels are the inputs shifted by one).

        Raises:
            StopIteration: the loader is not infinite and the next full step is past the data.
        """
        L, A = self.local_batch_size, self.grad_accum_steps
        step_end = self._position + self.global_batch_size - 1
        if self._microbatch == 0 and not self.source.infinite and not self.source.ensure(step_end):
            raise StopIteration  # drop the partial last step so every rank stops together
        if self._microbatch == 0 and isinstance(self.source, StreamWindows):
            self.source.release_before(self._position)  # what a resume from this step needs
        start = self._position + self.dp_rank * L * A + self._microbatch * L
        windows = self._fetch(start)
        epoch = self.source.epoch_of(start + L - 1)
        if epoch > self._logged_epoch:
            logger.info("data epoch %d begins at window position %d (%s windows per epoch)",
                        epoch, start, self.source.windows_per_epoch)
            self._logged_epoch = epoch
        self._microbatch += 1
        if self._microbatch == A:
            self._microbatch = 0
            self._position += self.global_batch_size
        return _split(windows if self._rows is None else windows[self._rows])

    def _gather(self, start: int) -> torch.Tensor:
        return self.source.gather(range(start, start + self.local_batch_size))

    def _starts(self) -> Iterator[int]:
        """First window positions of this rank's microbatches from the current state on, up to the
        last full step (the rule of `next_batch`)."""
        L, A = self.local_batch_size, self.grad_accum_steps
        position, microbatch = self._position, self._microbatch
        while True:
            step_end = position + self.global_batch_size - 1  # the step's last sample
            if microbatch == 0 and not self.source.infinite and not self.source.ensure(step_end):
                return
            yield position + self.dp_rank * L * A + microbatch * L
            microbatch += 1
            if microbatch == A:
                microbatch, position = 0, position + self.global_batch_size

    def _fetch(self, start: int) -> torch.Tensor:
        """The windows [start, start + L), from the read-ahead thread when there is one."""
        if not self.read_ahead:
            return self._gather(start)
        if self._reader is None:
            self._reader = ReadAhead(self._gather, self._starts(), self.read_ahead)
        windows = self._reader.get(start)
        if windows is None:  # the thread read other positions: read here, restart after this one
            self.close()
            windows = self._gather(start)
        return windows

    def close(self) -> None:
        """Stop the read-ahead thread (a later `next_batch` starts it again)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def log_metrics(self) -> dict[str, int]:
        """Per-source counters for metrics.jsonl: ``data_tokens_<set>`` = label tokens each set of a
        mixture gave the steps so far (the same on every rank); empty for a single source."""
        by_source = getattr(self.source, "tokens_by_source", None)
        if by_source is None:
            return {}
        return {f"data_tokens_{name}": tokens for name, tokens in by_source(self._position).items()}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            try:
                batch = self.next_batch()
            except StopIteration:
                return
            yield batch

    def state_dict(self) -> dict:
        """Plain ints/bools (torch.save and DCP friendly); the same on every dp rank."""
        n = self.source.windows_per_epoch
        identity = getattr(self.source, "identity", None)
        return {
            **({"data": identity} if identity else {}),
            "position": self._position,
            "microbatch": self._microbatch,
            "global_batch_size": self.global_batch_size,
            "local_batch_size": self.local_batch_size,
            "dp_degree": self.dp_degree,
            "seq_len": self.seq_len,
            "windows_per_epoch": n if n else -1,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "streaming": self.streaming,
            **({"stream": self.source.stream_state(self._position)} if isinstance(self.source, StreamWindows) else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved loader stopped (see the class docstring for layout changes).

        Raises:
            ValueError: missing keys, or a state from different data, seq_len, shuffle or seed,
                or a mid-step state loaded under another batch layout.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"data loader state lacks {missing}; it was not made by PackedDataLoader")
        mine = self.state_dict()
        if state.get("data", RAW_DATA) != mine.get("data", RAW_DATA):
            raise ValueError(
                f"data loader state was saved reading {describe_data(state.get('data', RAW_DATA))} but this run reads "
                f"{describe_data(mine.get('data', RAW_DATA))} (data.path / data.mixture changed): the saved positions "
                "address other windows; to continue that order, resume with the data.path or data.mixture of the "
                "checkpoint's config (quadra.json)")
        checks = ["seq_len", "streaming", "shuffle"] + (["seed"] if self.shuffle else [])
        if mine["windows_per_epoch"] > 0 and state["windows_per_epoch"] > 0:
            checks.append("windows_per_epoch")
        for key in checks:
            if state[key] != mine[key]:
                raise ValueError(
                    f"data loader state has {key}={state[key]!r} but this run has {mine[key]!r}: the "
                    "saved positions would address other windows; resume with the same data, "
                    "tokenizer, training.seq_len, data.shuffle and training.seed"
                )
        layout = ("global_batch_size", "local_batch_size", "dp_degree")
        if state["microbatch"] and any(state[k] != mine[k] for k in layout):
            raise ValueError(
                f"data loader state was saved in the middle of a step (microbatch "
                f"{state['microbatch']}) with {[(k, state[k]) for k in layout]}; resuming mid-step "
                "needs the same training.global_batch_size, training.local_batch_size and dp "
                "degree (save at a step boundary to change them)"
            )
        if not 0 <= state["microbatch"] < self.grad_accum_steps or state["position"] < 0:
            raise ValueError(f"data loader state is corrupt: {state}")
        if isinstance(self.source, StreamWindows):  # seeks with the state's stream note, else re-reads the epoch
            self.source.resume(int(state["position"]), state.get("stream") or "",
                               state["windows_per_epoch"] if state["windows_per_epoch"] > 0 else None)
        self.close()  # read-ahead of the old position
        self._position = int(state["position"])
        self._microbatch = int(state["microbatch"])
        self._logged_epoch = self.epoch


class ValidationDataLoader:
    """Validation microbatches for one dp rank; every iteration starts at the split's beginning.

    Batch k gives rank r the windows [k*L*dp + r*L, k*L*dp + (r+1)*L) in stream order (no
    shuffle, no wrap-around). Iteration stops after `steps` batches (-1: no limit) or when the
    next full batch over all ranks is past the end, so every rank yields the same number of
    batches and collectives stay matched (the ragged tail is dropped).
    """

    def __init__(self, make_source: Callable[[], MapWindows | StreamWindows], *, local_batch_size: int,
                 dp_rank: int, dp_degree: int, steps: int, streaming: bool):
        self._make_source = make_source
        self.streaming = streaming
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.steps = steps

    @property
    def num_batches(self) -> int | None:
        """Batches per iteration; None for streaming data (unknown until read)."""
        if self.streaming:
            return None
        source = self._make_source()
        n = source.windows_per_epoch // (self.local_batch_size * self.dp_degree)
        return n if self.steps < 0 else min(n, self.steps)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        source = self._make_source()
        L, per_batch = self.local_batch_size, self.local_batch_size * self.dp_degree
        k = 0
        while self.steps < 0 or k < self.steps:
            if not source.ensure((k + 1) * per_batch - 1):
                return
            start = k * per_batch + self.dp_rank * L
            yield _split(source.gather(range(start, start + L)))
            k += 1
