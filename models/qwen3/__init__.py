"""Qwen3 and Qwen3-MoE; importing this package registers the "qwen3" and "qwen3_moe" ModelSpecs.

The family is flavors (flavors.py), Qwen3's defaults (args.py) and the Hugging Face adapters
(hf.py: config.json <-> arguments, weight names and the q/k/QK-norm permutations of
models/common/hf.py); everything else is the common dense and MoE decoders (models/common/specs.py),
which take QK-norm and a free head width as options (models/common/args.py ``qk_norm``, ``head_size``).
"""

from models.common.checks import decoder_parallelism_check
from models.common.specs import DENSE_DECODER, MOE_DECODER
from models.qwen3.args import Qwen3ModelArgs, Qwen3MoEModelArgs
from models.qwen3.flavors import qwen3_flavors, qwen3_moe_flavors
from models.registry import ModelSpec, register_model_spec

__all__ = ["Qwen3ModelArgs", "Qwen3MoEModelArgs", "qwen3_flavors", "qwen3_moe_flavors"]

register_model_spec(ModelSpec(
    name="qwen3", flavors=qwen3_flavors, hf_adapter="models.qwen3.hf:QWEN3_HF_ADAPTER",
    validate_parallelism_fn=decoder_parallelism_check("qwen3", sparse_family="qwen3_moe"), **DENSE_DECODER))
register_model_spec(ModelSpec(
    name="qwen3_moe", flavors=qwen3_moe_flavors, hf_adapter="models.qwen3.hf:QWEN3_MOE_HF_ADAPTER",
    validate_parallelism_fn=decoder_parallelism_check("qwen3_moe"), **MOE_DECODER))
