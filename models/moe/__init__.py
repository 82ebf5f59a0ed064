"""Mixture-of-experts LLaMA family; importing this package registers the "moe" ModelSpec."""

from models.common.moe_args import MoEModelArgs
from models.moe.flavors import moe_flavors
from models.moe.checks import validate_moe_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["MoEModelArgs", "MoETransformer", "moe_flavors"]

register_model_spec(
    ModelSpec(
        name="moe",
        model_cls="models.common.moe_decoder:MoETransformer",
        flavors=moe_flavors,
        parallelize_plan="models.common.moe_parallelize:MOE_PLAN",
        validate_parallelism_fn=validate_moe_parallelism,
        hf_adapter="models.moe.hf:MIXTRAL_HF_ADAPTER",
        param_shapes="models.common.moe_shapes:moe_param_shapes",
        flops_per_token="models.common.moe_shapes:moe_flops_per_token",
        ffn_width="models.common.moe_shapes:moe_ffn_width",
        expert_routing="models.common.moe_shapes:moe_routing",
    )
)


def __getattr__(name: str):
    """``MoETransformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "MoETransformer":
        from models.common.moe_decoder import MoETransformer

        return MoETransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
