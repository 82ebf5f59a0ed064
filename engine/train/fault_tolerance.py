"""torchft replica groups: the outer data-parallel dimension fails, rejoins and heals while the rest steps on.

With ``[fault_tolerance] enable``, each launch (one torchrun) is one *replica group*: FSDP2 / TP / PP / CP
inside it as usual, and across the ``group_size`` groups torchft's managed process group sums the
gradients, which makes the groups together the replicate dimension of HSDP (Zhao et al. 2023, arXiv
2304.11277, Sec. 3.2.2). Every step (torchft's Manager protocol, https://github.com/pytorch/torchft):

1. ``start_quorum``: the lighthouse forms the step's quorum of live groups. A group behind the others
   (a restarted one) *heals*: its ranks receive the live state of the same rank of a peer group
   (parameters, optimizer state, learning-rate schedule, data position, step) and load it.
2. The label tokens of the step and, after backward, the gradients are summed over the participating
   groups (``Manager.allreduce``, ReduceOp.SUM), so the loss is the token-sum over every group's
   batch divided by their total tokens: with every group live, the same update as HSDP over one
   torchrun (tests/integration/test_fault_tolerance.py); with a group gone, the batch of the groups left.
3. ``should_commit``: the optimizer steps only when every rank of the group agrees that no collective
   failed and at least ``min_replica_size`` groups took part; otherwise the step is discarded.

The state sent to a healing group is each rank's *local* tensors (a DTensor's shard), which the rank
of the same group rank holds in the same layout, since every group runs the same config on the same
number of ranks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("quadra")
# torchft's HTTP transport hands the received state to torch.frombuffer, which warns once; the tensors
# are copied into this rank's own (engine/train/fault_tolerance.py: _load_live_state).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def data_ranks(section, dp: int, dp_rank: int) -> tuple[int, int]:
    """The data loader's (dp degree, dp rank) for ``[fault_tolerance]`` ``section``: with replica groups
    they are the outer data-parallel dimension, group-major (group g's dp rank r reads what dp rank
    g × dp + r of HSDP over every group reads); otherwise ``(dp, dp_rank)``."""
    if not section.enable:
        return dp, dp_rank
    return dp * section.group_size, max(section.replica_id, 0) * dp + dp_rank


def _local(value):
    """``value`` with every DTensor replaced by its local shard (recursively through dicts/lists)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


@torch.no_grad()
def _copy_model(part: torch.nn.Module, state: dict) -> None:
    """Copy a peer's local parameter and buffer shards into ``part`` in place."""
    for name, tensor in part.state_dict().items():
        target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        target.copy_(state[name])


def _optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A peer's optimizer ``state_dict`` (local shards) with each per-parameter tensor of the shape of
    the parameter's shard made a DTensor like the parameter, so that ``load_state_dict`` works on a
    group whose optimizer has no state yet (a restarted group)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in values.items():
            if torch.is_tensor(value) and value.shape == param.to_local().shape and value.dim() > 0:
                values[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                 shape=param.shape, stride=param.stride(), run_check=False)
    return state


