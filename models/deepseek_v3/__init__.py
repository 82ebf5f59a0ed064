"""DeepSeek-V3 (arXiv 2412.19437); importing this package registers the "deepseek_v3" ModelSpec.

Everything about the family is here: arguments and flavors (args.py, flavors.py), YaRN RoPE
(yarn.py), the module (model.py: MLA and group-limited routing on top of models/moe), its
parallelize plan (parallelize.py), start-up checks (checks.py), the Hugging Face adapter (hf.py)
and the planner's view (planning.py).
"""

from models.deepseek_v3.args import DeepseekV3ModelArgs
from models.deepseek_v3.checks import validate_deepseek_v3_parallelism
from models.deepseek_v3.flavors import deepseek_v3_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["DeepseekV3ModelArgs", "deepseek_v3_flavors"]

register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        model_cls="models.deepseek_v3.model:DeepseekV3Transformer",
        flavors=deepseek_v3_flavors,
        parallelize_plan="models.deepseek_v3.parallelize:DEEPSEEK_V3_PLAN",
        validate_parallelism_fn=validate_deepseek_v3_parallelism,
        hf_adapter="models.deepseek_v3.hf:DEEPSEEK_V3_HF_ADAPTER",
        param_shapes="models.deepseek_v3.planning:deepseek_v3_param_shapes",
        flops_per_token="models.deepseek_v3.planning:deepseek_v3_flops_per_token",
        ffn_width="models.deepseek_v3.planning:deepseek_v3_ffn_width",
        expert_routing="models.deepseek_v3.planning:deepseek_v3_routing",
        attention_activations="models.deepseek_v3.planning:deepseek_v3_attention_activations",
        ffn_activations="models.deepseek_v3.planning:deepseek_v3_ffn_activations",
        prediction_blocks="models.deepseek_v3.planning:deepseek_v3_prediction_blocks",
    )
)
