"""Model registry and model families. Importing this package registers every built-in model."""

from models.registry import (
    ModelArgs,
    ModelSpec,
    get_model_args,
    get_model_spec,
    list_model_names,
    register_model_spec,
)

# Imported for their side effect: register the "llama", "moe", "qwen3", "qwen3_moe" and "deepseek_v3" specs.
from models import llama  # noqa: E402,F401
from models import moe  # noqa: E402,F401
from models import qwen3  # noqa: E402,F401
from models import deepseek_v3  # noqa: E402,F401

__all__ = [
    "ModelArgs",
    "ModelSpec",
    "get_model_args",
    "get_model_spec",
    "list_model_names",
    "register_model_spec",
]
