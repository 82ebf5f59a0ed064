"""Muon on hidden weight matrices, AdamW on every other parameter: one optimizer, one state, one schedule.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is
Scalable for LLM Training", arXiv:2502.16982) replaces a matrix's momentum by its orthogonalised
version (Newton–Schulz iteration). The arithmetic follows ``torch.optim.Muon`` (torch 2.13) step by
step: ``buf.lerp_(g, 1 - mu)``; the update is ``g.lerp(buf, mu)`` (Nesterov) or ``buf``; it is cast to
the Newton–Schulz dtype, transposed when tall, divided by its Frobenius norm (clamped at ``eps``),
iterated ``ns_steps`` times with coefficients ``(a, b, c)``; decoupled weight decay
``p *= 1 - lr * wd``, then ``p -= adjusted_lr * O``. tests/integration/test_muon.py holds it bitwise to a plain
loop of ``torch.optim.Muon`` + ``torch.optim.AdamW``.

Parallel layouts (the point of this module): Newton–Schulz needs each weight's *whole* matrix.
A parameter that is a DTensor sharded on one of its matrix dims (FSDP2 ``Shard(0)``, tensor parallel
``Shard(0)``/``Shard(1)``, their composition, FSDP inside an expert) has its momentum-updated
gradient gathered whole (``DTensor.full_tensor``, exact: it only concatenates), orthogonalised once
by one *owner* rank, chosen round-robin by parameter among the ranks holding pieces of it (as
Moonlight's Distributed Muon and TorchTitan's DistMuon spread the work), broadcast from the owner
along each sharded mesh dim, and each rank keeps its own piece (a local slice, no communication).
Replicated mesh dims (HSDP's replicas, DDP) repeat the work, as they repeat the whole step. Every
piece-holder receives the whole matrix (an all-gather, where a gather to the owner would do; DTensor
has no gather-to-one-rank for strided shards), so the traffic per matrix and dim is its size twice
(engine/planner/optimizer_state.py). A 3-D
MoE expert weight ``[experts, rows, cols]`` is one matrix per expert; sharded only on the expert dim
(expert parallel, FSDP across experts) each rank orthogonalises its own whole experts locally.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

# Keller Jordan's Muon post (https://kellerjordan.github.io/posts/muon/), as torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
NS_EPS = 1e-7  # torch.optim.Muon's EPS: clamps the norm that scales the update to spectral norm <= 1
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def zeropower_via_newtonschulz(grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately orthogonalise a matrix: ``U S' V^T`` with ``S'_ii`` near 1 for ``G = U S V^T``.

    The quintic Newton–Schulz iteration of Keller Jordan's Muon, op for op as
    ``torch.optim._muon._zeropower_via_newtonschulz`` (which always uses bfloat16; ``dtype`` lets the
    float64 reference mode keep its precision).

    Args:
        grad: ``[rows, cols]`` momentum-updated gradient (any float dtype).
        ns_coefficients: ``(a, b, c)`` of ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``.
        ns_steps: iterations (< 100). eps: clamp of the Frobenius norm (divisor).
        dtype: dtype of the iteration.

    Returns:
        ``[rows, cols]`` tensor of ``dtype``.

    Raises:
        ValueError: ``grad`` not 2-D, ``ns_steps >= 100`` or not three coefficients.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    ortho = grad.to(dtype, copy=True)  # never in place on the momentum buffer (nesterov=False)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


def adjusted_lr(lr: float, adjust_lr_fn: str, rows: int, cols: int) -> float:
    """The learning rate of one ``[rows, cols]`` matrix, as ``torch.optim._muon._adjust_lr``.

    ``original`` (Keller Jordan): ``lr * sqrt(max(1, rows / cols))``. ``match_rms_adamw`` (Liu et al.
    2025, Sec. 2.2): ``lr * 0.2 * sqrt(max(rows, cols))``, which gives the update the RMS of AdamW's
    (~0.2), so AdamW's learning rate and weight decay carry over.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


