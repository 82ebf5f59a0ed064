"""Per-rank optimizer state and Muon's extra communication, from the parameters' names and local shards.

Which optimizer holds a parameter follows engine/config/param_groups.py (``optimizer.name``,
``optimizer.param_groups``), torch-free:

- AdamW (torch.optim.AdamW): ``exp_avg`` and ``exp_avg_sq``, each the parameter's local shape and
  dtype, and one 0-d fp32 ``step`` tensor;
- Muon (engine/train/muon.py, torch.optim.Muon): one ``momentum_buffer`` of the local shape and dtype,
  no step.

Muon's communication per step (engine/train/muon.py): a matrix sharded on one of its matrix dims is
gathered whole along each mesh dim that shards it (``all_gather``; counted at the whole matrix, the
size of the last gather's output, an upper bound for a matrix sharded over two dims), and the
orthogonalised matrix is broadcast back along the same dims (``broadcast``, float32 on the wire for a
bfloat16 iteration, float64 for a float64 one). A 3-D expert weight sharded only on the expert dim
needs neither.
"""

from __future__ import annotations

import math

STEP_TENSOR_BYTES = 4  # AdamW's per-parameter fp32 ``step`` tensor

PARAM_BYTES = 4  # fp32 master weights: gradients and optimizer state in their dtype


def algorithm_of(name: str, ndim: int, optimizer_cfg) -> str:
    """"muon" or "adamw" for a parameter (engine/config/param_groups.py ``group_key``)."""
    from engine.config.param_groups import group_key, parse_rules

    rules = parse_rules(list(getattr(optimizer_cfg, "param_groups", [])), optimizer_cfg.name)
    return group_key(name, ndim, rules, optimizer_cfg.name)[1]


def optimizer_bytes(named_local_numels, optimizer_cfg, element_bytes: int = PARAM_BYTES) -> int:
    """Optimizer state bytes of one rank.

    Args:
        named_local_numels: (canonical name, global ndim, local numel) of each of the rank's parameters.
        optimizer_cfg: the ``[optimizer]`` section. element_bytes: bytes per state element.
    """
    total = 0
    for name, ndim, numel in named_local_numels:
        if algorithm_of(name, ndim, optimizer_cfg) == "muon":
            total += element_bytes * numel
        else:
            total += 2 * element_bytes * numel + STEP_TENSOR_BYTES
    return total


def muon_comm(layout, params, tally) -> None:
    """Muon's gathers and broadcasts (module docstring) of the rank holding ``params`` (LocalParam
    list, engine/planner/params.py) into ``tally`` (engine/planner/comm.py ``_Tally``)."""
    cfg = layout.cfg.optimizer
    if cfg.name != "Muon":
        return
    shard_dim = "dp_shard" if layout.dp_replicate > 1 and layout.cp == 1 else "dp_shard_cp"
    wire = 8 if cfg.muon_ns_dtype == "float64" else 4
    for p in params:
        ndim = len(p.spec.shape)
        if algorithm_of(p.spec.name, ndim, cfg) != "muon":
            continue
        dims = []
        if p.spec.tp_dim is not None and layout.tp > 1 and not p.spec.expert:
            dims.append("tp")
        if p.fsdp_size > 1 and p.fsdp_dim >= ndim - 2:
            dims.append("dp_shard_mod_ep" if p.unit.endswith(".experts") else shard_dim)
        whole = math.prod(p.tp_local) * (layout.tp if "tp" in dims else 1)
        for dim in dims:
            tally.add(dim, "all_gather", whole * PARAM_BYTES)
            tally.add(dim, "broadcast", whole * wire)
