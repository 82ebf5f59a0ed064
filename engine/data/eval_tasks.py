"""Downstream multiple-choice tasks on local files, tokenized and scored as lm-evaluation-harness does.

A task file is JSON lines, one example per line::

    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "gold": 0}

with an optional ``"target_delimiter"`` (default ``" "``, lm-evaluation-harness's). This is what an
lm-evaluation-harness ``output_type: multiple_choice`` task hands its model (its ``doc_to_text``,
``doc_to_choice`` and ``doc_to_target`` of each document); scripts/eval_task.py writes it from any
lm_eval task whose data is on disk. Each choice is scored as the log-likelihood of the continuation
``target_delimiter + choice`` given the context (``lm_eval.api.task.ConfigurableTask``):

- ``acc``: the gold choice has the highest log-likelihood;
- ``acc_norm``: the gold choice has the highest log-likelihood per *character* of the choice
  (``len(choice)``, without the delimiter: lm_eval's ``completion_len``), not per token.

Tokenization is lm_eval's for a causal model (``TemplateLM._encode_pair``): trailing spaces of the
context move to the continuation, context + continuation are encoded *together* and split after as
many tokens as the context alone encodes to, so a token that straddles the boundary belongs to the
continuation. Both are prefixed with the tokenizer's BOS (EOS when it has none), as Quadra's packed
documents start, and as Hugging Face Llama tokenizers do under lm_eval (for an empty context
lm_eval's ``prefix_token_id``). A window longer than ``seq_len + 1`` tokens loses tokens on the left
(lm_eval's ``[-(max_length + 1):]``). Only the continuation's tokens are scored.

Torch-free: the pre-flight reads the task files before any rank starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

DEFAULT_DELIMITER = " "


@dataclass(frozen=True)
class Example:
    """One multiple-choice question: ``context``, its ``choices``, the index ``gold`` of the right one,
    and the ``delimiter`` put between the context and each choice."""

    context: str
    choices: tuple[str, ...]
    gold: int
    delimiter: str = DEFAULT_DELIMITER


@dataclass(frozen=True)
class Task:
    """A task file: its ``name`` (in metric keys), ``path`` and ``examples``."""

    name: str
    path: str
    examples: tuple[Example, ...]


def parse_task_specs(specs: list[str]) -> list[tuple[str, str]]:
    """``eval.tasks`` entries ("path" or "name=path") -> [(name, path)]; the name defaults to the
    file's stem. Raises ValueError (one line) for an empty or repeated name."""
    named = []
    for spec in specs:
        name, path = spec.split("=", 1) if "=" in spec else (os.path.splitext(os.path.basename(spec))[0], spec)
        if not name or not path:
            raise ValueError(f"eval.tasks entry {spec!r} is not \"path\" or \"name=path\"")
        if name in [n for n, _ in named]:
            raise ValueError(f"eval.tasks names task {name!r} twice; give one of them another name (\"name=path\")")
        named.append((name, path))
    return named


def _example(record, where: str) -> Example:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with context, choices and gold")
    context, choices, gold = record.get("context"), record.get("choices"), record.get("gold")
    delimiter = record.get("target_delimiter", DEFAULT_DELIMITER)
    if not isinstance(context, str) or not isinstance(delimiter, str):
        raise ValueError(f"{where}: \"context\" (and \"target_delimiter\", if given) must be strings")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{where}: \"choices\" must be a list of at least 2 non-empty strings")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ValueError(f"{where}: \"gold\" must be the index of the right choice "
                         f"(0..{len(choices) - 1}), got {gold!r}")
    return Example(context, tuple(choices), gold, delimiter)


def read_task(name: str, path: str, limit: int = -1) -> Task:
    """The first ``limit`` (-1: all) examples of the task file ``path``.

    Raises:
        FileNotFoundError: no such file; ValueError: a line that is not an example (names file and
        line) or a file without examples.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"eval.tasks: task file {path!r} does not exist (scripts/eval_task.py writes one)")
    examples = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if limit >= 0 and len(examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"eval.tasks: {path}:{number} is not JSON ({error.msg})") from None
            examples.append(_example(record, f"eval.tasks: {path}:{number}"))
    if not examples:
        raise ValueError(f"eval.tasks: task file {path!r} holds no example")
    return Task(name, path, tuple(examples))


def write_task(path: str, examples: list[dict]) -> str:
    """Write ``examples`` ({"context", "choices", "gold"} each) as a task file of the format
    :func:`read_task` reads, one JSON object per line (the folder is created); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        for example in examples:
            file.write(json.dumps(example) + "\n")
    return path


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm_eval's causal ``_encode_pair`` splits them, the
    context prefixed with BOS (EOS when the tokenizer has none; module docstring).

    ``tokenizer``: engine/data/tokenizer.py's ``Tokenizer`` (``encode(text, bos, eos)``)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    prefix = [tokenizer.bos_id if tokenizer.bos_id >= 0 else tokenizer.eos_id]
    whole = prefix + tokenizer.encode(context + continuation, bos=False, eos=False)
    context_len = len(prefix) + (len(tokenizer.encode(context, bos=False, eos=False)) if context else 0)
    return whole[:context_len], whole[context_len:]


def window(context_ids: list[int], continuation_ids: list[int], seq_len: int) -> tuple[list[int], int]:
    """(the at most ``seq_len + 1`` tokens of one scored row, left-truncated as lm_eval does, and the
    number of continuation tokens at its end).

    Raises:
        ValueError: an empty continuation, or one of ``seq_len`` tokens or more (nothing to condition on).
    """
    if not continuation_ids or len(continuation_ids) >= seq_len:
        raise ValueError(f"a continuation of {len(continuation_ids)} tokens cannot be scored in windows of "
                         f"training.seq_len = {seq_len} tokens")
    return (context_ids + continuation_ids)[-(seq_len + 1):], len(continuation_ids)


def first_argmax(values: list[float]) -> int:
    """Index of the largest value, the first on ties (``numpy.argmax``, as lm_eval picks)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def score(example: Example, loglikelihoods: list[float]) -> dict[str, float]:
    """{"acc", "acc_norm"} (1.0 or 0.0) of one example from its choices' log-likelihoods (nats)."""
    normalised = [ll / len(choice) for ll, choice in zip(loglikelihoods, example.choices)]
    return {"acc": float(first_argmax(loglikelihoods) == example.gold),
            "acc_norm": float(first_argmax(normalised) == example.gold)}
