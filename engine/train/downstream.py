"""In-loop downstream evaluation (``[eval]``): multiple-choice tasks scored by log-likelihood, as
lm-evaluation-harness scores them (Gao et al., "A framework for few-shot language model evaluation",
github.com/EleutherAI/lm-evaluation-harness; tokenization and metrics: engine/data/eval_tasks.py).

Every (example, choice) pair is one row: its context and continuation, left-truncated to
``training.seq_len`` tokens, right-padded to the longest row of the run's tasks (rounded up to a
multiple of tp, which sequence parallelism splits evenly; under pipeline and context parallelism
``seq_len`` itself, the shape the stages were set up with for validation and the one context
parallelism's positions were planned for); only the
continuation's tokens carry labels, so a row's cross-entropy sum is minus the continuation's
log-likelihood (padding after it is never attended to by it: causal attention). The rows are cut into contiguous
blocks, one per data-parallel rank, and each rank runs its block in batches of
``training.local_batch_size`` rows (padding rows without labels make the blocks equal, so every rank
runs the same forwards, as FSDP's collectives need) through the runner's forward-only path
(engine/train/runner.py ``evaluate_rows``): the pipeline schedule's ``eval`` under pp, the
vocabulary-sharded cross entropy under tp, context-parallel sharding and ring attention under cp.
Each rank writes its rows' sums into a vector of all rows, zeros elsewhere; one all-reduce over
dp × cp (the rows of other dp ranks, the other cp ranks' tokens of a row) and over pp (the last stage
holds the values) gives every rank every log-likelihood.
"""

from __future__ import annotations

import math

import torch

from engine.data.eval_tasks import Task, encode_pair, parse_task_specs, read_task, score, window
from engine.train.loss import IGNORE_INDEX


class DownstreamEvaluation:
    """The ``[eval]`` tasks of a run, tokenized once.

    Args:
        cfg: the ``[eval]`` section (``tasks``, ``freq``, ``limit``).
        tokenizer: engine/data/tokenizer.py's ``Tokenizer``.
        seq_len: the longest row (``training.seq_len``); rows_per_batch: ``training.local_batch_size``.
        row_multiple: rows are padded to a multiple of this (tp); fixed_length: pad every row to
            ``seq_len`` (pipeline and context parallelism).
        dp_rank, dp_degree: this rank's data-parallel coordinate.
        runner: the run's runner (``context.shard``, ``evaluate_rows``); reduce: sums a tensor over
            dp × cp and the pipeline stages, in place.

    Raises:
        FileNotFoundError, ValueError: a missing or malformed task file, a continuation that does not
        fit a window (one line naming the task).
    """

    def __init__(self, cfg, tokenizer, *, seq_len: int, rows_per_batch: int, dp_rank: int, dp_degree: int,
                 runner, reduce, row_multiple: int = 1, fixed_length: bool = False):
        self.freq, self.seq_len, self.rows_per_batch = cfg.freq, seq_len, rows_per_batch
        self.runner, self.reduce = runner, reduce
        self.tasks: list[Task] = [read_task(name, path, cfg.limit) for name, path in parse_task_specs(cfg.tasks)]
        self.rows: list[tuple[list[int], int]] = []  # (window tokens, continuation tokens) per choice
        for task in self.tasks:
            for example in task.examples:
                for choice in example.choices:
                    context, continuation = encode_pair(tokenizer, example.context, example.delimiter + choice)
                    try:
                        self.rows.append(window(context, continuation, seq_len))
                    except ValueError as error:
                        raise ValueError(f"eval task {task.name!r}: {error}") from None
        longest = max(len(tokens) - 1 for tokens, _ in self.rows)
        self.row_len = seq_len if fixed_length else min(seq_len, math.ceil(longest / row_multiple) * row_multiple)
        per_rank = math.ceil(len(self.rows) / (dp_degree * rows_per_batch)) * rows_per_batch
        self.total_rows = per_rank * dp_degree
        self.first_row, self.last_row = dp_rank * per_rank, (dp_rank + 1) * per_rank

    def due(self, step: int, last: int) -> bool:
        """Every ``eval.freq`` steps and at the run's last step."""
        return step % self.freq == 0 or step == last

    def _batch(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """LongTensor [rows_per_batch, row_len] inputs and labels of rows start.. (padding rows beyond
        the last: no labels)."""
        inputs = torch.zeros(self.rows_per_batch, self.row_len, dtype=torch.long)
        labels = torch.full_like(inputs, IGNORE_INDEX)
        for i, row in enumerate(range(start, min(start + self.rows_per_batch, len(self.rows)))):
            tokens, scored = self.rows[row]
            n = len(tokens) - 1
            inputs[i, :n] = torch.tensor(tokens[:-1])
            labels[i, n - scored:n] = torch.tensor(tokens[-scored:])
        return inputs, labels

    @torch.no_grad()
    def loglikelihoods(self, model_parts, device) -> list[float]:
        """Every row's continuation log-likelihood (nats), on every rank."""
        for part in model_parts:
            part.eval()
        sums = torch.zeros(self.total_rows, dtype=torch.float64, device=device)
        for start in range(self.first_row, self.last_row, self.rows_per_batch):
            inputs, labels = self._batch(start)
            inputs, labels, _ = self.runner.context.shard(inputs, labels)  # (training objectives' window: unused)
            rows = self.runner.evaluate_rows(inputs, labels)
            sums[start:start + self.rows_per_batch] = rows.to(device)
        for part in model_parts:
            part.train()
        self.reduce(sums)
        return (-sums[:len(self.rows)]).tolist()

    def evaluate(self, model_parts, device) -> tuple[dict[str, dict[str, float]], dict[str, list[list[float]]]]:
        """({task: {"acc", "acc_norm", "examples"}}, {task: per example, each choice's log-likelihood})."""
        flat = iter(self.loglikelihoods(model_parts, device))
        results, per_example = {}, {}
        for task in self.tasks:
            lls = [[next(flat) for _ in example.choices] for example in task.examples]
            scores = [score(example, ll) for example, ll in zip(task.examples, lls)]
            results[task.name] = {metric: sum(s[metric] for s in scores) / len(scores)
                                  for metric in ("acc", "acc_norm")}
            results[task.name]["examples"] = float(len(scores))
            per_example[task.name] = lls
        return results, per_example