def _placements(param: Tensor):
    """(mesh, placements) of a DTensor, or (None, ()) for a plain tensor."""
    spec = getattr(param, "_spec", None)
    if spec is None or not hasattr(param, "device_mesh"):
        return None, ()
    return param.device_mesh, tuple(param.placements)


def sharded_matrix_dims(param: Tensor) -> tuple[int, ...]:
    """Mesh dims along which ``param`` is sharded on one of its matrix dims (its last two)."""
    mesh, placements = _placements(param)
    if mesh is None:
        return ()
    ndim = param.ndim
    # Shard and _StridedShard (FSDP2 over tensor parallel; not a Shard subclass) both carry ``dim``.
    return tuple(i for i, pl in enumerate(placements)
                 if getattr(pl, "dim", None) is not None and pl.dim % ndim >= ndim - 2)  # type: ignore[attr-defined]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Owners:
    """Round-robin owner of each gathered matrix over the ranks that hold its pieces."""

    def __init__(self) -> None:
        self.count: dict = defaultdict(int)

    def owner(self, mesh, dims: tuple[int, ...]) -> tuple[int, ...]:
        key = (id(mesh), dims)
        index = self.count[key]
        self.count[key] += 1  # (-= 1 alike: the same round robin backwards, on which every rank agrees)
        sizes = [mesh.size(d) for d in dims]
        coords = []
        for size in reversed(sizes):
            coords.append(index % size)
            index //= size
        return tuple(reversed(coords))


def _orthogonalise_sharded(update: Tensor, param: Tensor, dims: tuple[int, ...], owner: tuple[int, ...],
                           ns) -> Tensor:
    """This rank's piece of NS(whole matrices) for ``update`` (this rank's piece, placed as ``param``):
    gather whole along the mesh dims ``dims`` (those sharding a matrix dim; a dim sharding experts
    stays sharded), NS on the ``owner`` (its coordinates on ``dims``), broadcast along ``dims``, slice."""
    from torch.distributed.tensor import DTensor, Replicate

    # Mutation testing: tests/unit/test_muon_rules.py runs this on a one-rank mesh, where every placement and group is
    # the identity; the placements, the non-owner's buffer and the broadcast groups are checked by the
    # 4-process tests/integration/test_muon_parallel.py (outside the fast selection). Alike:
    # redistribute(None, ...) (a DTensor's own mesh is the default); the non-owner's buffer in float32 (the
    # wire is float32 for bf16 and float32 NS); its device (CPU here; it matters on a GPU).
    mesh, placements = _placements(param)
    whole_placements = [Replicate() if d in dims else pl for d, pl in enumerate(placements)]
    sharded = DTensor.from_local(update, mesh, placements, shape=param.shape, stride=param.stride())
    whole = sharded.redistribute(mesh, whole_placements)
    mine = mesh.get_coordinate()
    if all(mine[d] == c for d, c in zip(dims, owner)):
        result = _orthogonalise_whole(whole.to_local(), ns)
    else:
        result = torch.empty(whole.to_local().shape, dtype=ns["dtype"], device=update.device)
    # bfloat16 travels as float32 (exact both ways): not every backend broadcasts bfloat16. Contiguous:
    # a tall matrix's result is a transposed view, which a collective would send in memory order.
    # (float() of a float32 result is the identity; gloo broadcasts bf16 as is, a backend without bf16 would not)
    wire = (result.float() if result.dtype == torch.bfloat16 else result).contiguous()
    for d, c in zip(dims, owner):  # after dim d, every rank matching the owner on the later dims has it
        dist.broadcast(wire, group=mesh.get_group(d), group_src=c)
    # (leaving the wire in float32 would be alike: it holds bf16 values exactly and add_ promotes anyway)
    result = DTensor.from_local(wire.to(ns["dtype"]), mesh, whole_placements, shape=param.shape,
                                stride=whole.stride())
    return result.redistribute(mesh, placements).to_local()


