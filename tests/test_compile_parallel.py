"""torch.compile with context parallel and with the MoE family trains like one eager process (gloo, CPU):
loss, grad norm and validation, clipping engaged.

Every layout runs in ONE set of 4 forked ranks (tests/training_utils.py ``run_in_turn``): a compile is
paid per rank and layout, so ranks are not forked again per layout. The layouts use the ``aot_eager``
backend: Dynamo and AOTAutograd trace the blocks (forward and backward graphs, the ring's custom
operator as an opaque node, the MoE block's compiled parts) exactly as they would for inductor,
without inductor's C++ code generation (20-40 s per rank on this CPU, ~34 s of this file's 95 s).
Inductor's lowering is checked by tests/test_ac_compile.py (the dense model) and the ring operator's
fake kernel (what inductor reads: shapes, strides) by opcheck in tests/test_ring_attention.py.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.test_document_mask_parity import _data, corpus  # noqa: F401  (corpus is a fixture)
from tests.training_utils import assert_parity, base_args, clipping_sides, run_in_turn, train_and_record

pytestmark = pytest.mark.slow  # multi-process training (see pyproject.toml)

AOT = {"compile.enable": "true", "compile.backend": "aot_eager"}
MOE = {"model.name": "moe"}
MASK = {"document_mask.enable": "true"}
CP2_FSDP2 = {"parallelism.cp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4}

# name: (overrides, reference); all on 4 ranks.
LAYOUTS = {
    "cp2_x_fsdp2": ({**CP2_FSDP2, **AOT}, "dense"),
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


def _train_compiled(folder: str, layouts: dict[str, dict]) -> dict:
    """In every rank, each layout in turn with Dynamo's caches cleared first: every layout builds new
    modules, so each would recompile the shared code objects (the blocks' forward) and five layouts
    in one process reach Dynamo's recompile limit, which fullgraph turns into an error. A training
    process builds one model."""
    import torch

    def one(name, overrides):
        torch._dynamo.reset()
        return train_and_record(base_args(f"{folder}/{name}", overrides))

    return run_in_turn(layouts, one)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):  # noqa: F811
    layouts = {name: {**overrides, **(_data(corpus) if ref == "mask" else {})} for name, (overrides, ref) in LAYOUTS.items()}
    results = run_distributed(_train_compiled, 4, str(tmp_path_factory.mktemp("compile_parallel")), layouts,
                              timeout=1200)
    return {name: [rank[name] for rank in results] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_equals_one_eager_process(layout, references, runs):
    for history in runs[layout]:
        assert not isinstance(history, str), f"layout {layout}:\n{history}"
        assert_parity(history, references[LAYOUTS[layout][1]])
