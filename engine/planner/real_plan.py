"""Per-rank state bytes from the run's real model and parallelize plan, built on the meta device.

One process joins a *fake* process group of the full world size (torch's ``backend="fake"`` with
``torch.testing._internal.distributed.fake_pg.FakeStore``: collectives complete without moving data,
as in TorchTitan's dry run), takes the place of one rank, builds the mesh, this rank's pipeline
stages and the model's own plan (TP, EP, CP, AC, FSDP/HSDP/DDP) on the meta device, and reads the
local shard of every parameter (``DTensor.to_local()``): its shape is what that rank allocates.
Nothing is allocated and no GPU is needed, so 405B on thousands of ranks builds in seconds.

Bytes per rank (units: bytes):
- parameters: Σ local numel × element size of the sharded (master, fp32) parameters;
- gradients: the same local shapes in the parameter dtype (FSDP2/DTensor gradients are laid out like
  their parameters, tests/training_utils.py ``gradient_placement_errors``);
- optimizer: AdamW's ``exp_avg`` and ``exp_avg_sq`` (each the parameter's local shape and dtype) and
  one 0-d fp32 ``step`` tensor per parameter (torch.optim.AdamW with foreach/fused keeps ``step`` as a
  float32 tensor; torch docs, torch.optim.AdamW).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from engine.planner.optimizer_state import STEP_TENSOR_BYTES


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for parameters, gradients and optimizer state, and the tensors counted.

    Attributes:
        params, grads, optimizer: bytes (see the module docstring).
        n_tensors: parameter tensors on this rank (one AdamW ``step`` each).
        param_elements: Σ local numel.
    """

    params: int
    grads: int
    optimizer: int
    n_tensors: int
    param_elements: int

    @property
    def total(self) -> int:
        """params + grads + optimizer, bytes."""
        return self.params + self.grads + self.optimizer


def state_bytes_of_params(params, optimizer_cfg=None) -> StateBytes:
    """:class:`StateBytes` of (possibly DTensor) parameters, from their local shards: ``params`` plain
    (AdamW state for all) or (canonical name, parameter) pairs with ``optimizer_cfg`` (the
    ``[optimizer]`` section: Muon's one buffer where it applies, engine/planner/optimizer_state.py)."""
    from torch.distributed.tensor import DTensor

    from engine.planner.optimizer_state import optimizer_bytes

    elements = nbytes = count = 0
    named = []
    for item in params:
        name, param = item if isinstance(item, tuple) else ("", item)
        local = param.to_local() if isinstance(param, DTensor) else param
        elements += local.numel()
        nbytes += local.numel() * local.element_size()
        count += 1
        named.append((name, param.ndim, local.numel()))
    optimizer = (optimizer_bytes(named, optimizer_cfg, local.element_size()) if optimizer_cfg is not None
                 else 2 * nbytes + STEP_TENSOR_BYTES * count)
    return StateBytes(params=nbytes, grads=nbytes, optimizer=optimizer, n_tensors=count, param_elements=elements)


@dataclass
class RealPlan:
    """The real plan of one rank built under the fake process group.

    Attributes:
        rank: the rank built; coords: its coordinate per mesh dim (pp, dp_replicate, dp_shard, cp, tp).
        parts: the parallelized meta model parts (pipeline stages) of that rank.
        state: :class:`StateBytes` of the parts.
        parallel_dims, setup: the validated degrees (mesh built) and the pre-flight's ``SetupPlan``.
        pp_plan: the rank's ``PipelinePlan`` (None without pipeline parallel).
        unsharded_param_elements: Σ global numel of the rank's parameters (what FSDP gathers).
    """

    rank: int
    coords: dict
    parts: list
    state: StateBytes
    parallel_dims: object
    setup: object
    pp_plan: object
    unsharded_param_elements: int
    extras: dict = field(default_factory=dict)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A fake process group of ``world_size`` ranks in which this process is ``rank`` (no data moves).

    On exit the group is destroyed and the process forgets the fake meshes (:func:`forget_meshes`), so
    a real run in this process, or in a process forked from it, starts as if no plan had been built.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; the dry run needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Clear DTensor's process-wide caches that hold ``DeviceMesh`` objects.

    ``DeviceMesh`` equality compares the ranks a mesh spans, its layout, device type and dim names,
    not the rank of the process that built it nor its process groups, so a later, real mesh of the
    same shape is equal to a fake one. DTensor's sharding propagation caches (the Python one and the
    C++ fast path's, cleared together by
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache``) would then return output specs that
    carry the fake mesh, whose coordinate is the fake rank's: a real rank 1 of tp 2 computed rank 0's
    shards (torch 2.13; found as tp 2 losses 0.6 % off in runs forked after a dry run). Also cleared:
    the redistribute planner's and the mesh topology caches, keyed by specs and meshes the same way.
    """
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def rank_of(coords: dict, dims) -> int:
    """Global rank of a mesh coordinate (row-major over pp, dp_replicate, dp_shard, cp, tp)."""
    rank = 0
    for name, size in (("pp", dims.pp), ("dp_replicate", dims.dp_replicate), ("dp_shard", dims.dp_shard),
                       ("cp", dims.cp), ("tp", dims.tp)):
        rank = rank * size + coords.get(name, 0)
    return rank


def build_real_plan(cfg, world_size: int, rank: int = 0, *, device_type: str = "cuda", setup=None) -> RealPlan:
    """Build rank ``rank``'s parallelized model parts on the meta device under a fake process group.

    Runs every check the ranks run at start-up (engine/setup/preflight.py ``check_setup`` without the data
    files) unless ``setup`` (its ``SetupPlan`` for ``world_size``) is given, then the trainer's own
    build recipe (engine/setup/model_builder.py ``build_model_parts``) minus allocation.

    Args:
        cfg: a validated ``JobConfig``; world_size: ranks of the run; rank: which one to build.
        device_type: the device the run will use ("cuda" for GPUs); only device-dependent rules read it.
        setup: the pre-flight's ``SetupPlan`` when the caller has it (resolved once per process).

    Returns:
        a :class:`RealPlan` (its meta modules stay usable after the fake group is destroyed).

    Raises:
        ValueError (and subclasses): what a rank would refuse at start-up, one line each.
    """
    import copy

    import torch

    from engine.setup.model_builder import build_context_parallel, build_model_parts

    if setup is None:
        from engine.setup.preflight import check_setup

        setup = check_setup(cfg, world_size, device_type, check_data=False)
    dims = copy.copy(setup.parallel_dims)  # the mesh built here belongs to this fake group only
    with fake_process_group(world_size, rank), torch.device("meta"):
        dims.build_mesh("cpu")
        world = dims.mesh("world")
        coords = dict(zip(world.mesh_dim_names, world.get_coordinate()))
        pp_plan = setup.pipeline_plan(coords["pp"])
        parts, _, _ = build_model_parts(cfg, setup.model_spec, setup.model_args, parallel_dims=dims, pp_plan=pp_plan,
                                        context_parallel=build_context_parallel(cfg, dims),
                                        global_batch_size=setup.global_batch_size,
                                        backend="nccl" if device_type == "cuda" else "gloo")
        from engine.config.param_groups import clean_name

        named = [(clean_name(name), param) for part in parts for name, param in part.named_parameters()]
        state = state_bytes_of_params(named, cfg.optimizer)
        unsharded = sum(param.numel() for _, param in named)
    return RealPlan(rank=rank, coords=coords, parts=parts, state=state, parallel_dims=dims, setup=setup,
                    pp_plan=pp_plan, unsharded_param_elements=unsharded)
