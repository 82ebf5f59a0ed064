"""Hugging Face ``config.json`` <-> Qwen3 / Qwen3-MoE model arguments (torch-free, plain functions).

- ``model_type = "qwen3"`` (``Qwen3ForCausalLM``) <-> ``model.name = "qwen3"`` (:class:`Qwen3ModelArgs`);
- ``model_type = "qwen3_moe"`` (``Qwen3MoeForCausalLM``) <-> ``model.name = "qwen3_moe"``
  (:class:`Qwen3MoEModelArgs`): softmax top-k routing, renormalized when ``norm_topk_prob``, no
  shared experts, every layer MoE. A Quadra model exports only when it has that form (QK-norm on,
  softmax, route_scale 1, no shared or dense layers, no routing bias).

Field names follow transformers' ``Qwen3Config`` / ``Qwen3MoeConfig`` and the published config.json
files. Absent fields take transformers' defaults (``head_dim``: 128 for Qwen3, hidden_size /
heads for Qwen3-MoE; ``norm_topk_prob``: false). RoPE theta is read from ``rope_theta`` or
transformers 5's ``rope_parameters``; only the default (unscaled) RoPE is implemented. Written
configs use the published keys (``rope_theta``, ``num_experts``), which transformers 4.51+ and 5 read.

Errors are ``ValueError("<where>: <field> ... ")``; the engine's converter reports them as its own.
"""

from __future__ import annotations

__all__ = ["MODEL_TYPES", "args_from_hf_config", "hf_config_from_args"]

MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}  # Hugging Face model_type -> model.name
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


def _rope_theta(config: dict, where: str) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    _require(kind == "default", where, f"RoPE scaling {kind!r} is not supported for Qwen3; Quadra implements "
                                       "the default RoPE (remove rope_scaling to train at the base context)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _unsupported(config: dict, where: str) -> None:
    """Refuse what Qwen3's published models never use and Quadra's modules lack."""
    _require(config.get("hidden_act", "silu") == "silu", where,
             f"hidden_act = {config.get('hidden_act')!r}; Quadra's feed-forward is SwiGLU (silu)")
    _require(not config.get("attention_bias"), where, "attention_bias = true; Quadra's linear layers have no biases")
    _require(not config.get("use_sliding_window"), where,
             "use_sliding_window = true; Quadra's attention has no sliding window")
    kinds = set(config.get("layer_types") or ["full_attention"])
    _require(kinds == {"full_attention"}, where,
             f"layer_types {sorted(kinds)}; Quadra's attention is full causal attention in every layer")


def args_from_hf_config(config: dict, where: str = "config.json"):
    """(model.name, model arguments) of a Qwen3 / Qwen3-MoE ``config.json`` (a dict).

    Raises:
        ValueError: another ``model_type``, a missing field, or a feature Quadra's modules lack
            (biases, another activation, sliding window, RoPE scaling, dense layers among MoE
            layers), naming the field; arguments that fail ``validate()``.
    """
    from models.qwen3.args import Qwen3ModelArgs, Qwen3MoEModelArgs

    model_type = config.get("model_type")
    _require(model_type in MODEL_TYPES, where,
             f"model_type = {model_type!r} is not a Qwen3 model (\"qwen3\" or \"qwen3_moe\")")
    _unsupported(config, where)
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        default_head = 128 if model_type == "qwen3" else dim // heads  # as transformers builds them
        common = dict(
            dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
            head_size=int(config.get("head_dim") or default_head), qk_norm=True,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config, where),
            max_seq_len=int(config.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            ffn_hidden_size=int(config["intermediate_size"]),
        )
        if model_type == "qwen3":
            args = Qwen3ModelArgs(**common)
        else:
            step, dense = int(config.get("decoder_sparse_step", 1)), list(config.get("mlp_only_layers") or [])
            _require(step == 1 and not dense, where,
                     f"decoder_sparse_step = {step}, mlp_only_layers = {dense}: Quadra's Qwen3-MoE has an MoE "
                     "feed-forward in every layer (decoder_sparse_step 1, no mlp_only_layers)")
            experts = config.get("num_experts", config.get("num_local_experts"))
            _require(experts is not None, where, "missing field 'num_experts'")
            args = Qwen3MoEModelArgs(
                **common, num_experts=int(experts), top_k=int(config["num_experts_per_tok"]),
                moe_inter_dim=int(config["moe_intermediate_size"]), n_shared_experts=0, n_dense_layers=0,
                score_func="softmax", route_norm=bool(config.get("norm_topk_prob", False)), route_scale=1.0,
                load_balance_coeff=0.0, aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
                capacity_factor=0.0,
            )
    except KeyError as error:
        raise ValueError(f"{where}: missing field {error.args[0]!r}") from None
    try:
        args.validate()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return MODEL_TYPES[model_type], args


def _check_exportable(name: str, args) -> None:
    where = f"model {name}"
    _require(name in _ARCHITECTURES, where, "not a Qwen3 model (\"qwen3\" or \"qwen3_moe\")")
    _require(args.qk_norm, where, "qk_norm = False; Hugging Face's Qwen3 always normalizes queries and keys")
    _require(args.rope_scaling == "none", where,
             f"rope_scaling = {args.rope_scaling!r}; a Qwen3 checkpoint here has the default RoPE")
    if name == "qwen3_moe":
        qwen_like = {"score_func": "softmax", "route_scale": 1.0, "n_shared_experts": 0, "n_dense_layers": 0,
                     "load_balance_coeff": 0.0, "capacity_factor": 0.0}
        for field, value in qwen_like.items():
            _require(getattr(args, field) == value, where,
                     f"{field} = {getattr(args, field)!r}; a Qwen3-MoE checkpoint needs {field} = {value!r} "
                     "(softmax top-k routing, no shared experts, dense layers, routing bias or capacity)")


def hf_config_from_args(name: str, args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """The ``config.json`` of a Quadra Qwen3 / Qwen3-MoE model for ``transformers.AutoModelForCausalLM``.

    Args:
        name: ``model.name`` ("qwen3" or "qwen3_moe"); args: its arguments; dtype: of the weights
            written ("float32", "bfloat16", "float16"); bos_id/eos_id: the tokenizer's, or None.

    Raises:
        ValueError: a model that Hugging Face's Qwen3 / Qwen3-MoE cannot express (see module docstring).
    """
    _check_exportable(name, args)
    config = {
        "architectures": [_ARCHITECTURES[name]], "model_type": name,
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": None, "tie_word_embeddings": args.tie_embeddings,
        "vocab_size": args.vocab_size, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers,
        "initializer_range": 0.02, "use_cache": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    if name == "qwen3_moe":
        config.update(num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_inter_dim, norm_topk_prob=args.route_norm,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=args.aux_loss_coeff,
                      output_router_logits=False)
    return config
