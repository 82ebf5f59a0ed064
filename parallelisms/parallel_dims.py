"""Parallelism degrees, their validation, and the DeviceMesh built from them.

The world is one 5-D mesh ``pp × dp_replicate × dp_shard × cp × tp`` (outermost first, so that the
innermost, most communication-hungry dimension, tp, lands on ranks that share a node). Size-1
dimensions are kept, so every named sub-mesh always exists and code never branches on the shape.
Flattened sub-meshes are named by use:

- ``dp``          = dp_replicate × dp_shard      — data loading: ranks that read different samples
- ``dp_shard_cp`` = dp_shard × cp                — parameter sharding (FSDP)
- ``dp_cp``       = dp_replicate × dp_shard × cp — loss / token-count reduction

Expert parallel (``ep``) is carved out of dp_shard × cp: dp_shard is unflattened into
``dp_shard_mod_ep × dp_shard_in_ep`` (ep = dp_shard_in_ep × cp), giving

- ``ep``              = dp_shard_in_ep × cp      — ranks that hold different experts (all-to-all)
- ``dp_shard_mod_ep`` = dp_shard · cp / ep       — ranks that shard each expert's weights (FSDP)
- ``ep_hsdp``         = dp_replicate × dp_shard_mod_ep — the same with replicas (HSDP of experts)

With tp > 1, ep may also span tp (TorchTitan 0.3's layout): when ep is a multiple of cp × tp that
divides dp_shard × cp × tp, dp_shard is unflattened with dp_shard_in_ep = ep / (cp · tp) and

- ``ep``              = dp_shard_in_ep × cp × tp — each tp rank then routes and dispatches its own
  sequence shard (models/common/moe_parallelize.py), so no tp rank repeats another's all-to-all;
- ``cp_tp``           = cp × tp                  — the ranks one sequence is spread over (balance loss).

Otherwise (ep dividing dp_shard × cp, a multiple of cp) the tp ranks replicate the routed experts.
The layout spanning tp is preferred whenever both fit (:attr:`ParallelDims.ep_over_tp`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by build_mesh only: validation runs in the torch-free pre-flight
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def ep_spans_tp(dp_shard: int, cp: int, tp: int, ep: int) -> bool:
    """Whether the routed experts are split over the tp ranks too (the module docstring): tp > 1 and ep
    a multiple of cp × tp dividing dp_shard × cp × tp. Torch-free (the planner reads it)."""
    return tp > 1 and ep > 1 and ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0


class ParallelismError(ValueError):
    """A ``[parallelism]`` setting that cannot work with this world size or this build."""


@dataclass
class ParallelDims:
    """Validated parallelism degrees for ``world_size`` ranks.

    Args:
        dp_replicate: replicas that each hold a full copy of the (dp_shard-sharded) model (DDP / HSDP).
        dp_shard: ranks that shard parameters, gradients and optimizer state (FSDP2); -1 = the rest
            of the world size after the other degrees.
        cp, tp, pp, ep: context, tensor, pipeline and expert parallel degrees.
        world_size: number of ranks (processes).

    Raises:
        ParallelismError: a degree < 1 (other than dp_shard = -1), a product that is not the world
            size, or an ``ep`` that fits neither layout of the module docstring (a multiple of cp
            dividing dp_shard × cp; with tp > 1 also a multiple of cp × tp dividing dp_shard × cp ×
            tp). Every message is one line naming the setting, its value and the fix.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _meshes: dict[str, "DeviceMesh"] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, parallelism_cfg, world_size: int) -> "ParallelDims":
        """Build from the ``[parallelism]`` config section (only the degrees are read)."""
        return cls(
            dp_replicate=parallelism_cfg.dp_replicate,
            dp_shard=parallelism_cfg.dp_shard,
            cp=parallelism_cfg.cp,
            tp=parallelism_cfg.tp,
            pp=parallelism_cfg.pp,
            ep=parallelism_cfg.ep,
            world_size=world_size,
        )

    def _validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ParallelismError(
                    f"parallelism.{name} = {value} is invalid: degrees must be >= 1 (1 disables it)."
                )
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others != 0:
                raise ParallelismError(
                    f"parallelism.dp_shard = -1 cannot fill the world: world_size {self.world_size} is "
                    f"not divisible by dp_replicate×cp×tp×pp = {others}. Change the degrees or the "
                    "number of processes (NGPU)."
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ParallelismError(
                f"parallelism.dp_shard = {self.dp_shard} is invalid: use -1 (the rest) or a degree >= 1."
            )
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ParallelismError(
                f"parallelism degrees multiply to {product} (dp_replicate {self.dp_replicate} × "
                f"dp_shard {self.dp_shard} × cp {self.cp} × tp {self.tp} × pp {self.pp}) but "
                f"world_size is {self.world_size}. Make the product equal the number of processes, "
                "or set dp_shard = -1 to use the rest."
            )
        if self.ep > 1 and self.tp > 1 and not self.ep_over_tp and not self._ep_in_dp_shard_cp():
            span = self.dp_shard * self.cp * self.tp
            raise ParallelismError(
                f"parallelism.ep = {self.ep} fits neither layout: split over tp it must be a multiple of cp×tp = "
                f"{self.cp * self.tp} dividing dp_shard×cp×tp = {span}; beside tp it must divide dp_shard×cp = "
                f"{self.dp_shard * self.cp} and be a multiple of cp = {self.cp}. Set parallelism.ep to one of "
                f"{sorted(set(self._valid_ep()))}."
            )
        if self.ep > 1 and self.tp == 1 and not self._ep_in_dp_shard_cp():
            valid = [self.cp * d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]
            raise ParallelismError(
                f"parallelism.ep = {self.ep} must divide dp_shard×cp = {self.dp_shard * self.cp} and be a "
                f"multiple of cp = {self.cp}: each expert-parallel group is a block of dp_shard ranks "
                f"times every cp rank. Set parallelism.ep to one of {valid} (or raise dp_shard"
                + (f", e.g. with a smaller dp_replicate, now {self.dp_replicate})." if self.dp_replicate > 1 else ").")
            )

    def _ep_in_dp_shard_cp(self) -> bool:
        """ep fits inside dp_shard × cp (a multiple of cp dividing it): tp ranks replicate the experts."""
        return (self.dp_shard * self.cp) % self.ep == 0 and self.ep % self.cp == 0

    def _valid_ep(self) -> list[int]:
        """Every ep > 1 of either layout for these degrees."""
        beside = [self.cp * d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]
        over = [self.cp * self.tp * d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]
        return [e for e in beside + (over if self.tp > 1 else []) if e > 1]

    @property
    def ep_over_tp(self) -> bool:
        """The routed experts are split over the tp ranks too: tp > 1, ep a multiple of cp × tp dividing
        dp_shard × cp × tp (the module docstring)."""
        return ep_spans_tp(self.dp_shard, self.cp, self.tp, self.ep)

    # ------------------------------------------------------------------ degrees by use
    @property
    def dp(self) -> int:
        """Data-parallel degree: number of distinct sample streams (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards parameters over dp_shard × cp (HSDP when dp_replicate > 1 as well)."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (DDP): dp_replicate > 1 and nothing sharded."""
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and its flattened sub-meshes (needs an initialized process group).

        Returns the 5-D world mesh; sub-meshes are available through :meth:`mesh`.
        """
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        self._meshes = {name: world[name] for name in MESH_DIM_NAMES}
        self._meshes["world"] = world
        # Keep the flattened meshes ourselves: re-slicing a flattened dim from the root is deprecated.
        self._meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        self._meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        # HSDP needs a 2-D (replicate, shard) mesh; cp ranks join the shard dim (they hold the same
        # parameters and see different tokens), which needs the flattened dim when cp > 1.
        shard_dim = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        with warnings.catch_warnings():
            # torch 2.13 has no public partial flatten; slicing the flattened dim is the documented way
            # until then (it warns that it "will be deprecated").
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            self._meshes["hsdp"] = world["dp_replicate", shard_dim]
        if self.ep > 1:
            self._build_ep_meshes(world)
        return world

    def _build_ep_meshes(self, world: DeviceMesh) -> None:
        over_tp = self.ep_over_tp
        in_ep = self.ep // (self.cp * self.tp) if over_tp else self.ep // self.cp
        split = world._unflatten("dp_shard", (self.dp_shard // in_ep, in_ep), ("dp_shard_mod_ep", "dp_shard_in_ep"))
        inner = ("dp_shard_in_ep", "cp", "tp") if over_tp else ("dp_shard_in_ep", "cp")
        self._meshes["ep"] = split[inner]._flatten("ep")
        if over_tp:
            self._meshes["cp_tp"] = world["cp", "tp"]._flatten("cp_tp") if self.cp > 1 else world["tp"]
        self._meshes["dp_shard_mod_ep"] = split["dp_shard_mod_ep"]
        self._meshes["ep_hsdp"] = split["dp_replicate", "dp_shard_mod_ep"]

    def mesh(self, name: str) -> DeviceMesh:
        """The sub-mesh called ``name`` (a dim of MESH_DIM_NAMES, or dp, dp_shard_cp, dp_cp, hsdp; with
        ep > 1 also ep, dp_shard_mod_ep, ep_hsdp; with ep over tp also cp_tp).

        Raises:
            RuntimeError: the mesh was not built (single process) or has no such name.
        """
        if name not in self._meshes:
            raise RuntimeError(
                f"no device mesh named {name!r}; built: {sorted(self._meshes) or 'none (single process)'}"
            )
        return self._meshes[name]

    @property
    def mesh_built(self) -> bool:
        return bool(self._meshes)

    @property
    def meshes(self) -> dict[str, DeviceMesh]:
        """Every built mesh by name (see :meth:`mesh`); empty for a single process."""
        return dict(self._meshes)
