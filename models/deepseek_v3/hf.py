"""Hugging Face ``model_type = "deepseek_v3"`` <-> the DeepSeek-V3 family, torch-free to import.

Field names follow transformers' ``DeepseekV3Config`` (and the published config.json files):
``q_lora_rank`` (null = full-rank ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``, ``n_routed_experts``, ``num_experts_per_tok``,
``n_shared_experts``, ``moe_intermediate_size``, ``first_k_dense_replace``, ``n_group``,
``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``; RoPE scaling "yarn" from
``rope_scaling`` or transformers 5's ``rope_parameters`` (absent ``mscale`` / ``mscale_all_dim`` are
0 = unused, as transformers reads them).

Weights map one to one (``q_a_proj`` <-> ``wq_a``, ``kv_a_proj_with_mqa`` <-> ``wkv_a``,
``kv_a_layernorm`` <-> ``kv_norm``, ``gate.e_score_correction_bias`` <-> ``router.expert_bias``, ...),
per-expert matrices transposed and stacked (models/moe/hf.py). No query/key permutation: with
``rope_interleave`` (the default, and DeepSeek's layout) transformers rotates the interleaved
channel pairs as Quadra does (it writes the result de-interleaved, the same permutation for queries
and keys, which leaves q·k unchanged). The multi-token-prediction layers of a published checkpoint
(``num_nextn_predict_layers`` D; ``model.layers.{num_hidden_layers + k}.*``, the names of
DeepSeek-V3's checkpoint and of vLLM's ``deepseek_mtp`` loader, which transformers' DeepseekV3
skips) map to ``mtp.{k}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` <-> ``norm`` and
the block's usual names <-> ``block.*``. The checkpoint's own copies of the shared embedding and
head (``embed_tokens``, ``shared_head.head``) are read as the main ones' (Quadra keeps one of each,
as the paper shares them) and written back as copies of them.
"""

from __future__ import annotations

import dataclasses

from models.common.hf import (HFAdapter, Rule, embedding_rule, feed_forward_rules, head_rules, norm_rules, one, require,
                              rope_scaling_of, same, stack_transposed, unstack_transposed, validated_args, yarn_fields)

__all__ = ["DEEPSEEK_V3_HF_ADAPTER"]


def _rope(config: dict, where: str) -> dict:
    """rope_theta and the YaRN fields of ``DeepseekV3ModelArgs`` from either config format, with
    DeepSeek's mscale / mscale_all_dim (the attention factor is derived from them)."""
    theta, kind, scaling = rope_scaling_of(config)
    if kind == "default":
        return dict(rope_theta=theta, rope_scaling="none")
    require(kind == "yarn", where,
            f"RoPE scaling {kind!r} is not supported; DeepSeek-V3 here has the default or \"yarn\"")
    require(scaling.get("attention_factor") is None, where, "rope attention_factor is set; Quadra derives it from "
                                                            "mscale / mscale_all_dim (remove attention_factor)")
    return dict(rope_theta=theta, **yarn_fields(config, scaling, where, default_positions=4096),
                rope_yarn_mscale=float(scaling.get("mscale") or 0),
                rope_yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0))


