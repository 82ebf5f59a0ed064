"""Qwen3 and Qwen3-MoE; importing this package registers the "qwen3" and "qwen3_moe" ModelSpecs.

Everything about the family is here: arguments and flavors (args.py, flavors.py), start-up checks
(checks.py), the Hugging Face adapter (hf_config.py: config.json <-> arguments; hf_weights.py:
weight names and the q/k/QK-norm permutations), and the planner's parameter shapes and FLOPs per
token (shapes.py). The modules and parallelize plans are LLaMA's and the MoE model's, which take
QK-norm and a free head width as options (models/llama/args.py ``qk_norm``, ``head_size``).
"""

from models.qwen3.args import Qwen3ModelArgs, Qwen3MoEModelArgs
from models.qwen3.checks import validate_qwen3_moe_parallelism, validate_qwen3_parallelism
from models.qwen3.flavors import qwen3_flavors, qwen3_moe_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["Qwen3ModelArgs", "Qwen3MoEModelArgs", "qwen3_flavors", "qwen3_moe_flavors"]

register_model_spec(
    ModelSpec(
        name="qwen3",
        model_cls="models.llama.model:Transformer",
        flavors=qwen3_flavors,
        parallelize_fn="models.llama.parallelize:parallelize_llama",
        validate_parallelism_fn=validate_qwen3_parallelism,
    )
)
register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        model_cls="models.moe.model:MoETransformer",
        flavors=qwen3_moe_flavors,
        parallelize_fn="models.moe.parallelize:parallelize_moe",
        validate_parallelism_fn=validate_qwen3_moe_parallelism,
    )
)
