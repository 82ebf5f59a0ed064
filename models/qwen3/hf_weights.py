"""Qwen3 / Qwen3-MoE weight names and layouts <-> Hugging Face's (the published safetensors files).

Names map one to one (:func:`weight_rules`), except three layouts:

- queries and keys: Quadra rotates the interleaved channel pairs (2i, 2i+1) of each head
  (models/llama/model.py ``apply_rope``, Meta's layout); Hugging Face rotates (i, i + head_dim/2)
  (``rotate_half``), so q_proj / k_proj rows are permuted within each head, as for LLaMA
  (transformers' ``convert_llama_weights_to_hf.py``);
- the QK-norm weights [head_dim] get the same permutation (one head): RMSNorm's mean of squares
  does not depend on the channel order, so normalizing the permuted channels with the permuted
  weight gives the permuted result, which the RoPE of the other layout then rotates alike;
- Qwen3-MoE experts: one [hidden, dim] / [dim, hidden] matrix per expert (``nn.Linear`` layout,
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) vs Quadra's stacked [E, dim, hidden] /
  [E, hidden, dim] (``x @ w`` layout): transposed and stacked.

All are index moves, so HF -> Quadra -> HF is bitwise. Tied embeddings: transformers' files hold no
``lm_head.weight``; Quadra's ``output.weight`` then reads ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

__all__ = ["WeightRule", "weight_rules", "to_quadra_state_dict", "to_hf_state_dict"]


@dataclass(frozen=True)
class WeightRule:
    """One Quadra weight and the Hugging Face weight(s) it is made of, with both conversions
    (the fields of engine/checkpoint/hf_weights.py's ``Rule``)."""

    quadra: str
    hf: tuple[str, ...]
    to_quadra: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(tensors):
    return tensors[0]


def _one(tensor):
    return [tensor]


def _rotate_half_to_pairs(tensors, heads: int):
    """[heads*hd, ...] in HF's (i, i + hd/2) order -> the interleaved (2i, 2i+1) order, per head."""
    w = tensors[0]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _pairs_to_rotate_half(w, heads: int):
    return [w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)]


def _permuted(heads: int) -> dict:
    return dict(to_quadra=partial(_rotate_half_to_pairs, heads=heads), to_hf=partial(_pairs_to_rotate_half, heads=heads))


def _stack_transposed(tensors):
    """E matrices [a, b] (nn.Linear layout) -> [E, b, a] (x @ w layout)."""
    return torch.stack([t.t() for t in tensors])


def _unstack_transposed(w):
    return [w[e].t() for e in range(w.shape[0])]


def _attention_rules(q: str, hf: str, args) -> list[WeightRule]:
    attn = hf + "self_attn."
    return [
        WeightRule(q + "attention.wq.weight", (attn + "q_proj.weight",), **_permuted(args.n_heads)),
        WeightRule(q + "attention.wk.weight", (attn + "k_proj.weight",), **_permuted(args.kv_heads)),
        WeightRule(q + "attention.wv.weight", (attn + "v_proj.weight",), _same, _one),
        WeightRule(q + "attention.wo.weight", (attn + "o_proj.weight",), _same, _one),
        WeightRule(q + "attention.q_norm.weight", (attn + "q_norm.weight",), **_permuted(1)),
        WeightRule(q + "attention.k_norm.weight", (attn + "k_norm.weight",), **_permuted(1)),
    ]


def weight_rules(name: str, args) -> list[WeightRule]:
    """Every weight of Quadra's ``name`` model ("qwen3" or "qwen3_moe") with its Hugging Face
    source(s), in Hugging Face's order (embedding, layers, norm, output head).

    Raises:
        ValueError: another model name, or a model Hugging Face's Qwen3 cannot hold (no QK-norm,
            shared experts, dense layers in an MoE model).
    """
    if name not in ("qwen3", "qwen3_moe") or not args.qk_norm:
        raise ValueError(f"model {name} (qk_norm = {args.qk_norm}) has no Hugging Face Qwen3 layout")
    if name == "qwen3_moe" and (args.n_shared_experts or args.n_dense_layers):
        raise ValueError("a Qwen3-MoE checkpoint has no shared experts and no dense layers; this model has "
                         f"n_shared_experts = {args.n_shared_experts}, n_dense_layers = {args.n_dense_layers}")
    rules = [WeightRule("tok_embeddings.weight", ("model.embed_tokens.weight",), _same, _one)]
    for i in range(args.n_layers):
        hf, q = f"model.layers.{i}.", f"layers.{i}."
        rules += _attention_rules(q, hf, args)
        if name == "qwen3":
            rules += [WeightRule(q + f"feed_forward.{w}.weight", (hf + f"mlp.{proj}.weight",), _same, _one)
                      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
        else:
            rules.append(WeightRule(q + "feed_forward.router.gate.weight", (hf + "mlp.gate.weight",), _same, _one))
            rules += [WeightRule(q + f"feed_forward.experts.{w}",
                                 tuple(f"{hf}mlp.experts.{e}.{proj}.weight" for e in range(args.num_experts)),
                                 _stack_transposed, _unstack_transposed)
                      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
        rules += [WeightRule(q + "attention_norm.weight", (hf + "input_layernorm.weight",), _same, _one),
                  WeightRule(q + "ffn_norm.weight", (hf + "post_attention_layernorm.weight",), _same, _one)]
    rules.append(WeightRule("norm.weight", ("model.norm.weight",), _same, _one))
    head = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
    rules.append(WeightRule("output.weight", (head,), _same, _one))
    return rules


def to_quadra_state_dict(name: str, args, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quadra's state dict (every parameter name, tied ones included) from a Hugging Face one.

    Raises:
        KeyError: ``hf_state`` lacks a weight the model needs. ValueError: as :func:`weight_rules`.
    """
    return {rule.quadra: rule.to_quadra([hf_state[key] for key in rule.hf]) for rule in weight_rules(name, args)}


def to_hf_state_dict(name: str, args, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (as its files store it: no ``lm_head.weight`` when tied) of a
    Quadra one. Raises: KeyError / ValueError as :func:`to_quadra_state_dict`."""
    out = {}
    for rule in weight_rules(name, args):
        if args.tie_embeddings and rule.quadra == "output.weight":
            continue
        out.update(zip(rule.hf, rule.to_hf(state[rule.quadra])))
    return out
