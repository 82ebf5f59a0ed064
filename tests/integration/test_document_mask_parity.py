"""Document masking under every layout: loss, grad norm and validation parity with one process (gloo,
CPU), clipping engaged, on a corpus of short documents (every 32-token window holds boundaries).

Each layout is one of the parity layouts of the existing test modules with ``[document_mask]`` on; every
context-parallel one also with torch.compile (``<layout>_compiled``: the mask's blocks handed to the ring's
operator, or to the all-gather's attention, inside compiled blocks).
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint_utils import STEPS, STOP, assert_bitwise_equal, ckpt_args, copy_checkpoint, read_checkpoint, train_run
from engine.testing.processes import run_distributed
from tests.integration.test_context_parallel import LAYOUTS as CP_LAYOUTS
from tests.integration.test_data_parallel import LAYOUTS as DP_LAYOUTS
from tests.integration.test_expert_parallel import LAYOUTS as EP_LAYOUTS
from tests.integration.test_pipeline import LAYOUTS as PP_LAYOUTS
from tests.integration.test_tensor_parallel import LAYOUTS as TP_LAYOUTS
from tests.training_utils import (
    SMALL_CORPUS,
    LayoutRuns,
    assert_parity,
    base_args,
    clipping_sides,
    train_and_record,
    with_compiled_twins,
)


MASK = {"document_mask.enable": "true"}
RESTART = {**MASK, "document_mask.restart_positions": "true"}
POSITIONS = {"document_mask.restart_positions": "true"}  # restarted positions, causal attention

# name: (world size, overrides, reference); the references are one process with the same masking.
LAYOUTS = with_compiled_twins({
    "fsdp2": (*DP_LAYOUTS["fsdp2"], RESTART, "restart"),
    "fsdp2_accum2": (*DP_LAYOUTS["fsdp2_accum2"], RESTART, "restart"),
    "ddp2": (*DP_LAYOUTS["ddp2"], RESTART, "restart"),
    "hsdp2x2": (*DP_LAYOUTS["hsdp2x2"], MASK, "mask"),
    "tp2_sp_lp_ac_compile": (*TP_LAYOUTS["tp2_sp_lp_ac_compile"], RESTART, "restart"),
    "pp2_1f1b": (*PP_LAYOUTS["1f1b"], RESTART, "restart"),
    "pp2_interleaved_1f1b": (*PP_LAYOUTS["interleaved_1f1b_2_stages_per_rank"], RESTART, "restart"),
    "pp2_zbv_zero_bubble": (*PP_LAYOUTS["zbv_zero_bubble"], RESTART, "restart"),
    "pp2_gpipe": (*PP_LAYOUTS["gpipe"], RESTART, "restart"),
    "pp2_looped_bfs": (*PP_LAYOUTS["looped_bfs"], RESTART, "restart"),
    "pp2_interleaved_zero_bubble": (*PP_LAYOUTS["interleaved_zero_bubble"], RESTART, "restart"),
    "pp2_dualpipev": (*PP_LAYOUTS["dualpipev"], RESTART, "restart"),
    "cp2_ring": (*CP_LAYOUTS["cp2_ring"], RESTART, "restart"),
    "cp2_ring_mask_only": (*CP_LAYOUTS["cp2_ring"], MASK, "mask"),
    "cp2_ring_positions_only": (*CP_LAYOUTS["cp2_ring"], POSITIONS, "positions"),
    "pp2_1f1b_positions_only": (*PP_LAYOUTS["1f1b"], POSITIONS, "positions"),
    "cp2_allgather_no_load_balance": (*CP_LAYOUTS["cp2_allgather_no_load_balance"], RESTART, "restart"),
    "cp2_x_tp2": (*CP_LAYOUTS["cp2_x_tp2"], RESTART, "restart"),
    "moe_ep2": (*EP_LAYOUTS["ep2"], RESTART, "moe"),
})
REFERENCES = {"restart": RESTART, "mask": MASK, "positions": POSITIONS, "moe": {**RESTART, "model.name": "moe"},
              "causal": {}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The small corpus cut into paragraphs: 1647 documents of 22 tokens (median), so a 32-token
    window holds about one document boundary and often two."""
    path = tmp_path_factory.mktemp("documents") / "paragraphs.jsonl"
    with open(SMALL_CORPUS) as source, open(path, "w") as out:
        for line in source:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph.strip()}) + "\n")
    return str(path)


