"""Per-rank memory of a layout: parameters, gradients, optimizer state, activations, in bytes.

State (exact, tests/unit/test_planner.py checks it equal to the real plan and tests/integration/test_planner_runs.py to
what CPU runs hold): the fp32 master parameters' local shards (engine/planner/params.py), gradients
of the same shapes, AdamW's two moments of the same shapes plus one 4-byte ``step`` per tensor, or Muon's
one momentum buffer (engine/planner/optimizer_state.py, by ``optimizer.name`` and ``param_groups``).

Activations: engine/planner/activations.py (Korthikanti et al. 2022, per block, per AC mode, with
the microbatches a pipeline stage holds in flight).

Transient data-parallel buffers, the ones alive at the activation peak (the loss) and so added to
it: under FSDP2 (torch ``fully_shard``: each unit all-gathers its parameters in the compute dtype
before use and frees them after, prefetching the next unit in backward; the root is not resharded
after forward) the root unit and the next block, gathered; with one gradient reduction per step
(``grad_sync_each_microbatch = false``, parallelisms/data_parallel.py ``sync_on_last_microbatch``)
and under pipeline parallel (torch's stage reduces only after the last microbatch's backward) every
unit stays gathered and keeps its unsharded gradient in the reduce dtype for the whole step;
under DDP (torch's FSDP2-based ``replicate``) every unit's unsharded parameters, a second copy of
the parameters in the compute dtype.

The step's peak (``peak_nonstate_bytes``) is the larger of two phases, never their sum:

    peak_nonstate = max(activations + transient, reduction)      total = state + peak_nonstate

the loss phase above and the gradient-reduction phase of backward (engine/planner/reduction.py: each
unit's unsharded gradients and reduce-scatter buffers, HSDP / DDP all-reduce buffers, the root unit
gathered with the output head's gradients, MoE experts' reduction inside their block; each term read
from how torch's FSDP2 allocates, torch/distributed/fsdp/_fully_shard, the ZeRO-3 / PyTorch FSDP
scheme of Rajbhandari et al. 2020, arXiv 1910.02054, and Zhao et al. 2023, arXiv 2304.11277). With
many tokens per microbatch the loss wins; with one sequence per microbatch the reduction does (its
buffers scale with the parameters). tests/integration/test_planner_runs.py checks the
max of both against the step's measured non-state peak of CPU runs, and the reduction phase alone
against the peak measured inside FSDP's ``post_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planner.activations import activation_bytes, block_activation_bytes  # noqa: F401  (re-exported)
from engine.planner.activations import microbatches_in_flight, saved_per_microbatch
from engine.planner.float8 import gathered_bytes_per_element
from engine.planner.params import padded_numel, rank_params
from engine.planner.optimizer_state import optimizer_bytes
from engine.planner.real_plan import StateBytes
from engine.planner.reduction import reduction_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank: params, grads, optimizer (the state); activations (peak) and
    transient (FSDP/DDP buffers alive at the activation peak): the loss phase; reduction: the
    non-state bytes of the gradient-reduction phase (engine/planner/reduction.py).
    total = state + the larger phase (the two phases never coexist)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    reduction: int = 0

    @property
    def peak_nonstate(self) -> int:
        """The larger of the loss phase (activations + transient) and the reduction phase, bytes."""
        return max(self.activations + self.transient, self.reduction)

    @property
    def total(self) -> int:
        """State plus :attr:`peak_nonstate`, bytes."""
        return self.params + self.grads + self.optimizer + self.peak_nonstate

    def as_dict(self) -> dict[str, int]:
        """The JSON form: every term, the larger phase (peak_nonstate) and the total, bytes."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "transient": self.transient, "reduction": self.reduction,
                "peak_nonstate": self.peak_nonstate, "total": self.total}


