"""One candidate layout, resolved from a job config and a world size with the launcher's own checks.

Everything the formulas need is read here once: degrees (``ParallelDims``), the model arguments as
trained, the batch geometry (sequences per microbatch, accumulation steps, pipeline microbatches),
the pipeline split of every pp rank, AC mode and dtypes. Building one costs the torch-free
pre-flight (engine/setup/preflight.py), so the search (engine/planner/search.py) can try hundreds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first (parallel_dims.py)


@dataclass
class Layout:
    """A resolved layout (see the module docstring).

    Attributes:
        cfg: the ``JobConfig`` it came from; world_size: ranks.
        pp, dp_replicate, dp_shard, cp, tp, ep: degrees (dp_shard resolved).
        model_args: the model's arguments as trained (vocabulary, ``max_seq_len = seq_len``);
        model_spec: its family's ``ModelSpec`` (parameter shapes, FLOPs, width, routing).
        seq_len: tokens per sequence; local_batch_size: sequences per rank per accumulation step;
        grad_accum: accumulation steps A; global_batch_size: sequences per optimizer step.
        pp_plans: one ``PipelinePlan`` per pp rank (empty without pipeline parallel).
        device_type: "cuda" or "cpu", the device the layout is planned for (it picks the collective
            backend, :attr:`comm_backend`).
    """

    cfg: object
    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    model_args: object
    seq_len: int
    local_batch_size: int
    grad_accum: int
    global_batch_size: int
    pp_plans: tuple
    device_type: str = "cuda"
    model_spec: object = None

    @property
    def params(self) -> list:
        """Every parameter of the model (``ModelSpec.param_shapes``, engine/planner/params.py), computed
        once per layout."""
        if "_params" not in self.__dict__:
            from engine.planner.params import model_params

            self.__dict__["_params"] = model_params(self.model_spec, self.model_args)
        return self.__dict__["_params"]

    @classmethod
    def from_config(cls, cfg, world_size: int, device_type: str = "cuda", setup=None) -> "Layout":
        """Resolve ``cfg`` for ``world_size`` ranks, from ``setup`` (the pre-flight's ``SetupPlan``
        for this world size) when the caller has it, else by running the pre-flight.

        Raises:
            ValueError: what the launcher's pre-flight refuses (one line naming the setting).
        """
        if setup is None:
            from engine.setup.preflight import check_setup

            setup = check_setup(cfg, world_size, device_type, check_data=False)
        d, t = setup.parallel_dims, cfg.training
        return cls(cfg, world_size, d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep, setup.model_args,
                   t.seq_len, t.local_batch_size, setup.grad_accum_steps, setup.global_batch_size, setup.pp_plans,
                   device_type, setup.model_spec)

    # ------------------------------------------------------------------ derived settings
    @property
    def degrees(self) -> dict[str, int]:
        """{pp, dp_replicate, dp_shard, cp, tp, ep}: the degrees as resolved (dp_shard = -1 filled)."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp, "ep": self.ep}

    @property
    def dp(self) -> int:
        """Data-parallel degree dp_replicate × dp_shard (sample streams)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks sharding each (non-expert) parameter: dp_shard × cp."""
        return self.dp_shard * self.cp

    @property
    def param_bytes(self) -> int:
        """Bytes per element of compute parameters and activations (training.mixed_precision_param)."""
        return DTYPE_BYTES[self.cfg.training.mixed_precision_param]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of gradient reduction (training.mixed_precision_reduce)."""
        return DTYPE_BYTES[self.cfg.training.mixed_precision_reduce]

    @property
    def comm_backend(self) -> str:
        """The collective backend as engine/train/distributed.py ``resolve_backend`` picks it: ``comm.backend``,
        or for "auto" NCCL on CUDA and gloo on the CPU."""
        setting = self.cfg.comm.backend
        if setting == "auto":
            return "nccl" if self.device_type == "cuda" else "gloo"
        return setting

    @property
    def sequence_parallel(self) -> bool:
        """Whether TP's residual stream is sequence-sharded (tp > 1 and parallelism.sequence_parallel)."""
        return self.tp > 1 and self.cfg.parallelism.sequence_parallel

    @property
    def microbatch_size(self) -> int:
        """Sequences in one forward: the pipeline microbatch under PP, else local_batch_size."""
        return self.cfg.parallelism.pp_microbatch_size if self.pp > 1 else self.local_batch_size

    @property
    def pp_microbatches(self) -> int:
        """M, pipeline microbatches per schedule step (1 without PP)."""
        return self.pp_plans[0].n_microbatches if self.pp_plans else 1

    @property
    def ac(self) -> tuple[str, str]:
        """(activation_checkpoint.mode, selective_ac_option)."""
        return self.cfg.activation_checkpoint.mode, self.cfg.activation_checkpoint.selective_ac_option

    @property
    def reshard(self) -> str:
        """FSDP reshard-after-forward as applied (parallelisms/data_parallel.py ``reshard_setting``)."""
        setting = self.cfg.parallelism.fsdp_reshard_after_forward
        return "never" if self.pp > 1 and setting == "default" else setting

    def stages_of(self, pp_rank: int) -> list[tuple[tuple[int, ...] | None, bool, bool]]:
        """(layers, is_first, is_last) of each stage pp rank ``pp_rank`` holds ([(None, True, True)] without PP)."""
        if not self.pp_plans:
            return [(None, True, True)]
        plan = self.pp_plans[pp_rank]
        last = plan.num_stages - 1
        return [(plan.stage_layers[s], s == 0, s == last) for s in plan.local_stages]

    def group_within_node(self, dim: str, gpus_per_node: int) -> bool:
        """Whether the ranks of a ``dim`` group share a node: its stride times its size (the product of
        this dim and every inner one, mesh order pp, dp_replicate, dp_shard, cp, tp) fits a node."""
        inner = {"tp": ("tp",), "cp": ("cp", "tp"), "dp_shard_cp": ("dp_shard", "cp", "tp"),
                 "dp_shard": ("dp_shard", "cp", "tp"), "ep": ("dp_shard", "cp", "tp"),
                 "dp_shard_mod_ep": ("dp_shard", "cp", "tp"), "dp_cp": ("dp_replicate", "dp_shard", "cp", "tp"),
                 "dp_replicate": ("dp_replicate", "dp_shard", "cp", "tp"), "pp": MESH_ORDER}[dim]
        span = 1
        for name in inner:
            span *= getattr(self, name)
        return span <= gpus_per_node


def config_with(cfg, **settings):
    """A copy of ``cfg`` with ``section__key=value`` settings replaced (e.g. ``parallelism__tp=8``)."""
    new = copy.deepcopy(cfg)
    for name, value in settings.items():
        section, key = name.split("__")
        setattr(getattr(new, section), key, value)
    return new
