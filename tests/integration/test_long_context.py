"""Long context: training past a model's max_seq_len (RoPE tables sized to the run), one warning,
the trained length recorded for Hugging Face exports; context parallel at that length equals one
process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import (FLAVOR, SEQ_LEN, assert_parity, base_args, clipping_sides, quadra_log_lines,
                                  train_and_record)

# The model the tests extend: the suite's flavor "trained" for half the tests' sequence length, with
# Llama 3.1's RoPE scaling (original length 8 tokens, so the scaled band covers these positions).
SHORT_MAX = SEQ_LEN // 2
WARNING = f"training.seq_len = {SEQ_LEN} is past the max_seq_len {SHORT_MAX}"


def _short_record(folder) -> str:
    from models.llama.flavors import llama3_flavors

    args = dataclasses.replace(llama3_flavors[FLAVOR], max_seq_len=SHORT_MAX, rope_scaling="llama3",
                               rope_original_max_seq_len=SHORT_MAX // 2)
    path = folder / "short_model.json"
    path.write_text(json.dumps({"name": "llama", "args": dataclasses.asdict(args)}))
    return str(path)


def _train_and_count_warnings(argv):
    """(history, how many long-context warnings this rank logged)."""
    with quadra_log_lines(WARNING) as seen:
        return train_and_record(argv), len(seen)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    return _short_record(tmp_path_factory.mktemp("short_model"))


def test_past_max_seq_len_is_planned_with_one_warning_and_recorded(short_model, tmp_path):
    """No refusal; the warning names the lengths and the scaling; the checkpoint record (what the
    Hugging Face export writes as max_position_embeddings) holds the trained length."""
    from engine.config import load_config
    from engine.setup.preflight import check_setup
    from models.common.hf import common_config
    from models.resolve import args_from_record

    cfg = load_config(base_args(str(tmp_path), {"model.args_path": short_model}))
    cfg.validate()
    plan = check_setup(cfg, 1, "cpu", check_data=False)
    (warning,) = plan.warnings
    assert WARNING in warning and "llama3 scaling (factor 8" in warning, warning
    assert plan.model_args.max_seq_len == SEQ_LEN
    _, recorded = args_from_record(plan.model_record, "record")
    config = common_config(recorded, architecture="LlamaForCausalLM", model_type="llama", dtype="float32",
                           bos_id=None, eos_id=None)
    assert config["max_position_embeddings"] == SEQ_LEN
    assert config["rope_scaling"]["original_max_position_embeddings"] == SHORT_MAX // 2
    # Within the model's length: no warning, and the model's own max_seq_len is recorded.
    within = load_config(base_args(str(tmp_path), {"model.args_path": short_model, "training.seq_len": SHORT_MAX}))
    within.validate()
    plan = check_setup(within, 1, "cpu", check_data=False)
    assert plan.warnings == () and plan.model_record["args"]["max_seq_len"] == SHORT_MAX


def test_cp2_past_max_seq_len_equals_one_process(short_model, tmp_path):
    """seq_len = 2 x max_seq_len: cp2 (load-balanced ring) equals one process, loss and grad norm,
    with clipping engaged; the warning is logged once over all ranks."""
    (one,) = run_distributed(_train_and_count_warnings, 1, base_args(str(tmp_path / "one"),
                             {"model.args_path": short_model}), torchrun_env=False)
    reference, warned = one
    assert warned == 1
    above, below = clipping_sides(reference)
    assert above >= 1 and below >= 1, reference
    ranks = run_distributed(_train_and_count_warnings, 2, base_args(str(tmp_path / "cp2"), {
        "model.args_path": short_model, "parallelism.cp": 2, "parallelism.dp_shard": 1}))
    assert sum(count for _, count in ranks) == 1, [count for _, count in ranks]
    for history, _ in ranks:
        assert_parity(history, reference)


def _extend(argv):
    """Build the Trainer of a new phase, train it; -> (step, data position and Adam step count after
    loading, the start-up lines about the phase, the losses)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    with quadra_log_lines("new phase", "fingerprint", "settings changed", "continues on world_size") as lines:
        cfg = load_config(argv)
        cfg.validate()
        trainer = Trainer(cfg)
        adam_steps = {float(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
        loaded = (trainer.step, trainer.dataloader.state_dict()["position"], adam_steps, list(lines))
        try:
            history = trainer.train()
        finally:
            trainer.close()
        return loaded, [h["loss"] for h in history]


def test_context_extension_resumes_weights_and_optimizer_at_twice_the_length(tmp_path):
    """engine/docs/long-context.md's context-extension command: a run at seq_len 16 saves step 2; a new run at seq_len
    32 starts from it with its optimizer state (Adam's step count 2), the step count and LR schedule
    restarted, and the data continued after the 2 x 8 x 16 = 256 tokens read (window 8 of 32 tokens);
    one line says so; it trains. The phase runs on 2 ranks (FSDP2) where the first ran on one: a
    layout the user chose, so no elastic "the group continues on world_size 2" line."""
    short = base_args(str(tmp_path / "short"), {"training.seq_len": SHORT_MAX, "training.steps": 2,
                                                "checkpoint.enable": "true", "checkpoint.interval": 2,
                                                "validation.enable": "false"})
    (first,) = run_distributed(train_and_record, 1, short, torchrun_env=False)
    assert len(first) == 2
    phase = base_args(str(tmp_path / "long"), {
        "training.steps": 2, "validation.enable": "false", "checkpoint.enable": "true",
        "checkpoint.initial_load_path": str(tmp_path / "short" / "checkpoint" / "step-2"),
        "checkpoint.initial_load_model_only": "false", "checkpoint.initial_load_lr": "restart",
        "parallelism.dp_shard": 2, "training.local_batch_size": 4})
    ((step, position, adam_steps, lines), losses) = run_distributed(_extend, 2, phase)[0]
    assert (step, position, adam_steps) == (0, 8, {2.0}), (step, position, adam_steps)
    levels, texts = zip(*lines)
    phase_line = [text for text in texts if text.startswith("new phase from")]
    assert len(phase_line) == 1 and f"seq_len {SHORT_MAX} -> {SEQ_LEN}" in phase_line[0], lines
    assert "restart at 0" in phase_line[0] and "data continues after 256 tokens (window 8)" in phase_line[0], lines
    # A new phase is a new run by design: its fingerprint change is information (naming what changed,
    # not the initial_load_* keys that start the phase), not a resume's warning.
    fingerprint = [text for text in texts if "convergence fingerprint" in text]
    assert set(levels) == {"INFO"} and len(fingerprint) == 1, lines
    others = " ".join(text for text in texts if not text.startswith("new phase from"))
    assert "training.seq_len: 16 -> 32" in fingerprint[0] and "initial_load" not in others, lines
    assert "job.dump_folder" not in others and "resumed" not in others, lines
    assert any(text.startswith("new phase loaded from") and ": step 0," in text for text in texts), lines
    assert len(losses) == 2 and all(loss == loss for loss in losses), losses
