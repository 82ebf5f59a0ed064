"""In-loop downstream evaluation ([eval], engine/train/downstream.py): every continuation's
log-likelihood is the model's, over the continuation's tokens only; acc_norm divides by characters;
and under fsdp2, tp2, pp2 (1F1B and ZBVZeroBubble), cp2 and ep2 (MoE) the log-likelihoods equal one
process's (fp32, 1e-5) and the accuracies are the same. The layouts run in turn in one set of 2
forked ranks (tests/training_utils.py ``run_in_turn``); every run evaluates the initial weights (no
step: the initialisation does not depend on the layout)."""

from __future__ import annotations

import json
import math

import pytest

from engine.data.eval_tasks import Example, score
from engine.testing.processes import run_distributed
from tests.training_utils import SMALL_CORPUS, base_args, run_in_turn

LAYOUTS = {
    # name: (model, overrides); 2 ranks each
    "fsdp2": ({}, {"parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "tp2": ({}, {"parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "pp2_1f1b": ({}, {"parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_schedule": "1F1B"}),
    "pp2_zbv": ({}, {"parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_schedule": "ZBVZeroBubble"}),
    "cp2": ({}, {"parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "moe_ep2": ({"model.name": "moe"}, {"parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 4}),
}

# Choices whose characters per token differ a lot (a long common word against rare letters), so that
# dividing by tokens instead of characters picks other answers; an empty context (lm_eval's prefix
# token), a context ending in spaces (they move to the continuation), a "no delimiter" example.
HANDMADE = [
    {"context": "KING HENRY. Now, lords, for France;", "choices": ["the enterprise", "zq xj vk", "a"], "gold": 0},
    {"context": "", "choices": ["What say you?", "qqq zzz", "Enter"], "gold": 0},
    {"context": "To be, or not to be, that is the  ", "choices": ["question", "xw", "kingdom of heaven"], "gold": 0},
    {"context": "My lord, I", "choices": ["'ll", "will go", "zzxq"], "gold": 1, "target_delimiter": ""},
    {"context": "Good morrow,", "choices": ["cousin", "gentlemen all", "xz"], "gold": 0},
    {"context": "O Romeo, Romeo! wherefore art thou", "choices": ["Romeo?", "qv", "a most unnatural thing"], "gold": 0},
]


def _write_tasks(folder) -> list[str]:
    """Two task files: a cloze task cut from the small corpus (scripts/make_cloze_task.py) and
    :data:`HANDMADE`; the rows are shorter than training.seq_len (32), so the runs without pp or cp
    pad them to the longest (a multiple of tp), the others to 32."""
    from scripts.make_cloze_task import main as make_cloze

    cloze = make_cloze(["--data_path", SMALL_CORPUS, "--output", str(folder / "cloze.jsonl"), "--examples", "5",
                        "--choices", "3", "--words", "2", "--context_chars", "20"])
    handmade = folder / "handmade.jsonl"
    handmade.write_text("".join(json.dumps(example) + "\n" for example in HANDMADE))
    return [cloze, f"hand={handmade}"]


def _evaluate(argv: list[str], reference: bool) -> dict:
    """Build a Trainer (no step), run the downstream evaluation. With ``reference`` (one process):
    also each continuation's log-likelihood from a plain forward of its unpadded tokens (log-softmax
    summed over the continuation's positions only), and each choice's token count."""
    import torch

    from engine.config import load_config
    from engine.data.eval_tasks import encode_pair
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    try:
        trainer.validate()  # as the loop runs them: validation, then the tasks (pp: two eval passes in a row)
        results, lls = trainer.downstream.evaluate(trainer.model_parts, trainer.device)
        out = {"results": results, "lls": lls, "row_len": trainer.downstream.row_len}
        if reference:
            model, direct, tokens = trainer.model_parts[0], {}, {}
            for task in trainer.downstream.tasks:
                direct[task.name], tokens[task.name] = [], []
                for example in task.examples:
                    pairs = [encode_pair(trainer.tokenizer, example.context, example.delimiter + c)
                             for c in example.choices]
                    tokens[task.name].append([len(cont) for _, cont in pairs])
                    direct[task.name].append([_direct_loglikelihood(model, ctx, cont, trainer.cfg.training.seq_len)
                                              for ctx, cont in pairs])
            out.update(direct=direct, tokens=tokens)
            torch.set_grad_enabled(True)
        return out
    finally:
        trainer.close()


def _direct_loglikelihood(model, context: list[int], continuation: list[int], seq_len: int) -> float:
    import torch

    whole = (context + continuation)[-(seq_len + 1):]
    with torch.no_grad():
        logits = model.eval()(torch.tensor([whole[:-1]]))
    model.train()
    logprobs = torch.log_softmax(logits[0].double(), dim=-1)
    targets = torch.tensor(whole[1:])
    return float(logprobs[torch.arange(len(targets)), targets][-len(continuation):].sum())


def _evaluate_layouts(folder: str, runs: dict[str, list[str]], reference: bool) -> dict:
    return run_in_turn({name: argv for name, argv in runs.items()},
                       lambda name, argv: _evaluate(argv, reference))


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    """(one process's {model: evaluation}, every rank's {layout: evaluation})."""
    folder = tmp_path_factory.mktemp("downstream")
    tasks = ",".join(_write_tasks(folder))
    common = {"eval.enable": "true", "eval.tasks": tasks}
    single = {model: base_args(f"{folder}/one/{model}", {**common, "model.name": model}) for model in ("llama", "moe")}
    (one,) = run_distributed(_evaluate_layouts, 1, str(folder), single, True, torchrun_env=False)
    layouts = {name: base_args(f"{folder}/many/{name}", {**common, **model, **overrides})
               for name, (model, overrides) in LAYOUTS.items()}
    return one, run_distributed(_evaluate_layouts, 2, str(folder), layouts, False, timeout=300)


def test_loglikelihoods_are_the_continuations_and_acc_norm_divides_by_characters(evaluations):
    """One process: each log-likelihood equals a plain forward's sum over the continuation's tokens
    (a row that also scored its context would be far lower), and acc / acc_norm are lm_eval's from
    them; the hand-made task is built so that dividing by tokens would give another acc_norm."""
    one, _ = evaluations
    for model, run in one.items():
        assert not isinstance(run, str), run
        assert run["row_len"] < 32, run["row_len"]  # trimmed windows (pp and cp pad to seq_len)
        for task, lls in run["lls"].items():
            for got, want in zip(lls, run["direct"][task]):
                assert got == pytest.approx(want, rel=1e-5), (model, task, got, want)
            examples = [Example(e["context"], tuple(e["choices"]), e["gold"]) for e in HANDMADE] \
                if task == "hand" else None
            if examples is None:
                continue
            scores = [score(example, ll) for example, ll in zip(examples, lls)]
            for metric in ("acc", "acc_norm"):
                assert run["results"][task][metric] == pytest.approx(sum(s[metric] for s in scores) / len(scores))
            per_token = sum(float(max(range(len(ll)), key=lambda i: ll[i] / n[i]) == e.gold)
                            for e, ll, n in zip(examples, lls, run["tokens"][task])) / len(examples)
            assert not math.isclose(per_token, run["results"][task]["acc_norm"]), (model, "not discriminating")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_scores_like_one_process(layout, evaluations):
    """The same log-likelihoods (fp32, 1e-5) and accuracies on every rank as one process's."""
    one, ranks = evaluations
    want = one[LAYOUTS[layout][0].get("model.name", "llama")]
    assert not isinstance(want, str), want
    for rank, runs in enumerate(ranks):
        got = runs[layout]
        assert not isinstance(got, str), f"rank {rank}:\n{got}"
        assert got["results"] == want["results"], (rank, got["results"], want["results"])
        for task, lls in want["lls"].items():
            for got_ll, want_ll in zip(got["lls"][task], lls):
                assert got_ll == pytest.approx(want_ll, rel=1e-5), (rank, task, got_ll, want_ll)


def _train_with_slow_evaluation(argv: list[str]) -> tuple[list[float], dict]:
    """Train with every evaluation lengthened by 1 s: (each step's seconds, the goodput ledger's record)."""
    import time

    from engine.config import load_config
    from engine.train import downstream
    from engine.train.trainer import Trainer

    original = downstream.DownstreamEvaluation.loglikelihoods

    def slow(self, *args):
        time.sleep(1.0)
        return original(self, *args)

    downstream.DownstreamEvaluation.loglikelihoods = slow
    trainer = Trainer(load_config(argv))
    try:
        history = trainer.train()
        return [h["step_seconds"] for h in history], dict(trainer.recovery.ledger.record)
    finally:
        trainer.close()


def test_evaluation_time_is_evaluation_in_the_ledger_not_step_time(tmp_path):
    """Two evaluations of a 2-step run (eval.freq 1) take >= 2 s: the goodput ledger's evaluation_s
    has them, the steps (and so productive time, tokens/s and MFU) do not."""
    (task,) = [f"hand={tmp_path / 'hand.jsonl'}"]
    (tmp_path / "hand.jsonl").write_text(json.dumps(HANDMADE[0]) + "\n")
    argv = base_args(str(tmp_path / "run"), {"eval.enable": "true", "eval.tasks": task, "eval.freq": 1,
                                             "training.steps": 2, "validation.enable": "false"})
    (result,) = run_distributed(_train_with_slow_evaluation, 1, argv, torchrun_env=False)
    steps, ledger = result
    assert ledger["evaluation_s"] >= 2.0, ledger
    assert max(steps) < 1.0 and ledger["productive_s"] == pytest.approx(sum(steps)), (steps, ledger)


def test_windows_are_left_truncated_as_lm_eval_does():
    """lm_eval's ``(context + continuation)[-(max_length + 1):]``, the continuation kept whole."""
    from engine.data.eval_tasks import window

    assert window([1, 2, 3, 4, 5], [6, 7], 4) == ([3, 4, 5, 6, 7], 2)
    assert window([1, 2], [3], 4) == ([1, 2, 3], 1)
    with pytest.raises(ValueError, match="training.seq_len = 4"):
        window([1], [2, 3, 4, 5], 4)
