"""Tensor parallel (+ sequence parallel, loss parallel, 2-D with FSDP) trains the same model as one process.

CPU, gloo. All work that needs the same number of ranks runs in one process group (a module-scoped
fixture), so the ranks start once per world size: several Trainers in a row, the collective counts,
and the bad settings. Tests then check parts of the results. The reference is the session fixture
``reference`` (one process, no process group; tests/conftest.py). The debugmodel flavor is GQA
(16 query / 8 key-value heads), so every layout also checks grouped-query attention on local heads.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.parity.compare import tolerance
from engine.testing.processes import run_distributed
from tests.training_utils import assert_parity, base_args, train_and_record

TP2, TP4 = {"parallelism.tp": 2, "parallelism.dp_shard": 1}, {"parallelism.tp": 4, "parallelism.dp_shard": 1}
TP2_FSDP2 = {"parallelism.tp": 2, "parallelism.dp_shard": 2, "training.local_batch_size": 4}
SP_LP = {"parallelism.sequence_parallel": "true", "parallelism.loss_parallel": "true"}
NO_SP_NO_LP = {"parallelism.sequence_parallel": "false", "parallelism.loss_parallel": "false"}
SP_ONLY = {"parallelism.sequence_parallel": "true", "parallelism.loss_parallel": "false"}
LP_ONLY = {"parallelism.sequence_parallel": "false", "parallelism.loss_parallel": "true"}
AC_COMPILE = {"activation_checkpoint.mode": "selective", "compile.enable": "true", "compile.backend": "aot_eager"}
# Every layout runs with and without sequence parallel and with and without loss parallel; the
# four combinations are spread over the layouts so that each Trainer run (the cost) adds one.
LAYOUTS = {
    # name: (world_size, overrides); the global batch is 8 sequences in every layout.
    "tp2_sp_lp": (2, {**TP2, **SP_LP}),
    "tp2_no_sp_no_lp": (2, {**TP2, **NO_SP_NO_LP}),
    # The documented order TP -> activation checkpointing -> compile (aot_eager: no code generation).
    "tp2_sp_lp_ac_compile": (2, {**TP2, **SP_LP, **AC_COMPILE}),
    # Eager per-op AC: "op" keeps the reduce-scatter outputs of sequence parallel (and recomputes
    # every second matmul), the cached collective results must give the same gradients.
    "tp2_sp_ac_op": (2, {**TP2, **SP_ONLY, "activation_checkpoint.mode": "selective"}),
    "tp4_sp_only": (4, {**TP4, **SP_ONLY}),
    "tp4_lp_only": (4, {**TP4, **LP_ONLY}),
    "tp2_fsdp2_sp_lp": (4, {**TP2_FSDP2, **SP_LP}),
    "tp2_fsdp2_no_sp_no_lp": (4, {**TP2_FSDP2, **NO_SP_NO_LP}),
}

BAD_SETTINGS = {
    # name: (overrides for 2 ranks with tp 2, fragments of the message)
    "vocab": ({"model.vocab_size": 4097}, ("vocabulary size 4097", "model.vocab_size = 4098")),
    "seq_len": ({"training.seq_len": 63}, ("training.seq_len = 63", "parallelism.tp = 2", "sequence_parallel = false")),
    "async_tp": ({"parallelism.async_tp": "true"}, ("parallelism.async_tp = true", "CUDA", "compile.enable")),
}


# ---------------------------------------------------------------- work done inside the ranks


def _collectives_per_block(sequence_parallel: bool) -> dict:
    """Collective calls in one block's forward and backward, and in one whole-model forward (tp 2)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from models import get_model_args
    from models.common.decoder import Transformer
    from models.common.parallelize import llama_tp_plan
    from parallelisms.tensor_parallel import apply_tp_plan

    args = dataclasses.replace(get_model_args("llama", "debugmodel"), n_layers=1, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply_tp_plan(model, mesh, llama_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=True))
    # The block's input as the residual stream holds it: a sequence shard with SP, else all of it.
    x = torch.randn(2, 8 if sequence_parallel else 16, args.dim, requires_grad=True)

    def counts(mode) -> dict:
        return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}

    with CommDebugMode() as fwd:
        out = model.layers["0"](x, model.rope_cos, model.rope_sin)
    with CommDebugMode() as bwd:
        out.sum().backward()
    with CommDebugMode() as whole, torch.no_grad():
        model(torch.randint(0, args.vocab_size, (2, 16)))
    return {"forward": counts(fwd), "backward": counts(bwd), "model_forward": counts(whole)}


