"""``ModelSpec`` presets of the two decoders every family builds on, spread into a family's spec:
``ModelSpec(name=..., flavors=..., hf_adapter=..., **DENSE_DECODER)``; a family overrides only the
fields where it differs (DeepSeek-V3's attention, say). Torch-free: every entry is a
"module:attribute" name imported on first use (models/registry.py ``load_ref``).
"""

from __future__ import annotations

__all__ = ["DENSE_DECODER", "MOE_DECODER"]

DENSE_DECODER: dict[str, str] = {
    "model_cls": "models.common.decoder:Transformer",
    "parallelize_plan": "models.common.parallelize:LLAMA_PLAN",
    "param_shapes": "models.common.shapes:llama_param_shapes",
    "flops_per_token": "models.common.shapes:llama_flops_per_token",
    "ffn_width": "models.common.shapes:llama_ffn_width",
}
"""The LLaMA decoder (models/common/decoder.py) with its TP plan and planner view; QK-norm and a free
head width are options of its arguments (models/common/args.py)."""

MOE_DECODER: dict[str, str] = {
    **DENSE_DECODER,
    "model_cls": "models.common.moe_decoder:MoETransformer",
    "parallelize_plan": "models.common.moe_parallelize:MOE_PLAN",
    "param_shapes": "models.common.moe_shapes:moe_param_shapes",
    "flops_per_token": "models.common.moe_shapes:moe_flops_per_token",
    "ffn_width": "models.common.moe_shapes:moe_ffn_width",
    "expert_routing": "models.common.moe_shapes:moe_routing",
}
"""The decoder with mixture-of-experts feed-forwards (models/common/moe_decoder.py, models/common/moe.py)."""
