"""The lm-evaluation-harness oracle of the in-loop downstream evaluation ([eval]): a tiny model trained
2 steps with a Hugging Face tokenizer, its checkpoint exported with ``to-hf``
(scripts/convert_checkpoint.py), scored by lm_eval's ``HFLM`` on the exported folder through a task
yaml of its own (a TaskManager include path, data on disk, nothing downloaded), gives the same
log-likelihood for every choice (fp32, 1e-5) and the same acc and acc_norm as Quadra's evaluation
of the same step. The tokenizer handed to HFLM prepends BOS, as Hugging Face Llama tokenizers do
(engine/data/eval_tasks.py); scripts/eval_task.py converts the same task back to Quadra's format."""

from __future__ import annotations

import json
import os

import pytest

from engine.testing.processes import run_distributed
from tests.extras import require_extra
from tests.training_utils import SMALL_CORPUS, base_args

TASK_YAML = """task: quadra_oracle
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""

HANDMADE = [  # a context ending in spaces (moved to the continuation), choices of unlike lengths
    {"context": "To be, or not to be, that is the  ", "choices": ["question", "xw", "kingdom of heaven"], "gold": 0},
    {"context": "KING HENRY. Now, lords, for France;", "choices": ["the enterprise", "zq xj vk", "a"], "gold": 0},
]


def _train_and_evaluate(argv: list[str]) -> dict:
    """Train, save the last step, return the in-loop evaluation's log-likelihoods of that step."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    try:
        trainer.train()
        results, lls = trainer.downstream.evaluate(trainer.model_parts, trainer.device)
        return {"results": results, "lls": lls}
    finally:
        trainer.close()


def _hf_tokenizer_with_bos(folder: str):
    """The exported tokenizer.json as transformers loads it, with a post-processor that prepends BOS."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                                        bos_token=config["bos_token"], eos_token=config["eos_token"],
                                        pad_token=config["pad_token"])
    bos = config["bos_token"]
    tokenizer._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    return tokenizer


def test_lm_eval_scores_the_exported_checkpoint_like_the_in_loop_evaluation(tmp_path):
    require_extra("lm_eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from scripts.convert_checkpoint import main as convert
    from scripts.eval_task import convert as convert_task
    from scripts.make_cloze_task import main as make_cloze
    from scripts.train_tokenizer import main as train_tokenizer

    tokenizer = train_tokenizer(["--data_path", SMALL_CORPUS, "--vocab_size", "512", "--output",
                                 str(tmp_path / "tok"), "--format", "hf"])
    docs = make_cloze(["--data_path", SMALL_CORPUS, "--output", str(tmp_path / "docs.jsonl"), "--examples", "8",
                       "--choices", "3", "--words", "3", "--context_chars", "60", "--seed", "1"])
    with open(docs, "a") as file:
        file.writelines(json.dumps(example) + "\n" for example in HANDMADE)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "quadra_oracle.yaml").write_text(TASK_YAML.format(docs=docs))
    # lm_eval's own reading of the task, converted back, is the file Quadra evaluates
    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # no index of lm_eval's own tasks
    converted = convert_task("quadra_oracle", str(tasks), task_manager=manager)
    assert [(e["context"], e["choices"], e["gold"]) for e in converted] == \
        [(e["context"], e["choices"], e["gold"]) for e in map(json.loads, open(docs))]
    run = tmp_path / "run"
    argv = base_args(str(run), {"model.tokenizer_path": tokenizer, "training.steps": 2, "training.seq_len": 128,
                                "validation.enable": "false", "checkpoint.enable": "true",
                                "eval.enable": "true", "eval.tasks": f"quadra_oracle={docs}"})
    (quadra,) = run_distributed(_train_and_evaluate, 1, argv, torchrun_env=False)
    assert convert(["to-hf", str(run / "checkpoint" / "step-2"), str(tmp_path / "hf")]) == 0

    model = HFLM(pretrained=str(tmp_path / "hf"), tokenizer=_hf_tokenizer_with_bos(str(tmp_path / "tok")),
                 dtype="float32", device="cpu", batch_size=8)
    out = simple_evaluate(model=model, tasks=["quadra_oracle"], task_manager=manager,
                          log_samples=True, num_fewshot=0)
    samples = sorted(out["samples"]["quadra_oracle"], key=lambda s: s["doc_id"])
    oracle = [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]  # [(ll, is_greedy)] per choice
    ours = quadra["lls"]["quadra_oracle"]
    assert len(oracle) == len(ours) == 10
    for doc_id, (got, want) in enumerate(zip(ours, oracle)):
        assert got == pytest.approx(want, rel=1e-5), (doc_id, got, want)
    for metric in ("acc", "acc_norm"):
        assert quadra["results"]["quadra_oracle"][metric] == pytest.approx(out["results"]["quadra_oracle"][f"{metric},none"])
