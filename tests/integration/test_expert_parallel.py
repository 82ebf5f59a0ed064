"""Expert parallel and the MoE model under the other parallelisms: loss and grad-norm parity against
one process (gloo, CPU), and an expert-parallel layer whose experts or ranks receive no tokens.

To keep CI fast, the layouts of one world size train one after another in the same forked ranks
(one process group, a fresh Trainer and mesh per layout); each layout is still its own test.

``<layout>_compiled``: the same layout with torch.compile, which compiles an MoE block's static-shape
parts (attention, router, shared experts) and leaves token routing and the all-to-all eager
(parallelisms/compile.py); every context-parallel layout, plain ep2 and ep2 × FSDP.
"""

from __future__ import annotations

import math

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import MOE_FLAVOR, assert_parity, base_args, train_and_record, train_layouts, with_compiled_twins


MOE = {"model.name": "moe"}
MIXTRAL = {"model.name": "moe", "model.flavor": "debugmodel_mixtral_tiny"}

# name: (world_size, overrides); every layout trains on the same global batch of 8 sequences.
LAYOUTS = with_compiled_twins({
    "ep2": (2, {**MOE, "parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 4}),
    # The first stage holds only the dense layer 0: a stage without MoE layers.
    "pp2_dense_first_stage": (
        2, {**MOE, "parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_split_points": "layers.1"},
    ),
    # Softmax routing with the balance loss in the objective, and 2 accumulation microbatches.
    "mixtral_ep2_aux_loss_accum2": (
        2, {**MIXTRAL, "parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 2},
    ),
    # Tensor parallel without sequence parallel: MoE layers replicated on the tp ranks.
    "tp2_no_sequence_parallel": (
        2, {**MOE, "parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.sequence_parallel": "false"},
    ),
    # Expert parallel over the context-parallel ranks (each holds half of every sequence).
    "ep2_over_cp2": (2, {**MOE, "parallelism.cp": 2, "parallelism.dp_shard": 1, "parallelism.ep": 2}),
    # The sequence-wise balance loss in the objective under context parallel: each cp rank adds its
    # share of the whole sequence's loss (taken per half-sequence, it changed loss and gradients).
    "mixtral_cp2_aux_loss": (2, {**MIXTRAL, "parallelism.cp": 2, "parallelism.dp_shard": 1}),
    # Each expert group of 2 ranks is FSDP-sharded over the other 2 ranks (dp_shard_mod_ep = 2).
    "ep2_x_fsdp2": (4, {**MOE, "parallelism.dp_shard": 4, "parallelism.ep": 2, "training.local_batch_size": 2}),
    # HSDP: ep inside dp_shard = 2, experts replicated over dp_replicate = 2 (the run_train.sh
    # example of the MoE issue: NGPU=4 --parallelism.ep 2 --parallelism.dp_shard 2, debug_moe.toml).
    "ep2_hsdp2x2": (
        4, {**MOE, "parallelism.dp_replicate": 2, "parallelism.dp_shard": 2, "parallelism.ep": 2,
            "training.local_batch_size": 2},
    ),
    # ep 2 spans the tp ranks (ep = tp = 2, parallelisms/parallel_dims.py ep_spans_tp): the experts are split
    # over tp, each tp rank dispatching its sequence shard; FSDP over dp_shard 2.
    "ep2_x_tp2": (
        4, {**MOE, "parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.ep": 2,
            "training.local_batch_size": 4},
    ),
    # Expert parallel inside each pipeline stage, FSDP over the stage's ranks.
    "ep2_x_pp2": (
        4, {**MOE, "parallelism.pp": 2, "parallelism.dp_shard": 2, "parallelism.ep": 2,
            "training.local_batch_size": 4, "parallelism.pp_microbatch_size": 2},
    ),
}, also=("ep2", "ep2_x_fsdp2"))


def _train_layouts(folder: str, names: list[str], zero_token_check: bool) -> dict:
    results = {"ep_zero_tokens": _zero_token_check() if zero_token_check else None}
    results["bad_ep"] = _startup_error(base_args(f"{folder}/bad_ep", {**MOE, "parallelism.ep": 3}))
    results.update(train_layouts(folder, {name: LAYOUTS[name][1] for name in names}))
    return results


def _references(folder: str) -> dict:
    return {
        flavor: train_and_record(base_args(f"{folder}/{flavor}", {"model.name": "moe", "model.flavor": flavor}))
        for flavor in (MOE_FLAVOR, MIXTRAL["model.flavor"])
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("moe_single"))
    (result,) = run_distributed(_references, 1, folder, torchrun_env=False, timeout=600)
    for history in result.values():
        # 5 steps of 32-token batches: the loss moves less than it varies from batch to batch, so
        # only finiteness is checked; the one-process engine is checked against a plain PyTorch
        # loop in tests/integration/test_reference_loop.py.
        assert len(history) == 5 and all(math.isfinite(loss) for loss, _ in history), history
    return result


def _runs(tmp_path_factory, world_size):
    names = [name for name, (ws, _) in LAYOUTS.items() if ws == world_size]
    folder = str(tmp_path_factory.mktemp(f"moe_ws{world_size}"))
    return run_distributed(_train_layouts, world_size, folder, names, world_size == 2, timeout=600)


@pytest.fixture(scope="module")
def runs_2(tmp_path_factory):
    return _runs(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _runs(tmp_path_factory, 4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_parity_with_one_process(layout, references, request):
    world_size, overrides = LAYOUTS[layout]
    results = request.getfixturevalue(f"runs_{world_size}")
    reference = references[overrides.get("model.flavor", MOE_FLAVOR)]
    for rank_results in results:  # every rank reports the same global loss and grad norm
        assert not isinstance(rank_results[layout], str), f"layout {layout}:\n{rank_results[layout]}"
        assert_parity(rank_results[layout], reference)


def _startup_error(argv: list[str]) -> str:
    """The message of the error a Trainer raises at start-up ("" if none)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    try:
        Trainer(load_config(argv)).close()
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_ep_fails_on_every_rank_at_start_up(world_size, request):
    for rank_results in request.getfixturevalue(f"runs_{world_size}"):
        assert "parallelism.ep = 3 must divide dp_shard×cp" in rank_results["bad_ep"], rank_results["bad_ep"]


def _zero_token_check() -> dict:
    """ep = 2 over 4 experts, with every token routed to experts 0 and 1 (rank 0's): rank 1 receives
    no token. The layer must not hang, must equal the one-process layer, and rank 1's experts must
    get zero gradients (not None, so gradient reduction sees the same tensors everywhere)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from parallelisms.expert_parallel import ExpertParallel
    from tests.unit.test_moe import TINY, build_layer

    dist.init_process_group("gloo")  # the trainers below reuse it
    rank = dist.get_rank()
    reference = build_layer(n_shared_experts=0, load_balance_coeff=0.1)
    layer = build_layer(n_shared_experts=0, load_balance_coeff=0.1)
    for moe in (reference, layer):
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    parallelize_module(layer.experts, init_device_mesh("cpu", (2,)), ExpertParallel())
    with torch.no_grad():  # the same weights as the reference, each rank its two experts
        for name in ("w1", "w2", "w3"):
            getattr(layer.experts, name).to_local().copy_(getattr(reference.experts, name)[2 * rank: 2 * rank + 2])
    x = torch.randn(2, 8, TINY.dim, generator=torch.Generator().manual_seed(rank))
    out = layer(x)
    out.square().sum().backward()
    expected = reference(x)
    expected.square().sum().backward()
    # An expert's gradient sums over the tokens of every rank: the references' gradients, summed.
    reference_grad = reference.experts.w1.grad.clone()
    dist.all_reduce(reference_grad)
    reference_grad = reference_grad[2 * rank: 2 * rank + 2]
    grad = layer.experts.w1.grad.to_local()
    return {
        "max_error": float((out - expected).abs().max()),
        "grad_error": float((grad - reference_grad).abs().max()),
        "grad_sum": float(grad.abs().sum()),
    }


def test_rank_without_tokens_gets_zero_gradients(runs_2):
    checks = [rank_results["ep_zero_tokens"] for rank_results in runs_2]
    assert all(c["max_error"] < 1e-5 and c["grad_error"] < 1e-5 for c in checks), checks
    # Rank 1 holds experts 2 and 3, which no token chose: defined, zero gradients.
    assert checks[1]["grad_sum"] == 0.0 and checks[0]["grad_sum"] > 0, checks


def test_experts_are_sharded_in_the_fsdp_step(monkeypatch, tmp_path):
    """The driver shards the experts after CP, activation checkpointing (and compile) and just before
    the blocks' FSDP units, as its docstring orders (parallelisms/parallelize.py): the real plan of an
    ep 2 × cp 2 layout with full AC, built on the meta device under a fake process group, records
    the order of the steps."""
    import parallelisms.expert_parallel as expert_parallel
    import parallelisms.parallelize as driver
    from engine.config import load_config
    from engine.planner.real_plan import build_real_plan

    order = []

    def record(name, real):
        def wrapped(*args, **kwargs):
            order.append(name)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(driver, "apply_cp", record("cp", driver.apply_cp))
    monkeypatch.setattr(driver, "apply_activation_checkpointing", record("ac", driver.apply_activation_checkpointing))
    monkeypatch.setattr(driver, "apply_fsdp", record("fsdp", driver.apply_fsdp))
    monkeypatch.setattr(expert_parallel, "shard_module", record("experts", expert_parallel.shard_module))
    cfg = load_config(base_args(str(tmp_path), {**MOE, "parallelism.cp": "2", "parallelism.dp_shard": "2",
                                                "parallelism.ep": "2", "activation_checkpoint.mode": "full",
                                                "training.local_batch_size": "4"}))
    cfg.validate()
    build_real_plan(cfg, 4, 0, device_type="cpu")
    experts = [i for i, name in enumerate(order) if name == "experts"]
    assert experts and order.index("cp") < order.index("ac") < experts[0]
    assert experts[-1] < order.index("fsdp"), order


# ---------------------------------------------------------------------- routed experts over tp
# ep spanning tp (parallelisms/parallel_dims.py ``ep_over_tp``): each tp rank routes and dispatches its
# own sequence shard (models/common/moe_parallelize.py). In the float64 reference mode, where every
# layout agrees with one process to ~1e-15, so a tp rank that dispatched another's tokens (its experts'
# gradients doubled: 7e-5 off at step 1, 1e-3 by step 4 in fp64) cannot hide under fp32 rounding.
# lr 6e-2: step 3 clipped, steps 1-2 not (grad norms 0.54, 0.55, 0.72 around MAX_NORM 0.65).
FP64_MOE = {**MOE, "training.mixed_precision_param": "float64", "training.mixed_precision_reduce": "float64",
            "optimizer.lr": "6e-2"}
EP_OVER_TP = {
    # ep = tp = 2: the whole ep group is the tp group; sequence parallel (the default).
    "ep2_over_tp2": (2, {**FP64_MOE, "parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.ep": 2}),
    # Without sequence parallel each tp rank takes its slice of the replicated sequence.
    "ep2_over_tp2_no_sequence_parallel": (
        2, {**FP64_MOE, "parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.ep": 2,
            "parallelism.sequence_parallel": "false"},
    ),
    # Softmax routing with the sequence-wise balance loss in the objective: each tp rank adds its share.
    "mixtral_ep2_over_tp2_aux_loss": (
        2, {**FP64_MOE, **MIXTRAL, "parallelism.tp": 2, "parallelism.dp_shard": 1, "parallelism.ep": 2},
    ),
    # ep = 4 over cp 2 × tp 2: a sequence spread over 4 ranks (the balance loss's cp_tp group).
    "ep4_over_cp2_x_tp2": (
        4, {**FP64_MOE, "parallelism.tp": 2, "parallelism.cp": 2, "parallelism.dp_shard": 1, "parallelism.ep": 4},
    ),
    # ep = 4 over dp_shard 2 × tp 2: no FSDP of the experts left (dp_shard_mod_ep = 1).
    "ep4_over_tp2_x_dp_shard2": (
        4, {**FP64_MOE, "parallelism.tp": 2, "parallelism.dp_shard": 2, "parallelism.ep": 4,
            "training.local_batch_size": 4},
    ),
}


def _fp64_reference(folder: str) -> dict:
    return {flavor: train_and_record(base_args(f"{folder}/fp64_{flavor}", {**FP64_MOE, "model.flavor": flavor}))
            for flavor in (MOE_FLAVOR, MIXTRAL["model.flavor"])}


def _ep_over_tp_layouts(folder: str, names: list[str]) -> dict:
    return train_layouts(folder, {name: EP_OVER_TP[name][1] for name in names})


@pytest.fixture(scope="module")
def fp64_reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("moe_fp64_single"))
    (histories,) = run_distributed(_fp64_reference, 1, folder, torchrun_env=False, timeout=600)
    from tests.training_utils import clipping_sides

    clipped, unclipped = clipping_sides(histories[MOE_FLAVOR])
    assert clipped and unclipped, histories  # clipping engaged on some steps, not on others
    return histories


@pytest.fixture(scope="module")
def ep_over_tp_runs(tmp_path_factory):
    runs = {}
    for world_size in sorted({ws for ws, _ in EP_OVER_TP.values()}):
        names = [name for name, (ws, _) in EP_OVER_TP.items() if ws == world_size]
        folder = str(tmp_path_factory.mktemp(f"moe_ep_over_tp_ws{world_size}"))
        runs[world_size] = run_distributed(_ep_over_tp_layouts, world_size, folder, names, timeout=600)
    return runs


@pytest.mark.parametrize("layout", list(EP_OVER_TP))
def test_routed_experts_over_tp_parity_with_one_process(layout, fp64_reference, ep_over_tp_runs):
    world_size, overrides = EP_OVER_TP[layout]
    for rank_results in ep_over_tp_runs[world_size]:
        assert not isinstance(rank_results[layout], str), f"layout {layout}:\n{rank_results[layout]}"
        assert_parity(rank_results[layout], fp64_reference[overrides.get("model.flavor", MOE_FLAVOR)])


@pytest.mark.parametrize("degrees, fragment", [
    # Spanning tp, ep must be a multiple of cp × tp: 3 is not a multiple of tp = 2, nor does it divide dp_shard.
    ({"dp_shard": 2, "tp": 2, "ep": 3}, "parallelism.ep = 3 fits neither layout: split over tp it must be a "
                                        "multiple of cp×tp = 2 dividing dp_shard×cp×tp = 4"),
    # A multiple of tp that does not divide dp_shard × cp × tp.
    ({"dp_shard": 2, "tp": 2, "ep": 8}, "Set parallelism.ep to one of [2, 4]"),
])
def test_ep_over_tp_refusals(degrees, fragment):
    from parallelisms.parallel_dims import ParallelDims, ParallelismError

    settings = {"dp_replicate": 1, "cp": 1, "pp": 1, **degrees}
    world = settings["dp_replicate"] * settings["dp_shard"] * settings["cp"] * settings["tp"] * settings["pp"]
    with pytest.raises(ParallelismError) as error:
        ParallelDims(world_size=world, **settings)
    message = str(error.value)
    assert fragment in message and "\n" not in message, message


def test_ep_over_tp_is_chosen_when_it_fits():
    """ep spans tp when it is a multiple of cp × tp dividing dp_shard × cp × tp (TorchTitan 0.3's
    layout); otherwise tp replicates the experts (ep inside dp_shard × cp)."""
    from parallelisms.parallel_dims import ParallelDims

    def dims(**degrees):
        settings = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
        world = settings["dp_replicate"] * settings["dp_shard"] * settings["cp"] * settings["tp"] * settings["pp"]
        return ParallelDims(world_size=world, **settings)

    assert dims(tp=2, ep=2).ep_over_tp and dims(dp_shard=2, tp=2, ep=4).ep_over_tp
    assert dims(dp_shard=2, tp=2, ep=2).ep_over_tp  # preferred over replicating on tp
    assert not dims(dp_shard=2, cp=2, tp=2, ep=2).ep_over_tp  # not a multiple of cp × tp: beside tp
    assert not dims(dp_shard=2, ep=2).ep_over_tp


@pytest.mark.parametrize("degrees", [
    {"parallelism.tp": "2", "parallelism.ep": "2", "parallelism.dp_shard": "2"},  # experts FSDP over dp_shard 2
    {"parallelism.tp": "2", "parallelism.ep": "4", "parallelism.dp_shard": "2"},
])
def test_planner_formulas_equal_the_real_plan_on_every_rank_when_ep_spans_tp(degrees, tmp_path):
    """The planner's bytes per rank (engine/planner/params.py: the routed experts Shard(0) over the ep
    ranks including tp, FSDP over dp_shard_mod_ep) equal the real plan's, built on the meta device
    under a fake process group, on each of the 4 ranks (tp rank 1 holds other experts than tp rank 0)."""
    from engine.config import load_config
    from engine.planner.layout import Layout
    from engine.planner.memory import state_bytes
    from engine.planner.real_plan import build_real_plan

    cfg = load_config(base_args(str(tmp_path), {**MOE, **degrees, "training.local_batch_size": "4"}))
    cfg.validate()
    layout = Layout.from_config(cfg, 4, "cpu")
    for rank in range(4):
        real = build_real_plan(cfg, 4, rank, device_type="cpu")
        assert real.parallel_dims.ep_over_tp
        assert state_bytes(layout, real.coords) == real.state, (rank, real.coords)
