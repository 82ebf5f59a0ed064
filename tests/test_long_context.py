"""Long context: training past a model's max_seq_len (RoPE tables sized to the run), one warning,
the trained length recorded for Hugging Face exports; context parallel at that length equals one
process."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import FLAVOR, SEQ_LEN, assert_parity, base_args, clipping_sides, train_and_record

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
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            if WARNING in record.getMessage():
                seen.append(record.getMessage())

    handler = Catch()
    logging.getLogger("quadra").addHandler(handler)
    try:
        return train_and_record(argv), len(seen)
    finally:
        logging.getLogger("quadra").removeHandler(handler)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    return _short_record(tmp_path_factory.mktemp("short_model"))


def test_past_max_seq_len_is_planned_with_one_warning_and_recorded(short_model, tmp_path):
    """No refusal; the warning names the lengths and the scaling; the checkpoint record (what the
    Hugging Face export writes as max_position_embeddings) holds the trained length."""
    from engine.config import load_config
    from engine.setup.preflight import check_setup
    from models.hf import common_config
    from models.registry import args_from_record

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


@pytest.mark.slow
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
