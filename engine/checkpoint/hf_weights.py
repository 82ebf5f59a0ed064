"""Quadra weight names and layouts <-> Hugging Face's, for engine/checkpoint/hf.py.

Names map one to one (:func:`weight_rules`), except two layouts:

- queries and keys: Quadra rotates the interleaved channel pairs (2i, 2i+1) of each head, as
  Meta's reference code; Hugging Face rotates (i, i + head_dim/2) (``rotate_half``), so its
  checkpoints store wq/wk rows permuted per head (transformers'
  ``convert_llama_weights_to_hf.py``). Import undoes the permutation, export applies it; both are
  pure index moves, so a round trip is bitwise.
- Mixtral experts: one [hidden, dim] / [dim, hidden] matrix per expert (``nn.Linear`` layout) vs
  Quadra's stacked [E, dim, hidden] / [E, hidden, dim] (``x @ w`` layout): transposed and stacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from engine.checkpoint.files import CheckpointError

__all__ = ["Rule", "weight_rules"]


@dataclass(frozen=True)
class Rule:
    """One Quadra weight and the Hugging Face weight(s) it is made of, with both conversions."""

    quadra: str
    hf: tuple[str, ...]
    to_quadra: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(tensors):
    return tensors[0]


def _one(tensor):
    return [tensor]


def _rotate_half_to_pairs(tensors, heads: int):
    """[heads*hd, dim] in HF's (i, i + hd/2) order -> Meta's interleaved (2i, 2i+1) order, per head."""
    w = tensors[0]
    return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _pairs_to_rotate_half(w, heads: int):
    return [w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)]


def _stack_transposed(tensors):
    """E matrices [a, b] (nn.Linear layout) -> [E, b, a] (x @ w layout)."""
    return torch.stack([t.t() for t in tensors])


def _unstack_transposed(w):
    return [w[e].t() for e in range(w.shape[0])]


def weight_rules(name: str, args) -> list[Rule]:
    """Every weight of Quadra's ``name`` model (``llama`` or ``moe``) with its Hugging Face source(s),
    in Hugging Face's order (embedding, layers, norm, output head).

    Raises:
        CheckpointError: an MoE model with shared experts or dense layers (no Mixtral equivalent).
    """
    rules = [Rule("tok_embeddings.weight", ("model.embed_tokens.weight",), _same, _one)]
    for i in range(args.n_layers):
        hf, q = f"model.layers.{i}.", f"layers.{i}."
        rules += [
            Rule(q + "attention.wq.weight", (hf + "self_attn.q_proj.weight",),
                 partial(_rotate_half_to_pairs, heads=args.n_heads), partial(_pairs_to_rotate_half, heads=args.n_heads)),
            Rule(q + "attention.wk.weight", (hf + "self_attn.k_proj.weight",),
                 partial(_rotate_half_to_pairs, heads=args.kv_heads), partial(_pairs_to_rotate_half, heads=args.kv_heads)),
            Rule(q + "attention.wv.weight", (hf + "self_attn.v_proj.weight",), _same, _one),
            Rule(q + "attention.wo.weight", (hf + "self_attn.o_proj.weight",), _same, _one),
        ]
        if name == "llama":
            rules += [Rule(q + f"feed_forward.{w}.weight", (hf + f"mlp.{proj}.weight",), _same, _one)
                      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
        else:
            if args.n_shared_experts or not args.is_moe_layer(i):
                raise CheckpointError("only Mixtral-style MoE models (no shared experts, no dense layers) map to "
                                      "Hugging Face; this model has n_shared_experts = "
                                      f"{args.n_shared_experts}, n_dense_layers = {args.n_dense_layers}")
            moe = hf + "block_sparse_moe."
            rules.append(Rule(q + "feed_forward.router.gate.weight", (moe + "gate.weight",), _same, _one))
            rules += [Rule(q + f"feed_forward.experts.{w}",
                           tuple(f"{moe}experts.{e}.{w}.weight" for e in range(args.num_experts)),
                           _stack_transposed, _unstack_transposed) for w in ("w1", "w2", "w3")]
        rules += [Rule(q + "attention_norm.weight", (hf + "input_layernorm.weight",), _same, _one),
                  Rule(q + "ffn_norm.weight", (hf + "post_attention_layernorm.weight",), _same, _one)]
    rules.append(Rule("norm.weight", ("model.norm.weight",), _same, _one))
    # Tied: transformers' checkpoints leave lm_head out; Quadra's state dict has both names.
    rules.append(Rule("output.weight", ("model.embed_tokens.weight",) if args.tie_embeddings else ("lm_head.weight",),
                      _same, _one))
    return rules
