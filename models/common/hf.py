"""Hugging Face interop shared by the families (torch-free to import): the adapter a family gives,
weight rules, and the pieces of ``config.json`` every LLaMA-style decoder shares.

A family's ``ModelSpec.hf_adapter`` names an :class:`HFAdapter`: the ``model_type`` values it reads,
``config.json`` -> model arguments and back, and its :class:`Rule` list (Quadra weight name <-> the
Hugging Face weight(s) it is made of, with both conversions). engine/convert/hf.py does the file
work for every family through it. Adapters raise :class:`HFConfigError` (a ValueError) naming the
field; the engine turns it into a one-line refusal.

Field names follow transformers' ``LlamaConfig``. Both the older keys (``rope_theta``,
``rope_scaling``) and transformers 5's ``rope_parameters`` are read; the older ones are written,
which every transformers release since 4.43 reads.

Queries and keys: Quadra rotates the interleaved channel pairs (2i, 2i+1) of each head, as Meta's
reference code; Hugging Face rotates (i, i + head_dim/2) (``rotate_half``), so its checkpoints store
wq/wk rows permuted per head (transformers' ``convert_llama_weights_to_hf.py``). Import undoes the
permutation, export applies it; both are pure index moves, so a round trip is bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

__all__ = ["HFConfigError", "HFAdapter", "Rule", "require", "rope_from_config", "common_args", "common_config",
           "validated_args",
           "same", "one", "attention_rules", "feed_forward_rules", "norm_rules", "embedding_rule", "head_rules",
           "stack_transposed", "unstack_transposed"]


class HFConfigError(ValueError):
    """A Hugging Face config or checkpoint a family cannot express; the message names the field."""


@dataclass(frozen=True)
class Rule:
    """One Quadra weight and the Hugging Face weight(s) it is made of, with both conversions
    (tensors in, tensors out: ``to_quadra(list) -> tensor``, ``to_hf(tensor) -> list``)."""

    quadra: str
    hf: tuple[str, ...]
    to_quadra: Callable
    to_hf: Callable


@dataclass(frozen=True)
class HFAdapter:
    """What a family gives engine/convert/hf.py.

    Attributes:
        model_types: the ``config.json`` ``model_type`` values it reads (e.g. ("llama",)).
        args_from_config: ``(config: dict, where: str) -> model args`` (validated).
        config_from_args: ``(args, *, dtype, bos_id, eos_id) -> config dict`` for
            ``transformers.AutoModelForCausalLM``.
        weight_rules: ``args -> list[Rule]`` in Hugging Face's order (embedding, layers, norm, head).
        args_for_weights: optional ``(args, weight names: set[str]) -> model args``: the arguments of
            the checkpoint's weights where config.json says more than they hold (e.g. transformers'
            DeepseekV3Config names an MTP layer its model never saves); None keeps config.json's.
    All raise :class:`HFConfigError` for what the family cannot express.
    """

    model_types: tuple[str, ...]
    args_from_config: Callable
    config_from_args: Callable
    weight_rules: Callable
    args_for_weights: Callable | None = None


def require(ok: bool, where: str, message: str) -> None:
    """Raise :class:`HFConfigError` ``"{where}: {message}"`` unless ``ok``."""
    if not ok:
        raise HFConfigError(f"{where}: {message}")


def rope_scaling_of(config: dict) -> tuple[float, str, dict]:
    """(rope_theta, the scaling's kind, its fields) of a ``config.json`` in either format:
    transformers 4's ``rope_theta`` and ``rope_scaling``, or 5's ``rope_parameters``; kind
    "default" with no fields when the config scales nothing."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else {})
    return theta, scaling.get("rope_type") or scaling.get("type") or "default", scaling


def yarn_fields(config: dict, scaling: dict, where: str, default_positions: int) -> dict:
    """The YaRN fields of the model arguments (Peng et al. 2023, "YaRN: Efficient Context Window
    Extension of Large Language Models", sec. 3: the scale ``factor`` over the
    ``original_max_position_embeddings``, the ramp's ``beta_fast`` / ``beta_slow``, default 32 / 1)
    from a rope scaling of type "yarn"; a missing factor is max_position_embeddings / original, as in
    transformers. Raises :class:`HFConfigError` for ``truncate = false``."""
    require(scaling.get("truncate", True), where, "yarn truncate = false is not implemented")
    positions = int(config.get("max_position_embeddings", default_positions))
    original = int(scaling.get("original_max_position_embeddings") or positions)
    return {"rope_scaling": "yarn", "rope_scaling_factor": float(scaling.get("factor") or positions / original),
            "rope_original_max_seq_len": original, "rope_yarn_beta_fast": float(scaling.get("beta_fast") or 32),
            "rope_yarn_beta_slow": float(scaling.get("beta_slow") or 1)}


def rope_from_config(config: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, LlamaModelArgs rope fields) from either config format (:func:`rope_scaling_of`):
    the default RoPE, Llama 3.1's "llama3" scaling, or "yarn" (Qwen3's long-context scaling, as its
    model cards publish it: ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    32768}``; the attention factor is transformers' default 0.1 * ln(factor) + 1)."""
    theta, kind, scaling = rope_scaling_of(config)
    params = config.get("rope_parameters") or {}
    require(float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) == 1.0, where,
            "partial_rotary_factor != 1 (RoPE on part of each head) is not implemented in Quadra's attention")
    if kind == "default":
        return theta, {"rope_scaling": "none"}
    require(kind in ("llama3", "yarn"), where, f"RoPE scaling {kind!r} is not supported; Quadra implements the "
                                                "default, Llama 3.1's \"llama3\" and \"yarn\"")
    if kind == "yarn":
        for field in ("attention_factor", "mscale", "mscale_all_dim"):
            require(not scaling.get(field), where, f"rope_scaling {field} is set; Quadra's YaRN here takes the "
                                                   "attention factor 0.1 * ln(factor) + 1 (remove it)")
        return theta, yarn_fields(config, scaling, where, default_positions=32768)
    return theta, {
        "rope_scaling": "llama3",
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
    }


