"""Start-up rules of ``[float8]`` (parallelisms/float8.py): the config in, one clear error out.

Torch-free (the launcher's pre-flight, engine/setup/preflight.py, runs them before any rank starts):
whether torchao is installed is asked of ``importlib.util.find_spec``, which does not import it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["Float8ConfigError", "float8_weight", "validate_float8"]

INSTALL = 'pip install -e ".[float8]"'
ALIGN = 16  # torch._scaled_mm: both dims of each float8 operand are multiples of 16


def float8_weight(fqn: str, shape: tuple[int, ...], filter_fqns: list[str]) -> bool:
    """The conversion rule of ``[float8]`` for one linear (parallelisms/float8.py; the planner reads it
    for the parameters of ``ModelSpec.param_shapes``): ``fqn`` (the linear's fully qualified name)
    contains no non-empty entry of ``filter_fqns``, and its weight ``shape`` is 2-D ``[out, in]`` with
    both dims multiples of 16."""
    if len(shape) != 2 or any(p and p in fqn for p in filter_fqns):
        return False
    return shape[0] % ALIGN == 0 and shape[1] % ALIGN == 0


class Float8ConfigError(ValueError):
    """A ``[float8]`` setting that cannot work with this installation or run."""


def validate_float8(float8_cfg, *, mixed_precision_param: str, dp_shard_degree: int, tp_degree: int = 1,
                    fused_loss: bool = False, tied_embeddings: bool = False) -> None:
    """Refuse what float8 cannot do here, in one line naming the setting, the reason and the fix.

    Args:
        float8_cfg: ``[float8]`` (enable, recipe, fsdp_all_gather).
        mixed_precision_param: ``training.mixed_precision_param``.
        dp_shard_degree: ranks FSDP shards the weights over (dp_shard × cp; 1: no FSDP).
        tp_degree: ``parallelism.tp``.
        fused_loss: ``loss.chunk_tokens > 0`` (the loss multiplies by the output head's weight itself);
        tied_embeddings: ``model.tie_embeddings`` (the output head's weight is the embedding's).

    Raises:
        Float8ConfigError: torchao missing; ``fsdp_all_gather`` with the rowwise recipe, or with
            float8 off, or without FSDP; rowwise with tensor parallel; float8 in the float64
            reference mode; an output head left
            to float8 whose weight the fused loss or the embedding uses directly.
    """
    if not float8_cfg.enable:
        if float8_cfg.fsdp_all_gather:
            raise Float8ConfigError("float8.fsdp_all_gather = true acts on float8 linears, but float8.enable = false. "
                                    "Fix: --float8.enable true, or --float8.fsdp_all_gather false")
        return
    if importlib.util.find_spec("torchao") is None:
        raise Float8ConfigError(f"float8.enable = true needs torchao, which is not installed. Fix: {INSTALL} "
                                "(or --float8.enable false)")
    if float8_cfg.fsdp_all_gather and float8_cfg.recipe != "tensorwise":
        raise Float8ConfigError(
            f'float8.fsdp_all_gather = true with float8.recipe = "{float8_cfg.recipe}": torchao all-gathers '
            "float8 weights with one scale per tensor (the tensorwise recipe); rowwise scales are taken per row "
            'after a high-precision all-gather. Fix: --float8.recipe tensorwise, or --float8.fsdp_all_gather false')
    if float8_cfg.fsdp_all_gather and dp_shard_degree == 1:
        raise Float8ConfigError("float8.fsdp_all_gather = true but no FSDP shards the weights (dp_shard x cp = 1): "
                                "nothing is all-gathered. Fix: --float8.fsdp_all_gather false, or shard with "
                                "--parallelism.dp_shard")
    if float8_cfg.recipe == "rowwise" and tp_degree > 1:
        raise Float8ConfigError(
            f'float8.recipe = "rowwise" with parallelism.tp = {tp_degree}: torchao\'s float8 tensor-parallel styles '
            "are tensorwise only, and a row's scale over a tp-sharded dim would come from the rank's shard (a tp2 "
            "run left one process's numbers at step 1). Fix: --float8.recipe tensorwise, or parallelism.tp = 1")
    head_kept = any(p and p in "output" for p in float8_cfg.filter_fqns)
    if not head_kept and (fused_loss or tied_embeddings):
        why = "the fused loss multiplies by" if fused_loss else "the tied embedding looks up rows of"
        raise Float8ConfigError(
            f"float8.filter_fqns = {list(float8_cfg.filter_fqns)} converts the output head, but {why} its weight "
            "directly, which a float8 linear's weight cannot serve. Fix: add \"output\" to float8.filter_fqns")
    if mixed_precision_param == "float64":
        raise Float8ConfigError(
            'float8.enable = true with training.mixed_precision_param = "float64": torch._scaled_mm has no float64 '
            "output, and the float64 reference mode exists to leave rounding out. Fix: --float8.enable false, or "
            'training.mixed_precision_param = "float32" / "bfloat16"')