def state_bytes(layout, coords: dict | None = None) -> StateBytes:
    """Parameter, gradient and optimizer bytes of the rank at ``coords`` (fp32 master weights)."""
    params = rank_params(layout, coords)
    elements = sum(p.local_numel for p in params)
    nbytes = 4 * elements
    named = [(p.spec.name, len(p.spec.shape), p.local_numel) for p in params]
    return StateBytes(params=nbytes, grads=nbytes, optimizer=optimizer_bytes(named, layout.cfg.optimizer),
                      n_tensors=len(params), param_elements=elements)


def transient_bytes(layout, coords: dict | None = None) -> int:
    """Data-parallel buffers alive at the activation peak (module docstring), bytes; 0 without
    FSDP/DDP wrapping.

    FSDP2 (torch ``fully_shard``, torch/distributed/fsdp/_fully_shard): the unit in use and the next
    one (backward prefetch) all-gathered in the compute dtype (a float8 weight under float8
    all-gather: 1 byte per element); the root unit is not resharded after
    forward, so at the loss it and the last block are the two gathered units. With one gradient
    reduction per step, and under pipeline parallel (whose stage runs every backward without FSDP's
    reduction, torch/distributed/pipelining/stage.py ``backward_maybe_with_nosync``), every unit
    stays gathered and keeps its unsharded gradient (reduce dtype) from the first microbatch on. DDP
    (torch ``replicate``, FSDP2's code on a size-1 shard) keeps every unit's unsharded parameters for
    the whole step (parallelisms/data_parallel.py).
    """
    ddp = layout.fsdp == 1 and layout.dp_replicate > 1
    units: dict[str, int] = {}  # gathered bytes per unit (float8 weights: 1 byte under float8 all-gather)
    elements: dict[str, int] = {}
    for p in rank_params(layout, coords):
        if p.fsdp_size > 1 or ddp:
            n = padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size)
            units[p.unit] = units.get(p.unit, 0) + n * gathered_bytes_per_element(layout, p.spec)
            elements[p.unit] = elements.get(p.unit, 0) + n
    if not units:
        return 0
    rb = layout.reduce_bytes
    if layout.pp > 1:
        gathered, grads = sum(units.values()), sum(elements.values()) * rb
        pp_rank = (coords or {}).get("pp", 0)
        if layout.pp_microbatches > microbatches_in_flight(layout, pp_rank):
            return gathered + grads  # a later backward starts with as many microbatches in flight
        # The stage's first backward starts with every microbatch saved and no gradient yet; each
        # later one with a microbatch fewer and every unit's unsharded gradient.
        return max(gathered, gathered + grads - saved_per_microbatch(layout, pp_rank))
    if layout.grad_accum > 1 and not layout.cfg.parallelism.grad_sync_each_microbatch:
        return sum(units.values()) + sum(elements.values()) * rb
    if ddp:
        return sum(units.values())
    largest = sorted(units.values(), reverse=True)
    return largest[0] + (largest[1] if len(largest) > 1 else 0)


def peak_nonstate_bytes(layout, coords: dict | None = None) -> int:
    """The step's peak of non-state bytes (everything but parameter shards, their gradients and
    optimizer state) of the rank at ``coords``: :attr:`MemoryEstimate.peak_nonstate`, the larger of
    the loss phase (activations + transient) and the gradient-reduction phase, bytes."""
    return MemoryEstimate(0, 0, 0, *_nonstate_terms(layout, coords or {})).peak_nonstate


def _nonstate_terms(layout, coords: dict) -> tuple[int, int, int]:
    """(activations, transient, reduction) of the rank at ``coords``, bytes."""
    return (activation_bytes(layout, coords.get("pp", 0)), transient_bytes(layout, coords),
            reduction_bytes(layout, coords))


def estimate_memory(layout) -> MemoryEstimate:
    """:class:`MemoryEstimate` of the busiest rank: the pp rank with the largest total (coordinate 0
    on the other dims, whose shards are the largest under ``torch.chunk``)."""
    best = None
    for pp_rank in range(layout.pp):
        coords = {"pp": pp_rank}
        state = state_bytes(layout, coords)
        est = MemoryEstimate(state.params, state.grads, state.optimizer, *_nonstate_terms(layout, coords))
        if best is None or est.total > best.total:
            best = est
    return best
