"""Mixture-of-experts LLaMA family; importing this package registers the "moe" ModelSpec."""

from models.moe.args import MoEModelArgs
from models.moe.flavors import moe_flavors
from models.moe.model import MoETransformer
from models.moe.parallelize import parallelize_moe, validate_moe_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["MoEModelArgs", "MoETransformer", "moe_flavors"]

register_model_spec(
    ModelSpec(
        name="moe",
        model_cls=MoETransformer,
        flavors=moe_flavors,
        parallelize_fn=parallelize_moe,
        pipeline_fn=None,
        validate_parallelism_fn=validate_moe_parallelism,
    )
)
