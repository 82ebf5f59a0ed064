"""DeepSeek-V3's multi-token prediction (MTP; DeepSeek-AI 2024, arXiv 2412.19437 §2.2).

D = ``num_nextn_predict_layers`` sequential modules; module k (1..D) predicts, at position t, token
t+1+k from the previous depth's hidden state h^{k-1}_t (h^0: the main model's, before its final
norm) and the embedding of token t+k:

    h'^k_t = eh_proj_k([enorm_k(Emb(token_{t+k})); hnorm_k(h^{k-1}_t)])     (eq. 21; the concatenation
             in the published checkpoints' order: embedding first, as vLLM's ``deepseek_mtp``)
    h^k   = TRM_k(h'^k)                                                      (eq. 22: one block)
    L_k   = CE(output(norm_k(h^k_t)), token_{t+1+k})                         (eq. 23-24)

with the embedding ``Emb`` and the output head shared with the main model, and the objective
L_main + λ · (1/D) Σ_k L_k (eq. 25), λ = ``[loss] mtp_weight``. Token sums here: the trainer divides
them, like the main loss, by the step's label tokens.

Positions are kept (S per depth): depth k sees the tokens rolled by k, and the last k positions of a
sequence, whose token t+k lies past the window, get no target (-100); causal attention keeps those
wrapped tokens out of every earlier position. Under ``[document_mask]`` a position gets no target
where token t+k begins or lies in another document than token t (the ids of
models/common/document_mask.py), so no depth predicts across documents.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.init import init_linear
from models.common.linear_cross_entropy import linear_cross_entropy_sum, z_loss_token_sum

__all__ = ["MTPModule", "mtp_targets", "token_sum_cross_entropy"]

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One MTP depth: ``enorm``, ``hnorm`` (RMSNorm [dim]), ``eh_proj`` [dim, 2·dim], one
    transformer ``block`` (``block_cls(layer_id, args)``, layer_id = n_layers + k - 1, as the published
    checkpoints number it) and ``norm`` (the checkpoints' ``shared_head.norm``) before the shared head."""

    def __init__(self, layer_id: int, args, block_cls):
        super().__init__()
        self.layer_id = layer_id
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block_cls(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                extra: dict) -> torch.Tensor:
        """h: [B, S, dim] previous depth's hidden state; embedded: [B, S, dim] Emb(token_{t+k});
        cos/sin, extra: the main blocks' inputs. Returns h^k [B, S, dim] (before ``norm``)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return self.block(x, cos, sin, **extra)

    def init_weights(self, seed: int) -> None:
        """Norms = 1, eh_proj ~ trunc_normal(0.02) from (seed, its name), the block as the main ones."""
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        init_linear(self.eh_proj, 0.02, seed, f"mtp.{self.layer_id}.eh_proj")
        self.block.init_weights(seed)


def mtp_targets(labels: torch.Tensor, depth: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depth ``depth``'s targets [B, S]: position t gets labels[t + depth] (token t+1+depth), -100 for
    the last ``depth`` positions and, with ``documents`` (int [B, S] document ids of the window),
    where token t+depth is in another document than token t.

    Raises:
        ValueError: depth < 1 or >= S, or documents not of labels' shape.
    """
    seq = labels.shape[1]
    if not 1 <= depth < seq:
        raise ValueError(f"MTP depth {depth} needs 1 <= depth < sequence length {seq}")
    targets = labels.roll(-depth, dims=1)
    keep = torch.ones_like(labels, dtype=torch.bool)
    keep[:, seq - depth:] = False
    if documents is not None:
        if documents.shape != labels.shape:
            raise ValueError(f"document ids {tuple(documents.shape)} do not match labels {tuple(labels.shape)}")
        keep &= documents == documents.roll(-depth, dims=1)
    return targets.masked_fill(~keep, IGNORE_INDEX)


def token_sum_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            chunk_tokens: int, z_loss=None) -> torch.Tensor:
    """Σ cross entropy (fp32, nats) of ``h @ weight.T`` [B, S, V] against ``labels`` [B, S]: fused over
    chunks of ``chunk_tokens`` tokens (models/common/linear_cross_entropy.py) when > 0, else on full logits
    (as engine/train/loss.py's unfused loss). ``z_loss`` (an object with ``weight`` and ``add``, the
    run's z-loss, or None): adds PaLM's ``weight * logsumexp(logits)^2`` per label token (Chowdhery
    et al. 2022, Sec. 5) and hands its token sum to ``z_loss.add``."""
    weight_z = float(z_loss.weight) if z_loss is not None else 0.0
    if chunk_tokens > 0:
        return linear_cross_entropy_sum(h, weight, labels, chunk_tokens, weight_z, z_loss.add if weight_z else None)
    logits = F.linear(h, weight)
    flat = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(flat, labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX)
    if weight_z:
        z_sum = z_loss_token_sum(flat, labels.flatten(0, 1), weight_z)
        z_loss.add(z_sum)
        loss = loss + z_sum
    return loss
