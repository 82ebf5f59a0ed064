"""Exact causal attention over a sequence split across context-parallel ranks.

Ring attention (Liu et al., arXiv 2310.01889): each rank keeps its queries and the K/V
blocks travel around the ring of cp ranks by point-to-point send/recv. Each step attends the local
queries to one K/V block, and the partial results are merged with the log-sum-exp rule

    lse = logaddexp(lse_a, lse_b),  out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

(the online softmax of Milakov & Gimelshein, arXiv 1805.02867, as in FlashAttention, arXiv
2205.14135). Backward recomputes each block's probabilities from the saved global lse and sends the
K/V gradients around the ring with their blocks, so they arrive back at their owner after a full
circle. Causality is exact for any token placement: a query at global position i sees keys at
positions <= i, from the positions each rank holds (contiguous or load-balanced).

With document ids (models/document_mask.py; every rank holds those of the whole window) each block
pair's mask is also restricted to keys of the query's own document (block-causal, Llama 3 §3.2),
and a block pair with no visible (query, key) pair in any sequence of the batch is skipped: no
matmul, no exchange beyond the ring's own.

This is a reference implementation in plain matmuls (memory O((S/cp)²) per block, no fused kernel):
it runs on every device and is the CPU path; GPUs would want a flash kernel per block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of ``group`` and receive the previous rank's (same shapes)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    # gloo needs contiguous buffers, and q/k/v arrive as transposed views.
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _block_forward(q, k, mask, scale):
    """Scores of one block: masked logits [B, H, Sq, Sk] (float32 or wider)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


def _pair_mask(positions, rank, source, documents):
    """bool mask of the queries of cp rank ``rank`` over the keys of ``source``: [Sl, Sk] causal,
    or [B, 1, Sl, Sk] block-causal when ``documents`` (int [B, S], the whole window) is given."""
    q_pos, k_pos = positions[rank], positions[source].reshape(-1)
    causal = q_pos[:, None] >= k_pos[None, :]
    if documents is None:
        return causal
    same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]
    return (causal & same).unsqueeze(1)


def _merge(out, lse, out_b, lse_b):
    """Log-sum-exp merge of two partial attention results; rows with no visible key stay -inf."""
    new_lse = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new_lse)
    w_a = torch.where(finite, torch.exp(lse - new_lse), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b - new_lse), torch.zeros_like(lse_b))
    return out * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1), new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, documents):
        # q, k, v: [B, H, Sl, D]; positions: [cp, Sl] global positions held by each cp rank;
        # documents: None (causal) or int [B, S] document ids of the whole window.
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        compute = torch.promote_types(q.dtype, torch.float32)
        qc = q.to(compute)
        scale = q.shape[-1] ** -0.5
        out = qc.new_zeros(*q.shape[:-1], v.shape[-1])  # the value width may differ from q/k's (MLA)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        kv = (k, v)
        for step in range(size):
            source = (rank - step) % size
            if step + 1 < size:
                incoming = _ring_exchange(list(kv), group)  # overlaps nothing on gloo, but keeps the ring
            mask = _pair_mask(positions, rank, source, documents)
            if mask.any():
                scores = _block_forward(qc, kv[0].to(compute), mask, scale)
                lse_b = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - torch.where(torch.isfinite(lse_b), lse_b, 0.0).unsqueeze(-1))
                out_b = torch.matmul(probs, kv[1].to(compute))
                out, lse = _merge(out, lse, out_b, lse_b)
            if step + 1 < size:
                kv = tuple(incoming)
        ctx.save_for_backward(q, k, v, positions, out, lse, documents)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, positions, out, lse, documents = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        compute = out.dtype
        qc, dout = q.to(compute), grad_out.to(compute)
        scale = q.shape[-1] ** -0.5
        delta = (dout * out).sum(-1, keepdim=True)  # D_i = Σ_d dO·O, FlashAttention-2 eq. for dS
        dq = torch.zeros_like(qc)
        k_blk, v_blk = k, v
        dk_blk = torch.zeros(k.shape, dtype=compute, device=k.device)
        dv_blk = torch.zeros(v.shape, dtype=compute, device=v.device)
        for step in range(size):
            source = (rank - step) % size
            mask = _pair_mask(positions, rank, source, documents)
            if mask.any():
                kc, vc = k_blk.to(compute), v_blk.to(compute)
                scores = _block_forward(qc, kc, mask, scale)
                probs = torch.exp(scores - lse.unsqueeze(-1))  # exact: lse is the final one
                dv_blk = dv_blk + torch.matmul(probs.transpose(-1, -2), dout)
                dscores = probs * (torch.matmul(dout, vc.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(dscores, kc) * scale
                dk_blk = dk_blk + torch.matmul(dscores.transpose(-1, -2), qc) * scale
            # The block and its gradient accumulators move on together; after `size` hops the
            # accumulators are back with the block's owner.
            if step + 1 < size:
                k_blk, v_blk, dk_blk, dv_blk = _ring_exchange([k_blk, v_blk, dk_blk, dv_blk], group)
            elif size > 1:
                dk_blk, dv_blk = _ring_exchange([dk_blk, dv_blk], group)
        return dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group: dist.ProcessGroup,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the local queries over the whole (cp-split) sequence, by ring exchange.

    Args:
        q, k, v: [B, H, S/cp, head_dim] local blocks (same head count: repeat GQA heads first); v
            may have its own width v_dim (MLA, models/deepseek_v3/model.py).
        positions: LongTensor[cp, S/cp], the global positions held by each rank of ``group``.
        group: the cp process group.
        documents: None, or int [B, S] document ids of the whole window (block-causal attention).

    Returns:
        [B, H, S/cp, v_dim], equal to the matching rows of full causal (block-causal) attention.
    """
    return _RingAttention.apply(q, k, v, positions, group, documents)


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group: dist.ProcessGroup,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same result by all-gathering K/V once (more memory, fewer steps; autograd reduce-scatters
    the K/V gradients back). Shapes as :func:`ring_attention`."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    rank = dist.get_rank(group)
    # Gather along a leading dim, then lay the blocks out along the sequence in rank order.
    k_all = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=group)
    v_all = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=group)
    mask = _pair_mask(positions, rank, slice(None), documents)
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
