"""Exact causal attention over a sequence split across context-parallel ranks.

Ring attention (Liu et al., arXiv 2310.01889): each rank keeps its queries and the K/V
blocks travel around the ring of cp ranks by point-to-point send/recv. Each step attends the local
queries to one K/V block with a fused attention kernel that also returns the rows' log-sum-exp, and
the partial results are merged with the log-sum-exp rule

    lse = logaddexp(lse_a, lse_b),  out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

(the online softmax of Milakov & Gimelshein, arXiv 1805.02867, as in FlashAttention, arXiv
2205.14135). Backward runs the kernel's backward per block with the saved global output and lse
(FlashAttention-2, arXiv 2307.08691, Algorithm 2: the probabilities are rebuilt from the final lse,
so each block's gradients are exact on their own) and sends the K/V gradients around the ring with
their blocks, so they arrive back at their owner after a full circle.

Causality is exact for any token placement: a query at global position i sees keys at positions
<= i. A rank's positions are contiguous runs ("chunks": one of S/cp tokens, or two of S/(2·cp) under
the load-balanced split of parallelisms/context_parallel.py), so each (query chunk, key chunk) pair
is entirely visible (kernel without mask), the diagonal (the kernel's causal mask) or invisible
(skipped): no [S/cp, S/cp] mask or score tensor is built. With document ids (models/common/document_mask.py;
every rank holds those of the whole window) each block pair gets a block-causal additive mask
[B, 1, S/cp, S/cp] instead (Llama 3 §3.2), and a pair with no visible (query, key) pair in any
sequence of the batch is skipped.

The kernels: on the CPU ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, on
CUDA ``aten::_scaled_dot_product_efficient_attention`` (any dtype, an additive mask, lse) and its
backward — the ops behind ``torch.nn.functional.scaled_dot_product_attention`` (torch docs), as in
torch's own context parallel (torch/distributed/tensor/experimental/_context_parallel/_attention.py).

The whole ring, communication included, is one custom operator (``quadra::ring_attention``, torch
docs "Python custom operators"): ``torch.compile`` treats it as an opaque node, so compiled blocks
keep ``fullgraph=True`` and the send/recv run eagerly, exactly as without compile (the compute
inside is already a fused kernel: a compiler has nothing to fuse there). Selective activation
checkpointing saves its output like SDPA's (parallelisms/activation_checkpoint.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from parallelisms.comm_counter import OPAQUE_GROUP, report_opaque

aten = torch.ops.aten


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
    # Counters and timers (dispatch modes) cannot see inside this operator: it reports (comm_counter.py).
    report_opaque("send", group, tensors)
    report_opaque("recv", group, received)
    OPAQUE_GROUP[0] = group.group_name
    try:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    finally:
        OPAQUE_GROUP[0] = None
    return received


def _runs(positions: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Contiguous runs of a rank's positions: [(first index, end index, first position, last position)]."""
    pos = positions.tolist()
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((start, i, pos[start], pos[i - 1]))
            start = i
    return runs


def _pair_mask(positions, rank, source, documents):
    """bool mask of the queries of cp rank ``rank`` over the keys of ``source``: [Sl, Sk] causal,
    or [B, 1, Sl, Sk] block-causal when ``documents`` (int [B, S], the whole window) is given."""
    q_pos, k_pos = positions[rank], positions[source].reshape(-1)
    causal = q_pos[:, None] >= k_pos[None, :]
    if documents is None:
        return causal
    same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]
    return (causal & same).unsqueeze(1)


