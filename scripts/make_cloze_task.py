#!/usr/bin/env python3
"""Write a small multiple-choice cloze task from a local text corpus, in the ``[eval]`` task format.

Each example is a passage cut before a space inside a line (the context), its true next words and
``--choices - 1`` word spans of the same length from elsewhere in the corpus (the distractors), in
a seeded random order; ``gold`` is the true one's index. A model that has learnt the language picks
the true continuation more often than 1 / choices. No network, no lm_eval::

    python scripts/make_cloze_task.py --data_path assets/data/shakespeare/validation.jsonl \\
        --output outputs/eval/shakespeare_cloze.jsonl --examples 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.data.eval_tasks import write_task  # noqa: E402  (torch-free)


def _spans(text: str, words: int) -> list[tuple[int, int]]:
    """(start, end) of every run of ``words`` words inside one line that follows a space."""
    spans, offset = [], 0
    for line in text.split("\n"):
        found = list(re.finditer(r"\S+", line))
        for i in range(1, len(found) - words + 1):
            start = found[i].start()
            if line[start - 1] == " ":
                spans.append((offset + start, offset + found[i + words - 1].end()))
        offset += len(line) + 1
    return spans


def make_task(texts: list[str], examples: int, choices: int, context_chars: int, words: int, seed: int) -> list[dict]:
    """The examples (module docstring) from the documents ``texts``."""
    rng = random.Random(seed)
    text = "\n\n".join(texts)
    spans = _spans(text, words)
    if len(spans) < examples * choices:
        raise SystemExit(f"the corpus has only {len(spans)} spans of {words} words; ask for fewer examples")
    picked = rng.sample(spans, examples)
    tasks = []
    for start, end in picked:
        cut = text.rfind(" ", 0, max(start - 1 - context_chars, 0)) + 1  # start the context at a word
        context = text[cut:start - 1]
        true = text[start:end]
        others: list[str] = []
        while len(others) < choices - 1:
            s, e = rng.choice(spans)
            if text[s:e] != true and text[s:e] not in others:
                others.append(text[s:e])
        gold = rng.randrange(choices)
        tasks.append({"context": context, "choices": others[:gold] + [true] + others[gold:], "gold": gold})
    return tasks


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_path", required=True, help="jsonl with a text field, or a .txt file")
    parser.add_argument("--output", required=True, help="task file to write (jsonl)")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context_chars", type=int, default=160, help="about this many characters of context")
    parser.add_argument("--words", type=int, default=4, help="words per choice")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with open(args.data_path, encoding="utf-8") as file:
        if args.data_path.endswith(".txt"):
            texts = [file.read()]
        else:
            texts = [json.loads(line)[args.text_column] for line in file if line.strip()]
    tasks = make_task(texts, args.examples, args.choices, args.context_chars, args.words, args.seed)
    write_task(args.output, tasks)
    print(f"wrote {len(tasks)} examples of {args.choices} choices to {args.output}")
    return args.output


if __name__ == "__main__":
    main()
