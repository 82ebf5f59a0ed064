"""What a real multi-process CPU run holds and sends, per rank, for comparison with engine/planner.

:func:`measure_layouts` runs inside every rank of one process group (tests/dist_utils.py) and, for
each layout in turn, builds a Trainer, trains one warm-up step and then measures the second step:
- state bytes: local shards of the parameters, of the gradients just before ``optimizer.step()`` and
  of every optimizer state tensor after it;
- communication: every collective of the step (parallelisms/comm_counter.py ``CommCounter``),
  attributed to mesh dims by ``group_names_by_mesh_dim``; payload and ring ("wire") bytes per dim;
- peak memory of the same step beyond the state (:func:`peak_tracker`), over the whole step and
  inside the gradient reductions of backward.
"""

from __future__ import annotations

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
    from tests.dist_utils import run_distributed

    return run_distributed(_build_real_plans, 1, cfg, world_size, ranks, torchrun_env=False)[0]


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def peak_tracker(trainer):
    """A torch ``MemTracker`` over the model parts and the optimizer that, at every tensor allocation
    of the step it is entered around, records two peaks (bytes):

    - ``activation_peak``: the largest sum of the categories ACT + TEMP + OTH (every live tensor that
      is not a parameter, buffer, gradient or optimizer state): the planner's ``activations``;
    - ``transient_peak``: the largest sum of every live tensor byte that is not the rank's own state
      (its parameter shards, the gradients of those shards alive at that moment, optimizer state,
      buffers). FSDP2 / ``replicate`` register the all-gathered (unsharded) parameters as the
      module's parameters, so ``MemTracker`` counts them as PARAM, and their accumulated gradients as
      GRAD; reduce-scatter / all-reduce buffers are allocated in backward and count as TEMP. This is
      what the planner's ``peak_nonstate_bytes`` predicts;
    - ``reduction_peak``: the same sum, only while an FSDP2 / ``replicate`` parameter group runs its
      ``post_backward`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: reshard, gradient
      copy-in, reduce-scatter, all-reduce): what engine/planner/reduction.py predicts. The method is
      wrapped while the tracker is entered (the ranks are forked test processes).

    ``MemTracker`` refuses a second forward of a root module (accumulation and pipeline
    microbatches call it several times); those calls are let through, the peaks are still tracked.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    params = [p for part in trainer.model_parts for p in part.parameters()]
    held_params = _local_bytes(params)
    # A gradient has its parameter's local shape (tests/training_utils.py gradient_placement_errors):
    # its bytes are known in advance, so each allocation only checks which gradients exist.
    grad_bytes = [(p, _local_bytes([p])) for p in params]

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    class _RepeatedCalls(MemTracker):
        activation_peak = 0
        transient_peak = 0
        reduction_peak = 0
        in_reduction = False

        def _update_peak_stats(self, peak_state) -> None:
            # MemTracker's own per-module and per-device peaks (deep copies of the snapshot, for every
            # tracked module, at every allocation) are never read here: they cost half the measured
            # step. The three peaks below need only the current snapshot.
            for categories in self._curr_mem_snap.values():
                named = {str(c).rsplit(".", 1)[-1]: b for c, b in categories.items()}
                live = named.get("ACT", 0) + named.get("TEMP", 0) + named.get("OTH", 0)
                self.activation_peak = max(self.activation_peak, live)
                state = held_params + sum(size for p, size in grad_bytes if p.grad is not None)
                other = named.get("PARAM", 0) + named.get("GRAD", 0) - state
                self.transient_peak = max(self.transient_peak, live + other)
                if self.in_reduction:
                    self.reduction_peak = max(self.reduction_peak, live + other)

        def __enter__(self):
            original = FSDPParamGroup.post_backward
            tracker = self

            def post_backward(group, *args, **kwargs):
                tracker.in_reduction = True
                try:
                    return original(group, *args, **kwargs)
                finally:
                    tracker.in_reduction = False

            self._original_post_backward = original
            FSDPParamGroup.post_backward = post_backward
            return super().__enter__()

        def __exit__(self, *exc):
            FSDPParamGroup.post_backward = self._original_post_backward
            return super().__exit__(*exc)

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the root module's next microbatch
                pass

    tracker = _RepeatedCalls()
    tracker.track_external(*trainer.model_parts, trainer.optimizer)
    return tracker


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
            lambda *_: grads.append(_local_bytes([p.grad for p in params if p.grad is not None])))
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
                "params": _local_bytes(params), "grads": grads[0], "optimizer": _local_bytes(optimizer_tensors),
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
    from tests.dist_utils import run_distributed

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
