"""DeepSeek-V3 under every parallelism, in the float64 reference mode: loss, grad norm and validation
loss equal one process to 1e-12 (relative) at every step (gloo, CPU), clipping engaged on some steps.

What these layouts guard: MLA's heads split over tp while the query and key-value latents (wq_a,
wkv_a) and their RMSNorms stay replicated with gradients summed over every tp rank's heads (with
and without sequence parallel; the RoPE key's gradient too), ring attention with a value width
(12) apart from the query-key width (24), YaRN's tables and softmax scale under cp's position
sharding, group-limited routing under ep and ep × tp, and pipeline stages cutting the dense and MoE
layers, multi-token prediction's modules under fsdp, ep, tp (with and without sequence parallel), ep × tp,
pp (on the last stage, beside a copy of the embedding whose gradient is summed with the first stage's)
and cp with document masking (targets shifted on whole windows before the load-balanced split). Layouts
of one world size train in the same forked ranks (:class:`tests.training_utils.LayoutRuns`).

Compiled (``compile.enable``, refused in the float64 reference mode, so in fp32 against an fp32 eager
process with training_utils' tolerances): DeepSeek-V3 with every compiled part (MLA with the query
latent, YaRN and the document mask, the dense block, the group-limited router, the shared expert and
the two MTP depths' blocks; parallelisms/compile.py) in one process, under ep 2 × fsdp 2 and under cp 2.
"""

from __future__ import annotations

import math

import pytest

from engine.testing.processes import run_distributed
from tests.integration.test_document_mask_parity import corpus  # noqa: F401  (fixture: a corpus of short documents)
from tests.training_utils import (COMPILED, MAX_NORM, LayoutRuns, assert_parity, base_args, clipping_sides,
                                  train_and_record)


# lr 6e-2 spreads the grad norms across training_utils.MAX_NORM (steps 1-2 below, 4 above), so
# clipping is engaged on some steps and not on others.
FP64 = {"training.mixed_precision_param": "float64", "training.mixed_precision_reduce": "float64",
        "optimizer.lr": "6e-2"}
QLORA = {"model.name": "deepseek_v3", "model.flavor": "debugmodel", **FP64}  # q latent + YaRN
FULL_Q = {"model.name": "deepseek_v3", "model.flavor": "debugmodel_noqlora", **FP64}
# Block-causal attention with RoPE restarting per document (models/common/document_mask.py); the data
# paths are the documents corpus (fixture ``corpus``).
DOCUMENTS = {**QLORA, "document_mask.enable": "true", "document_mask.restart_positions": "true"}
# Two multi-token-prediction depths in the objective (models/deepseek_v3/mtp.py): under fsdp their
# modules are in the root unit, under ep their MoE's experts are split like the main blocks'.
MTP = {**QLORA, "model.flavor": "debugmodel_mtp", "loss.mtp_weight": "0.3", "training.max_norm": "0.8"}  # norms 0.61-0.97
MTP_UNFUSED = {**MTP, "loss.chunk_tokens": 0}
DOCUMENTS_MTP = {**MTP, "document_mask.enable": "true", "document_mask.restart_positions": "true"}
TOLERANCE = 1e-12

