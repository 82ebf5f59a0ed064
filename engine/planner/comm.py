"""Communication bytes per optimizer step per rank, for each mesh dimension of a layout.

Counted as parallelisms/comm_counter.py counts them (``payload``: the full buffer of each collective,
both the send and the recv of point-to-point; ``wire``: the ring bytes through this rank's link,
(n-1)/n·S for all-gather / reduce-scatter / all-to-all, 2(n-1)/n·S for all-reduce, S for send/recv,
nccl-tests/doc/PERFORMANCE.md), so tests/integration/test_planner_runs.py compares them with CPU runs directly.

Per mesh dim (A accumulation steps, M pipeline microbatches, X = b·(s/cp)·h·B the activation of one
microbatch, B the compute dtype's bytes):
- ``dp_shard_cp`` (FSDP2, ZeRO-3, Rajbhandari et al. 2020): per microbatch an all-gather of every unit
  in forward, again in backward for units resharded after forward, and a reduce-scatter of every
  unit's gradient (reduce dtype); once per step instead with ``grad_sync_each_microbatch = false``,
  and once per schedule step under PP (weights stay gathered across microbatches). Buffers are the
  TP-local shapes padded to a multiple of the shard count (FSDP2's padding). With
  ``float8.fsdp_all_gather`` a float8 weight is all-gathered at 1 byte per element, plus one
  all-reduce of its float32 amax per step (engine/planner/float8.py).
- ``dp_replicate``: DDP all-reduces full gradients per microbatch (or once); HSDP all-reduces the
  reduce-scattered shards.
- ``tp`` (Megatron-LM, arXiv 1909.08053; sequence parallel arXiv 2205.05198 §4.2.2): per block an
  all-gather and a reduce-scatter of X per sub-block in forward and the transposed pair in backward
  (4X each) with SP, or 2 forward + 2 backward all-reduces of X without; the vocab-parallel
  embedding and the output head one X each way; under SP the replicated norm weights' gradients are
  all-reduced once per step.
- ``cp`` (ring attention, parallelisms/ring_attention.py): per block and microbatch cp-1 forward hops of
  K and V (repeated to every local query head), cp-1 backward hops of K, V and their fp32 gradient
  accumulators, and one last hop of the accumulators; each hop is a send and a recv.
- ``ep`` (parallelisms/expert_parallel.py): per MoE block and microbatch the dispatch and combine
  all-to-alls of T·top_k rows of width h (T local tokens), forward and backward, plus the [E] int64
  counts; exact for the mean over ep ranks (a rank's combine follows the routing).
- ``pp``: per microbatch and stage boundary one send and one recv of the activation (forward) and of
  its gradient (backward).
- Muon (``optimizer.name = "Muon"``): each sharded matrix gathered whole and its orthogonalised form
  broadcast back, along each mesh dim that shards it (engine/planner/optimizer_state.py).
- scalars: the step's token count and loss (``dp_cp``), one 8-byte norm partial per mesh dim that
  shards gradients, the loss over stages (``pp``).
Recomputation (full AC, every N-th block, and the per-op policies, which rerun the whole block with
the kept op outputs from a cache) repeats a block's forward collectives in backward: under tp both
all-gathers but only the first of its two reduce-scatters / all-reduces (torch's checkpoint stops
recomputing once the last tensor backward needs is back, before the block's last collective), and
no reduce-scatter under the per-op policies (they keep its output); under ep all of them, under cp
(the ring) all of them in a whole-block recomputation and none under the per-op policies (they
keep the ring operator's output).
Measured on the CPU runs of tests/integration/test_planner_runs.py for tp; cp and ep under AC are not measured.
"""

from __future__ import annotations

from engine.planner.optimizer_state import muon_comm

from engine.planner.float8 import FLOAT8_BYTES, SCALE_BYTES, float8_all_gather, is_float8_param
from engine.planner.params import rank_params
from engine.planner.params import padded_numel
from parallelisms.parallel_dims import ep_spans_tp

_RING = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
         "send": lambda n: 1.0, "recv": lambda n: 1.0, "broadcast": lambda n: 1.0}


class _Tally:
    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes
        self.dims: dict[str, dict] = {}

    def add(self, dim: str, kind: str, payload: float) -> None:
        n = self.sizes[dim]
        if n <= 1 or payload == 0:
            return
        entry = self.dims.setdefault(dim, {"payload": 0.0, "wire": 0.0, "kinds": {}})
        entry["payload"] += payload
        entry["wire"] += payload * _RING[kind](n)
        entry["kinds"][kind] = entry["kinds"].get(kind, 0.0) + payload


