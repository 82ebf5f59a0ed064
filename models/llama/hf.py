"""Hugging Face ``model_type = "llama"`` (Llama-2, Llama-3, 3.1, 3.2: GQA, tied embeddings, ``llama3``
RoPE scaling) <-> the LLaMA family (:class:`models.common.args.LlamaModelArgs`), torch-free to import.

Weight names map one to one (models/common/hf.py: the q/k permutation of RoPE's pair order, the tied head).
"""

from __future__ import annotations

from models.common.hf import (HFAdapter, Rule, attention_rules, common_args, common_config, embedding_rule,
                              feed_forward_rules, head_rules, norm_rules, require, validated_args)

__all__ = ["LLAMA_HF_ADAPTER"]


def args_from_config(config: dict, where: str = "config.json"):
    """``LlamaModelArgs`` of a Llama ``config.json``.

    Raises:
        HFConfigError: a feature Quadra's LLaMA lacks (biases, another activation, head_dim !=
            hidden_size / heads, another RoPE scaling) or a missing field, naming it.
    """
    from models.common.args import LlamaModelArgs

    return validated_args(lambda: LlamaModelArgs(**common_args(config, where)), where)


def config_from_args(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """``config.json`` of a LLaMA model for ``transformers.LlamaForCausalLM``."""
    require(not args.qk_norm, "model llama", "qk_norm = True; Hugging Face's Llama has no QK-norm (model.name = "
            "\"qwen3\" exports it)")
    config = common_config(args, architecture="LlamaForCausalLM", model_type="llama", dtype=dtype,
                           bos_id=bos_id, eos_id=eos_id)
    config["mlp_bias"] = False
    return config


def weight_rules(args) -> list[Rule]:
    """Every weight of a LLaMA model with its Hugging Face source, in Hugging Face's order."""
    rules = [embedding_rule()]
    for i in range(args.n_layers):
        rules += attention_rules(args, i) + feed_forward_rules(i) + norm_rules(i)
    return rules + head_rules(args)


LLAMA_HF_ADAPTER = HFAdapter(model_types=("llama",), args_from_config=args_from_config,
                             config_from_args=config_from_args, weight_rules=weight_rules)
