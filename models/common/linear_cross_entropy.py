"""Chunked, fused linear cross entropy: the output projection and the token-sum loss in one pass.

The unfused loss materializes logits ``[N, V]`` (N tokens, V vocabulary entries), a float copy, the
log-softmax and its gradient: for Llama 3 (V = 128,256) at 16,384 tokens that is 8.4 GB per fp32
tensor. Here the tokens are cut into chunks of ``chunk_tokens`` and only one chunk's logits
``[chunk, V / tp]`` (and its softmax gradient) exist at a time, in forward and in backward.

Method: Liger Kernel's fused linear cross entropy (Hsu et al. 2024, arXiv 2410.10989, §3.2), in plain
PyTorch. The loss is the last operation of the step and a scalar, so its gradients are linear in
the incoming gradient g: d(loss)/dh = g * G_h, d(loss)/dW = g * G_W. When gradients are needed,
the forward computes, chunk by chunk, the per-token log-sum-exp (Wijmans et al. 2024, "Cut Your
Losses in Large-Vocabulary Language Models", arXiv 2411.09009, eq. 1: loss = lse(x W^T) - (x W^T)_y),
then G_h = (softmax - onehot) W and accumulates G_W = (softmax - onehot)^T h in fp32; the backward
only scales them by g. Three matmuls per chunk, as the unfused loss needs (no logit recomputation),
and nothing of size [N, V] is kept.

Tensor parallel (Megatron-LM's vocab-parallel cross entropy, arXiv 1909.08053 §3): the output
weight is vocab-sharded (a ``Shard(0)`` DTensor on the tp mesh, rows ``[r V/tp, (r+1) V/tp)`` on
tp rank r). Each rank computes its shard's log-sum-exp per token, the tp ranks combine them chunk by
chunk (one all-reduce MAX and one all-reduce SUM of [chunk] floats: the softmax gradient of a chunk
needs its log-sum-exp over the whole vocabulary), and the target logit comes from the rank that owns
it (one all-reduce SUM of [N] floats per call). The hidden states' gradient is then a partial sum over tp, which the
DTensor redistribution of the input reduces (all-reduce, or reduce-scatter under sequence parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100  # label value that contributes neither loss nor gradient

__all__ = ["IGNORE_INDEX", "linear_cross_entropy_sum", "z_loss_token_sum"]


def z_loss_token_sum(logits: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """PaLM's z-loss (Chowdhery et al. 2022, Sec. 5) of full logits: ``weight`` x the sum over the label
    tokens of ``logsumexp(logits)^2``, 0-dim, in the logits' dtype (the unfused losses pass fp32 or
    fp64; :func:`linear_cross_entropy_sum` computes the same term chunk by chunk).

    Args:
        logits: [N, V] (the tokens flattened); labels: LongTensor [N], -100 where a token has no label.
    """
    return weight * (torch.logsumexp(logits, dim=-1).square() * (labels != IGNORE_INDEX)).sum()  # (dim=1: the same)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int, z_loss_weight: float = 0.0, z_loss_out=None) -> torch.Tensor:
    """Σ over label tokens of cross entropy (nats) of ``hidden @ weight.T``, never holding all logits.

    Equal to ``F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum",
    ignore_index=-100)`` (the logits in the matmul's dtype, e.g. bf16 under autocast, the softmax in fp32).

    Args:
        hidden: [B, S, dim] final-normed hidden states; a plain tensor, or under tensor parallel a
            DTensor on the tp mesh (``Shard(1)`` with sequence parallel) or the plain full-sequence
            tensor every tp rank holds.
        weight: [V, dim] output projection (tied embedding included); under tensor parallel a
            ``Shard(0)`` DTensor on the tp mesh (vocab rows sharded).
        labels: LongTensor [B, S] target ids, -100 where a token has no label.
        chunk_tokens: tokens per chunk (> 0): at most [chunk_tokens, V / tp] logits exist at a time.
        z_loss_weight: PaLM's z-loss (Chowdhery et al. 2022, Sec. 5): adds ``z_loss_weight * lse^2``
            per label token (lse: the log-sum-exp of the token's logits over the whole vocabulary, so
            the same under tensor parallel); its logit gradient is ``2 w lse softmax``. 0: off.
        z_loss_out: None, or a callable given the (detached, 0-dim) z-loss token sum, to log it apart.

    Returns:
        0-dim fp32 tensor, the token sum (the same value on every tp rank).

    Raises:
        ValueError: ``chunk_tokens`` < 1, hidden/labels shapes that do not match, or a DTensor
            weight that is not ``Shard(0)`` on a 1-D mesh.
        RuntimeError: a second backward through the same call (the gradients are handed over once).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    group, vocab_start = None, 0
    if hasattr(weight, "device_mesh"):  # a DTensor: vocab-sharded over the tp mesh
        hidden, group, vocab_start, weight = _local_operands(hidden, weight)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    # Gradients are computed in the forward only when a backward can follow (not in evaluation).
    want_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    hidden_2d = hidden.flatten(0, -2)
    with torch.no_grad():
        loss, grads, z_sum = _fused_forward(hidden_2d, weight, labels.flatten(), chunk_tokens, group, vocab_start,
                                            want_grads, z_loss_weight)
    if z_loss_out is not None and z_loss_weight:
        z_loss_out(z_sum)
    if not want_grads:
        return loss
    # Two autograd nodes, one per input: a pipeline schedule that splits the backward (zero bubble:
    # inputs first, weights later) runs each exactly once, and each hands its buffer over.
    holder = {"hidden": grads[0], "weight": grads[1], "weight_dtype": weight.dtype}
    return _HiddenGradient.apply(hidden_2d, loss, holder) + _WeightGradient.apply(weight, holder)


def _local_operands(hidden, weight):
    """Under tensor parallel: (full-sequence local hidden whose gradient is reduced over tp, the tp
    group, the first vocab row of this rank's shard, the local weight shard [V/tp, dim])."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ValueError(f"the output weight must be vocab-sharded on a 1-D tp mesh, got {weight.placements}")
    if not isinstance(hidden, DTensor):  # the same full sequence on every tp rank
        # (equivalent: placements None is Replicate; run_check False is the default, True only adds a check)
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Gathered to the full sequence (sequence parallel); this rank's gradient covers only its vocab
    # rows, so it goes back as a Partial and the redistribution's backward sums it over tp.
    # (redistribute(None, ...) keeps the DTensor's own mesh, this one: equivalent)
    local_hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local_weight = weight.to_local()  # its gradient returns as the parameter's Shard(0)
    return local_hidden, mesh.get_group(), mesh.get_local_rank() * local_weight.shape[0], local_weight


def _fused_forward(hidden, weight, labels, chunk_tokens, group, vocab_start, want_grads, z_loss_weight=0.0):
    """hidden [N, dim], weight [V_local, dim], labels [N] -> (Σ cross entropy + z-loss, 0-dim fp32; with
    ``want_grads`` (G_h [N, dim], G_W [V_local, dim] fp32) for an incoming gradient of 1, else None;
    the z-loss sum alone)."""
    n, rows = hidden.shape[0], weight.shape[0]
    local_labels = labels - vocab_start
    valid = labels != IGNORE_INDEX
    owned = (local_labels >= 0) & (local_labels < rows) & valid  # this rank's vocab rows
    # any row index serves (1 too): its gathered logit is masked to 0 and its gradient subtracts owned = 0
    local_labels = local_labels.masked_fill(~owned, 0)
    acc = torch.promote_types(hidden.dtype, torch.float32)  # float64 in the float64 reference mode
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    target = torch.zeros(n, dtype=acc, device=hidden.device)
    grads = None
    if want_grads:
        grads = (torch.empty_like(hidden), torch.zeros(weight.shape, dtype=acc, device=weight.device))
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        lse[start:end] = _chunk(hidden[start:end], weight, local_labels[start:end], owned[start:end],
                                valid[start:end], target[start:end], group, z_loss_weight,
                                None if grads is None else (grads[0][start:end], grads[1]))
    if group is not None:
        dist.all_reduce(target, group=group)  # the target logit is on the rank that owns it
    z_sum = z_loss_weight * (lse.square() * valid).sum()
    return ((lse - target) * valid).sum() + z_sum, grads, z_sum


def _take(holder: dict, key: str) -> torch.Tensor:
    buffer = holder.pop(key, None)
    if buffer is None:
        raise RuntimeError("the fused linear cross entropy's backward runs once per forward (no retain_graph reuse)")
    return buffer


class _HiddenGradient(torch.autograd.Function):
    """Identity on the precomputed loss value; backward: G_h scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, loss, holder):
        ctx.holder = holder
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        return _take(ctx.holder, "hidden").mul_(grad_loss), None, None


