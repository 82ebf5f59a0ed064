"""Count the collective communication of a region, per process group, as it is dispatched.

A ``TorchDispatchMode`` sees every collective that reaches torch's dispatcher: the c10d ops behind
``torch.distributed.all_reduce`` & co. and FSDP2's all-gathers / reduce-scatters (``c10d.*``), and the
functional collectives of DTensor, tensor parallel and compiled graphs (``_c10d_functional.*``). For
each it records the process group, the op kind and the payload in bytes, so a caller can attribute
communication to mesh dimensions (``ParallelDims``' sub-mesh groups) and compare with formulas.

Conventions, per rank and per call (n = group size, S = payload):
- payload S: the full (unsharded) buffer: an all-gather's output, a reduce-scatter's input, an
  all-reduce's tensor, an all-to-all's input, a send's / recv's tensor, a broadcast's tensor;
- wire bytes: what a bandwidth-optimal ring algorithm moves through this rank's link (the "bus
  bytes" of NCCL's performance notes, nccl-tests/doc/PERFORMANCE.md): (n-1)/n·S for all-gather,
  reduce-scatter and all-to-all, 2(n-1)/n·S for all-reduce, S for send/recv and broadcast.
Scalars (e.g. a loss all-reduce) count like any other tensor. Ops not listed are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without overload) -> (kind, index of the tensor(s) whose size is the payload)
_C10D_OPS = {
    "c10d._allgather_base_": ("all_gather", 0),  # (output, input, group, ...)
    "c10d.allgather_": ("all_gather", 0),  # ([outputs per rank...], [input], group, ...)
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, group, ...)
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.allreduce_": ("all_reduce", 0),  # ([tensors], group, ...)
    "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d.alltoall_base_": ("all_to_all", 1),  # (output, input, group, ...)
    "c10d.alltoall_": ("all_to_all", 1),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.send": ("send", 0),
    "c10d.recv_": ("recv", 0),
}
_FUNCTIONAL_OPS = {
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_reduce_coalesced": "all_reduce",
    "_c10d_functional.all_to_all_single": "all_to_all",
    "_c10d_functional.broadcast": "broadcast",
}
_RING_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


# Observers of communication inside opaque custom operators (parallelisms/ring_attention.py), which a
# dispatch mode cannot see: it receives the operator as one op and runs its body with the mode off.
# Each observer's ``opaque_collective(kind, group, payload_bytes)`` is called per tensor sent or
# received; ``OPAQUE_GROUP[0]`` names the group whose requests are being waited on (for timers that
# time ``Work.wait``), None outside such a wait.
OPAQUE_OBSERVERS: list = []
OPAQUE_GROUP: list = [None]


def report_opaque(kind: str, group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Tell the active observers (:data:`OPAQUE_OBSERVERS`) about ``tensors`` sent or received
    (``kind`` "send" / "recv") in ``group`` by an opaque operator."""
    for observer in list(OPAQUE_OBSERVERS):
        for tensor in tensors:
            observer.opaque_collective(kind, group, _nbytes(tensor))


def resolve_group(group) -> dist.ProcessGroup:
    """The process group a dispatched collective names: a c10d group name (functional collectives),
    a boxed ``ProcessGroup`` script object (c10d ops) or a ``ProcessGroup``."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


def group_name(group) -> str:
    """c10d's name of ``group`` (any form :func:`resolve_group` takes); a name is returned as is."""
    return group if isinstance(group, str) else resolve_group(group).group_name


def c10d_group_arg(args) -> torch.ScriptObject | None:
    """The boxed ``ProcessGroup`` among a c10d op's arguments (ReduceOp is a script object too)."""
    return next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)


def functional_group_arg(args, kwargs):
    """The group name of a functional collective (its last argument, or ``group_name=``)."""
    return kwargs.get("group_name", args[-1])


