"""LLaMA-3 model family; importing this package registers the "llama" ModelSpec."""

from models.common.args import LlamaModelArgs
from models.llama.flavors import llama3_flavors
from models.common.checks import validate_llama_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["LlamaModelArgs", "Transformer", "llama3_flavors"]

register_model_spec(
    ModelSpec(
        name="llama",
        model_cls="models.common.decoder:Transformer",
        flavors=llama3_flavors,
        parallelize_plan="models.common.parallelize:LLAMA_PLAN",
        validate_parallelism_fn=validate_llama_parallelism,
        hf_adapter="models.llama.hf:LLAMA_HF_ADAPTER",
        param_shapes="models.common.shapes:llama_param_shapes",
        flops_per_token="models.common.shapes:llama_flops_per_token",
        ffn_width="models.common.shapes:llama_ffn_width",
    )
)


def __getattr__(name: str):
    """``Transformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "Transformer":
        from models.common.decoder import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
