"""Hugging Face ``config.json`` <-> Quadra model arguments (torch-free).

Two families map onto Quadra's models:

- ``model_type = "llama"`` (Llama-2, Llama-3, 3.1, 3.2: GQA, tied embeddings, ``llama3`` RoPE
  scaling) -> ``model.name = "llama"`` (:class:`models.llama.args.LlamaModelArgs`);
- ``model_type = "mixtral"`` (softmax top-k routing renormalized over the chosen experts, no shared
  experts, every layer MoE; Jiang et al. 2024, arXiv 2401.04088) -> ``model.name = "moe"``
  (:class:`models.moe.args.MoEModelArgs`). A Quadra MoE exports to Mixtral only when it routes the
  same way: softmax scores, ``route_norm``, ``route_scale = 1``, no shared experts or dense layers,
  no auxiliary-loss-free bias (it changes the routing, and Mixtral has no place for it).

Field names follow transformers' ``LlamaConfig`` / ``MixtralConfig``. Both the older keys
(``rope_theta``, ``rope_scaling``) and transformers 5's ``rope_parameters`` are read; the older
ones are written, which every transformers release since 4.43 reads.
"""

from __future__ import annotations

from engine.checkpoint.files import CheckpointError

__all__ = ["args_from_hf_config", "hf_config_from_args", "generation_config"]

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "moe": "MixtralForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "moe": "mixtral"}


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {message}")


def _rope(config: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, LlamaModelArgs rope fields) from either config format."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    kind = (scaling.get("rope_type") or scaling.get("type")) if scaling else "default"
    _require(float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) == 1.0, where,
             "partial_rotary_factor != 1 (RoPE on part of each head) is not implemented in Quadra's attention")
    if kind in (None, "default"):
        return theta, {"rope_scaling": "none"}
    _require(kind == "llama3", where, f"RoPE scaling {kind!r} is not supported; Quadra implements the default "
                                      "and Llama 3.1's \"llama3\" scaling")
    return theta, {
        "rope_scaling": "llama3",
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
    }


def args_from_hf_config(config: dict, where: str = "config.json"):
    """(model.name, model arguments) for a Hugging Face ``config.json`` (a dict).

    Raises:
        CheckpointError: an unsupported ``model_type`` or a feature Quadra's models lack (attention
            or MLP biases, another activation, head_dim != hidden_size / heads, sliding-window
            attention, another RoPE scaling), naming the field.
    """
    from models.llama.args import LlamaModelArgs
    from models.moe.args import MoEModelArgs

    model_type = config.get("model_type")
    _require(model_type in ("llama", "mixtral"), where,
             f"model_type = {model_type!r} is not supported; from-hf converts \"llama\" (Llama-2/3/3.1/3.2) "
             "and \"mixtral\" checkpoints")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        _require(config.get("hidden_act", "silu") == "silu", where,
                 f"hidden_act = {config.get('hidden_act')!r}; Quadra's feed-forward is SwiGLU (silu)")
        _require(not config.get("attention_bias") and not config.get("mlp_bias"), where,
                 "attention_bias / mlp_bias = true; Quadra's linear layers have no biases")
        head_dim = config.get("head_dim") or dim // heads
        _require(head_dim * heads == dim, where,
                 f"head_dim = {head_dim} with {heads} heads != hidden_size = {dim}; Quadra needs head_dim = hidden_size / heads")
        theta, rope = _rope(config, where)
        common = dict(
            dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            ffn_hidden_size=int(config["intermediate_size"]), **rope,
        )
        if model_type == "llama":
            args, name = LlamaModelArgs(**common), "llama"
        else:
            _require(config.get("sliding_window") is None, where,
                     f"sliding_window = {config.get('sliding_window')}; Quadra's attention has no sliding window")
            # Mixtral's balance loss weight carries over to Quadra's sequence-wise balance loss.
            args, name = MoEModelArgs(
                **common, num_experts=int(config["num_local_experts"]), top_k=int(config["num_experts_per_tok"]),
                moe_inter_dim=int(config["intermediate_size"]), n_shared_experts=0, n_dense_layers=0,
                score_func="softmax", route_norm=True, route_scale=1.0, load_balance_coeff=0.0,
                aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)), capacity_factor=0.0,
            ), "moe"
    except KeyError as error:
        raise CheckpointError(f"{where}: missing field {error.args[0]!r}") from None
    try:
        args.validate()
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from None
    return name, args


def hf_config_from_args(name: str, args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """The ``config.json`` of a Quadra model for ``transformers.AutoModelForCausalLM``.

    Args:
        name: ``model.name`` ("llama" or "moe"); args: its arguments; dtype: of the weights
            written ("float32", "bfloat16", "float16"); bos_id/eos_id: the tokenizer's, or None.

    Raises:
        CheckpointError: a model Hugging Face's Llama / Mixtral cannot express (see module docstring).
    """
    where = f"model {name}"
    _require(name in _ARCHITECTURES, where, "only the llama and moe models export to Hugging Face")
    config = {
        "architectures": [_ARCHITECTURES[name]], "model_type": _MODEL_TYPES[name],
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
    if name == "llama":
        config["mlp_bias"] = False
        return config
    mixtral_like = {"score_func": "softmax", "route_norm": True, "route_scale": 1.0, "n_shared_experts": 0,
                    "n_dense_layers": 0, "load_balance_coeff": 0.0}
    for field, value in mixtral_like.items():
        _require(getattr(args, field) == value, where,
                 f"{field} = {getattr(args, field)!r}; a Mixtral checkpoint needs {field} = {value!r} "
                 "(softmax top-k routing renormalized, no shared experts, dense layers or routing bias)")
    del config["head_dim"]
    config.update(intermediate_size=args.moe_inter_dim, num_local_experts=args.num_experts,
                  num_experts_per_tok=args.top_k, router_aux_loss_coef=args.aux_loss_coeff,
                  output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    return config


def generation_config(config: dict) -> dict:
    """``generation_config.json``: the special ids of ``config`` (greedy decoding by default)."""
    return {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
            "_from_model_config": True}

