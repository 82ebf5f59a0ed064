"""Document masking: attention that stays inside each document of a packed window.

Packing (engine/data/packing.py) concatenates documents as [BOS] + tokens (+ [EOS]) into one stream
and cuts it into windows, so every document of a window begins at a BOS token (with a tokenizer
whose BOS is its EOS, the single separator begins the next document), except the window's first
one, which may be the tail of a document begun in an earlier window. A token's document id is
therefore the number of BOS tokens at or before it (:func:`document_ids`): derived from the input
ids, it needs no tensor of its own in the data pipeline, the checkpoints or the pipeline sends.

Block-causal attention over those documents (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
§3.2: "an attention mask that prevents self-attention between different documents within the same
sequence"; TorchTitan's ``block_causal`` FlexAttention mask) lets query i see key j iff j <= i and
both are in the same document. :func:`document_positions` restarts the RoPE positions at 0 at each
document (Megatron-LM's ``--reset-position-ids``; packed fine-tuning with per-example position ids),
so a document in a window is computed exactly as it would be alone.

Kernels (:func:`document_attention`): on CUDA, FlexAttention (``torch.nn.attention.flex_attention``,
Dong et al. 2024, arXiv 2412.05496) with a ``BlockMask`` built from the document ids once per model
forward, outside the blocks (which compile with fullgraph, :func:`attention_inputs`): no S x S mask
or score matrix exists and fully masked 128 x 128 tiles are skipped. Elsewhere (the CPU, where torch
2.13's FlexAttention has no backward) a dense boolean mask [B, 1, S, S] for
``F.scaled_dot_product_attention``: B·S² bytes, for debug sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["document_ids", "document_positions", "document_mask", "block_mask", "attention_inputs",
           "document_attention"]


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Per-token document index of packed windows: the number of BOS tokens at or before each token.

    Args:
        tokens: LongTensor [B, S] token ids of whole windows (not context-parallel shards).
        bos_id: the tokenizer's BOS id (>= 0), the first token of every packed document.
    Returns:
        int32 [B, S], non-decreasing along S; 0 for the tail of a document begun before the window.
    """
    return (tokens == bos_id).to(torch.int32).cumsum(dim=1, dtype=torch.int32)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (0 at each document's first token in the window).

    Args:
        documents: int [B, S] non-decreasing document ids (:func:`document_ids`).
    Returns:
        int64 [B, S]: t - (index of the first token of t's document), so every value is <= t.
    """
    seq = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, seq, torch.zeros_like(seq)).cummax(dim=1).values
    return seq - first


def document_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Dense block-causal mask: True where query i may attend to key j (same document, k_pos <= q_pos).

    Args:
        q_docs: [B, Sq] and k_docs: [B, Sk] document ids; q_pos: [Sq] and k_pos: [Sk] positions of
        the queries and keys in the window.
    Returns:
        bool [B, 1, Sq, Sk] (B·Sq·Sk bytes), broadcast over heads.
    """
    causal = q_pos[:, None] >= k_pos[None, :]
    return (causal & (q_docs[:, :, None] == k_docs[:, None, :])).unsqueeze(1)


_compiled: dict = {}  # torch.compile'd flex_attention and create_block_mask, built on first CUDA use


def _compiled_fn(name: str):
    if name not in _compiled:
        from torch.nn.attention import flex_attention as flex

        # Uncompiled, flex_attention runs an unfused reference that materializes the scores, and
        # create_block_mask evaluates the mask densely before reducing it to blocks.
        _compiled[name] = torch.compile(getattr(flex, name), dynamic=False)
    return _compiled[name]


def block_mask(documents: torch.Tensor):
    """FlexAttention ``BlockMask`` of the block-causal mask of ``documents`` (int [B, S]): per 128 x 128
    tile, which tiles are partly or fully visible (int32 indices, 16·B·(S/128)² bytes; no S x S tensor).

    Raises:
        RuntimeError: from torch, where FlexAttention cannot compile (e.g. no Triton for the device).
    """
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    bs, seqlen = documents.shape
    return _compiled_fn("create_block_mask")(mask_mod, bs, None, seqlen, seqlen, device=documents.device)


def attention_inputs(documents: torch.Tensor | None, layers) -> object:
    """What a model part's blocks receive as ``documents``: the document ids [B, S] themselves, or, on
    CUDA where the blocks attend over their own sequence (no context-parallel ``attention_fn``), the
    :func:`block_mask` built once per forward, outside the (compiled) blocks."""
    if documents is None or documents.device.type != "cuda":
        return documents
    if any(getattr(layer.attention, "attention_fn", None) is not None for layer in layers):
        return documents  # context parallel masks each block pair from the ids
    return block_mask(documents)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents) -> torch.Tensor:
    """Block-causal attention of a whole (not context-parallel) window.

    Args:
        q, k, v: [B, H, S, head_dim] (same head count: GQA heads repeated).
        documents: int [B, S] document ids of the S tokens (:func:`document_ids`): a dense mask for
            SDPA; or their :func:`block_mask` (CUDA): FlexAttention.
    Returns:
        [B, H, S, head_dim]; with one document per window it equals causal attention.
    Raises:
        ValueError: ``documents`` is not [B, S] for the B, S of ``q``.
    """
    bs, _, seqlen, _ = q.shape
    if not isinstance(documents, torch.Tensor):  # a BlockMask
        return _compiled_fn("flex_attention")(q, k, v, block_mask=documents)
    if documents.shape != (bs, seqlen):
        raise ValueError(f"document ids of shape {tuple(documents.shape)} for attention over [B={bs}, S={seqlen}]")
    pos = torch.arange(seqlen, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, documents, pos, pos))
