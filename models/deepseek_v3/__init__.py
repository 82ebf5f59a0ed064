"""DeepSeek-V3 (arXiv 2412.19437); importing this package registers the "deepseek_v3" ModelSpec.

The family holds what is its own, on the MoE decoder of models/common (specs.py ``MOE_DECODER``,
moe.py, moe_decoder.py): arguments and flavors (args.py, flavors.py), YaRN RoPE tables (yarn.py),
multi-head latent attention and group-limited routing (model.py), multi-token prediction (mtp.py),
their tensor-parallel plan (parallelize.py), the planner's view of MLA and MTP (planning.py) and the
Hugging Face adapter (hf.py). The start-up checks are the common decoder's (models/common/checks.py).
"""

from models.common.checks import decoder_parallelism_check
from models.common.specs import MOE_DECODER
from models.deepseek_v3.args import DeepseekV3ModelArgs
from models.deepseek_v3.flavors import deepseek_v3_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["DeepseekV3ModelArgs", "deepseek_v3_flavors"]

_OWN = "models.deepseek_v3."  # MLA and multi-token prediction (model.py, mtp.py), their plan and planner view
register_model_spec(ModelSpec(**{
    **MOE_DECODER,
    "name": "deepseek_v3",
    "flavors": deepseek_v3_flavors,
    "validate_parallelism_fn": decoder_parallelism_check("deepseek_v3"),
    "hf_adapter": _OWN + "hf:DEEPSEEK_V3_HF_ADAPTER",
    "model_cls": _OWN + "model:DeepseekV3Transformer",
    "parallelize_plan": _OWN + "parallelize:DEEPSEEK_V3_PLAN",
    "param_shapes": _OWN + "planning:deepseek_v3_param_shapes",
    "flops_per_token": _OWN + "planning:deepseek_v3_flops_per_token",
    "attention_activations": _OWN + "planning:deepseek_v3_attention_activations",
    "ffn_activations": _OWN + "planning:deepseek_v3_ffn_activations",
    "prediction_blocks": _OWN + "planning:deepseek_v3_prediction_blocks",
}))
