"""LLaMA-3 model family; importing this package registers the "llama" ModelSpec."""

from models.llama.args import LlamaModelArgs
from models.llama.flavors import llama3_flavors
from models.llama.checks import validate_llama_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["LlamaModelArgs", "Transformer", "llama3_flavors"]

register_model_spec(
    ModelSpec(
        name="llama",
        model_cls="models.llama.model:Transformer",
        flavors=llama3_flavors,
        parallelize_plan="models.llama.parallelize:LLAMA_PLAN",
        validate_parallelism_fn=validate_llama_parallelism,
        hf_adapter="models.llama.hf:LLAMA_HF_ADAPTER",
        param_shapes="models.llama.planning:llama_param_shapes",
        flops_per_token="models.llama.planning:llama_flops_per_token",
        ffn_width="models.llama.planning:llama_ffn_width",
    )
)


def __getattr__(name: str):
    """``Transformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "Transformer":
        from models.llama.model import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
