"""Per-rank bytes alive during backward's gradient reductions (the reduction phase), torch-free.

A step's peak of non-state tensor bytes is the larger of two phases (engine/planner/memory.py
``peak_nonstate_bytes``): the loss, where the activations peak, and the gradient reductions of
backward, where the data-parallel buffers peak. With few tokens per microbatch the second one wins:
its buffers scale with the parameters, not with the tokens.

The phase follows how torch's FSDP2 allocates (``fully_shard``, torch/distributed/fsdp/_fully_shard/:
``_fsdp_param_group.py`` ``FSDPParamGroup.post_backward``, ``_fsdp_collectives.py`` ``foreach_reduce``;
Zhao et al. 2023, "PyTorch FSDP", arXiv 2304.11277 §3.2-3.3; ZeRO-3, Rajbhandari et al. 2020, arXiv
1910.02054; DDP is torch's FSDP2-based ``replicate``), with this repo's units (parallelisms/
data_parallel.py: each block and the root; parallelisms/expert_parallel.py: each MoE block's experts).
Backward reduces the units in reverse: each block of the rank's stages from the last (a MoE block's
experts inside its block's backward), the root (embedding, final norm, output head) last. With ``pb``
/ ``rb`` bytes per element of the compute / reduce dtype, a unit of ``U`` elements whose
reduce-scatter over k ranks takes ``R`` elements (U with the sharded dim padded to a multiple of k),
its reduction holds at its successive moments:

    t1  before resharding:   U·pb (its gathered parameters; 1 byte per element of a float8 weight under
                             float8 all-gather) + U·pb (its unsharded gradients)
                             + the previous unit's R·rb (FSDP keeps one reduce-scatter input alive
                             until the next unit's ``post_backward``)
    t2  copy-in:             U·pb (gradients) + R·rb (the reduce-scatter input)
    t3  the reduce-scatter:  R·rb·c + R/k·rb (its output) + the unit's last parameter's gradient·pb
                             (``foreach_reduce``'s loop over the gradients keeps its variable bound
                             until the function returns); c = 2 on gloo (ProcessGroupGloo's
                             reduce_scatter all-reduces a copy of its input and keeps its chunk), 1 on
                             NCCL. k = 1 (DDP, or an experts unit alone on its mesh): no collective,
                             but dividing by the gradient divide factor (1.0, data_parallel.py
                             ``_sum_gradients``) copies the input into the output: 3·R·rb
    t4  the cast:            R·rb + R/k·rb + R/k·4 when the reduce dtype is not the fp32 master
                             weights' (the reduced shard is cast to fp32), + the last gradient (k > 1)

and beside it (``base``):
- the saved activations of the blocks not yet back-propagated, per block as in memory.py, of one
  microbatch (a step's last reduction follows its last microbatch's backward); none under pipeline
  parallel, whose stage runs every backward without FSDP's reduction and then reduces every unit
  (torch/distributed/pipelining/stage.py ``backward_maybe_with_nosync``, ``perform_reduce_grad``)
  in FSDP's state order: the stage's root first, then its blocks;
- the root unit gathered (from the loss to its own reduction, the end of backward), the output head's
  and final norm's unsharded gradients (computed at the loss, reduced with the root), the next block
  prefetched for backward (its all-gather output) and, at a MoE block's experts reduction, the block;
- with one gradient reduction per step (``grad_sync_each_microbatch = false``) and under pipeline
  parallel (its stage defers FSDP's reduction to after the last microbatch): every unit not yet reduced,
  gathered and with its accumulated unsharded gradient (reduce dtype); under DDP every unit not yet
  reduced, gathered (``replicate`` reshards each after its reduction);
- under HSDP and DDP when the step accumulates (a sharded gradient exists, so the all-reduced output
  is a new buffer added to it): every reduced unit's all-reduce buffer R/k·rb, which
  ``FSDPParamGroup`` holds (``_all_reduce_state``) until ``finalize_backward`` ends backward.

The phase's bytes are the largest t1..t4 + base over the units. tests/integration/test_planner_runs.py checks them
against the peak measured inside FSDP's ``post_backward`` on CPU runs, and the max of both phases
against the step's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.planner.activations import block_activation_bytes
from engine.planner.float8 import gathered_bytes_per_element
from engine.planner.params import padded_numel, rank_params

MASTER_BYTES = 4  # the sharded master weights (and so their gradients) are fp32


@dataclass
class Unit:
    """One FSDP2 / ``replicate`` unit of a rank, in elements.

    Attributes:
        name: "root", "layers.N" or "layers.N.experts".
        unsharded: elements of its parameters as gathered (its unsharded gradients have as many).
        gathered: bytes of its parameters as gathered: ``pb`` per element, 1 for a float8 weight
            under float8 all-gather (engine/planner/float8.py ``gathered_bytes_per_element``).
        padded: elements of its reduce-scatter input (each sharded dim padded to a multiple of k).
        k: ranks of its reduce-scatter (1: DDP, or an experts unit alone on its mesh).
        last: elements of its last parameter (registration order).
        head: elements of the output head and final norm (the root unit of the last stage), else 0.
    """

    name: str
    unsharded: int = 0
    gathered: int = 0
    padded: int = 0
    k: int = 1
    last: int = 0
    head: int = 0


def rank_units(layout, coords: dict | None = None) -> dict[str, Unit]:
    """The data-parallel units of the rank at ``coords``, by name (empty without FSDP / HSDP / DDP):
    each parameter is in its block's unit, its experts' unit (ep > 1) or the root's."""
    if layout.fsdp == 1 and layout.dp_replicate == 1:
        return {}
    units: dict[str, Unit] = {}
    for p in rank_params(layout, coords):
        u = units.setdefault(p.unit, Unit(p.unit))
        numel = math.prod(p.tp_local)
        u.unsharded += numel
        u.gathered += numel * gathered_bytes_per_element(layout, p.spec)
        u.padded += padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size)
        u.k = p.fsdp_size
        u.last = numel
        if p.spec.layer is None and not p.spec.name.startswith("tok_embeddings"):
            u.head += numel
    return units


