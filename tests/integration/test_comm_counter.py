"""parallelisms/comm_counter.py counts what the collectives carry; with it, gradient accumulation's
communication: one reduction per step with ``parallelism.grad_sync_each_microbatch = false``."""

from __future__ import annotations

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import base_args


def _counted_basics() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parallelisms.comm_counter import CommCounter

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Linear(4, 6)  # 24 + 6 fp32 parameters: 120 bytes
    fully_shard(model, mesh=mesh)
    with CommCounter() as comm:
        dist.all_reduce(torch.ones(3))  # 12 bytes, ring: 2·(n-1)/n·12 = 12
        model(torch.randn(2, 4)).sum().backward()
    return {"kinds": [r.kind for r in comm.records], "payload": [r.payload_bytes for r in comm.records],
            "wire": [r.wire_bytes for r in comm.records]}


def test_counter_sees_c10d_and_fsdp_collectives():
    for result in run_distributed(_counted_basics, 2, timeout=60):
        # all-reduce; forward all-gather of the weights (the root unit keeps them for backward);
        # backward reduce-scatter of the gradients.
        assert result["kinds"] == ["all_reduce", "all_gather", "reduce_scatter"], result
        assert result["payload"] == [12, 120, 120], result
        assert result["wire"] == [12.0, 60.0, 60.0], result


def _fsdp_step_bytes(folder: str) -> dict:
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train.trainer import Trainer
    from parallelisms.comm_counter import CommCounter

    results = {}
    for sync_each in ("true", "false"):
        cfg = load_config(base_args(f"{folder}/{sync_each}", {
            "parallelism.dp_shard": 2, "training.local_batch_size": 2, "training.steps": 1,  # A = 2
            "parallelism.grad_sync_each_microbatch": sync_each, "validation.enable": "false",
        }))
        cfg.validate()
        trainer = Trainer(cfg)
        try:
            group = trainer.parallel_dims.mesh("dp_shard_cp").get_group().group_name
            with CommCounter() as comm:
                trainer.train()
            param_bytes = sum(p.numel() * p.element_size() for p in trainer.model_parts[0].parameters())
        finally:
            trainer.close()
        fsdp = [r for r in comm.records if r.group_name == group]
        results[sync_each] = {
            "reduce_scatter": sum(r.payload_bytes for r in fsdp if r.kind == "reduce_scatter"),
            "all_gather": sum(r.payload_bytes for r in fsdp if r.kind == "all_gather"),
            # DTensor parameters report their global size: the unsharded bytes every collective carries
            "model_bytes": param_bytes,
        }
    assert dist.is_initialized()
    return results


def test_accumulation_reduces_once_per_step_when_asked(tmp_path):
    """A = 2 microbatches under FSDP 2: the gradients cross the wire twice with per-microbatch sync
    (the default) and once with ``grad_sync_each_microbatch = false``, which also gathers the
    weights only once per step."""
    for result in run_distributed(_fsdp_step_bytes, 2, str(tmp_path), timeout=240):
        each, last = result["true"], result["false"]
        model = each["model_bytes"]
        assert each["reduce_scatter"] == 2 * model, result
        assert last["reduce_scatter"] == model, result
        assert last["all_gather"] == model, result
        assert each["all_gather"] > 2 * model, result  # forward and backward gathers per microbatch
