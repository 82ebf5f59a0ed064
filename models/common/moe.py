"""The mixture-of-experts feed-forward: router, token permutation, routed and shared experts.

Data flow of one MoE layer over T = B·S tokens (``MoE.forward``):

    x [T, dim] ─ router ─► top_k expert ids [T, K], gate weights [T, K]
      ─ sort_tokens_by_expert ─► token copies grouped by expert [N, dim] (N = T·K minus dropped)
      ─ experts (grouped SwiGLU; under expert parallel all-to-all hooks move the groups to the ranks
        holding their experts and back) ─► [N, dim]
      ─ combine_expert_outputs ─► Σ_k weight_k · expert_k(x) [T, dim]  (+ shared experts)

The permutation helpers are pure functions of their arguments so they can be tested on one process.
Sources: Switch Transformer (arXiv 2101.03961), GShard (arXiv 2006.16668) for top-k token choice and
capacity, Mixtral (arXiv 2401.04088) for softmax top-2, DeepSeek-V3 (arXiv 2412.19437) for sigmoid
scores, shared experts and the sequence-wise balance loss, arXiv 2408.15664 for the
auxiliary-loss-free bias.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.common.init import init_generator, init_linear, init_tensor_, trunc_normal
from models.common.decoder import FeedForward
from models.common.moe_args import MoEModelArgs

__all__ = [
    "sort_tokens_by_expert",
    "combine_expert_outputs",
    "capacity_keep_mask",
    "TokenChoiceRouter",
    "GroupedExperts",
    "MoE",
]


# ---------------------------------------------------------------------------------- pure functions
def sort_tokens_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the T·K (token, slot) pairs grouped by expert, and the size of each group.

    Args:
        expert_ids: LongTensor [T, K], expert of each token's k-th slot; a value == num_experts
            marks a dropped slot (it sorts last and is in no group).
        num_experts: E.
    Returns:
        order: LongTensor [T·K], flat slot indices (token = order // K) sorted by expert; within an
            expert, tokens keep their order (stable sort), so the result is deterministic.
        counts: LongTensor [E], slots per expert; the first counts.sum() entries of ``order`` are
            the routed slots.
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]  # (any minlength > E alike: sliced)
    return order, counts


def combine_expert_outputs(
    expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Inverse of the sort: Σ_k weights[t, k] · (output of token t's k-th slot).

    Args:
        expert_out: [N, dim] outputs of the routed slots, in the order of ``order[:N]``.
        order: LongTensor [>= N] from ``sort_tokens_by_expert``; entries past N are dropped slots.
        weights: [T, K] gate weights (float32); dropped slots contribute 0 whatever their weight.
    Returns:
        [T, dim] in float32. The k slots are added in slot order, so every layout of the same
        tokens gives the same sum bit for bit.
    """
    num_tokens, top_k = weights.shape
    n_routed = expert_out.shape[0]
    # float64 in the float64 reference mode. (Equivalent to keeping expert_out's dtype while the weights are
    # float32, as the router's are: bf16 copies exactly and the product promotes.)
    dtype = torch.promote_types(expert_out.dtype, torch.float32)
    slots = expert_out.new_zeros(num_tokens * top_k, expert_out.shape[1], dtype=dtype)
    slots = slots.index_copy(0, order[:n_routed], expert_out.to(dtype))
    return (slots.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def capacity_keep_mask(expert_ids: torch.Tensor, seq_len: int, num_experts: int, capacity: int) -> torch.Tensor:
    """Which slots fit their expert's per-sequence capacity (GShard's dispatch mask).

    Args:
        expert_ids: LongTensor [B·S, K] of token-major slots.
        seq_len: S; capacity counts each sequence separately, so the result does not depend on
            how sequences are spread over ranks or microbatches.
        capacity: slots one expert accepts per sequence; earlier tokens win.
    Returns:
        BoolTensor [B·S, K]: True where the slot is kept.
    """
    tokens, top_k = expert_ids.shape
    per_seq = expert_ids.view(tokens // seq_len, seq_len * top_k)
    one_hot = F.one_hot(per_seq, num_experts)  # [B, S·K, E] (unused trailing experts would not move a position)
    position = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1  # 0-based arrival order at its expert
    return (position < capacity).view(tokens, top_k)


# ---------------------------------------------------------------------------------- router
class TokenChoiceRouter(nn.Module):
    """Top-k token-choice router: each token picks its ``top_k`` best-scoring experts.

    Weights: gate [num_experts, dim]. Buffer ``expert_bias`` [num_experts] (float32, checkpointed)
    when auxiliary-loss-free balancing is on: it is added to the scores for the *choice* only.
    """

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.route_norm, self.route_scale = args.score_func, args.route_norm, args.route_scale
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)  # (bias=None alike: falsy)
        bias = torch.zeros(args.num_experts) if args.load_balance_coeff > 0 else None
        self.register_buffer("expert_bias", bias, persistent=True)  # (torch's default: omitting it is alike)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens x [T, dim].

        Returns:
            weights: float32 [T, K] gate weights (from the scores, without the bias; renormalized
                over the K slots if route_norm; times route_scale).
            expert_ids: LongTensor [T, K], in descending order of biased score.
            scores: float32 [T, E], softmax or sigmoid of the gate logits (for the balance loss).
        """
        # logits, scores, choice: [T, E], so dim=1 / default dims / sorted=True by default are equivalent variants,
        # and the float32 bias promotes to the scores' dtype by itself.
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
        # The bias moves tokens between experts, but gradients flow only through the plain scores.
        expert_ids = torch.topk(choice.detach(), self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, expert_ids)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights * self.route_scale, expert_ids, scores

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        init_linear(self.gate, init_std, seed, f"{prefix}.gate")
        if self.expert_bias is not None:
            self.expert_bias.zero_()


# ---------------------------------------------------------------------------------- experts
_GROUPED_MM_ALIGN = {"cpu": 1, "cuda": 16}  # rows per group that the kernel wants (CUDA: TMA tiles)


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for x [N, a] @ w [G, a, b] on this device and dtype.

    CPU kernels (torch >= 2.9) need rows of 16 bytes; CUDA kernels need bfloat16 on SM >= 8.0, and
    so does the op's meta function that torch.compile traces with, whatever the device. Anything
    else uses the per-expert loop, which gives the same result. (Mutation testing: the CUDA lines are only
    reached on a GPU, tests/integration/test_gpu.py.)
    """
    if not hasattr(torch, "_grouped_mm") or x.device.type not in _GROUPED_MM_ALIGN:
        return False
    if x.dtype != torch.bfloat16 and (x.device.type == "cuda" or torch.compiler.is_compiling()):
        return False
    if x.dtype == torch.float64:  # no float64 kernel (the float64 reference mode loops)
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 8:
        return False
    row_bytes = x.element_size()
    return all(size * row_bytes % 16 == 0 for size in (w.shape[1], w.shape[2]))


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # The CPU grouped-mm backward rejects expanded (stride-0) gradients, e.g. from a plain .sum().
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def _grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3, align: int) -> torch.Tensor:
    """SwiGLU of each group of rows with its expert's weights, through ``torch._grouped_mm``.

    With ``align`` > 1 each group is padded with zero rows to a multiple of ``align`` rows first. (Mutation
    testing: align is 1 or 16, so "align > 2" is alike; a tile more of padding changes no output row; the
    device arguments matter on a GPU only.)
    """
    if align > 1:
        padded = (counts + align - 1) // align * align
        shift = torch.cumsum(padded, 0) - padded - (torch.cumsum(counts, 0) - counts)
        dest = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(shift, counts)
        rows = int(padded.sum())
        out = _grouped_swiglu(x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x), padded, w1, w2, w3, 1)
        return out.index_select(0, dest)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = F.silu(_contiguous_grad(torch._grouped_mm(x, w1, offs=offs)))
    h = h * _contiguous_grad(torch._grouped_mm(x, w3, offs=offs))
    return _contiguous_grad(torch._grouped_mm(h, w2, offs=offs))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights.

    Weights: w1, w3 [E, dim, hidden] and w2 [E, hidden, dim] (``x @ w`` layout, the one grouped
    matmul takes). Under expert parallel they are DTensors sharded on dim 0 (each rank holds
    E / ep experts) and the forward sees only the local experts' tokens.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts  # (read by nothing: informative)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.use_grouped_mm = True  # tests turn it off to compare with the loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: rows grouped by (local) expert, ``counts`` [E_local] rows each (sum N).

        Returns [N, dim] in the compute dtype. An expert with no rows gets a zero gradient, never
        None, so gradient reduction sees the same parameters on every rank.
        """
        # (DTensors under expert parallel only: the multi-process tests/integration/test_expert_parallel.py, not
        # the fast ones)
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if torch.is_autocast_enabled(x.device.type):  # autocast does not cover the grouped kernel
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if x.dtype != w1.dtype:
            x = x.to(w1.dtype)
        if self.use_grouped_mm and _grouped_mm_usable(x, w1) and _grouped_mm_usable(x, w2):  # (same two sizes)
            return _grouped_swiglu(x, counts, w1, w2, w3, _GROUPED_MM_ALIGN[x.device.type])
        outputs = []
        # Empty groups still run (on 0 rows): their weights then get zero gradients.
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            outputs.append((F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e])
        return torch.cat(outputs)

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        """w1 ~ trunc_normal(0.02); w2, w3 ~ trunc_normal(init_std), as the dense FeedForward."""
        for name, std in (("w1", 0.02), ("w2", init_std), ("w3", init_std)):
            init_tensor_(getattr(self, name), trunc_normal(std), init_generator(seed, f"{prefix}.{name}"))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends gradient 1 into ``aux_loss`` (a scalar).

    This adds aux_loss to the objective inside the layer, so it works unchanged on any pipeline
    stage, under activation checkpointing, and without the trainer knowing about it.
    """

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # (autograd casts a float32 ones to aux_loss's dtype; the device matters on GPU)
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