def _orthogonalise_whole(update: Tensor, ns) -> Tensor:
    """NS of a whole 2-D matrix, or of each expert of a 3-D ``[experts, rows, cols]`` one."""
    args = (ns["ns_coefficients"], ns["ns_steps"], ns["eps"], ns["dtype"])
    if update.ndim == 2:
        return zeropower_via_newtonschulz(update, *args)
    return torch.stack([zeropower_via_newtonschulz(matrix, *args) for matrix in update.unbind(0)])


def muon_group_step(group: dict, state, owners: _Owners) -> None:
    """One Muon step of a param group (``torch.optim.Muon``'s ``_single_tensor_muon`` per matrix)."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    ns = {"ns_coefficients": tuple(group["ns_coefficients"]), "ns_steps": group["ns_steps"],
          "eps": group["eps"], "dtype": NS_DTYPES[group["ns_dtype"]]}
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.ndim not in (2, 3):
            raise ValueError(f"Muon needs 2-D matrices or 3-D [experts, rows, cols] weights, got {tuple(p.shape)}")
        param_state = state[p]
        if "momentum_buffer" not in param_state:
            # (preserve_format is zeros_like's default: omitting it is alike)
            param_state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf = _local(p.grad), _local(param_state["momentum_buffer"])
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        dims = sharded_matrix_dims(p)  # (a plain tensor has none; DTensors: see _orthogonalise_sharded)
        if dims:
            mesh, _ = _placements(p)
            ortho = _orthogonalise_sharded(update, p, dims, owners.owner(mesh, dims), ns)
        else:
            ortho = _orthogonalise_whole(update, ns)
        rows, cols = p.shape[-2], p.shape[-1]
        local = _local(p)
        local.mul_(1 - lr * wd)
        local.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``"algorithm": "muon"``, ``torch.optim.AdamW`` on the others.

    One optimizer, so one LR scheduler, one ``state`` (momentum buffers and Adam moments keyed by
    parameter) and one ``param_groups`` list for DCP checkpoints. The AdamW groups are stepped by an
    inner ``torch.optim.AdamW`` that shares the group dicts and the state (re-linked at every step, so
    ``load_state_dict``, which replaces both, cannot split them).

    Args:
        groups: param group dicts, each with ``params``, ``algorithm`` ("muon"|"adamw"), ``lr``,
            ``weight_decay``; Muon groups also ``momentum``, ``nesterov``, ``ns_coefficients``,
            ``ns_steps``, ``eps``, ``adjust_lr_fn``, ``ns_dtype``.
        adamw_kwargs: ``torch.optim.AdamW`` keywords of the AdamW groups (``lr``, ``betas``, ``eps``,
            ``foreach``/``fused``).

    Raises:
        ValueError: a Muon parameter that is not 2-D or 3-D; an unknown ``algorithm``.
    """

    def __init__(self, groups: list[dict], adamw_kwargs: dict) -> None:
        for group in groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"param group {group.get('name')!r}: algorithm {group['algorithm']!r} is not "
                                 "muon or adamw")
            if group["algorithm"] == "muon":
                bad = [tuple(p.shape) for p in group["params"] if p.ndim not in (2, 3)]
                if bad:
                    raise ValueError(f"param group {group.get('name')!r}: Muon needs 2-D (or 3-D expert) "
                                     f"weights, got shapes {bad}; give them optimizer=adamw")
        adamw_groups = [g for g in groups if g["algorithm"] == "adamw"]
        # Fills AdamW's defaults (betas, amsgrad, fused, ...) into these very dicts.
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs) if adamw_groups else None
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group; ``closure`` as in ``torch.optim.Optimizer.step``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
            self._adamw.state = self.state
            self._adamw.step()
        owners = _Owners()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                muon_group_step(group, self.state, owners)
        return loss
