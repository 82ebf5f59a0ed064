"""engine/train/downstream.py's rules without a model (its module docstring): one row per (example,
choice), the row length (the longest row rounded up to tp, or seq_len under pp / cp), contiguous blocks
of rows per data-parallel rank padded to whole batches, inputs and labels of each row (labels on the
continuation only), minus the rows' sums as log-likelihoods, the schedule. The runner is a stub whose
"cross-entropy" of a row is a known function of its labelled (input, label) pairs, so the oracle is a
hand count over each row's tokens; tests/integration/test_downstream.py checks a real model under every layout."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.data.eval_tasks import write_task
from engine.train.downstream import DownstreamEvaluation
from engine.train.loss import IGNORE_INDEX

BOS = 1
EXAMPLES = [  # one token per character (the stub tokenizer below)
    {"context": "abcdefghij", "choices": ["kl", "xyz", "q"], "gold": 1},
    {"context": "hello", "choices": ["world", "there"], "gold": 0},
    {"context": "", "choices": ["abc", "zz"], "gold": 1},
]
OTHER = [{"context": "to be or not", "choices": ["to be", "x"], "gold": 0, "target_delimiter": ""}]


class CharTokenizer:
    bos_id, eos_id = BOS, 2

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return [ord(c) for c in text]


def _nll(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The stub's "cross-entropy sum" of each row: Σ over labelled positions of label + inputs / 1000."""
    mask = labels != IGNORE_INDEX
    return ((labels.double() + inputs.double() / 1000) * mask).sum(dim=1)


class Runner:
    """The stub runner: records each batch's shape and the model's mode, scores with :func:`_nll`."""

    def __init__(self, model):
        self.model, self.shapes = model, []
        self.context = SimpleNamespace(shard=lambda inputs, labels: (inputs, labels, None))

    def evaluate_rows(self, inputs, labels):
        assert not self.model.training  # evaluated in eval mode
        assert inputs.dtype == labels.dtype == torch.long  # token ids (_batch's docstring: LongTensor)
        self.shapes.append(tuple(inputs.shape))
        return _nll(inputs, labels)


def _expected(examples: list[dict], seq_len: int) -> list[float]:
    """Hand count: row = [BOS] + context + delimiter + choice, its last seq_len + 1 tokens; the
    continuation's k-th token from the end is predicted from the token before it."""
    lls = []
    for ex in examples:
        for choice in ex["choices"]:
            continuation = ex.get("target_delimiter", " ") + choice
            whole = ([BOS] + [ord(c) for c in ex["context"] + continuation])[-(seq_len + 1):]
            lls.append(-sum(whole[-k] + whole[-k - 1] / 1000 for k in range(1, len(continuation) + 1)))
    return lls


def _evaluation(tmp_path, *, seq_len=16, rows_per_batch=3, dp_rank=0, dp_degree=1, row_multiple=1,
                fixed_length=False, freq=5, limit=-1, tasks=None):
    tasks = tasks or [write_task(str(tmp_path / "a.jsonl"), EXAMPLES), "b=" + write_task(str(tmp_path / "o.jsonl"), OTHER)]
    model = torch.nn.Linear(1, 1)
    runner, reduced = Runner(model), []
    cfg = SimpleNamespace(tasks=tasks, freq=freq, limit=limit)
    evaluation = DownstreamEvaluation(cfg, CharTokenizer(), seq_len=seq_len, rows_per_batch=rows_per_batch,
                                      dp_rank=dp_rank, dp_degree=dp_degree, runner=runner,
                                      reduce=lambda sums: reduced.append(sums.clone()),
                                      row_multiple=row_multiple, fixed_length=fixed_length)
    return evaluation, model, runner, reduced


