"""Hugging Face ``model_type = "qwen3"`` / ``"qwen3_moe"`` <-> the Qwen3 families, torch-free to import.

- ``"qwen3"`` (``Qwen3ForCausalLM``) <-> ``model.name = "qwen3"`` (:class:`Qwen3ModelArgs`);
- ``"qwen3_moe"`` (``Qwen3MoeForCausalLM``) <-> ``model.name = "qwen3_moe"`` (:class:`Qwen3MoEModelArgs`):
  softmax top-k routing, renormalized when ``norm_topk_prob``, no shared experts, every layer MoE.
  A Quadra model exports only when it has that form (QK-norm on, softmax, route_scale 1, no shared
  or dense layers, no routing bias or capacity).

Field names follow transformers' ``Qwen3Config`` / ``Qwen3MoeConfig`` and the published config.json
files. Absent fields take transformers' defaults (``head_dim``: 128 for Qwen3, hidden_size / heads
for Qwen3-MoE; ``norm_topk_prob``: false). Only the default (unscaled) RoPE is read. Written configs
use the published keys (``rope_theta``, ``num_experts``), which transformers 4.51+ and 5 read.

Weights (models/common/hf.py): names map one to one; q/k projections and the QK-norm weights [head_dim] are
permuted per head from Hugging Face's ``rotate_half`` order to Quadra's interleaved pairs; the MoE's
per-expert ``nn.Linear`` matrices are transposed and stacked (models/moe/hf.py). All index moves, so
HF -> Quadra -> HF is bitwise. Refusals are :class:`models.common.hf.HFConfigError` naming the field.
"""

from __future__ import annotations

from models.common.hf import (HFAdapter, HFConfigError, Rule, attention_rules, common_config, embedding_rule,
                              feed_forward_rules, head_rules, norm_rules, one, require, rope_from_config, same,
                              stack_transposed, unstack_transposed, validated_args)

__all__ = ["QWEN3_HF_ADAPTER", "QWEN3_MOE_HF_ADAPTER"]

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_QWEN_LIKE = {"score_func": "softmax", "route_scale": 1.0, "n_shared_experts": 0, "n_dense_layers": 0,
              "load_balance_coeff": 0.0, "capacity_factor": 0.0}


def _common(config: dict, model_type: str, where: str) -> dict:
    """The ``LlamaModelArgs`` fields of a Qwen3 config (head_dim free of hidden_size / heads)."""
    require(config.get("model_type") == model_type, where,
            f"model_type = {config.get('model_type')!r} is not a Qwen3 model ({model_type!r} expected)")
    require(config.get("hidden_act", "silu") == "silu", where,
            f"hidden_act = {config.get('hidden_act')!r}; Quadra's feed-forward is SwiGLU (silu)")
    require(not config.get("attention_bias"), where, "attention_bias = true; Quadra's linear layers have no biases")
    require(not config.get("use_sliding_window"), where,
            "use_sliding_window = true; Quadra's attention has no sliding window")
    kinds = set(config.get("layer_types") or ["full_attention"])
    require(kinds == {"full_attention"}, where,
            f"layer_types {sorted(kinds)}; Quadra's attention is full causal attention in every layer")
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    theta, rope = rope_from_config(config, where)
    default_head = 128 if model_type == "qwen3" else dim // heads  # as transformers builds them
    return dict(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                n_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
                head_size=int(config.get("head_dim") or default_head), qk_norm=True,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, **rope,
                max_seq_len=int(config.get("max_position_embeddings", 32768)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                ffn_hidden_size=int(config["intermediate_size"]))


def qwen3_args_from_config(config: dict, where: str = "config.json"):
    """``Qwen3ModelArgs`` of a Qwen3 ``config.json``.

    Raises:
        HFConfigError: another model_type, a missing field, or a feature Quadra lacks (biases, another
            activation, sliding window, a RoPE scaling other than llama3 / YaRN), naming the field.
    """
    from models.qwen3.args import Qwen3ModelArgs

    return validated_args(lambda: Qwen3ModelArgs(**_common(config, "qwen3", where)), where)


def _moe_args(config: dict, where: str):
    from models.qwen3.args import Qwen3MoEModelArgs

    common = _common(config, "qwen3_moe", where)
    step, dense = int(config.get("decoder_sparse_step", 1)), list(config.get("mlp_only_layers") or [])
    require(step == 1 and not dense, where,
            f"decoder_sparse_step = {step}, mlp_only_layers = {dense}: Quadra's Qwen3-MoE has an MoE "
            "feed-forward in every layer (decoder_sparse_step 1, no mlp_only_layers)")
    experts = config.get("num_experts", config.get("num_local_experts"))
    require(experts is not None, where, "missing field 'num_experts'")
    return Qwen3MoEModelArgs(
        **common, num_experts=int(experts), top_k=int(config["num_experts_per_tok"]),
        moe_inter_dim=int(config["moe_intermediate_size"]), n_shared_experts=0, n_dense_layers=0,
        score_func="softmax", route_norm=bool(config.get("norm_topk_prob", False)), route_scale=1.0,
        load_balance_coeff=0.0, aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)), capacity_factor=0.0)