def _clip_over_mixed_meshes() -> dict:
    """clip_grad_norm_ over gradients as TP + FSDP leave them (4 ranks, 2 × 2 mesh) vs the full tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from parallelisms.grad_norm import clip_grad_norm_

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = [
        (mesh, [Shard(0), Shard(1)]),  # FSDP over a row-parallel weight
        (mesh, [Shard(0), Shard(0)]),  # FSDP over a column-parallel weight
        (mesh, [Shard(0), Replicate()]),  # FSDP over a sequence-parallel norm weight
        (mesh["tp"], [Shard(0)]),  # TP alone
        (mesh["tp"], [Replicate()]),  # SP norm weight without FSDP
        None,  # a plain tensor, equal on every rank
    ]
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(8, 6, generator=generator) for _ in range(len(layouts) + 1)]
    fulls.append(torch.randn(6, generator=generator))
    params = []
    for full, layout in zip(fulls, layouts):
        param = torch.nn.Parameter(torch.zeros_like(full) if layout is None else distribute_tensor(full * 0, *layout))
        # clone: a replicated DTensor may share the full tensor's storage, and clipping is in place.
        param.grad = full.clone() if layout is None else distribute_tensor(full.clone(), *layout)
        params.append(param)
    # Sequence parallel's pending gradients: each tp rank holds half of the sum (two, of different
    # shapes, which are reduced together in one buffer).
    for full in fulls[-2:]:
        partial = torch.nn.Parameter(distribute_tensor(full * 0, mesh["tp"], [Replicate()]))
        partial.grad = DTensor.from_local(full / 2, mesh["tp"], [Partial("sum")])
        params.append(partial)
    want = torch.stack([f.double().norm() for f in fulls]).norm()
    norm = clip_grad_norm_(params, max_norm=1.0)
    scale = 1.0 / (want + 1e-6)
    clip_error = max(
        float(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - f * scale).abs().max())
        for p, f in zip(params, fulls)
    )
    return {"norm": float(norm), "want": float(want), "clip_error": clip_error}


def _vocab_parallel_embedding(sequence_parallel: bool) -> dict:
    """A 2-rank VocabParallelEmbedding against the full nn.Embedding: output, weight gradient, layout."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from parallelisms.tensor_parallel import VocabParallelEmbedding, apply_tensor_parallel
    from tests.training_utils import gradient_placement_errors

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = torch.nn.Embedding(8, 3)
    sharded = torch.nn.Embedding(8, 3)
    sharded.load_state_dict(full.state_dict())
    apply_tensor_parallel(sharded, mesh, {"": VocabParallelEmbedding(output_layouts=Shard(1) if sequence_parallel else Replicate())})
    ids = torch.tensor([[0, 5, 7, 3], [4, 4, 1, 6]])  # ids of both ranks' rows, repeated ids
    upstream = torch.randn(2, 4, 3)
    want = full(ids)
    (want * upstream).sum().backward()
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2) if sequence_parallel else slice(None)
    got = sharded(ids)
    (got * upstream[:, rows]).sum().backward()
    return {
        "output_error": float((got - want[:, rows]).abs().max()),
        "grad_error": float((sharded.weight.grad.full_tensor() - full.weight.grad).abs().max()),
        "layout_errors": gradient_placement_errors([sharded.weight]),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_keeps_gradient_sharded(sequence_parallel):
    """Same output and gradient as nn.Embedding, and the gradient is the rank's row shard (torch's
    RowwiseParallel leaves a full-size replicated gradient on every rank)."""
    for result in run_distributed(_vocab_parallel_embedding, 2, sequence_parallel, timeout=60):
        assert result["output_error"] < 1e-6 and result["grad_error"] < 1e-6, result
        assert result["layout_errors"] == [], result


def _startup_error(argv: list[str]) -> str:
    """The message of the error a Trainer raises at start-up ("" if none)."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    cfg.validate()
    try:
        Trainer(cfg).close()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _rank_work(folder: str, world_size: int) -> dict:
    """Everything this world size checks, in one process group: trainings, counts, bad settings."""
    results: dict = {"histories": {}, "errors": {}}
    for name, (size, overrides) in LAYOUTS.items():
        if size == world_size:
            results["histories"][name] = train_and_record(base_args(f"{folder}/{name}", overrides))
    if world_size == 2:
        results["collectives"] = {sp: _collectives_per_block(sp) for sp in (True, False)}
        for name, (overrides, _) in BAD_SETTINGS.items():
            argv = base_args(f"{folder}/bad_{name}", {"parallelism.tp": 2, "parallelism.dp_shard": 1, **overrides})
            results["errors"][name] = _startup_error(argv)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """{world_size: [per-rank results of _rank_work]}, computed once per world size."""
    cache: dict[int, list] = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            folder = str(tmp_path_factory.mktemp(f"tp_world{world_size}"))
            cache[world_size] = run_distributed(_rank_work, world_size, folder, world_size, timeout=300)
        return cache[world_size]

    return get


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_one_process(layout, rank_results, reference):
    world_size, _ = LAYOUTS[layout]
    # Every rank (tp peers included) reports the same reduced loss and grad norm.
    for results in rank_results(world_size):
        assert_parity(results["histories"][layout], reference)


def _first_step(folder: str) -> list:
    return list(train_and_record(base_args(folder, {**TP2, "training.steps": 1})))


def test_real_plan_built_in_process_stays_tied_and_leaves_no_state(tmp_path, reference):
    """parallelize_module distributes each module's weight on its own; apply_tp_plan points the output
    back at the embedding's DTensor (parallelisms/tensor_parallel.py), so the tied matrix stays one
    vocab-sharded parameter that the optimizer updates once: the real plan of a tp 2 rank, built on
    the meta device under a fake process group, in this process. Ranks forked from it afterwards
    train step 1 as one process does: the fake group's meshes are forgotten on exit
    (engine/planner/real_plan.py ``forget_meshes``; kept, tp rank 1 computed rank 0's shards)."""
    from torch.distributed.tensor import Shard

    from engine.config import load_config
    from engine.planner.real_plan import build_real_plan

    cfg = load_config(base_args(str(tmp_path / "plan"), {"model.tie_embeddings": "true", **TP2}))
    cfg.validate()
    (part,) = build_real_plan(cfg, 2, 0, device_type="cpu").parts
    assert part.output.weight is part.tok_embeddings.weight
    assert part.output.weight.placements == (Shard(0),)
    assert "output.weight" not in dict(part.named_parameters())  # counted, and stepped, once
    (ref_loss, ref_norm), tol = reference[0], tolerance(1)
    for ((loss, norm),) in run_distributed(_first_step, 2, str(tmp_path / "tp2")):
        assert math.isclose(loss, ref_loss, rel_tol=tol) and math.isclose(norm, ref_norm, rel_tol=tol), \
            (loss, norm, ref_loss, ref_norm)


def test_grad_norm_and_clipping_over_mixed_meshes():
    """Shards counted once, replicas not twice, pending (Partial) gradients reduced, every rank equal."""
    for clip in run_distributed(_clip_over_mixed_meshes, 4, timeout=120):
        assert clip["norm"] == pytest.approx(clip["want"], rel=1e-6), clip
        assert clip["norm"] > 1.0 and clip["clip_error"] < 1e-6, clip  # clipping did scale


# ---------------------------------------------------------------- collectives


def test_collectives_per_block_follow_megatron(rank_results):
    """Megatron-LM §3: one all-reduce per sub-block in forward and one in backward; with sequence
    parallel (arXiv 2205.05198 §4.2.2) each becomes an all-gather plus a reduce-scatter."""
    counts = rank_results(2)[0]["collectives"]
    sp, plain = counts[True], counts[False]
    # Two sub-blocks (attention, feed-forward) per block.
    assert plain["forward"] == {"all_reduce": 2}, plain
    assert plain["backward"] == {"all_reduce": 2}, plain
    assert sp["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, sp
    assert sp["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, sp
    # Whole model, one block: embedding (reduce-scatter / all-reduce of the partial lookups),
    # the block, and the output's input gather with SP; loss parallel leaves the logits sharded.
    assert sp["model_forward"] == {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 3}, sp
    assert plain["model_forward"] == {"all_reduce": 3}, plain


# ---------------------------------------------------------------- start-up validation


@pytest.mark.parametrize("name", list(BAD_SETTINGS))
def test_bad_setting_fails_on_every_rank(name, rank_results):
    _, fragments = BAD_SETTINGS[name]
    for rank, results in enumerate(rank_results(2)):
        message = results["errors"][name]
        assert message.startswith("TensorParallelError"), (rank, message)
        for fragment in fragments:
            assert fragment in message, (rank, fragment, message)


def _validate(tp: int, *, seq_len: int = 64, device_type: str = "cpu", compile_enabled: bool = False, **changes):
    from engine.config.schema_scale import ParallelismSection
    from models import get_model_args
    from models.registry import get_model_spec

    knobs = {k: changes.pop(k) for k in ("sequence_parallel", "loss_parallel", "async_tp") if k in changes}
    args = dataclasses.replace(get_model_args("llama", "debugmodel"), **changes)
    cfg = ParallelismSection(tp=tp, **knobs)
    get_model_spec("llama").validate_parallelism_fn(args, cfg, seq_len=seq_len, device_type=device_type,
                                                    compile_enabled=compile_enabled)


@pytest.mark.parametrize(
    "tp, changes, fragments",
    [
        (8, {"dim": 252, "n_heads": 6, "n_kv_heads": 6}, ("parallelism.tp = 8", "dim = 252")),
        (4, {"n_heads": 2, "n_kv_heads": 2, "dim": 256}, ("n_heads = 2",)),
        (4, {"n_heads": 16, "n_kv_heads": 2}, ("n_kv_heads = 2",)),  # GQA: fewer kv heads than tp
        (3, {"dim": 192, "n_heads": 6, "n_kv_heads": 6}, ("ffn_hidden_dim) = 512",)),
        (2, {"vocab_size": 4097}, ("vocabulary size 4097", "model.vocab_size = 4098")),
        (4, {"vocab_size": 4097}, ("model.vocab_size = 4100",)),
        (2, {"seq_len": 65}, ("training.seq_len = 65", "sequence_parallel = false")),
        (2, {"async_tp": True}, ("parallelism.async_tp = true", "CUDA", "compile.enable = true")),
        (2, {"async_tp": True, "device_type": "cuda"}, ("compile.enable = true",)),
        (2, {"async_tp": True, "device_type": "cuda", "compile_enabled": True, "sequence_parallel": False},
         ("sequence_parallel = true",)),
        (1, {"async_tp": True, "device_type": "cuda", "compile_enabled": True}, ("parallelism.tp > 1",)),
    ],
)
def test_validation_names_setting_value_and_fix(tp, changes, fragments):
    from parallelisms.tensor_parallel import TensorParallelError

    changes = dict(changes)
    kwargs = {k: changes.pop(k) for k in ("seq_len", "device_type", "compile_enabled") if k in changes}
    with pytest.raises(TensorParallelError) as info:
        _validate(tp, **kwargs, **changes)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize(
    "tp, kwargs",
    [
        (2, {}),
        (8, {}),  # debugmodel: 16 / 8 heads, 8 / 8 kv heads
        (2, {"seq_len": 65, "sequence_parallel": False}),  # no sequence split, no constraint
        (1, {"seq_len": 65, "vocab_size": 4097}),  # tp 1 shards nothing
        (2, {"async_tp": True, "device_type": "cuda", "compile_enabled": True}),
    ],
)
def test_validation_accepts(tp, kwargs):
    _validate(tp, **kwargs)