def test_each_choice_scores_its_continuation_only(tmp_path):
    """One process: every (example, choice) in file order, its log-likelihood the hand count (the
    window cut to seq_len + 1 = 9 tokens for the long contexts); the model is back in training mode."""
    evaluation, model, runner, reduced = _evaluation(tmp_path, seq_len=8)
    want = _expected(EXAMPLES, 8) + _expected(OTHER, 8)
    got = evaluation.loglikelihoods([model], torch.device("cpu"))
    assert got == pytest.approx(want, rel=1e-12, abs=0) and len(got) == 9
    assert model.training and len(reduced) == 1
    assert reduced[0].dtype == torch.float64 and reduced[0].shape == (9,)  # 3 batches of 3 rows


def test_inputs_are_the_rows_tokens_and_labels_the_continuations_next_tokens(tmp_path):
    evaluation, *_ = _evaluation(tmp_path, seq_len=8, rows_per_batch=4)
    inputs, labels = evaluation._batch(0)
    row = [BOS] + [ord(c) for c in "abcdefghij xyz"]
    first = [BOS] + [ord(c) for c in "abcdefghij kl"]
    assert evaluation.row_len == 8
    assert inputs[0].tolist() == first[-9:-1] and inputs[1].tolist() == row[-9:-1]
    assert labels[0].tolist() == [IGNORE_INDEX] * 5 + first[-3:]  # " kl": 3 continuation tokens
    short = [BOS] + [ord(c) for c in "hello world"]
    assert labels[3].tolist() == [IGNORE_INDEX] * 2 + short[-6:]  # " world" in a full window
    inputs, labels = evaluation._batch(8)  # the last row and 3 padding rows
    cont = [ord(c) for c in "x"]
    assert labels[0].tolist() == [IGNORE_INDEX] * 7 + cont
    assert (labels[1:] == IGNORE_INDEX).all() and (inputs[1:] == 0).all()


def test_a_short_row_is_padded_after_its_tokens(tmp_path):
    evaluation, *_ = _evaluation(tmp_path, seq_len=64, rows_per_batch=9)
    inputs, labels = evaluation._batch(0)
    row = [BOS] + [ord(c) for c in "hello there"]  # row 4: 12 tokens, 11 inputs
    assert inputs[4].tolist() == row[:-1] + [0] * (evaluation.row_len - 11)
    assert labels[4].tolist() == [IGNORE_INDEX] * 5 + row[6:] + [IGNORE_INDEX] * (evaluation.row_len - 11)


@pytest.mark.parametrize("row_multiple, fixed_length, row_len", [(1, False, 17), (3, False, 18), (5, False, 20),
                                                                 (16, False, 32), (64, False, 32), (1, True, 32)])
def test_the_row_length_is_the_longest_row_rounded_to_tp_or_seq_len(tmp_path, row_multiple, fixed_length, row_len):
    """The longest row, BOS + "to be or not" + "to be", has 17 inputs; rounded up to a multiple of
    row_multiple (tp), at most seq_len (32); fixed_length (pp, cp): seq_len. Every batch has that length."""
    evaluation, model, runner, _ = _evaluation(tmp_path, seq_len=32, row_multiple=row_multiple,
                                               fixed_length=fixed_length)
    assert evaluation.row_len == row_len
    evaluation.loglikelihoods([model], torch.device("cpu"))
    assert set(runner.shapes) == {(3, row_len)}