def common_args(config: dict, where: str) -> dict:
    """The ``LlamaModelArgs`` fields of a LLaMA-style ``config.json`` (SwiGLU, no biases,
    head_dim = hidden_size / heads). Raises :class:`HFConfigError`; KeyError for a missing field."""
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    require(config.get("hidden_act", "silu") == "silu", where,
            f"hidden_act = {config.get('hidden_act')!r}; Quadra's feed-forward is SwiGLU (silu)")
    require(not config.get("attention_bias") and not config.get("mlp_bias"), where,
            "attention_bias / mlp_bias = true; Quadra's linear layers have no biases")
    head_dim = config.get("head_dim") or dim // heads
    require(head_dim * heads == dim, where,
            f"head_dim = {head_dim} with {heads} heads != hidden_size = {dim}; "
            "Quadra needs head_dim = hidden_size / heads")
    theta, rope = rope_from_config(config, where)
    return dict(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                n_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                max_seq_len=int(config.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                ffn_hidden_size=int(config["intermediate_size"]), **rope)


def validated_args(make: Callable[[], object], where: str):
    """``make()`` (the family's model arguments from a config.json), validated.

    Raises:
        HFConfigError: ``"{where}: missing field 'x'"`` for a KeyError in ``make``, or
            ``"{where}: <reason>"`` when the arguments' ``validate()`` refuses them.
    """
    try:
        args = make()
    except KeyError as error:
        raise HFConfigError(f"{where}: missing field {error.args[0]!r}") from None
    try:
        args.validate()
    except ValueError as error:
        raise HFConfigError(f"{where}: {error}") from None
    return args


def common_config(args, *, architecture: str, model_type: str, dtype: str, bos_id, eos_id) -> dict:
    """The ``config.json`` fields every LLaMA-style decoder writes (RoPE scaling included)."""
    config = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": None, "tie_word_embeddings": args.tie_embeddings,
        "vocab_size": args.vocab_size, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    if args.rope_scaling == "llama3":
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    elif args.rope_scaling == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": args.rope_scaling_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
            "beta_fast": args.rope_yarn_beta_fast, "beta_slow": args.rope_yarn_beta_slow,
        }
    return config