class ReplicaGroup:
    """This rank's side of a torchft replica group (one ``torchft.Manager`` per rank).

    Built first of all (its heartbeat makes the lighthouse wait for this group); the state it sends
    to a healing peer, or replaces when this group heals, is given by :meth:`attach` once built.

    Args:
        section: the ``[fault_tolerance]`` config section (``replica_id`` >= 0 here: the launcher
            gives each group its id).
        rank, world_size: this rank in its group (torchrun's RANK / WORLD_SIZE of the launch).
        device: the training device (CPU: torchft's gloo group; CUDA: its NCCL group).

    Raises:
        ValueError: ``replica_id`` < 0 (a rank started without the launcher's group id).
        RuntimeError (torchft): the lighthouse cannot be reached within the quorum timeout.
    """

    def __init__(self, section, *, rank: int, world_size: int, device: torch.device):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if section.replica_id < 0:
            raise ValueError(f"fault_tolerance.replica_id = {section.replica_id}: a rank needs its group's id; "
                             "start the groups with ./run_train.sh (replica_id = -1) or give each launch "
                             "--fault_tolerance.replica_id N")
        self.rank, self.state = rank, None
        self.replica_id, self.group_size = section.replica_id, section.group_size
        timeout = timedelta(seconds=section.quorum_timeout_seconds)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        host, port = _group_store(rank, world_size)
        lighthouse = section.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self.manager = Manager(
            pg=pg, load_state_dict=self._load_live_state, state_dict=self._live_state,
            min_replica_size=section.min_replica_size, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout, rank=rank, world_size=world_size,
            store_addr=host, store_port=port, lighthouse_addr=lighthouse or None,
            replica_id=f"quadra_{self.replica_id}", init_sync=False,
        )
        self.participants, self.wait_all, self.timeout = 0, True, timeout

    def attach(self, *, model_parts, optimizer, lr_scheduler, dataloader, state_dict, load_state_dict) -> None:
        """The training state a healing peer receives and a heal replaces, in place: the model parts'
        local shards, the optimizer, the LR schedule, the data position, and the loop's own state
        (``state_dict()`` / ``load_state_dict(state)``: ``Trainer``'s step, tokens seen, step health)."""
        self.state = dict(model_parts=model_parts, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          dataloader=dataloader, state_dict=state_dict, load_state_dict=load_state_dict)

    # ------------------------------------------------------------------ the step
    def start_step(self, step: int) -> None:
        """Step ``step``'s quorum; a group behind its peers heals here (its training state is replaced).

        A group's first step waits, up to ``quorum_timeout_seconds``, until every group takes part: the
        lighthouse only waits for groups it has heard of, and one still starting would otherwise miss
        the first steps of a fresh job (and heal later)."""
        self.manager.start_quorum()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.wait_all and self.manager.num_participants() < self.group_size and time.monotonic() < deadline:
            time.sleep(0.2)
            self.manager.start_quorum()
        self.wait_all = False
        previous, self.participants = self.participants, self.manager.num_participants()
        if previous and self.participants != previous and self.rank == 0:
            logger.warning("step %d: %d of %d replica groups take part", step, self.participants, self.group_size)

    def wait_for_every_group(self) -> None:
        """The next step's quorum waits, as the first one does, until every group takes part."""
        self.wait_all = True

    def sum_(self, value: torch.Tensor) -> torch.Tensor:
        """Sum ``value`` in place over the participating groups (a healing group adds zero)."""
        self.manager.allreduce(value, reduce_op=dist.ReduceOp.SUM).wait()
        return value

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum every gradient's local shard over the participating groups, in one flat buffer per dtype."""
        grads = [p.grad for p in params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
        for locals_ in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in locals_])
            self.sum_(flat)
            offset = 0
            for g in locals_:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def should_commit(self) -> bool:
        """Whether the optimizer may step: every rank of the group agrees (a collective across groups
        failed on none) and at least ``min_replica_size`` groups took part."""
        return self.manager.should_commit()

    def resume_at(self, step: int) -> None:
        """After a checkpoint resume: torchft's step counter follows the trainer's."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * max(self.participants, 1)})

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ healing
    def _live_state(self) -> dict:
        t = self.state
        return {"model": [_local(part.state_dict()) for part in t["model_parts"]],
                "optimizer": _local(t["optimizer"].state_dict()),
                "lr_scheduler": t["lr_scheduler"].state_dict(), "dataloader": t["dataloader"].state_dict(),
                "trainer": t["state_dict"]()}

    def _load_live_state(self, state: dict) -> None:
        t = self.state
        for part, part_state in zip(t["model_parts"], state["model"]):
            _copy_model(part, part_state)
        t["optimizer"].load_state_dict(_optimizer_state(t["optimizer"], state["optimizer"]))
        t["lr_scheduler"].load_state_dict(state["lr_scheduler"])
        t["dataloader"].load_state_dict(state["dataloader"])
        t["load_state_dict"](state["trainer"])
        logger.info("replica group %d healed from a live peer at step %d", self.replica_id,
                    int(state["trainer"]["step"]))


def _group_store(rank: int, world_size: int) -> tuple[str, int]:
    """A fresh TCPStore for this attempt's Manager, hosted by the group's rank 0 (torchrun's own store
    outlives a restart and would hand a restarted group the dead attempt's manager address); its
    address reaches the other ranks through the default process group."""
    if rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, world_size, is_master=True, wait_for_workers=False)
        _group_store.keep = store  # the store lives as long as the process
        where = [socket.gethostname(), store.port]
    else:
        where = [None, None]
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(where, src=0)
    return where[0], int(where[1])
