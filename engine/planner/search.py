"""Candidate layouts for a model on a cluster, ranked, and the decision-matrix row that applies.

Candidates: tp ∈ {1, 2, 4, 8} up to the GPUs of a node (TP stays inside a node), pp over the divisors
of the world size (one 1F1B stage per rank, one sequence per pipeline microbatch, M = the local batch),
cp ∈ {1, 2, 4} for sequences of at least 4096·cp tokens, FSDP or HSDP (dp_replicate = nodes) or
pure DDP, ep over the valid expert-parallel degrees for MoE models, AC none / selective "op" / full,
and for each the largest local batch (fewest accumulation steps) that fits. Every candidate passes
the launcher's own pre-flight (engine/setup/preflight.py) or is dropped.

Decision matrix (the order a practitioner tries, from least to most communication):
1. the full training state and activations fit one GPU            → DDP (dp_replicate = world)
2. they fit when sharded over all ranks                           → FSDP (dp_shard = world)
3. fast intra-node links (NVLink)                                 → TP (or CP) inside the node + FSDP across
4. otherwise                                                      → add PP across nodes
The first row with a fitting layout applies; the reason quotes the bytes that decided it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planner.estimate import LayoutEstimate, estimate
from engine.planner.layout import Layout, config_with

GIB = 1024**3
ROWS = {
    1: "full state fits one GPU -> DDP",
    2: "fits when sharded -> FSDP",
    3: "fast intra-node links -> TP inside the node + FSDP across nodes",
    4: "does not fit without pipelining -> add PP across nodes",
}


@dataclass
class Plan:
    """The search's answer: ``ranked`` estimates (fitting first, then by step time), the decision
    ``row`` (1-4, 0 when nothing fits), ``reason`` (one paragraph with the numbers)."""

    ranked: list[LayoutEstimate]
    row: int
    reason: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _try(cfg, world_size: int, gpu, gpus_per_node: int, efficiency: float) -> LayoutEstimate | None:
    try:
        layout = Layout.from_config(cfg, world_size)
    except (ValueError, FileNotFoundError):
        return None
    return estimate(layout, gpu, gpus_per_node, efficiency)


def _best_batch(cfg, world_size, gpu, gpus_per_node, efficiency, dp: int, pp: int) -> LayoutEstimate | None:
    """The fitting candidate with the largest local batch, else the smallest-memory one."""
    gbs = cfg.training.global_batch_size
    if gbs % dp:
        return None
    per_rank = gbs // dp
    if pp > 1:
        options = [config_with(cfg, training__local_batch_size=per_rank, parallelism__pp_microbatch_size=1,
                               parallelism__pp_schedule="1F1B")]
    else:
        options = [config_with(cfg, training__local_batch_size=b) for b in (8, 4, 2, 1) if per_rank % b == 0]
    smallest = None
    for option in options:
        est = _try(option, world_size, gpu, gpus_per_node, efficiency)
        if est is None:
            continue
        if est.fits:
            return est
        if smallest is None or est.memory.total < smallest.memory.total:
            smallest = est
    return smallest


def _routes_experts(cfg) -> bool:
    """Whether ``[model]`` is a family that routes tokens to experts (its spec gives
    ``expert_routing``): then ep degrees are candidates too."""
    import models  # noqa: F401  (registers the built-in families; torch-free)
    from models.registry import get_model_spec

    return get_model_spec(cfg.model.name).expert_routing is not None


def candidates(cfg, world_size: int, gpu, gpus_per_node: int, efficiency: float) -> list[LayoutEstimate]:
    """Every candidate layout's estimate (see the module docstring), unranked."""
    out = []
    routed = _routes_experts(cfg)
    nodes = max(world_size // gpus_per_node, 1)
    seq_len = cfg.training.seq_len
    for tp in (1, 2, 4, 8):
        if tp > gpus_per_node or world_size % tp:
            continue
        for pp in _divisors(world_size // tp):
            for cp in (1, 2, 4):
                if cp > 1 and seq_len < 4096 * cp:
                    continue
                rest = world_size // (tp * pp)
                if rest % cp:
                    continue
                dp_total = rest // cp
                replicas = {1}
                if nodes > 1 and dp_total % nodes == 0 and dp_total > nodes:
                    replicas.add(nodes)  # HSDP: shard inside a node's ranks, replicate across nodes
                shapes = [(r, dp_total // r) for r in replicas]
                if tp == pp == cp == 1 and world_size > 1:
                    shapes.append((world_size, 1))  # pure DDP
                for dp_replicate, dp_shard in shapes:
                    eps = [1]
                    if routed:
                        eps = [e for e in _divisors(dp_shard * cp) if e % cp == 0 and e > 1][:4] or [1]
                    for ep in eps:
                        for ac, option in (("none", "op"), ("selective", "op"), ("full", "op")):
                            c = config_with(cfg, parallelism__tp=tp, parallelism__pp=pp, parallelism__cp=cp,
                                            parallelism__dp_replicate=dp_replicate, parallelism__dp_shard=dp_shard,
                                            parallelism__ep=ep, activation_checkpoint__mode=ac,
                                            activation_checkpoint__selective_ac_option=option)
                            est = _best_batch(c, world_size, gpu, gpus_per_node, efficiency,
                                              dp_replicate * dp_shard, pp)
                            if est is not None:
                                out.append(est)
    return out


def _row_of(est: LayoutEstimate) -> int:
    d = est.layout
    if d.tp == d.pp == d.cp == 1 and d.dp_shard == 1:
        return 1
    if d.tp == d.pp == d.cp == 1:
        return 2
    if d.pp == 1:
        return 3
    return 4


def plan(cfg, world_size: int, gpu, gpus_per_node: int, efficiency: float) -> Plan:
    """Rank the candidates and pick the decision-matrix row (module docstring)."""
    found = candidates(cfg, world_size, gpu, gpus_per_node, efficiency)
    ranked = sorted(found, key=lambda e: (not e.fits, e.step_time_s if e.fits else e.memory.total))
    by_row: dict[int, list[LayoutEstimate]] = {}
    for est in found:
        by_row.setdefault(_row_of(est), []).append(est)
    cap = gpu.usable_bytes / GIB
    notes = []
    row = 0
    for r in (1, 2, 3, 4):
        members = by_row.get(r, [])
        fitting = [e for e in members if e.fits]
        smallest = min(members, key=lambda e: e.memory.total, default=None)
        if fitting:
            best = min(fitting, key=lambda e: e.step_time_s)
            notes.append(f"row {r} ({ROWS[r]}): {_describe(best)} needs {best.memory.total / GIB:.1f} GiB "
                         f"of {cap:.0f} GiB per GPU -> applies")
            row = r
            break
        if smallest is not None:
            m = smallest.memory
            notes.append(f"row {r} ({ROWS[r]}): its smallest layout {_describe(smallest)} needs "
                         f"{m.total / GIB:.1f} GiB (state {(m.params + m.grads + m.optimizer) / GIB:.1f}, "
                         f"activations {m.activations / GIB:.1f}, gradient reduction {m.reduction / GIB:.1f}) "
                         f"> {cap:.0f} GiB")
        else:
            notes.append(f"row {r} ({ROWS[r]}): no valid layout on {world_size} GPUs")
    if row == 0:
        notes.append("nothing fits: more GPUs, a shorter seq_len or a smaller global batch")
    return Plan(ranked, row, "\n".join(notes))


def _describe(est: LayoutEstimate) -> str:
    d = est.layout
    parts = [f"{k} {v}" for k, v in d.degrees.items() if v > 1]
    ac = d.ac[0] if d.ac[0] != "selective" else f"selective {d.ac[1]}"
    return f"[{' x '.join(parts) or 'one GPU'}, AC {ac}, local batch {d.local_batch_size}]"
