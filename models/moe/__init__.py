"""The mixture-of-experts decoder of models/common with its debug and Mixtral-style flavors and the
Hugging Face ``mixtral`` adapter; importing this package registers the "moe" ModelSpec."""

from models.common.checks import decoder_parallelism_check
from models.common.moe_args import MoEModelArgs
from models.common.specs import MOE_DECODER
from models.moe.flavors import moe_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["MoEModelArgs", "MoETransformer", "moe_flavors"]

register_model_spec(ModelSpec(
    name="moe", flavors=moe_flavors, hf_adapter="models.moe.hf:MIXTRAL_HF_ADAPTER",
    validate_parallelism_fn=decoder_parallelism_check("moe"), **MOE_DECODER))


def __getattr__(name: str):
    """``MoETransformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "MoETransformer":
        from models.common.moe_decoder import MoETransformer

        return MoETransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