# ---------------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing the dense feed-forward of a block.

    Per-step statistics accumulate in buffers during training forwards (not during activation
    checkpointing's recomputation, nor in eval): ``tokens_per_expert`` [E] (routed slots),
    ``balance_loss_sum`` (Σ over sequences of the sequence-wise balance loss, times
    ``aux_loss_scale``) and ``dropped_slots``. The model reduces and resets them after each
    optimizer step (``MoETransformer.post_optimizer_step``).
    """

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.load_balance_coeff, self.aux_loss_coeff = args.load_balance_coeff, args.aux_loss_coeff
        self.capacity_factor = args.capacity_factor
        self.router = TokenChoiceRouter(args)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.num_experts)
        self.shared_experts = (
            FeedForward(args, hidden_dim=args.moe_inter_dim * args.n_shared_experts)
            if args.n_shared_experts > 0 else None
        )
        # 1 / (sequences per optimizer step): makes the balance loss a mean over sequences; set by
        # the parallelize function, which knows the batch geometry.
        self.aux_loss_scale = 1.0
        # The context-parallel group: each sequence's tokens are spread over it (see _balance_loss).
        self.cp_group: dist.ProcessGroup | None = None
        # The tp group when the routed experts are split over tp (the layer then runs on its sequence
        # shard, models/common/moe_parallelize.py); cp_group is then the cp × tp group.
        self.routed_tp_group: dist.ProcessGroup | None = None
        # persistent=None would be alike (falsy): statistics of one step, not checkpointed
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("balance_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("dropped_slots", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim].

        Raises:
            ValueError: under a capacity factor, an input that is not whole sequences [B, S, dim].
        """
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, expert_ids, scores = self.router(tokens)
        routed_ids = expert_ids
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * seqlen * self.top_k / self.num_experts)
            keep = capacity_keep_mask(expert_ids, seqlen, self.num_experts, capacity)
            routed_ids = expert_ids.masked_fill(~keep, self.num_experts)
        order, counts = sort_tokens_by_expert(routed_ids, self.num_experts)
        n_routed = int(counts.sum())
        expert_out = self.experts(tokens.index_select(0, order[:n_routed] // self.top_k), counts)
        out = combine_expert_outputs(expert_out, order, weights).to(x.dtype).view(bsz, seqlen, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        balance = self._balance_loss(scores, expert_ids, bsz, seqlen)
        if self.training and not _in_recomputation():
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
                self.balance_loss_sum += balance.detach().float() * self.aux_loss_scale
                self.dropped_slots += float(expert_ids.numel() - n_routed)
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():  # (>= 0 alike: 0 · loss)
            out = _AttachAuxLoss.apply(out, balance * (self.aux_loss_coeff * self.aux_loss_scale))
        return out

    def _balance_loss(self, scores: torch.Tensor, expert_ids: torch.Tensor, bsz: int, seqlen: int) -> torch.Tensor:
        """Σ over the B sequences of E · Σ_i f_i · P_i (DeepSeek-V3 eq. 17-20, Switch per sequence).

        f_i = (E / (K·S)) · (slots of the sequence choosing expert i), P_i = mean over the sequence
        of the normalized score of expert i. 1 per sequence when routing is uniform. Per sequence,
        so it does not depend on how sequences are split over ranks. Under context parallel
        (``cp_group`` set) a rank holds S / cp tokens of each sequence: f_i is summed over the cp
        group (no gradient flows through the counts) and this rank returns its share of the sum in
        P_i, so the cp ranks' values add up to the whole sequences' loss and gradient.
        """
        # (softmax rows sum to 1 to rounding, so normalising them too, or summing over dim 1 of [T, E], is alike)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.router.score_func == "sigmoid" else scores
        probs = probs.view(bsz, seqlen, self.num_experts).sum(dim=1)  # [B, E], this rank's tokens
        chosen = F.one_hot(expert_ids.view(bsz, seqlen * self.top_k), self.num_experts).sum(dim=1).float()
        sequence_tokens = seqlen
        if self.cp_group is not None:
            dist.all_reduce(chosen, op=dist.ReduceOp.SUM, group=self.cp_group)  # (SUM: also the default)
            sequence_tokens = seqlen * dist.get_world_size(self.cp_group)
        f = chosen * (self.num_experts / (self.top_k * sequence_tokens))
        return (f * probs / sequence_tokens).sum()

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing (arXiv 2408.15664, eq. 3): bias_i += u · sign(mean - c_i).

        ``global_counts`` [E] are the step's routed slots per expert over every rank, so every
        layout updates the bias identically.
        """
        if self.router.expert_bias is not None and self.load_balance_coeff > 0:
            error = global_counts.mean() - global_counts
            self.router.expert_bias += self.load_balance_coeff * torch.sign(error).to(self.router.expert_bias.dtype)

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.balance_loss_sum.zero_()
        self.dropped_slots.zero_()

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        """Router gate ~ trunc_normal(init_std); experts as ``GroupedExperts``; statistics zeroed."""
        self.router.init_weights(init_std, seed, f"{prefix}.router")
        self.experts.init_weights(init_std, seed, f"{prefix}.experts")
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std, seed, f"{prefix}.shared_experts")
        self.reset_stats()


def _in_recomputation() -> bool:
    """True while autograd's engine runs (activation checkpointing recomputes the forward there):
    statistics must count each token once."""
    return torch._C._current_graph_task_id() != -1
