"""What a real multi-process CPU run holds and sends, per rank, for comparison with engine/planner.

:func:`measure_layouts` runs inside every rank of one process group (engine/testing/processes.py) and, for
each layout in turn, builds a Trainer, trains one warm-up step and then measures the second step:
- state bytes: local shards of the parameters, of the gradients just before ``optimizer.step()`` and
  of every optimizer state tensor after it;
- communication: every collective of the step (parallelisms/comm_counter.py ``CommCounter``),
  attributed to mesh dims by ``group_names_by_mesh_dim``; payload and ring ("wire") bytes per dim;
- peak memory of the same step beyond the state (:func:`peak_tracker`), over the whole step and
  inside the gradient reductions of backward.
"""

from __future__ import annotations

from engine.testing.memory import local_bytes, peak_tracker
from tests.training_utils import base_args, run_in_turn


def _build_real_plans(cfg, world_size: int, ranks: list[int]) -> list[tuple[dict, object]]:
    from engine.planner.real_plan import build_real_plan

    plans = [build_real_plan(cfg, world_size, rank, device_type="cpu") for rank in ranks]
    return [(plan.coords, plan.state) for plan in plans]


def real_plan_states(cfg, world_size: int, ranks: list[int]) -> list[tuple[dict, object]]:
    """[(mesh coordinate, StateBytes)] of each rank's real plan (engine/planner/real_plan.py), built
    in a forked child: a process that has built a plan under the fake process group must not fork
    the training ranks of later tests (they trained different numbers, or failed to resolve their
    process groups, when it did)."""
    from engine.testing.processes import run_distributed

    return run_distributed(_build_real_plans, 1, cfg, world_size, ranks, torchrun_env=False)[0]


def measure_one(argv: list[str]) -> dict:
    """One layout in this rank: {rank, coords, params, grads, optimizer, comm: {dim: {payload, wire}},
    activations, activations_transient, reduction} (the last three: :func:`peak_tracker`, over the same
    step)."""
    import torch.distributed as dist

    from engine.config import load_config
    from engine.train.trainer import Trainer
    from parallelisms.comm_counter import CommCounter, group_names_by_mesh_dim

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    try:
        trainer.train_step()  # warm-up: lazy initialization, optimizer state created
        grads: list[int] = []
        params = [p for part in trainer.model_parts for p in part.parameters()]
        handle = trainer.optimizer.register_step_pre_hook(
            lambda *_: grads.append(local_bytes([p.grad for p in params if p.grad is not None])))
        tracker = peak_tracker(trainer)
        with CommCounter() as comm, tracker:
            trainer.train_step()
        handle.remove()
        names = group_names_by_mesh_dim(trainer.parallel_dims)
        by_dim: dict[str, dict[str, float]] = {}
        for record in comm.records:
            dim = names.get(record.group_name, f"other:{record.group_name}")
            if record.group_size == 1:
                continue  # a size-1 group moves nothing (e.g. the loss sum over dp × cp = 1)
            entry = by_dim.setdefault(dim, {"payload": 0, "wire": 0.0, "calls": 0, "kinds": {}})
            entry["kinds"][record.kind] = entry["kinds"].get(record.kind, 0) + record.payload_bytes
            entry["payload"] += record.payload_bytes
            entry["wire"] += record.wire_bytes
            entry["calls"] += 1
        optimizer_tensors = [v for state in trainer.optimizer.state.values() for v in state.values()
                             if hasattr(v, "numel")]
        world = trainer.parallel_dims.mesh("world") if trainer.parallel_dims.mesh_built else None
        coords = dict(zip(world.mesh_dim_names, world.get_coordinate())) if world is not None else {}
        # Mesh names that share a process group are counted under one name (the counter's): e.g.
        # dp_shard_cp is dp_shard's group when cp = 1.
        aliases = {name: names.get(mesh.get_group().group_name, name)
                   for name, mesh in trainer.parallel_dims.meshes.items() if mesh.ndim == 1 and mesh.size() > 1}
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "coords": coords, "aliases": aliases,
                "params": local_bytes(params), "grads": grads[0], "optimizer": local_bytes(optimizer_tensors),
                "comm": by_dim,
                "activations": tracker.activation_peak, "activations_transient": tracker.transient_peak,
                "reduction": tracker.reduction_peak}
    finally:
        trainer.close()


def measure_layouts(folder: str, layouts: dict[str, dict]) -> dict[str, dict | str]:
    """In every rank: {layout name: :func:`measure_one` result, or the traceback of its failure}
    (tests/training_utils.py :func:`run_in_turn`)."""
    return run_in_turn(layouts, lambda name, overrides: measure_one(
        base_args(f"{folder}/{name}", {"training.steps": 3, **overrides})))


def measured_layouts(layouts: dict[str, tuple[int, dict]], folder: str):
    """``get(name) -> [per-rank result of measure_one]`` for ``layouts`` ({name: (world_size,
    overrides)}): every layout of a world size is measured in the same forked ranks, once, on first
    use (a module fixture of the planner-run tests returns it).

    Raises (from ``get``):
        AssertionError: a rank's measurement failed (its traceback).
    """
    from engine.testing.processes import run_distributed

    cache: dict[int, list[dict]] = {}

    def get(name: str) -> list[dict]:
        world_size = layouts[name][0]
        if world_size not in cache:
            same = {n: o for n, (w, o) in layouts.items() if w == world_size}
            cache[world_size] = run_distributed(measure_layouts, world_size, f"{folder}/w{world_size}", same,
                                                timeout=60.0 + 40.0 * world_size * len(same),
                                                torchrun_env=world_size > 1)
        per_rank = [results[name] for results in cache[world_size]]
        for result in per_rank:
            if isinstance(result, str):
                raise AssertionError(f"layout {name}:\n{result}")
        return per_rank

    return get
