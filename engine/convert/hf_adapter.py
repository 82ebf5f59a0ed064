"""The family adapter for a Hugging Face checkpoint, found through the model registry (torch-free).

Each family's ``ModelSpec.hf_adapter`` (models/<family>/hf.py, built on models/common/hf.py) knows its
``config.json`` fields, weight names and layouts; this module only picks the family and turns an
adapter's refusal (``models.common.hf.HFConfigError``) into a one-line :class:`CheckpointError`.
engine/convert/hf.py does the file work.
"""

from __future__ import annotations

from contextlib import contextmanager

from engine.checkpoint.files import CheckpointError

__all__ = ["args_from_hf_config", "hf_config_from_args", "weight_rules", "generation_config", "args_for_weights"]


@contextmanager
def _as_checkpoint_error():
    try:
        yield
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(str(error)) from None


def _adapter(name: str):
    from models.registry import get_model_spec

    spec = get_model_spec(name)
    if spec.hf_adapter is None:
        raise CheckpointError(f"model {name}: this family has no Hugging Face equivalent (its ModelSpec gives no "
                              "hf_adapter)")
    return spec.get("hf_adapter")


def args_from_hf_config(config: dict, where: str = "config.json"):
    """(model.name, model arguments) for a Hugging Face ``config.json`` (a dict).

    Raises:
        CheckpointError: a ``model_type`` no family reads, or what the family's adapter refuses
            (a feature its model lacks, a missing field), naming the field.
    """
    import models  # noqa: F401  (registers the built-in families)
    from models.registry import hf_spec_for_model_type

    with _as_checkpoint_error():
        spec = hf_spec_for_model_type(config.get("model_type"), where)
        return spec.name, spec.get("hf_adapter").args_from_config(config, where)


def hf_config_from_args(name: str, args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """The ``config.json`` of Quadra model ``name`` (``model.name``) with ``args`` for
    ``transformers.AutoModelForCausalLM``; dtype: of the weights written; bos_id/eos_id: the
    tokenizer's, or None.

    Raises:
        CheckpointError: a model Hugging Face cannot express (the family's adapter says why).
    """
    with _as_checkpoint_error():
        return _adapter(name).config_from_args(args, dtype=dtype, bos_id=bos_id, eos_id=eos_id)


def args_for_weights(name: str, args, weight_names: set[str]):
    """The model arguments of a checkpoint's weights (``HFAdapter.args_for_weights``; ``args``
    unchanged when the family gives none).

    Raises:
        CheckpointError: weights the family cannot read as any model of ``args``'s kind.
    """
    adapter = _adapter(name)
    if adapter.args_for_weights is None:
        return args
    with _as_checkpoint_error():
        return adapter.args_for_weights(args, weight_names)


def weight_rules(name: str, args) -> list:
    """The family's ``models.common.hf.Rule`` list: every weight with its Hugging Face source(s), in Hugging
    Face's order.

    Raises:
        CheckpointError: a model whose weights have no Hugging Face equivalent.
    """
    with _as_checkpoint_error():
        return _adapter(name).weight_rules(args)


def generation_config(config: dict) -> dict:
    """``generation_config.json``: the special ids of ``config`` (greedy decoding by default)."""
    return {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
            "_from_model_config": True}