def _args(config: dict, where: str):
    from models.deepseek_v3.args import DeepseekV3ModelArgs

    require(config.get("model_type") == "deepseek_v3", where,
            f"model_type = {config.get('model_type')!r} is not a DeepSeek-V3 model")
    require(config.get("hidden_act", "silu") == "silu", where,
            f"hidden_act = {config.get('hidden_act')!r}; Quadra's feed-forward is SwiGLU (silu)")
    require(not config.get("attention_bias"), where, "attention_bias = true; Quadra's linear layers have no biases")
    require(config.get("rope_interleave", True), where, "rope_interleave = false is not supported (DeepSeek's "
                                                        "checkpoints rotate interleaved channel pairs)")
    require(config.get("scoring_func", "sigmoid") == "sigmoid", where,
            f"scoring_func = {config.get('scoring_func')!r}; DeepSeek-V3 routes with sigmoid scores")
    heads = int(config["num_attention_heads"])
    require(int(config.get("num_key_value_heads") or heads) == heads, where,
            f"num_key_value_heads = {config.get('num_key_value_heads')} != num_attention_heads = {heads}; MLA has "
            "one key/value per head")
    return DeepseekV3ModelArgs(
        dim=int(config["hidden_size"]), n_layers=int(config["num_hidden_layers"]), n_heads=heads,
        vocab_size=int(config["vocab_size"]), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        ffn_hidden_size=int(config["intermediate_size"]), num_experts=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]), moe_inter_dim=int(config["moe_intermediate_size"]),
        n_shared_experts=int(config.get("n_shared_experts") or 0),
        n_dense_layers=int(config.get("first_k_dense_replace") or 0), score_func="sigmoid",
        route_norm=bool(config.get("norm_topk_prob", False)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)), load_balance_coeff=0.0,
        aux_loss_coeff=0.0, capacity_factor=0.0, q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]), qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]), v_head_dim=int(config["v_head_dim"]),
        n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
        num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0), **_rope(config, where))


def args_from_config(config: dict, where: str = "config.json"):
    """``DeepseekV3ModelArgs`` of a DeepSeek-V3 ``config.json`` (load_balance_coeff 0: set the bias
    step of a run in its flavor or record).

    Raises:
        HFConfigError: another model_type, a missing field, or a feature Quadra lacks, naming the field.
    """
    return validated_args(lambda: _args(config, where), where)


def config_from_args(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of a Quadra DeepSeek-V3 model for ``transformers.DeepseekV3ForCausalLM``."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.n_shared_experts, "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.top_k, "routed_scaling_factor": args.route_scale,
        "kv_lora_rank": args.kv_lora_rank, "q_lora_rank": args.q_lora_rank or None,
        "qk_rope_head_dim": args.qk_rope_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim,
        "v_head_dim": args.v_head_dim, "n_group": args.n_group, "topk_group": args.topk_group,
        "first_k_dense_replace": args.n_dense_layers, "norm_topk_prob": args.route_norm, "scoring_func": "sigmoid",
        "hidden_act": "silu", "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": None, "rope_interleave": True,
        "tie_word_embeddings": args.tie_embeddings, "vocab_size": args.vocab_size, "attention_bias": False,
        "attention_dropout": 0.0, "num_nextn_predict_layers": args.num_nextn_predict_layers,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype,
    }
    if args.yarn_enabled:
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": args.rope_scaling_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
            "beta_fast": args.rope_yarn_beta_fast, "beta_slow": args.rope_yarn_beta_slow,
            "mscale": args.rope_yarn_mscale, "mscale_all_dim": args.rope_yarn_mscale_all_dim}
    return config


def _attention_rules(args, layer: int) -> list[Rule]:
    hf, q = f"model.layers.{layer}.self_attn.", f"layers.{layer}.attention."
    pairs = ([("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj")] if args.q_lora_rank
             else [("wq", "q_proj")])
    pairs += [("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj")]
    return [Rule(f"{q}{ours}.weight", (f"{hf}{theirs}.weight",), same, one)
            for ours, theirs in pairs]


