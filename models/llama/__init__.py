"""LLaMA-3 model family; importing this package registers the "llama" ModelSpec."""

from models.llama.args import LlamaModelArgs
from models.llama.flavors import llama3_flavors
from models.llama.model import Transformer
from models.llama.parallelize import parallelize_llama, validate_llama_parallelism
from models.registry import ModelSpec, register_model_spec

__all__ = ["LlamaModelArgs", "Transformer", "llama3_flavors"]

register_model_spec(
    ModelSpec(
        name="llama",
        model_cls=Transformer,
        flavors=llama3_flavors,
        parallelize_fn=parallelize_llama,
        pipeline_fn=None,
        validate_parallelism_fn=validate_llama_parallelism,
    )
)