def qwen3_moe_args_from_config(config: dict, where: str = "config.json"):
    """``Qwen3MoEModelArgs`` of a Qwen3-MoE ``config.json``.

    Raises:
        HFConfigError: as :func:`qwen3_args_from_config`, and dense layers among the MoE layers.
    """
    return validated_args(lambda: _moe_args(config, where), where)


def _check_exportable(name: str, args) -> None:
    where = f"model {name}"
    require(args.qk_norm, where, "qk_norm = False; Hugging Face's Qwen3 always normalizes queries and keys")
    if name == "qwen3_moe":
        for field, value in _QWEN_LIKE.items():
            require(getattr(args, field) == value, where,
                    f"{field} = {getattr(args, field)!r}; a Qwen3-MoE checkpoint needs {field} = {value!r} "
                    "(softmax top-k routing, no shared experts, dense layers, routing bias or capacity)")


def _config(name: str, args, *, dtype: str, bos_id, eos_id) -> dict:
    _check_exportable(name, args)
    config = common_config(args, architecture=_ARCHITECTURES[name], model_type=name, dtype=dtype,
                           bos_id=bos_id, eos_id=eos_id)
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    if name == "qwen3_moe":
        config.update(num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_inter_dim, norm_topk_prob=args.route_norm,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=args.aux_loss_coeff,
                      output_router_logits=False)
    return config


def qwen3_config_from_args(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of a Quadra Qwen3 model for ``transformers.Qwen3ForCausalLM``.

    Raises:
        HFConfigError: no QK-norm or a scaled RoPE (Hugging Face's Qwen3 has neither form).
    """
    return _config("qwen3", args, dtype=dtype, bos_id=bos_id, eos_id=eos_id)


def qwen3_moe_config_from_args(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of a Quadra Qwen3-MoE model for ``transformers.Qwen3MoeForCausalLM``.

    Raises:
        HFConfigError: as :func:`qwen3_config_from_args`, and routing Qwen3-MoE cannot express.
    """
    return _config("qwen3_moe", args, dtype=dtype, bos_id=bos_id, eos_id=eos_id)


def _require_qk_norm(args) -> None:
    if not args.qk_norm:
        raise HFConfigError(f"a model with qk_norm = {args.qk_norm} has no Hugging Face Qwen3 layout")


def qwen3_weight_rules(args) -> list[Rule]:
    """Every weight of a Qwen3 model with its Hugging Face source, in Hugging Face's order.

    Raises:
        HFConfigError: no QK-norm.
    """
    _require_qk_norm(args)
    rules = [embedding_rule()]
    for i in range(args.n_layers):
        rules += attention_rules(args, i) + feed_forward_rules(i) + norm_rules(i)
    return rules + head_rules(args)


def qwen3_moe_weight_rules(args) -> list[Rule]:
    """Every weight of a Qwen3-MoE model with its Hugging Face source(s), in Hugging Face's order
    (per-expert ``mlp.experts.{e}.{gate,down,up}_proj`` stacked and transposed).

    Raises:
        HFConfigError: no QK-norm, shared experts or dense layers.
    """
    _require_qk_norm(args)
    if args.n_shared_experts or args.n_dense_layers:
        raise HFConfigError("a Qwen3-MoE checkpoint has no shared experts and no dense layers; this model has "
                            f"n_shared_experts = {args.n_shared_experts}, n_dense_layers = {args.n_dense_layers}")
    rules = [embedding_rule()]
    for i in range(args.n_layers):
        hf, q = f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward."
        rules += attention_rules(args, i)
        rules.append(Rule(q + "router.gate.weight", (hf + "gate.weight",), same, one))
        rules += [Rule(q + f"experts.{w}", tuple(f"{hf}experts.{e}.{proj}.weight" for e in range(args.num_experts)),
                       stack_transposed, unstack_transposed)
                  for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
        rules += norm_rules(i)
    return rules + head_rules(args)


QWEN3_HF_ADAPTER = HFAdapter(model_types=("qwen3",), args_from_config=qwen3_args_from_config,
                             config_from_args=qwen3_config_from_args, weight_rules=qwen3_weight_rules)
QWEN3_MOE_HF_ADAPTER = HFAdapter(model_types=("qwen3_moe",), args_from_config=qwen3_moe_args_from_config,
                                 config_from_args=qwen3_moe_config_from_args, weight_rules=qwen3_moe_weight_rules)
