"""Per-rank memory of a layout: parameters, gradients, optimizer state, activations, in bytes.

State (exact, tests/test_planner.py checks it equal to the real plan and tests/test_planner_runs.py to
what CPU runs hold): the fp32 master parameters' local shards (engine/planner/params.py), gradients
of the same shapes, AdamW's two moments of the same shapes plus one 4-byte ``step`` per tensor.

Activations (a model): the bytes saved for backward, counted per transformer block the way
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, §4.1 and Table 2) count them for GPT, redone for this LLaMA block: RMSNorm inputs, the
attention inputs q, k, v (k, v repeated to every query head), the attention output and log-sum-exp
(fused attention keeps no s×s scores), and the SwiGLU tensors w1·x, silu(w1·x), w3·x and their product.
With b sequences of s tokens (s = seq_len / cp), width h, SwiGLU width f, n_heads a, on t = tp ranks:

    per block (no AC)  =  T·h·(2/t' + 2 + 5/t)·B  +  4·T·f/t·B  +  T·a/t·4       (T = b·s tokens)
                          norm inputs, inputs of wq.. and w1.. (all-gathered under SP),
                          q, k, v (repeated), attention output and its copy for wo; SwiGLU; lse

where B = bytes per activation element (training.mixed_precision_param), t' = t with sequence
parallel (norm tensors are sequence shards) else 1. ``full`` AC keeps only each block's input
(b·s·h/t'·B) plus, during backward, one block's full set (Korthikanti eq. 6's "2sbh·L + one layer").
``selective`` "op" keeps the matmul and attention outputs (q, k, v before repetition, o, wo·x, w1·x,
w3·x, w2·x) and the block input: the element-wise tensors (norms, silu, product) are recomputed.
On top of the saved tensors the peak holds the larger of the loss's backward (final norm tensors and
three fp32 [T, V/t] tensors: log-softmax output, its gradient, the logits' gradient; four under loss
parallel) and one block's backward (its gradient temporaries, and its recomputed activations under
full AC). The constants of these last two terms are the tensors the CPU runs of
tests/test_planner_runs.py show alive at the peak (torch's MemTracker).

Pipeline stages hold the activations of the microbatches in flight: M for GPipe (all forwards
first), min(M, pp - pp_rank) for 1F1B-style schedules (Narayanan et al. arXiv 2104.04473 §2.2).

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
buffers scale with the parameters). tests/test_planner_runs.py checks the
max of both against the step's measured non-state peak of CPU runs, and the reduction phase alone
against the peak measured inside FSDP's ``post_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planner.params import local_params, padded_numel, stage_param_specs
from engine.planner.real_plan import STEP_TENSOR_BYTES, StateBytes


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


def rank_params(layout, coords: dict | None = None):
    """The :class:`~engine.planner.params.LocalParam` list of the rank at ``coords`` (all its stages)."""
    coords = coords or {}
    out = []
    for layers, first, last in layout.stages_of(coords.get("pp", 0)):
        out += local_params(stage_param_specs(layout.params, layers, first, last), layout, coords)
    return out


def state_bytes(layout, coords: dict | None = None) -> StateBytes:
    """Parameter, gradient and optimizer bytes of the rank at ``coords`` (fp32 master weights)."""
    params = rank_params(layout, coords)
    elements = sum(p.local_numel for p in params)
    nbytes = 4 * elements
    return StateBytes(params=nbytes, grads=nbytes, optimizer=2 * nbytes + STEP_TENSOR_BYTES * len(params),
                      n_tensors=len(params), param_elements=elements)


def _tokens(layout) -> int:
    """T: tokens of one microbatch on one rank (sequences × seq_len / cp)."""
    return layout.microbatch_size * (layout.seq_len // layout.cp)


def block_activation_bytes(layout, ac: str) -> int:
    """Bytes one transformer block keeps for backward per microbatch (see the module docstring).

    Args:
        ac: "none", "full" or "op".
    """
    a = layout.model_args
    T, h, t = _tokens(layout), a.dim, layout.tp
    f = layout.model_spec.get("ffn_width")(a)  # MoE: top_k routed copies of each token + shared experts
    kv = a.kv_heads * a.head_dim
    bb = layout.param_bytes
    tsp = t if layout.sequence_parallel else 1
    lse = T * (a.n_heads // t) * 4
    if ac == "full":
        return T * h // tsp * bb
    if ac == "op":  # the outputs of the saved ops, and the block input the checkpoint keeps
        return T * (h // tsp + h // t + 2 * kv // t + h // t + 2 * h) * bb + lse + 2 * T * f // t * bb
    # none: two norm inputs, the (gathered) inputs of wq/wk/wv and w1/w3, q and k, v repeated to every
    # query head, the attention output and its [T, h] copy for wo, SwiGLU's four f-wide tensors
    return T * (2 * h // tsp + 2 * h + 3 * h // t + 2 * h // t) * bb + lse + 4 * T * f // t * bb


def backward_temporary_bytes(layout) -> int:
    """Gradients alive inside one block's backward: SwiGLU's four f-wide and attention's five h-wide
    tensors (in the compute dtype)."""
    a = layout.model_args
    f = a.ffn_hidden_dim if not hasattr(a, "num_experts") else (a.top_k + a.n_shared_experts) * a.moe_inter_dim
    return _tokens(layout) * (4 * f + 5 * a.dim) // layout.tp * layout.param_bytes


def head_peak_bytes(layout) -> int:
    """The last stage's peak at the loss: the final norm's input and (gathered) output, and
    cross entropy's fp32 [T, V/t] tensors alive in its backward: the log-softmax output, its gradient
    and the logits' gradient (one more under loss parallel, whose log-softmax keeps its exp); under
    pipeline parallel also the output weight's gradient of a later microbatch before it is added to
    the accumulated one."""
    a = layout.model_args
    T, t = _tokens(layout), layout.tp
    tsp = t if layout.sequence_parallel else 1
    copies = 4 if t > 1 and layout.cfg.parallelism.loss_parallel else 3
    head = T * (a.dim // tsp + a.dim) * layout.param_bytes + copies * T * (a.vocab_size // t) * 4
    if layout.pp > 1:  # a later microbatch's output-weight gradient [V/t, h], before it is accumulated
        head += a.vocab_size // t * a.dim * 4
    return head


def activation_bytes(layout, pp_rank: int = 0) -> int:
    """Peak activation bytes of one rank (module docstring): the saved tensors of every block of the
    microbatches in flight, plus the larger of the loss's peak (last stage) and one block's backward
    (its recomputation first, under full AC)."""
    mode, option = layout.ac
    ac = "none" if mode == "none" else ("full" if mode == "full" else ("op" if option == "op" else "every"))
    stages = layout.stages_of(pp_rank)
    n_layers = sum(len(layers) if layers is not None else layout.model_args.n_layers for layers, _, _ in stages)
    has_last = any(last for _, _, last in stages)
    if ac == "every":  # selective N: every N-th block fully recomputed
        full = n_layers // int(option)
        per_mb = full * block_activation_bytes(layout, "full") + (n_layers - full) * block_activation_bytes(layout, "none")
    else:
        per_mb = n_layers * block_activation_bytes(layout, ac)
    in_flight = 1
    if layout.pp > 1:
        m = layout.pp_microbatches
        in_flight = m if layout.cfg.parallelism.pp_schedule.lower() == "gpipe" else min(m, layout.pp - pp_rank)
        in_flight *= len(stages)
    backward = backward_temporary_bytes(layout)
    if ac in ("full", "every"):
        backward += block_activation_bytes(layout, "none")
    return per_mb * in_flight + max(head_peak_bytes(layout) if has_last else 0, backward)


def transient_bytes(layout, coords: dict | None = None) -> int:
    """Data-parallel buffers alive at the activation peak (module docstring), bytes; 0 without
    FSDP/DDP wrapping.

    FSDP2 (torch ``fully_shard``, torch/distributed/fsdp/_fully_shard): the unit in use and the next
    one (backward prefetch) all-gathered in the compute dtype; the root unit is not resharded after
    forward, so at the loss it and the last block are the two gathered units. With one gradient
    reduction per step, and under pipeline parallel (whose stage runs every backward without FSDP's
    reduction, torch/distributed/pipelining/stage.py ``backward_maybe_with_nosync``), every unit
    stays gathered and keeps its unsharded gradient (reduce dtype) from the first microbatch on. DDP
    (torch ``replicate``, FSDP2's code on a size-1 shard) keeps every unit's unsharded parameters for
    the whole step (parallelisms/data_parallel.py).
    """
    ddp = layout.fsdp == 1 and layout.dp_replicate > 1
    units: dict[str, int] = {}
    for p in rank_params(layout, coords):
        if p.fsdp_size > 1 or ddp:
            units[p.unit] = units.get(p.unit, 0) + padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size)
    if not units:
        return 0
    pb, rb = layout.param_bytes, layout.reduce_bytes
    if layout.pp > 1 or (layout.grad_accum > 1 and not layout.cfg.parallelism.grad_sync_each_microbatch):
        return sum(units.values()) * (pb + rb)
    if ddp:
        return sum(units.values()) * pb
    largest = sorted(units.values(), reverse=True)
    return (largest[0] + (largest[1] if len(largest) > 1 else 0)) * pb


def peak_nonstate_bytes(layout, coords: dict | None = None) -> int:
    """The step's peak of non-state bytes (everything but parameter shards, their gradients and
    optimizer state) of the rank at ``coords``: :attr:`MemoryEstimate.peak_nonstate`, the larger of
    the loss phase (activations + transient) and the gradient-reduction phase, bytes."""
    return MemoryEstimate(0, 0, 0, *_nonstate_terms(layout, coords or {})).peak_nonstate


def _nonstate_terms(layout, coords: dict) -> tuple[int, int, int]:
    """(activations, transient, reduction) of the rank at ``coords``, bytes."""
    from engine.planner.reduction import reduction_bytes  # reduction.py builds on this module

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