class _WeightGradient(torch.autograd.Function):
    """A zero that carries G_W: backward returns G_W scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, weight, holder):
        ctx.holder = holder
        # (dtype None, i.e. float32, is equivalent: a float32 zero added to a float64 loss leaves it float64)
        return torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)

    @staticmethod
    def backward(ctx, grad_loss):
        # (.to(None) is equivalent: autograd casts a gradient to its input's dtype itself)
        return _take(ctx.holder, "weight").mul_(grad_loss).to(ctx.holder["weight_dtype"]), None


def _chunk(hidden, weight, local_labels, owned, valid, target, group, z_loss_weight, grads):
    """One chunk of c tokens: write the target logits into ``target`` [c] (0 where another tp rank
    owns the label), return the log-sum-exp [c] over the whole vocabulary, and with ``grads``
    (views of G_h [c, dim] and of G_W [V_local, dim]) add this chunk's gradients for an incoming
    gradient of 1. One [c, V_local] fp32 buffer holds the logits, then exp, then the softmax
    gradient (in place), plus the matmul's own output when it is not fp32 (bf16 autocast)."""
    logits = F.linear(hidden, weight)  # [c, V_local] in the compute dtype (bf16 under autocast)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the same tensor when fp32 or fp64
    target.copy_(probs.gather(1, local_labels[:, None]).squeeze(1).masked_fill(~owned, 0.0))
    peak = probs.amax(dim=-1, keepdim=True)  # (here and below dim=1 is the same: probs is [c, V_local])
    total = probs.sub_(peak).exp_().sum(dim=-1)  # probs = exp(logits - peak)
    lse = peak.squeeze(1) + torch.log(total)
    if group is not None:
        lse = _combine_lse(lse, group)
    if grads is None:
        return lse
    grad_hidden, grad_weight = grads
    scale = torch.exp(peak.squeeze(1) - lse)  # softmax over the whole vocabulary
    if z_loss_weight:  # d(w lse^2)/d logits = 2 w lse softmax
        scale = scale * (1 + 2 * z_loss_weight * lse)
    probs.mul_(scale[:, None])
    # (an arange on the CPU would index the same rows: device= only saves a host-to-device copy)
    probs[torch.arange(probs.shape[0], device=probs.device), local_labels] -= owned.to(probs.dtype)
    probs.mul_(valid[:, None])  # ignored tokens: no gradient
    grad_logits = probs.to(logits.dtype)
    del logits
    grad_hidden.copy_(grad_logits @ weight)  # a partial sum over the vocab rows under tensor parallel
    if grad_logits.dtype == hidden.dtype == grad_weight.dtype:  # fp32 (or fp64)
        grad_weight.addmm_(grad_logits.t(), hidden)
    else:  # bf16 chunk products (bf16 parameters, or autocast), summed in fp32
        grad_weight += grad_logits.t() @ hidden
    return lse


def _combine_lse(lse: torch.Tensor, group) -> torch.Tensor:
    """Log-sum-exp over the tp ranks of each rank's per-token log-sum-exp over its vocab shard."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = torch.exp(lse - peak)
    dist.all_reduce(total, group=group)
    return peak + torch.log(total)
