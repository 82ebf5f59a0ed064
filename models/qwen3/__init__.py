"""Qwen3 and Qwen3-MoE; importing this package registers the "qwen3" and "qwen3_moe" ModelSpecs.

Everything about the family is here: arguments and flavors (args.py, flavors.py), start-up checks
(checks.py), the Hugging Face adapters (hf.py: config.json <-> arguments, weight names and the
q/k/QK-norm permutations of models/common/hf.py), and the planner's parameter shapes, FLOPs per token,
feed-forward width and expert routing (planning.py). The modules and parallelize plans are
LLaMA's and the MoE model's, which take QK-norm and a free head width as options
(models/common/args.py ``qk_norm``, ``head_size``).
"""

from models.qwen3.args import Qwen3ModelArgs, Qwen3MoEModelArgs
from models.qwen3.checks import validate_qwen3_moe_parallelism, validate_qwen3_parallelism
from models.qwen3.flavors import qwen3_flavors, qwen3_moe_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["Qwen3ModelArgs", "Qwen3MoEModelArgs", "qwen3_flavors", "qwen3_moe_flavors"]

register_model_spec(
    ModelSpec(
        name="qwen3",
        model_cls="models.common.decoder:Transformer",
        flavors=qwen3_flavors,
        parallelize_plan="models.common.parallelize:LLAMA_PLAN",
        validate_parallelism_fn=validate_qwen3_parallelism,
        hf_adapter="models.qwen3.hf:QWEN3_HF_ADAPTER",
        param_shapes="models.qwen3.planning:qwen3_param_shapes",
        flops_per_token="models.qwen3.planning:qwen3_flops_per_token",
        ffn_width="models.qwen3.planning:qwen3_ffn_width",
    )
)
register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        model_cls="models.common.moe_decoder:MoETransformer",
        flavors=qwen3_moe_flavors,
        parallelize_plan="models.common.moe_parallelize:MOE_PLAN",
        validate_parallelism_fn=validate_qwen3_moe_parallelism,
        hf_adapter="models.qwen3.hf:QWEN3_MOE_HF_ADAPTER",
        param_shapes="models.qwen3.planning:qwen3_moe_param_shapes",
        flops_per_token="models.qwen3.planning:qwen3_moe_flops_per_token",
        ffn_width="models.qwen3.planning:qwen3_moe_ffn_width",
        expert_routing="models.qwen3.planning:qwen3_moe_routing",
    )
)
