"""LLaMA-3 (Grattafiori et al. 2024): the dense decoder of models/common with Meta's flavors and the
Hugging Face ``llama`` adapter; importing this package registers the "llama" ModelSpec."""

from models.common.args import LlamaModelArgs
from models.common.checks import decoder_parallelism_check
from models.common.specs import DENSE_DECODER
from models.llama.flavors import llama3_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["LlamaModelArgs", "Transformer", "llama3_flavors"]

register_model_spec(ModelSpec(
    name="llama", flavors=llama3_flavors, hf_adapter="models.llama.hf:LLAMA_HF_ADAPTER",
    validate_parallelism_fn=decoder_parallelism_check("llama", sparse_family="moe"), **DENSE_DECODER))


def __getattr__(name: str):
    """``Transformer`` on first use: importing the package (and the registry) stays torch-free."""
    if name == "Transformer":
        from models.common.decoder import Transformer

        return Transformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