LAYOUTS = {
    "fsdp2_mtp": (2, {**MTP, "parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "tp2": (2, {**QLORA, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "tp2_no_sequence_parallel": (2, {**QLORA, "parallelism.tp": 2, "parallelism.dp_shard": 1,
                                     "parallelism.sequence_parallel": "false"}),
    "full_q_tp2": (2, {**FULL_Q, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "ep2_mtp": (2, {**MTP, "parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 4}),
    "cp2": (2, {**QLORA, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "pp2": (2, {**QLORA, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    "documents_tp2": (2, {**DOCUMENTS, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "documents_cp2": (2, {**DOCUMENTS, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "ep2_x_tp2": (4, {**QLORA, "parallelism.dp_shard": 2, "parallelism.ep": 2, "parallelism.tp": 2,
                      "training.local_batch_size": 4}),
    # Multi-token prediction under tp (MTP's projections beside the heads split, the vocab-parallel
    # loss), pp (MTP on the last stage with a copy of the embedding, gradients summed with stage 0's)
    # and cp with document masking (shifted tokens and targets cut after the shift, load-balanced).
    "tp2_mtp": (2, {**MTP, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "tp2_mtp_no_sequence_parallel": (2, {**MTP, "parallelism.tp": 2, "parallelism.dp_shard": 1,
                                         "parallelism.sequence_parallel": "false"}),
    "pp2_mtp": (2, {**MTP, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    # the unfused loss: the last stage still gets the labels, tp's MTP loss stays vocab-parallel
    "pp2_mtp_unfused_loss": (2, {**MTP_UNFUSED, "parallelism.pp": 2, "parallelism.dp_shard": 1}),
    "tp2_mtp_unfused_loss": (2, {**MTP_UNFUSED, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "documents_cp2_mtp": (2, {**DOCUMENTS_MTP, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "ep2_x_tp2_mtp": (4, {**MTP, "parallelism.dp_shard": 2, "parallelism.ep": 2, "parallelism.tp": 2,
                          "training.local_batch_size": 4}),
}


# Compiled layouts, in fp32 (compile is not verified in the float64 mode) against one fp32 eager
# process: grad norms 1.03, 0.65, 0.68, 0.75, 0.83 about max_norm 0.8 on the documents corpus. They
# train after the float64 layouts in the same forked ranks (training_utils.train_layouts clears Dynamo).
FP32_DOCUMENTS_MTP = {key: value for key, value in DOCUMENTS_MTP.items()
                      if not key.startswith("training.mixed_precision")}
COMPILED_LAYOUTS = {
    "ep2_x_fsdp2_documents_mtp_compiled": (2, {**FP32_DOCUMENTS_MTP, **COMPILED, "parallelism.dp_shard": 2,
                                               "parallelism.ep": 2, "training.local_batch_size": 4}),
    # MLA's value heads narrower than its query-key heads through the ring's operator in a compiled block.
    "cp2_documents_mtp_compiled": (2, {**FP32_DOCUMENTS_MTP, **COMPILED, "parallelism.cp": 2,
                                       "parallelism.dp_shard": 1}),
}

REFERENCES = {"qlora": QLORA, "full_q": FULL_Q, "documents": DOCUMENTS, "mtp": MTP, "mtp_unfused": MTP_UNFUSED,
              "documents_mtp": DOCUMENTS_MTP}

ONE_PROCESS = {**REFERENCES, "fp32": FP32_DOCUMENTS_MTP}  # the eager one-process runs


def _reference_name(overrides: dict) -> str:
    """The reference a layout's overrides extend (the most specific one)."""
    matches = [name for name, ref in REFERENCES.items() if all(overrides.get(k) == v for k, v in ref.items())]
    return max(matches, key=lambda name: len(REFERENCES[name]))


def _with_data(overrides: dict, corpus: str) -> dict:
    if overrides.get("document_mask.enable") != "true":
        return overrides
    return {**overrides, "data.path": corpus, "validation.path": corpus}


def _references(folder: str, corpus: str) -> dict:
    """The float64 references and the fp32 one, then the fp32 one compiled (the process's only compiled
    run; its failure is its test's, as a traceback, not every test's of this file)."""
    import traceback

    result = {name: train_and_record(base_args(f"{folder}/{name}", _with_data(model, corpus)))
              for name, model in ONE_PROCESS.items()}
    try:
        result["fp32_compiled"] = train_and_record(
            base_args(f"{folder}/fp32_compiled", _with_data({**FP32_DOCUMENTS_MTP, **COMPILED}, corpus)))
    except Exception:  # noqa: BLE001 - reported by test_compiled_deepseek_v3_in_one_process_equals_eager
        result["fp32_compiled"] = traceback.format_exc()
    return result


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus):  # noqa: F811
    """{reference name: History} of the single-process runs (no process group): the float64 ones of
    :data:`REFERENCES`, "fp32" and "fp32_compiled" (or the compiled run's traceback)."""
    (result,) = run_distributed(_references, 1, str(tmp_path_factory.mktemp("deepseek_single")), corpus,
                                torchrun_env=False, timeout=600)
    for name, settings in ONE_PROCESS.items():
        history = result[name]
        above, below = clipping_sides(history, float(settings.get("training.max_norm", MAX_NORM)))
        assert above >= 1 and below >= 1, f"{name}: max_norm is not between the steps' norms: {list(history)}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    layouts = {name: (size, _with_data(overrides, corpus))
               for name, (size, overrides) in {**LAYOUTS, **COMPILED_LAYOUTS}.items()}
    return LayoutRuns(layouts, str(tmp_path_factory.mktemp("deepseek_layouts")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_v3_fp64_parity_with_one_process(layout, references, runs):
    reference = references[_reference_name(LAYOUTS[layout][1])]
    for history in runs.history(layout):  # every rank reports the global loss and grad norm
        assert len(history) == len(reference)
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, reference), start=1):
            assert math.isclose(loss, ref_loss, rel_tol=TOLERANCE), f"step {step}: loss {loss} vs {ref_loss}"
            assert math.isclose(norm, ref_norm, rel_tol=TOLERANCE), f"step {step}: grad_norm {norm} vs {ref_norm}"
        for (step, loss), (_, ref_loss) in zip(history.validation, reference.validation):
            assert math.isclose(loss, ref_loss, rel_tol=TOLERANCE), f"validation after step {step}: {loss} vs {ref_loss}"


def test_compiled_deepseek_v3_in_one_process_equals_eager(references):
    assert not isinstance(references["fp32_compiled"], str), references["fp32_compiled"]
    assert_parity(references["fp32_compiled"], references["fp32"])


@pytest.mark.parametrize("layout", list(COMPILED_LAYOUTS))
def test_compiled_deepseek_v3_layout_equals_one_eager_process(layout, references, runs):
    for history in runs.history(layout):
        assert_parity(history, references["fp32"])
