"""torch.compile with context parallel and with the MoE family trains like one eager process (gloo, CPU):
loss, grad norm and validation, clipping engaged.

Every layout runs in ONE set of 4 forked ranks (tests/training_utils.py ``LayoutRuns``): a compile is
paid per rank and layout, so ranks are not forked again per layout. All layouts but one use the
``aot_eager`` backend: Dynamo and AOTAutograd trace the blocks (forward and backward graphs, the
ring's custom operator as an opaque node, the MoE block's compiled parts) exactly as they would for
inductor, without inductor's C++ code generation (20-40 s per rank on this CPU). One layout uses
inductor itself, so a graph that traces but does not lower fails too.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.test_document_mask_parity import _data, corpus  # noqa: F401  (corpus is a fixture)
from tests.training_utils import LayoutRuns, assert_parity, base_args, clipping_sides, train_and_record

pytestmark = pytest.mark.slow  # multi-process training (see pyproject.toml)

AOT = {"compile.enable": "true", "compile.backend": "aot_eager"}
INDUCTOR = {"compile.enable": "true", "compile.backend": "inductor"}
MOE = {"model.name": "moe"}
MASK = {"document_mask.enable": "true"}
CP2_FSDP2 = {"parallelism.cp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4}

# name: (overrides, reference); all on 4 ranks.
LAYOUTS = {
    "cp2_x_fsdp2_inductor": ({**CP2_FSDP2, **INDUCTOR}, "dense"),
    "cp2_x_tp2": ({"parallelism.cp": 2, "parallelism.tp": 2, "parallelism.dp_shard": 1, **AOT}, "dense"),
    "cp2_x_fsdp2_document_mask": ({**CP2_FSDP2, **MASK, **AOT}, "mask"),
    "ep2_x_fsdp4": ({**MOE, "parallelism.dp_shard": 4, "parallelism.ep": 2, "training.local_batch_size": 2, **AOT},
                    "moe"),
    "ep2_over_cp2_x_fsdp2": ({**MOE, **CP2_FSDP2, "parallelism.ep": 2, **AOT}, "moe"),
}


def _references(folder: str, corpus_path: str) -> dict:
    """One eager process: the masked dense model on the paragraph corpus, and the MoE model."""
    return {"mask": train_and_record(base_args(f"{folder}/mask", {**MASK, **_data(corpus_path)})),
            "moe": train_and_record(base_args(f"{folder}/moe", MOE))}


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus, reference):  # noqa: F811
    folder = str(tmp_path_factory.mktemp("compile_references"))
    (result,) = run_distributed(_references, 1, folder, corpus, torchrun_env=False, timeout=600)
    above, below = clipping_sides(result["mask"], max_norm=0.62)
    assert above >= 1 and below >= 1, result["mask"]
    return {**result, "dense": reference}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    layouts = {name: (4, {**overrides, **(_data(corpus) if ref == "mask" else {})})
               for name, (overrides, ref) in LAYOUTS.items()}
    return LayoutRuns(layouts, str(tmp_path_factory.mktemp("compile_parallel")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_equals_one_eager_process(layout, references, runs):
    for history in runs.history(layout):
        assert_parity(history, references[LAYOUTS[layout][1]])
