"""Mixture-of-experts LLaMA family; importing this package registers the "moe" ModelSpec."""

from models.moe.args import MoEModelArgs
from models.moe.flavors import moe_flavors
from models.moe.checks import validate_moe_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["MoEModelArgs", "MoETransformer", "moe_flavors"]

register_model_spec(
    ModelSpec(
        name="moe",
        model_cls="models.moe.model:MoETransformer",
        flavors=moe_flavors,
        parallelize_plan="models.moe.parallelize:MOE_PLAN",
        validate_parallelism_fn=validate_moe_parallelism,
        hf_adapter="models.moe.hf:MIXTRAL_HF_ADAPTER",
        param_shapes="models.moe.planning:moe_param_shapes",
        flops_per_token="models.moe.planning:moe_flops_per_token",
        ffn_width="models.moe.planning:moe_ffn_width",
        expert_routing="models.moe.planning:moe_routing",
    )
)


def __getattr__(name: str):
    """``MoETransformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "MoETransformer":
        from models.moe.model import MoETransformer

        return MoETransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
