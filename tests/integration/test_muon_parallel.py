"""Muon under sharded layouts (engine/train/muon.py), in 4 gloo processes: FSDP2 rows (uneven), tensor
parallel columns, both on a 2-D mesh, HSDP (replicated x sharded), FSDP2 over tensor parallel (the
real ``fully_shard`` of a ``ColwiseParallel`` weight: a strided shard), expert weights sharded on the
expert dim (local experts) and inside each expert. Every parameter after 3 steps equals, bitwise, one
process's Muon on the whole matrices, and the Newton–Schulz work is spread over the ranks."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

from engine.testing.processes import run_distributed

STEPS = 3


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _layouts():
    """(name, global shape, mesh dim names, placements) of the hand-made DTensor parameters."""
    from torch.distributed.tensor import Replicate, Shard

    return [
        ("fsdp_rows_uneven", (26, 16), ("world",), (Shard(0),)),
        ("tp_columns", (16, 20), ("tp",), (Shard(1),)),
        ("fsdp_x_tp", (24, 20), ("dp", "tp"), (Shard(0), Shard(1))),
        ("hsdp", (24, 16), ("dp", "tp"), (Replicate(), Shard(0))),
        ("experts_local", (4, 12, 8), ("world",), (Shard(0),)),
        ("experts_split", (2, 12, 8), ("dp", "tp"), (Shard(0), Shard(1))),
    ]


def _muon_group(params, **extra):
    from engine.train.muon import DEFAULT_NS_COEFFICIENTS, NS_EPS

    return {"params": params, "algorithm": "muon", "name": "muon", "lr": 0.02, "weight_decay": 0.1,
            "momentum": 0.95, "nesterov": True, "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "ns_steps": 5,
            "eps": NS_EPS, "adjust_lr_fn": "match_rms_adamw", "ns_dtype": "bfloat16", **extra}


def _rank_run():
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import engine.train.muon as muon

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    meshes = {("world",): world, ("tp",): mesh["tp"], ("dp", "tp"): mesh}
    params, fulls = [], []
    for i, (name, shape, dims, placements) in enumerate(_layouts()):
        full = _full(shape, i)
        params.append(nn.Parameter(distribute_tensor(full, meshes[dims], list(placements))))
        fulls.append(full)
    # FSDP2 over tensor parallel: fully_shard's own placements of a column-parallel weight.
    block = nn.Sequential(nn.Linear(16, 24, bias=False))
    with torch.no_grad():
        block[0].weight.copy_(_full((24, 16), 99))
    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
    params.append(block[0].weight)
    fulls.append(_full((24, 16), 99))
    placements = [str(p.placements) for p in params]

    optimizer = muon.MuonWithAdamW([_muon_group(params)], {})
    reference = [nn.Parameter(f.clone()) for f in fulls]
    ref_state: dict = defaultdict(dict)
    calls = {"n": 0}
    original = muon.zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    for step in range(STEPS):
        for i, (p, r) in enumerate(zip(params, reference)):
            grad = _full(r.shape, 1000 * step + i)
            r.grad = grad.clone()
            p.grad = DTensor.from_local(grad, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                        run_check=False).redistribute(p.device_mesh, p.placements)
        muon.zeropower_via_newtonschulz = counted
        optimizer.step()
        muon.zeropower_via_newtonschulz = original
        with torch.no_grad():  # plain tensors: one process
            muon.muon_group_step(_muon_group(reference), ref_state, muon._Owners())
    same = [bool(torch.equal(p.full_tensor(), r.detach())) for p, r in zip(params, reference)]
    return {"same": same, "calls": calls["n"], "placements": placements}


def test_muon_under_sharded_layouts_equals_one_process_bitwise():
    results = run_distributed(_rank_run, 4, timeout=240)
    names = [name for name, *_ in _layouts()] + ["fsdp_over_tp_colwise"]
    for rank, result in enumerate(results):
        failed = [n for n, ok in zip(names, result["same"]) if not ok]
        assert not failed, (rank, failed, result["placements"])
    assert results[0]["placements"][-1].startswith("(_StridedShard(dim=0")  # the composition is covered
    # Each whole matrix is orthogonalised once per group of ranks holding its pieces: fsdp rows 1,
    # tp columns 1 per dp row (2), fsdp x tp 1, hsdp 1 per replica (2), split experts 2 (one each),
    # fsdp over tp 1, local experts 4 (each rank its own) = 13 per step; every rank repeating every
    # matrix would make 4 x 7 + 4 = 32.
    per_rank = [r["calls"] / STEPS for r in results]
    assert sum(per_rank) == 13, per_rank


def test_muon_checkpoint_resumes_bitwise_and_on_another_layout(tmp_path):
    """fsdp2 Muon, 10 steps, saving at 5: the run resumed from step-5 gives the same losses and the same
    step-10 checkpoint (weights, momentum buffers, Adam moments) bitwise; one process resumed from the
    same step-5 (DCP reshards the momentum buffers) follows it to 1e-5 (another summation order).
    Newton-Schulz in float32 here: a bfloat16 rounding flip across layouts would be a 4e-3 step."""
    from tests.checkpoint_utils import (STEPS, STOP, assert_bitwise_equal, assert_losses_close, ckpt_args,
                                        copy_checkpoint, read_checkpoint, train_run, write_tiny_corpus)

    corpus = write_tiny_corpus(str(tmp_path))
    muon = {"optimizer.name": "Muon", "optimizer.muon_ns_dtype": "float32", "loss.z_loss_weight": "0.001"}
    fsdp2 = {**muon, "parallelism.dp_shard": 2, "training.local_batch_size": 4}
    full_folder, resumed_folder, single_folder = (str(tmp_path / n) for n in ("full", "resumed", "single"))
    full = run_distributed(train_run, 2, ckpt_args(full_folder, corpus, fsdp2), None, None)[0]
    copy_checkpoint(full_folder, resumed_folder, STOP)
    copy_checkpoint(full_folder, single_folder, STOP)
    resumed = run_distributed(train_run, 2, ckpt_args(resumed_folder, corpus, fsdp2), None, None)[0]
    after = {s: full["losses"][s] for s in range(STOP + 1, STEPS + 1)}
    assert resumed["start_step"] == STOP and resumed["losses"] == after
    got = read_checkpoint(os.path.join(resumed_folder, "checkpoint", f"step-{STEPS}"), str(tmp_path / "got.pt"))
    want = read_checkpoint(os.path.join(full_folder, "checkpoint", f"step-{STEPS}"), str(tmp_path / "want.pt"))
    assert any(key.endswith("momentum_buffer") for key in want) and any(key.endswith("exp_avg") for key in want)
    assert_bitwise_equal(got, want, "Muon step-10 checkpoint, resumed vs uninterrupted")
    (single,) = run_distributed(train_run, 1, ckpt_args(single_folder, corpus, {**muon, "training.local_batch_size": 8}),
                                None, None, torchrun_env=False)
    assert single["start_step"] == STOP
    assert_losses_close(single["losses"], after, rel=1e-5)
    # The z-loss is logged on its own (its share of the logged loss, which includes it).
    records = [json.loads(line) for line in open(os.path.join(full_folder, "metrics.jsonl"), encoding="utf-8")]
    train = [r for r in records if r.get("kind") == "train"]
    assert train and all(0 < r["z_loss"] < r["loss"] for r in train), train[:2]


# The float64 reference mode (what ./scripts/parity.py --precision fp64 sets), Muon's Newton-Schulz in
# float64 too, and the z-loss; clipping engaged on every step (max_norm 0.405 under the Muon run's grad
# norms 0.51-0.54).
MUON_FP64 = {"optimizer.name": "Muon", "training.max_norm": "0.405", "loss.z_loss_weight": "0.001",
             "training.mixed_precision_param": "float64", "training.mixed_precision_reduce": "float64",
             "optimizer.muon_ns_dtype": "float64"}


def test_muon_and_z_loss_float64_layouts_match_one_process_to_1e12(tmp_path):
    """Muon and the z-loss in the float64 reference mode: FSDP2 x TP (strided shards, the vocab-sharded
    fused loss) and a pipeline (1F1B) agree with one process to 1e-12 (loss, grad norm, validation)
    with clipping engaged. In forked ranks: ./scripts/parity.py's launcher path is tests/integration/test_parity.py's.
    (The first test of this file covers the other placements bitwise.)"""
    import math

    from tests.training_utils import base_args, clipping_sides, train_and_record

    (single,) = run_distributed(train_and_record, 1, base_args(str(tmp_path / "one"), MUON_FP64), torchrun_env=False)
    assert clipping_sides(single, max_norm=0.405)[0] == len(single), single
    layouts = {
        "fsdp2xtp2": (4, {"parallelism.dp_shard": 2, "parallelism.tp": 2, "training.local_batch_size": 4}),
        "pp2_1f1b": (2, {"parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_schedule": "1F1B",
                         "parallelism.pp_microbatch_size": 4}),
    }
    for name, (world_size, overrides) in layouts.items():
        for history in run_distributed(train_and_record, world_size,
                                       base_args(str(tmp_path / name), {**MUON_FP64, **overrides})):
            pairs = [*zip(history, single), *zip(history.validation, single.validation)]
            assert len(history) == len(single) and len(history.validation) == len(single.validation) == 3, name
            for got, want in pairs:
                assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, want)), (name, got, want)


def test_muon_float32_fsdp2_equals_one_process_with_clipping(tmp_path):
    """The fp32 parity of a Muon layout with clipping engaged on every step (max_norm 0.405 under the
    Muon run's grad norms 0.51-0.54), float32 Newton-Schulz (a bfloat16 one lets fp32 rounding
    differences flip bfloat16 roundings, see engine/docs/optimizers.md): fsdp2 equals one process at the
    fp32 standard (tests/training_utils.py ``assert_parity``: loss, grad norm, validation). In forked
    ranks (the launcher's path is the fp64 sweep's above)."""
    from tests.training_utils import MAX_NORM, assert_parity, base_args, clipping_sides, train_and_record

    muon = {"optimizer.name": "Muon", "optimizer.muon_ns_dtype": "float32", "training.max_norm": "0.405"}
    (single,) = run_distributed(train_and_record, 1, base_args(str(tmp_path / "one"), muon), torchrun_env=False)
    assert clipping_sides(single, max_norm=0.405)[0] == len(single) and 0.405 < MAX_NORM, single
    for history in run_distributed(train_and_record, 2, base_args(str(tmp_path / "fsdp2"), {
            **muon, "parallelism.dp_shard": 2, "training.local_batch_size": 4})):
        assert_parity(history, single)
