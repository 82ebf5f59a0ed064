"""Hugging Face ``model_type = "mixtral"`` <-> the MoE family (:class:`models.common.moe_args.MoEModelArgs`),
torch-free to import.

Mixtral (Jiang et al. 2024, arXiv 2401.04088): softmax top-k routing renormalized over the chosen
experts, no shared experts, every layer MoE. A Quadra MoE exports to Mixtral only when it routes the
same way: softmax scores, ``route_norm``, ``route_scale = 1``, no shared experts or dense layers, no
auxiliary-loss-free bias (it changes the routing, and Mixtral has no place for it). Mixtral stores
one [hidden, dim] / [dim, hidden] matrix per expert (``nn.Linear`` layout); Quadra stacks them as
[E, dim, hidden] / [E, hidden, dim] (``x @ w`` layout): transposed and stacked.
"""

from __future__ import annotations

from models.common.hf import (HFAdapter, HFConfigError, Rule, attention_rules, common_args, common_config,
                              embedding_rule, head_rules, norm_rules, one, require, same, stack_transposed,
                              unstack_transposed, validated_args)

__all__ = ["MIXTRAL_HF_ADAPTER"]

_MIXTRAL_LIKE = {"score_func": "softmax", "route_norm": True, "route_scale": 1.0, "n_shared_experts": 0,
                 "n_dense_layers": 0, "load_balance_coeff": 0.0}


def args_from_config(config: dict, where: str = "config.json"):
    """``MoEModelArgs`` of a Mixtral ``config.json`` (its balance loss weight carries over to
    Quadra's sequence-wise balance loss).

    Raises:
        HFConfigError: a feature Quadra's MoE lacks (sliding window, biases, ...) or a missing field.
    """
    from models.common.moe_args import MoEModelArgs

    def make() -> MoEModelArgs:
        common = common_args(config, where)
        require(config.get("sliding_window") is None, where,
                f"sliding_window = {config.get('sliding_window')}; Quadra's attention has no sliding window")
        return MoEModelArgs(
            **common, num_experts=int(config["num_local_experts"]), top_k=int(config["num_experts_per_tok"]),
            moe_inter_dim=int(config["intermediate_size"]), n_shared_experts=0, n_dense_layers=0,
            score_func="softmax", route_norm=True, route_scale=1.0, load_balance_coeff=0.0,
            aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)), capacity_factor=0.0,
        )

    return validated_args(make, where)


def config_from_args(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of a Mixtral-like MoE model for ``transformers.MixtralForCausalLM``.

    Raises:
        HFConfigError: routing Mixtral cannot express (see the module docstring).
    """
    for field, value in _MIXTRAL_LIKE.items():
        require(getattr(args, field) == value, "model moe",
                f"{field} = {getattr(args, field)!r}; a Mixtral checkpoint needs {field} = {value!r} "
                "(softmax top-k routing renormalized, no shared experts, dense layers or routing bias)")
    require(not args.qk_norm, "model moe", "qk_norm = True; Hugging Face's Mixtral has no QK-norm (model.name = "
            "\"qwen3_moe\" exports it)")
    config = common_config(args, architecture="MixtralForCausalLM", model_type="mixtral", dtype=dtype,
                           bos_id=bos_id, eos_id=eos_id)
    del config["head_dim"]
    config.update(intermediate_size=args.moe_inter_dim, num_local_experts=args.num_experts,
                  num_experts_per_tok=args.top_k, router_aux_loss_coef=args.aux_loss_coeff,
                  output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    return config


def weight_rules(args) -> list[Rule]:
    """Every weight of a Mixtral-like MoE model with its Hugging Face source(s), in Hugging Face's order.

    Raises:
        HFConfigError: shared experts or dense layers (no Mixtral equivalent).
    """
    rules = [embedding_rule()]
    for i in range(args.n_layers):
        if args.n_shared_experts or not args.is_moe_layer(i):
            raise HFConfigError("only Mixtral-style MoE models (no shared experts, no dense layers) map to "
                                f"Hugging Face; this model has n_shared_experts = {args.n_shared_experts}, "
                                f"n_dense_layers = {args.n_dense_layers}")
        moe, q = f"model.layers.{i}.block_sparse_moe.", f"layers.{i}.feed_forward."
        rules += attention_rules(args, i)
        rules.append(Rule(q + "router.gate.weight", (moe + "gate.weight",), same, one))
        rules += [Rule(q + f"experts.{w}", tuple(f"{moe}experts.{e}.{w}.weight" for e in range(args.num_experts)),
                       stack_transposed, unstack_transposed) for w in ("w1", "w2", "w3")]
        rules += norm_rules(i)
    return rules + head_rules(args)


MIXTRAL_HF_ADAPTER = HFAdapter(model_types=("mixtral",), args_from_config=args_from_config,
                               config_from_args=config_from_args, weight_rules=weight_rules)