def group_sizes(layout) -> dict[str, int]:
    """Size of each mesh dim's group (the names of parallelisms/parallel_dims.py)."""
    return {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard_cp": layout.fsdp,
            "dp_shard": layout.dp_shard, "dp_cp": layout.dp * layout.cp, "cp": layout.cp, "tp": layout.tp,
            "ep": layout.ep, "dp_shard_mod_ep": layout.fsdp * (layout.tp if _ep_over_tp(layout) else 1) // layout.ep}


def _ep_over_tp(layout) -> bool:
    """The routed experts span tp (parallelisms/parallel_dims.py ``ep_spans_tp``)."""
    return ep_spans_tp(layout.dp_shard, layout.cp, layout.tp, layout.ep)


def _recomputed_blocks(layout, n_layers: int) -> float:
    """Share of block forwards run again in backward: 1 under full AC and the per-op policies (the
    whole block reruns, saved op outputs come from the cache), (n_layers // N) / n_layers for every
    N-th block, 0 without AC."""
    mode, option = layout.ac
    if mode == "none":
        return 0.0
    if mode == "selective" and option.isdigit():
        return (n_layers // int(option)) / max(n_layers, 1)
    return 1.0


def _recompute_factor(layout, n_layers: int) -> float:
    """Forward collectives per block forward where the recomputation repeats them all (cp, ep)."""
    return 1.0 + _recomputed_blocks(layout, n_layers)


def comm_bytes(layout, coords: dict | None = None) -> dict[str, dict]:
    """{mesh dim: {"payload", "wire", "kinds"}} in bytes per optimizer step for the rank at ``coords``
    (default: the first rank). Dims of size 1 are absent."""
    coords = coords or {}
    a = layout.model_args
    tally = _Tally(group_sizes(layout))
    pb, rb = layout.param_bytes, layout.reduce_bytes
    b, s, h = layout.microbatch_size, layout.seq_len // layout.cp, a.dim
    n_mb = layout.grad_accum * layout.pp_microbatches  # forwards per step
    stages = layout.stages_of(coords.get("pp", 0))
    n_layers = sum(len(ls) if ls is not None else a.n_layers for ls, _, _ in stages)
    layer_ids = [i for ls, _, _ in stages for i in (ls if ls is not None else range(a.n_layers))]
    has_first = any(first for _, first, _ in stages)
    has_last = any(last for _, _, last in stages)
    recompute = _recompute_factor(layout, n_layers)
    _data_parallel(layout, coords, tally, pb, rb)
    x = b * s * h * pb
    if layout.tp > 1:  # per microbatch: forward, backward and the recomputation of a checkpointed block
        # forward's two all-gathers (SP) are rerun by every recomputation; of its two reduce-scatters
        # (or all-reduces without SP) only the first: the block's last is needed by no saved tensor,
        # and torch's checkpoint stops the recomputation before it (early stop); the per-op policies
        # keep reduce-scatter outputs, so under SP they rerun none.
        rerun = _recomputed_blocks(layout, n_layers)
        per_op = layout.ac[0] == "selective" and not layout.ac[1].isdigit()
        if layout.sequence_parallel:
            ends = (x if has_first else 0) + (x if has_last else 0)  # embedding and output head
            gathers = 2 * x + 2 * x + 2 * x * rerun  # forward, backward of the reduce-scatters, rerun
            scatters = 2 * x + 2 * x + (0 if per_op else x * rerun)
            tally.add("tp", "all_gather", n_mb * (n_layers * gathers + ends))
            tally.add("tp", "reduce_scatter", n_mb * (n_layers * scatters + ends))
            # replicated norm weights: their whole gradient, whatever FSDP shards (grad_norm.py)
            norms = sum(p.spec.numel for p in rank_params(layout, coords) if p.spec.norm)
            tally.add("tp", "all_reduce", 4 * norms)
        else:
            per_block = 2 * x + 2 * x + x * rerun
            tally.add("tp", "all_reduce",
                      n_mb * (n_layers * per_block + (x if has_first else 0) + (x if has_last else 0)))
        tally.add("tp", "all_reduce", 8)  # gradient norm partial
    if layout.cp > 1:
        k = b * (a.n_heads // layout.tp) * s * a.head_dim
        kb, kf = k * pb, k * 4
        if layout.cfg.parallelism.cp_rotate_method == "allgather":
            full = 2 * k * layout.cp * pb
            tally.add("cp", "all_gather", n_mb * n_layers * full * recompute)
            tally.add("cp", "reduce_scatter", n_mb * n_layers * full)
        else:
            hops = layout.cp - 1
            # The per-op policies keep the ring operator's output (parallelisms/activation_checkpoint.py):
            # only a whole-block recomputation (full AC, every N-th block) runs its exchange again.
            rerun = 1.0 if layout.ac[0] == "selective" and not layout.ac[1].isdigit() else recompute
            send = hops * 2 * kb * rerun + hops * (2 * kb + 2 * kf) + 2 * kf
            tally.add("cp", "send", n_mb * n_layers * send)
            tally.add("cp", "recv", n_mb * n_layers * send)
    if layout.ep > 1:
        routing = layout.model_spec.get("expert_routing")(a)
        moe_layers = sum(1 for i in layer_ids if i in routing.moe_layers)
        rows = b * s * routing.top_k * h * pb
        if _ep_over_tp(layout):  # each tp rank dispatches its own sequence shard (models/common/moe_parallelize.py)
            rows //= layout.tp
        per_layer = 2 * rows * recompute + 2 * rows + 8 * routing.num_experts * recompute
        tally.add("ep", "all_to_all", n_mb * moe_layers * per_layer)
        tally.add("ep", "all_reduce", 8)  # gradient norm partial of the expert shards
    if layout.pp > 1:
        xp = b * s * h * pb // (layout.tp if layout.sequence_parallel else 1)
        plan = layout.pp_plans[coords.get("pp", 0)]
        local = set(plan.local_stages)
        boundaries = 0
        for stage in plan.local_stages:
            if stage > 0 and stage - 1 not in local:
                boundaries += 1
            if stage < plan.num_stages - 1 and stage + 1 not in local:
                boundaries += 1
        per_mb = boundaries * 2 * xp  # per boundary: the activation one way, its gradient back
        tally.add("pp", "send", n_mb * per_mb / 2)
        tally.add("pp", "recv", n_mb * per_mb / 2)
        tally.add("pp", "all_reduce", 12)  # gradient norm partial (8) and the loss over stages (4)
    tally.add("dp_cp", "all_reduce", 8)  # the step's token count and loss
    muon_comm(layout, rank_params(layout, coords), tally)  # Muon's whole-matrix gathers (optimizer_state.py)
    return tally.dims


def _data_parallel(layout, coords: dict, tally: _Tally, pb: int, rb: int) -> None:
    """FSDP / HSDP / DDP traffic (module docstring) into ``tally``."""
    params = rank_params(layout, coords)
    a_steps = layout.grad_accum
    sync_each = layout.cfg.parallelism.grad_sync_each_microbatch or a_steps == 1
    n_mb = a_steps * layout.pp_microbatches
    if layout.fsdp == 1:
        if layout.dp_replicate > 1:  # DDP
            full = sum(p.local_numel for p in params) * rb
            tally.add("dp_replicate", "all_reduce", full * (a_steps if sync_each else 1))
        return
    # HSDP shards over the 2-D mesh's second dim: dp_shard itself when cp = 1 (parallel_dims.py "hsdp")
    shard_dim = "dp_shard" if layout.dp_replicate > 1 and layout.cp == 1 else "dp_shard_cp"
    units: dict[str, dict] = {}
    f8_gather = float8_all_gather(layout)
    for p in params:
        dim = "dp_shard_mod_ep" if p.unit.endswith(".experts") else shard_dim
        u = units.setdefault(p.unit, {"dim": dim, "padded": 0, "shard": 0, "gathered": 0})
        n = p.fsdp_size
        padded = padded_numel(p.tp_local, p.fsdp_dim, n) if n > 1 else p.local_numel
        u["padded"] += padded
        u["shard"] += padded // n
        f8 = f8_gather and n > 1 and is_float8_param(layout, p.spec)  # engine/planner/float8.py
        u["gathered"] += padded * (FLOAT8_BYTES if f8 else pb)
        if f8:  # the scales' one all-reduce after the optimizer step: one float32 amax per weight
            tally.add(dim, "all_reduce", SCALE_BYTES)
    blocks = sorted(u for u in units if u.startswith("layers.") and not u.endswith(".experts"))
    blocks.sort(key=lambda u: int(u.split(".")[1]))
    setting = layout.reshard
    for name, u in units.items():
        if name == "root":
            reshard = setting == "always"
        elif name.endswith(".experts"):
            reshard = setting != "never"
        else:
            reshard = setting == "always" or (setting == "default" and name != blocks[-1])
        if layout.pp > 1:
            gathers = a_steps * (1 if not reshard else 2 * layout.pp_microbatches)
            reductions = a_steps
        elif sync_each:
            gathers = a_steps * (2 if reshard else 1)
            reductions = a_steps
        else:
            gathers, reductions = 1, 1
        tally.add(u["dim"], "all_gather", gathers * u["gathered"])
        tally.add(u["dim"], "reduce_scatter", reductions * u["padded"] * rb)
        if layout.dp_replicate > 1:
            tally.add("dp_replicate", "all_reduce", reductions * u["shard"] * rb)
    tally.add(shard_dim, "all_reduce", 8)  # gradient norm partial
    if layout.tp > 1:  # TP-sharded and TP-replicated gradients are summed in separate groups
        tally.add(shard_dim, "all_reduce", 8)
    if any(u["dim"] == "dp_shard_mod_ep" for u in units.values()):
        tally.add("dp_shard_mod_ep", "all_reduce", 8)
    del n_mb