def _pieces(positions, rank, source, documents, dtype):
    """The kernel calls of one block pair: [(query slice, key slice, is_causal, additive mask or None,
    bool [B, 1, Lq] rows with a visible key or None)]; empty when nothing is visible."""
    if documents is not None:
        mask = _pair_mask(positions, rank, source, documents)
        if not bool(mask.any()):
            return []
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        whole = slice(None)
        return [(whole, whole, False, additive, mask.any(-1))]
    pieces = []
    for q0, q1, qa, qb in _runs(positions[rank]):
        for k0, k1, ka, kb in _runs(positions[source]):
            if qb < ka:
                continue  # every key after every query
            if qa > kb:
                pieces.append((slice(q0, q1), slice(k0, k1), False, None, None))
            elif (qa, qb) == (ka, kb):
                pieces.append((slice(q0, q1), slice(k0, k1), True, None, None))
            else:  # a partial overlap (no layout of context_parallel.py makes one): an explicit mask
                q_pos, k_pos = positions[rank][q0:q1], positions[source][k0:k1]
                visible = (q_pos[:, None] >= k_pos[None, :])[None, None]
                if bool(visible.any()):
                    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
                    pieces.append((slice(q0, q1), slice(k0, k1), False,
                                   additive.masked_fill(~visible, float("-inf")), visible.any(-1)))
    return pieces


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` zero-padded on its last dim to ``width``: the CPU flash kernel needs one head width for q,
    k and v, and a value wider by zeros gives the same output (and gradients) in its first columns."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _cuda_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The additive mask [B or 1, 1, Lq, Lk] as the CUDA memory-efficient kernel takes it: expanded to
    [B, H, Lq, Lk] (the kernel checks every dimension, broadcasting none) over a row stride padded to
    a multiple of 16 elements (its alignment check). Values are unchanged: the padding is sliced off.
    This is what ``scaled_dot_product_attention`` does before it calls the kernel (aten's
    ``preprocess_mask`` in transformers/attention.cpp)."""
    if mask is None:
        return None
    width = mask.shape[-1]
    if mask.stride(-2) % 16 or mask.stride(-1) != 1:
        mask = torch.nn.functional.pad(mask, (0, -width % 16 or 16))[..., :width]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _kernel_forward(q, k, v, causal, mask, scale):
    """(out [B, H, Lq, Dv] in q's dtype, lse [B, H, Lq] float32 or wider) of one block pair."""
    if v.shape[-1] != q.shape[-1]:  # MLA (models/deepseek_v3): value heads narrower than query-key heads
        width = max(q.shape[-1], v.shape[-1])
        out, lse = _kernel_forward(_widen(q, width), _widen(k, width), _widen(v, width), causal, mask, scale)
        return out[..., : v.shape[-1]], lse
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse.to(_lse_dtype(q.dtype))
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(mask, q, k), True, 0.0, causal,
                                                                  scale=scale)
    return out, lse[..., : q.shape[2]].float()  # the kernel pads lse's rows to a multiple of 32


def _kernel_backward(dout, q, k, v, out, lse, causal, mask, scale):
    """(dq, dk, dv) of one block pair, from the global ``out`` and ``lse`` of the query rows."""
    if v.shape[-1] != q.shape[-1]:  # as in _kernel_forward
        width = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _kernel_backward(_widen(dout, width), _widen(q, width), _widen(k, width), _widen(v, width),
                                      _widen(out, width), lse, causal, mask, scale)
        return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_lse_dtype(q.dtype)), 0.0, causal, attn_mask=mask, scale=scale)
    # The kernel takes ``out`` in the layout its forward returns ([B, Lq, H, Dv] in memory), not the
    # ring's merged [B, H, Lq, Dv]-contiguous one: given the latter, on an H200 (torch 2.11) its bf16
    # backward returned dq and dk 45 % off, NaN or an illegal memory access, while fp32 and dv were
    # right. Hence one copy into the layout it reads.
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    padded = -(-q.shape[2] // 32) * 32
    lse = torch.nn.functional.pad(lse.float(), (0, padded - q.shape[2]))
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _cuda_bias(mask, q, k), out, lse, empty, empty, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _merge(out, lse, out_b, lse_b):
    """Log-sum-exp merge of two partial attention results; rows with no visible key stay -inf."""
    new_lse = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new_lse)
    w_a = torch.where(finite, torch.exp(lse - new_lse), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b - new_lse), torch.zeros_like(lse_b))
    return out * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1), new_lse


@torch.library.custom_op("quadra::ring_attention", mutates_args=())
def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  documents: torch.Tensor | None, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sl, Dv] in q's dtype, lse [B, H, Sl] float32 or wider); see :func:`ring_attention`."""
    group = _resolve_process_group(group_name)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    compute = _lse_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=compute)  # v's width may differ from q/k's (MLA)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    kv = (k, v)
    for step in range(size):
        source = (rank - step) % size
        if step + 1 < size:
            incoming = _ring_exchange(list(kv), group)  # overlaps nothing on gloo, but keeps the ring
        for qs, ks, causal, mask, has_key in _pieces(positions, rank, source, documents, q.dtype):
            out_b, lse_b = _kernel_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, mask, scale)
            if has_key is not None:  # rows without a visible key: the kernel reports lse 0 there
                lse_b = lse_b.masked_fill(~has_key, float("-inf"))
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], out_b.to(compute), lse_b)
        if step + 1 < size:
            kv = tuple(incoming)
    return out.to(q.dtype), lse


@_ring_forward.register_fake
def _(q, k, v, positions, documents, group_name):
    return (q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("quadra::ring_attention_backward", mutates_args=())
def _ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None,
                   group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`_ring_forward`; the K/V blocks travel with their fp32 gradient accumulators."""
    group = _resolve_process_group(group_name)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    compute = _lse_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    grad_out = grad_out.contiguous()
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)
    k_blk, v_blk = k, v
    dk_blk = torch.zeros(k.shape, dtype=compute, device=k.device)
    dv_blk = torch.zeros(v.shape, dtype=compute, device=v.device)
    for step in range(size):
        source = (rank - step) % size
        for qs, ks, causal, mask, _ in _pieces(positions, rank, source, documents, q.dtype):
            dq_b, dk_b, dv_b = _kernel_backward(grad_out[:, :, qs], q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks],
                                                out[:, :, qs], lse[:, :, qs], causal, mask, scale)
            dq[:, :, qs] += dq_b
            dk_blk[:, :, ks] += dk_b
            dv_blk[:, :, ks] += dv_b
        # The block and its gradient accumulators move on together; after `size` hops the
        # accumulators are back with the block's owner.
        if step + 1 < size:
            k_blk, v_blk, dk_blk, dv_blk = _ring_exchange([k_blk, v_blk, dk_blk, dv_blk], group)
        elif size > 1:
            dk_blk, dv_blk = _ring_exchange([dk_blk, dv_blk], group)
    return dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype)


@_ring_backward.register_fake
def _(grad_out, q, k, v, out, lse, positions, documents, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones


def _setup_context(ctx, inputs, output):
    q, k, v, positions, documents, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, positions, documents)
    ctx.group_name = group_name
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, positions, documents = ctx.saved_tensors
    dq, dk, dv = _ring_backward(grad_out, q, k, v, out, lse, positions, documents, ctx.group_name)
    return dq, dk, dv, None, None, None


_ring_forward.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group: dist.ProcessGroup | str,
    documents: torch.Tensor | None = None, *, rank: int | None = None,
) -> torch.Tensor:
    """Causal attention of the local queries over the whole (cp-split) sequence, by ring exchange.

    Args:
        q, k, v: [B, H, S/cp, head_dim] local blocks (same head count: repeat GQA heads first); v
            may have its own width v_dim (MLA, models/deepseek_v3/model.py).
        positions: LongTensor[cp, S/cp], the global positions held by each rank of ``group``.
        group: the cp process group, or its name (``group.group_name``).
        documents: None, or int [B, S] document ids of the whole window (block-causal attention).
        rank: unused (the operator finds this rank in ``group``); accepted like :func:`allgather_attention`.

    Returns:
        [B, H, S/cp, v_dim], equal to the matching rows of full causal (block-causal) attention.
    """
    out, _ = _ring_forward(q, k, v, positions, documents, group if isinstance(group, str) else group.group_name)
    return out


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group: dist.ProcessGroup | str,
    documents: torch.Tensor | None = None, *, rank: int | None = None,
) -> torch.Tensor:
    """The same result by all-gathering K/V once (more memory, fewer steps; autograd reduce-scatters
    the K/V gradients back); functional collectives, so compiled blocks trace them. Shapes as
    :func:`ring_attention`; ``rank``: this rank's index in ``group`` (looked up when None)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    if rank is None:
        rank = dist.get_rank(_resolve_process_group(group) if isinstance(group, str) else group)
    # Gather along a leading dim, then lay the blocks out along the sequence in rank order.
    k_all = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=group)
    v_all = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=group)
    mask = _pair_mask(positions, rank, slice(None), documents)
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