@pytest.mark.parametrize("dp_degree, rows_per_batch", [(2, 2), (3, 1), (2, 4), (4, 1)])
def test_data_parallel_ranks_run_contiguous_equal_blocks_whose_sum_is_every_row(tmp_path, dp_degree, rows_per_batch):
    """9 rows over dp ranks: each rank runs ceil(9 / (dp · batch)) whole batches of its contiguous
    block (the same count on every rank, for FSDP's collectives), writes its rows only; the sum over
    ranks (the all-reduce) is one process's vector, whose first 9 entries are the rows'."""
    single, model, _, one = _evaluation(tmp_path, rows_per_batch=rows_per_batch)
    single.loglikelihoods([model], torch.device("cpu"))
    per_rank = math.ceil(9 / (dp_degree * rows_per_batch)) * rows_per_batch
    total = torch.zeros(per_rank * dp_degree, dtype=torch.float64)
    batches = set()
    for rank in range(dp_degree):
        evaluation, model, runner, reduced = _evaluation(tmp_path, rows_per_batch=rows_per_batch, dp_rank=rank,
                                                         dp_degree=dp_degree)
        got = evaluation.loglikelihoods([model], torch.device("cpu"))
        assert len(got) == 9
        (local,) = reduced
        assert local.shape == (per_rank * dp_degree,)
        outside = torch.cat([local[:rank * per_rank], local[(rank + 1) * per_rank:]])
        assert (outside == 0).all() and (local[rank * per_rank:(rank + 1) * per_rank][:max(0, 9 - rank * per_rank)]
                                         != 0).all()
        batches.add(len(runner.shapes))
        total += local
    assert batches == {per_rank // rows_per_batch}
    assert total[:9].tolist() == pytest.approx([-x for x in _expected(EXAMPLES, 16) + _expected(OTHER, 16)], rel=1e-12)
    assert (total[9:] == 0).all()


def test_scores_per_task_are_the_hand_counted_accuracies(tmp_path):
    """acc: the choice of highest log-likelihood is gold; acc_norm: per character of the choice."""
    evaluation, model, *_ = _evaluation(tmp_path)
    results, lls = evaluation.evaluate([model], torch.device("cpu"))
    want = _expected(EXAMPLES, 16)
    assert lls["a"] == [pytest.approx(want[0:3]), pytest.approx(want[3:5]), pytest.approx(want[5:7])]
    acc, norm = [], []
    for i, ex in enumerate(EXAMPLES):
        ll = lls["a"][i]
        acc.append(float(max(range(len(ll)), key=lambda j: ll[j]) == ex["gold"]))
        per_char = [v / len(c) for v, c in zip(ll, ex["choices"])]
        norm.append(float(max(range(len(ll)), key=lambda j: per_char[j]) == ex["gold"]))
    assert results["a"] == {"acc": sum(acc) / 3, "acc_norm": sum(norm) / 3, "examples": 3.0}
    assert set(results) == {"a", "b"} and results["b"]["examples"] == 1.0


def test_due_every_freq_steps_and_at_the_last(tmp_path):
    evaluation, *_ = _evaluation(tmp_path, freq=5)
    assert [step for step in range(1, 13) if evaluation.due(step, last=12)] == [5, 10, 12]


def test_a_continuation_too_long_for_the_window_names_its_task(tmp_path):
    with pytest.raises(ValueError, match=r"^eval task 'a': a continuation of 6 tokens cannot be scored"):
        _evaluation(tmp_path, seq_len=6)
    evaluation, *_ = _evaluation(tmp_path, limit=1)
    assert [len(task.examples) for task in evaluation.tasks] == [1, 1] and len(evaluation.rows) == 5


def test_without_tp_pp_or_cp_rows_are_padded_to_the_longest_and_scored_where_asked(tmp_path):
    """The defaults (no row_multiple, no fixed_length): the longest row's 17 inputs, not seq_len; and
    evaluate() computes its log-likelihoods on the device it is given (the all-reduce's)."""
    cfg = SimpleNamespace(tasks=[write_task(str(tmp_path / "a.jsonl"), EXAMPLES), "b=" + write_task(
        str(tmp_path / "o.jsonl"), OTHER)], freq=5, limit=-1)
    evaluation = DownstreamEvaluation(cfg, CharTokenizer(), seq_len=32, rows_per_batch=3, dp_rank=0, dp_degree=1,
                                      runner=Runner(torch.nn.Linear(1, 1)), reduce=lambda sums: None)
    assert evaluation.row_len == 17
    seen, device = [], object()

    def loglikelihoods(model_parts, where):
        seen.append(where)
        return [-1.0] * 9

    evaluation.loglikelihoods = loglikelihoods
    evaluation.evaluate([], device)
    assert seen == [device]