def _moe_rules(args, layer: int) -> list[Rule]:
    hf, q = f"model.layers.{layer}.mlp.", f"layers.{layer}.feed_forward."
    rules = [Rule(q + "router.gate.weight", (hf + "gate.weight",), same, one),
             Rule(q + "router.expert_bias", (hf + "gate.e_score_correction_bias",), same, one)]
    rules += [Rule(q + f"experts.{w}", tuple(f"{hf}experts.{e}.{proj}.weight" for e in range(args.num_experts)),
                   stack_transposed, unstack_transposed)
              for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
    if args.n_shared_experts:
        rules += [Rule(f"{q}shared_experts.{w}.weight", (f"{hf}shared_experts.{proj}.weight",), same, one)
                  for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
    return rules


def weight_rules(args) -> list[Rule]:
    """Every weight (and the routing bias) of a DeepSeek-V3 model with its Hugging Face source(s),
    in Hugging Face's order."""
    rules = [embedding_rule()]
    for i in range(args.n_layers):
        rules += _block_rules(args, i)
    rules += head_rules(args)
    for k in range(args.num_nextn_predict_layers):
        rules += _mtp_rules(args, k)
    return _with_mtp_copies(rules, args)


def _block_rules(args, layer: int) -> list[Rule]:
    rules = _attention_rules(args, layer)
    rules += _moe_rules(args, layer) if args.is_moe_layer(layer) else feed_forward_rules(layer)
    return rules + norm_rules(layer)


def _mtp_rules(args, k: int) -> list[Rule]:
    """MTP depth k: its block's rules renamed from ``layers.{L + k}.`` to ``mtp.{k}.block.``, then
    enorm, hnorm, eh_proj and shared_head.norm."""
    layer = args.n_layers + k
    hf, q, block = f"model.layers.{layer}.", f"mtp.{k}.", f"layers.{layer}."
    rules = [dataclasses.replace(rule, quadra=q + "block." + rule.quadra.removeprefix(block))
             for rule in _block_rules(args, layer)]
    return rules + [Rule(q + ours, (hf + theirs,), same, one) for ours, theirs in (
        ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
        ("norm.weight", "shared_head.norm.weight"))]


def _with_mtp_copies(rules: list[Rule], args) -> list[Rule]:
    """The embedding's and output head's rules also name each MTP layer's copies (``embed_tokens``,
    ``shared_head.head``): read from the main ones, written as copies of them."""
    layers = range(args.n_layers, args.n_layers + args.num_nextn_predict_layers)
    if not layers:
        return rules
    copies = {"tok_embeddings.weight": [f"model.layers.{i}.embed_tokens.weight" for i in layers],
              "output.weight": [f"model.layers.{i}.shared_head.head.weight" for i in layers]}
    if args.tie_embeddings:  # one tensor: every copy comes from the embedding's rule
        copies = {"tok_embeddings.weight": copies["tok_embeddings.weight"] + copies["output.weight"]}
    out = []
    for rule in rules:
        extra = copies.get(rule.quadra)
        if extra and not (args.tie_embeddings and rule.quadra == "output.weight"):
            rule = Rule(rule.quadra, rule.hf + tuple(extra), lambda ts, f=rule.to_quadra, n=len(rule.hf): f(ts[:n]),
                        lambda t, f=rule.to_hf, m=len(extra): _with_copies(f(t), m))
        out.append(rule)
    return out


def _with_copies(tensors: list, m: int) -> list:
    """``tensors`` and ``m`` copies of the first (own memory: safetensors refuses shared storage)."""
    return list(tensors) + [tensors[0].clone() for _ in range(m)]


def args_for_weights(args, names: set[str]):
    """``HFAdapter.args_for_weights``: transformers' ``DeepseekV3Config`` says num_nextn_predict_layers
    = 1 by default while ``DeepseekV3ForCausalLM`` saves no MTP layer, so a checkpoint without any
    MTP layer's ``eh_proj`` is read without MTP.

    Raises:
        HFConfigError: only some of the MTP layers config.json names are present.
    """
    depths = args.num_nextn_predict_layers
    present = [f"model.layers.{args.n_layers + k}.eh_proj.weight" in names for k in range(depths)]
    if all(present):
        return args
    require(not any(present), "config.json", f"num_nextn_predict_layers = {depths} but the checkpoint holds "
                                             f"{sum(present)} MTP layers' eh_proj; give all or none")
    return dataclasses.replace(args, num_nextn_predict_layers=0)


DEEPSEEK_V3_HF_ADAPTER = HFAdapter(model_types=("deepseek_v3",), args_from_config=args_from_config,
                                   config_from_args=config_from_args, weight_rules=weight_rules,
                                   args_for_weights=args_for_weights)