def unit_reduce_bytes(u: Unit, layout, prev_input: int, grad_bytes: int) -> int:
    """The largest of t1..t4 (module docstring) of unit ``u``, bytes.

    Args:
        prev_input: bytes of the previous unit's reduce-scatter input, alive until this reduction.
        grad_bytes: bytes per element of its unsharded gradient (the compute dtype, or the reduce
            dtype when accumulated over microbatches).
    """
    pb, rb = layout.param_bytes, layout.reduce_bytes
    grads = u.unsharded * grad_bytes
    out = u.padded // u.k
    last = u.last * grad_bytes if u.k > 1 else 0
    t1 = u.gathered + grads + prev_input
    t2 = grads + u.padded * rb
    if u.k > 1:
        t3 = u.padded * rb * (2 if layout.comm_backend == "gloo" else 1) + out * rb + last
    else:
        t3 = 3 * u.padded * rb
    t4 = u.padded * rb + out * rb + out * MASTER_BYTES + last if rb != MASTER_BYTES else 0
    return max(t1, t2, t3, t4)


def saved_per_block(layout) -> float:
    """Mean bytes one block keeps for backward per microbatch (memory.py's formulas per AC mode)."""
    mode, option = layout.ac
    if mode in ("none", "full"):
        return block_activation_bytes(layout, mode)
    if not option.isdigit():  # the per-op policies, "op" and "op_all_matmuls"
        return block_activation_bytes(layout, option)
    n = int(option)  # every n-th block fully recomputed
    return (block_activation_bytes(layout, "full") + (n - 1) * block_activation_bytes(layout, "none")) / n


def reduction_bytes(layout, coords: dict | None = None) -> int:
    """Peak non-state bytes of the rank at ``coords`` during backward's gradient reductions (module
    docstring): the largest of :func:`reduction_events`, bytes; 0 without FSDP / HSDP / DDP."""
    return max(reduction_events(layout, coords).values(), default=0)


def reduction_events(layout, coords: dict | None = None) -> dict[str, int]:
    """Non-state bytes of the rank at ``coords`` at each unit's gradient reduction (the largest of
    its t1..t4 + base, module docstring), by unit name in backward order; {} without FSDP / HSDP /
    DDP."""
    coords = coords or {}
    units = rank_units(layout, coords)
    if not units:
        return {}
    pb, rb = layout.param_bytes, layout.reduce_bytes
    ddp = layout.fsdp == 1
    deferred = layout.pp > 1 or (layout.grad_accum > 1 and not layout.cfg.parallelism.grad_sync_each_microbatch)
    holds_all_reduce = layout.dp_replicate > 1 and layout.grad_accum > 1 and not deferred
    grad_bytes = rb if deferred else pb
    saved = saved_per_block(layout)
    pending = set(units)  # units not reduced yet
    walk = {"held": 0, "prev_input": 0}
    events: dict[str, int] = {}

    def base(gathered: tuple[str, ...]) -> int:
        total = walk["held"]
        if ddp or deferred:  # every unit stays gathered until its own reduction
            total += sum(units[n].gathered for n in pending)
        else:
            total += sum(units[n].gathered for n in (set(gathered) | ({"root"} & pending)) if n in units)
        if deferred:  # with its accumulated gradient
            total += sum(units[n].unsharded for n in pending) * grad_bytes
        elif "root" in pending:
            total += units["root"].head * grad_bytes
        return total

    def reduce(name: str, activations: float, gathered: tuple[str, ...] = ()) -> None:
        u = units[name]
        pending.discard(name)
        here = base(gathered) + int(activations) + unit_reduce_bytes(u, layout, walk["prev_input"], grad_bytes)
        events[name] = here
        walk["prev_input"] = u.padded * rb
        if holds_all_reduce:
            walk["held"] += u.padded // u.k * rb

    stages = layout.stages_of(coords.get("pp", 0))
    if layout.pp > 1:  # reduced after the last backward, in FSDP's state order: each root, then its blocks
        for name in ["root"] + [f"layers.{layer}{part}" for layers, _, _ in stages for layer in layers
                                for part in ("", ".experts")]:
            if name in units:
                reduce(name, 0)
        return events
    for layers, _, _ in reversed(stages):
        layers = tuple(range(layout.model_args.n_layers)) if layers is None else layers
        for position in reversed(range(len(layers))):
            name = f"layers.{layers[position]}"
            prefetched = (f"layers.{layers[position - 1]}",) if position > 0 else ()
            if f"{name}.experts" in units:  # inside its block's backward: the block is gathered
                reduce(f"{name}.experts", position * saved, prefetched + (name,))
            if name in units:
                reduce(name, position * saved, prefetched)
    if "root" in units:
        reduce("root", 0)
    return events