def _data(corpus: str) -> dict:
    """The corpus, and a clipping threshold between the grad norms of its steps: at this learning
    rate step 2 stays under it by 11 % (0.549) and steps 3-5 exceed it by 13-170 % (0.70-1.67)."""
    return {"data.path": corpus, "validation.path": corpus, "training.max_norm": "0.62", "optimizer.lr": "0.05"}


def _references(folder: str, corpus: str) -> dict:
    return {name: train_and_record(base_args(f"{folder}/{name}", {**_data(corpus), **overrides}))
            for name, overrides in REFERENCES.items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus):
    folder = str(tmp_path_factory.mktemp("single"))
    (result,) = run_distributed(_references, 1, folder, corpus, torchrun_env=False, timeout=600)
    for name in ("restart", "mask", "positions", "moe"):
        above, below = clipping_sides(result[name], max_norm=0.62)
        assert above >= 1 and below >= 1, f"{name}: clipping not engaged on both sides: {result[name]}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    layouts = {name: (size, {**overrides, **masking, **_data(corpus)})
               for name, (size, overrides, masking, _) in LAYOUTS.items()}
    return LayoutRuns(layouts, str(tmp_path_factory.mktemp("document_mask")))


def test_masking_changes_the_run(references):
    """The corpus puts boundaries in the windows: the mask, and restarted positions without it, move
    the grad norm of some step by 10 times the parity tolerance (1e-4) or more, so a layout that
    dropped either fails parity (the mask by 0.6 % at step 1; positions by 0.3 % at step 5 only: at
    initialization RoPE barely moves the scores)."""
    causal = references["causal"]
    for name in ("mask", "positions"):
        moved = max(abs(norm / ref - 1) for (_, norm), (_, ref) in zip(references[name], causal))
        assert moved > 1e-3, (name, references[name], causal)


def test_restarted_positions_under_the_mask_change_only_rounding(references):
    """RoPE scores depend on q_pos - k_pos only (Su et al. 2021, eq. 16), and under the mask every
    visible pair is in one document, so shifting both by the document's start changes nothing but
    the rounding of the rotation angles."""
    assert_parity(references["restart"], references["mask"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_document_mask_parity_with_one_process(layout, references, runs):
    reference = references[LAYOUTS[layout][3]]
    for history in runs.history(layout):
        assert_parity(history, reference)


def test_exact_resume_under_context_parallel(corpus, tmp_path):
    """Document ids are derived from each batch's tokens, so a resume needs nothing new in the
    checkpoint: cp2 with masking and restarted positions, resumed from the uninterrupted run's step-5,
    trains steps 6-10 bit for bit like it (losses and the whole step-10 checkpoint)."""
    overrides = {**CP_LAYOUTS["cp2_ring"][1], **RESTART, **_data(corpus)}
    full_folder, stopped = str(tmp_path / "full"), str(tmp_path / "stopped")
    full = run_distributed(train_run, 2, ckpt_args(full_folder, corpus, overrides), None, None)[0]
    copy_checkpoint(full_folder, stopped, STOP)
    for result in run_distributed(train_run, 2, ckpt_args(stopped, corpus, overrides), None, None):
        assert result["start_step"] == STOP
        assert result["losses"] == {s: full["losses"][s] for s in range(STOP + 1, STEPS + 1)}
    got = read_checkpoint(f"{stopped}/checkpoint/step-{STEPS}", str(tmp_path / "got.pt"))
    want = read_checkpoint(f"{full_folder}/checkpoint/step-{STEPS}", str(tmp_path / "want.pt"))
    assert_bitwise_equal(got, want, "cp2 with document masking: step-10, resumed vs uninterrupted")


def test_a_tokenizer_without_bos_is_refused_at_start_up(monkeypatch, tmp_path):
    """No BOS, no document boundaries: refused by the pre-flight in one line (never plain causal)."""
    from engine.config import load_config
    from engine.data.tokenizer import Tokenizer
    from engine.setup.preflight import check_setup

    init = Tokenizer.__init__

    def without_bos(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.bos_id = -1

    monkeypatch.setattr(Tokenizer, "__init__", without_bos)
    for masking in (MASK, POSITIONS):
        cfg = load_config(base_args(str(tmp_path), masking))
        cfg.validate()
        with pytest.raises(ValueError, match=r"^document_mask.enable / restart_positions need a tokenizer with a BOS"):
            check_setup(cfg, 1, "cpu", check_data=False)
    check_setup(load_config(base_args(str(tmp_path))), 1, "cpu", check_data=False)  # off: accepted