def same(tensors):
    """One Hugging Face tensor -> the Quadra tensor, unchanged."""
    return tensors[0]


def one(tensor):
    """The Quadra tensor -> one Hugging Face tensor, unchanged."""
    return [tensor]


def rotate_half_to_pairs(tensors, heads: int):
    """[heads*hd, ...] in HF's (i, i + hd/2) order -> Meta's interleaved (2i, 2i+1) order, per head
    (a q/k projection [heads*hd, dim], or a QK-norm weight [hd] with heads = 1)."""
    w = tensors[0]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def pairs_to_rotate_half(w, heads: int):
    """The inverse of :func:`rotate_half_to_pairs`, as a one-tensor list."""
    return [w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)]


def embedding_rule() -> Rule:
    """The token embedding."""
    return Rule("tok_embeddings.weight", ("model.embed_tokens.weight",), same, one)


def _permuted(quadra: str, hf: str, heads: int) -> Rule:
    return Rule(quadra, (hf,), partial(rotate_half_to_pairs, heads=heads), partial(pairs_to_rotate_half, heads=heads))


def attention_rules(args, layer: int) -> list[Rule]:
    """wq/wk (permuted per head, see the module docstring), wv, wo of block ``layer``, and with
    ``args.qk_norm`` the QK-norm weights [head_dim] (``q_norm``/``k_norm``, Qwen3's names), permuted
    as one head: RMSNorm's mean of squares ignores the channel order, so normalizing permuted
    channels with the permuted weight gives the permuted result, which RoPE then rotates alike."""
    hf, q = f"model.layers.{layer}.self_attn.", f"layers.{layer}.attention."
    rules = [
        _permuted(q + "wq.weight", hf + "q_proj.weight", args.n_heads),
        _permuted(q + "wk.weight", hf + "k_proj.weight", args.kv_heads),
        Rule(q + "wv.weight", (hf + "v_proj.weight",), same, one),
        Rule(q + "wo.weight", (hf + "o_proj.weight",), same, one),
    ]
    if getattr(args, "qk_norm", False):
        rules += [_permuted(q + "q_norm.weight", hf + "q_norm.weight", 1),
                  _permuted(q + "k_norm.weight", hf + "k_norm.weight", 1)]
    return rules


def norm_rules(layer: int) -> list[Rule]:
    """The two RMSNorm weights of block ``layer``."""
    hf, q = f"model.layers.{layer}.", f"layers.{layer}."
    return [Rule(q + "attention_norm.weight", (hf + "input_layernorm.weight",), same, one),
            Rule(q + "ffn_norm.weight", (hf + "post_attention_layernorm.weight",), same, one)]


def head_rules(args) -> list[Rule]:
    """The final norm and the output head (tied: transformers' checkpoints leave ``lm_head`` out;
    Quadra's state dict has both names, so ``output.weight`` reads the embedding)."""
    return [Rule("norm.weight", ("model.norm.weight",), same, one),
            Rule("output.weight", ("model.embed_tokens.weight",) if args.tie_embeddings else ("lm_head.weight",),
                 same, one)]


def feed_forward_rules(layer: int) -> list[Rule]:
    """The SwiGLU w1/w2/w3 of block ``layer`` (gate_proj, down_proj, up_proj)."""
    hf, q = f"model.layers.{layer}.mlp.", f"layers.{layer}.feed_forward."
    return [Rule(q + f"{w}.weight", (hf + f"{proj}.weight",), same, one)
            for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]


def stack_transposed(tensors):
    """E matrices [a, b] (nn.Linear layout) -> [E, b, a] (x @ w layout)."""
    import torch

    return torch.stack([t.t() for t in tensors])


def unstack_transposed(w):
    """[E, b, a] -> E matrices [a, b]."""
    return [w[e].t() for e in range(w.shape[0])]
