#!/usr/bin/env python3
"""Convert an lm-evaluation-harness multiple-choice task into an ``[eval]`` task file.

lm_eval builds the task exactly as it would score it (its ``doc_to_text``, ``doc_to_choice``,
``doc_to_target``, ``target_delimiter``, ``description`` and few-shot context, the evaluation
split), from data on disk: a task yaml in ``--include_path`` whose ``dataset_path: json`` and
``dataset_kwargs: {data_files: ...}`` name local files (or a built-in task whose data sits in the
Hugging Face datasets cache). Nothing is downloaded: ``HF_DATASETS_OFFLINE=1`` is set here. Each
document becomes one line ``{"context", "choices", "gold", "target_delimiter"}``, the context being
the string lm_eval hands its model. Needs lm_eval (``pip install -e ".[dev]"``)::

    python scripts/eval_task.py --include_path my_tasks --task my_arc --output outputs/eval/my_arc.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.data.eval_tasks import write_task  # noqa: E402  (torch-free)


def convert(task_name: str, include_path: str | None, limit: int | None = None,
            num_fewshot: int | None = None, task_manager=None) -> list[dict]:
    """The ``[eval]`` examples of lm_eval task ``task_name`` (module docstring); ``task_manager``: an
    ``lm_eval.tasks.TaskManager`` to reuse (indexing lm_eval's built-in tasks takes seconds), else
    one of ``include_path`` and the built-in tasks.

    Raises:
        ValueError: the task is not a ``multiple_choice`` task, or a gold answer is not one of its choices.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = task_manager or TaskManager(include_path=include_path)
    if hasattr(manager, "load"):  # lm_eval >= 0.4.10; get_task_dict before
        task = manager.load([task_name])["tasks"][task_name]
    else:
        task = get_task_dict([task_name], manager)[task_name]
    if task.OUTPUT_TYPE != "multiple_choice":
        raise ValueError(f"task {task_name!r} is {task.OUTPUT_TYPE!r}; only multiple_choice tasks convert")
    if num_fewshot is not None:
        task.set_config(key="num_fewshot", value=num_fewshot)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    contexts: dict[int, str] = {}
    docs: dict[int, dict] = {}
    for instance in task.instances:
        doc_id = instance.doc_id
        contexts.setdefault(doc_id, instance.arguments[0])
        docs.setdefault(doc_id, instance.doc)
    examples = []
    for doc_id in sorted(docs):
        doc = docs[doc_id]
        choices = [str(c) for c in task.doc_to_choice(doc)]
        gold = task.doc_to_target(doc)
        if isinstance(gold, str):
            if gold not in choices:
                raise ValueError(f"task {task_name!r} document {doc_id}: gold {gold!r} is not among its choices")
            gold = choices.index(gold)
        examples.append({"context": contexts[doc_id], "choices": choices, "gold": int(gold),
                         "target_delimiter": task.config.target_delimiter})
    return examples


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="lm_eval task name")
    parser.add_argument("--include_path", default=None, help="folder of task yamls (lm_eval --include_path)")
    parser.add_argument("--output", required=True, help="task file to write (jsonl)")
    parser.add_argument("--limit", type=int, default=None, help="first N documents")
    parser.add_argument("--num_fewshot", type=int, default=None)
    args = parser.parse_args(argv)
    examples = convert(args.task, args.include_path, args.limit, args.num_fewshot)
    write_task(args.output, examples)
    print(f"wrote {len(examples)} examples of task {args.task} to {args.output}")
    return args.output


if __name__ == "__main__":
    main()