def _nbytes(value) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class CommRecord:
    """One collective call: ``kind`` (all_gather, reduce_scatter, all_reduce, all_to_all, broadcast,
    send, recv), ``group_name`` (c10d's name of its process group), ``group_size`` (n ranks),
    ``payload_bytes`` (S, see the module docstring) and ``wire_bytes`` (ring bytes through this rank)."""

    kind: str
    group_name: str
    group_size: int
    payload_bytes: int
    wire_bytes: float


@dataclass
class CommCounter(TorchDispatchMode):
    """Context manager recording every collective dispatched inside it (see the module docstring).

    Usage::

        with CommCounter() as comm:
            loss.backward()
        sum(r.payload_bytes for r in comm.records if r.kind == "reduce_scatter")

    ``records`` lists the calls in order. Works for gloo and NCCL alike (nothing is timed).
    """

    records: list[CommRecord] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __enter__(self):
        OPAQUE_OBSERVERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        OPAQUE_OBSERVERS.remove(self)
        return super().__exit__(*exc)

    def opaque_collective(self, kind: str, group, payload: int) -> None:
        """A send/recv inside an opaque operator (:func:`report_opaque`)."""
        self._record(kind, group, payload)

    def _record(self, kind: str, group, payload: int) -> None:
        group = resolve_group(group)
        size = group.size()
        self.records.append(CommRecord(kind, group.group_name, size, payload, payload * _RING_FACTOR[kind](size)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in _C10D_OPS:
            kind, index = _C10D_OPS[name]
            group = c10d_group_arg(args)
            payload = _nbytes(args[index])
            if kind == "all_gather" and isinstance(args[0], list) and args[0] and isinstance(args[0][0], list):
                payload = _nbytes(args[0])  # allgather_: [[outputs of every rank] per input]
            self._record(kind, group, payload)
        elif name in _FUNCTIONAL_OPS:
            kind = _FUNCTIONAL_OPS[name]
            out = func(*args, **kwargs)
            group = functional_group_arg(args, kwargs)
            # payload: the full buffer, i.e. the output of an all-gather, the input otherwise
            payload = _nbytes(out) if kind == "all_gather" else _nbytes(args[0])
            self._record(kind, group, payload)
            return out
        return func(*args, **kwargs)


class MeshDimNames(dict):
    """{c10d group name: mesh dim} (:func:`group_names_by_mesh_dim`) that also names a group it does
    not list by its ranks: a group over the same global ranks as a mesh dim's moves its bytes over
    the same links, so ``get`` returns that dim. Such groups exist: torch's ``DeviceMesh`` caches
    sub-meshes by the mesh's shape and names, so a second mesh of the same shape in one process (a
    second trainer) can hand out the first one's process groups."""

    def __init__(self, names: dict[str, str], by_ranks: dict[tuple[int, ...], str]):
        super().__init__(names)
        self.by_ranks = by_ranks

    def get(self, group: str, default=None):
        """The mesh dim of c10d group ``group``: by name, else by its ranks, else ``default``."""
        if group in self:
            return self[group]
        try:
            ranks = tuple(dist.get_process_group_ranks(resolve_group(group)))
        except (ValueError, RuntimeError, KeyError):  # not a live group name
            return default
        return self.by_ranks.get(ranks, default)


def group_names_by_mesh_dim(parallel_dims) -> MeshDimNames:
    """{c10d group name: mesh dim} for every 1-D sub-mesh of ``parallel_dims`` whose degree is > 1
    (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``; flattened meshes such as ``dp_shard_cp``
    and ``ep`` too). A group shared by two names (e.g. ``dp_shard`` and ``dp_shard_cp`` when cp = 1)
    keeps the first; a group not listed is named by its ranks (:class:`MeshDimNames`). Empty for a
    single process."""
    names: dict[str, str] = {}
    by_ranks: dict[tuple[int, ...], str] = {}
    for name, mesh in parallel_dims.meshes.items():
        if mesh.ndim == 1 and mesh.size() > 1:
            group = mesh.get_group()
            dim = names.setdefault(group.group_name, name)
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), dim)
    return MeshDimNames(names, by_ranks)
