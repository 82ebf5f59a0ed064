"""Float8 training through torchao (``torchao.float8``): linears that multiply in float8, composed with
FSDP2, tensor, pipeline and context parallel.

Float8 linear layers (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433)
cast the input, the weight and, in backward, the output gradient to float8 (e4m3 forward, e5m2 for
gradients) with a dynamic scale ``448 / amax`` and multiply with ``torch._scaled_mm``; the weights the
optimizer updates, and the checkpoints, stay in high precision. torchao's recipes
(``Float8LinearConfig.from_recipe_name``): ``tensorwise`` (one scale per tensor) and ``rowwise`` (one
scale per row, power-of-2 rounded). The library's own guide: torchao/float8/README.md.

Order in the rank build (engine/setup/model_builder.py), as in TorchTitan's model converters: the model
on the meta device → :func:`convert_to_float8` (``nn.Linear`` → ``Float8Linear``, same parameter names
and shapes) → pipeline stages → the parallelize driver (parallelisms/parallelize.py), which swaps the
family's tensor-parallel styles for the float8 ones (:func:`float8_tp_plan`) → FSDP2.

Which linears: every ``nn.Linear`` whose fully qualified name contains none of ``[float8]
filter_fqns`` (default: the output head ``output`` and the MoE router ``router.gate``: the logits and
the routing decision are the most rounding-sensitive products) and whose weight's two dims are both
multiples of 16 (``torch._scaled_mm``'s requirement); a linear that fails either test stays in high
precision. Routed MoE experts are stacked ``[E, ...]`` weights, not ``nn.Linear``: left alone.

Distributed scales: a scale must come from the whole tensor, not one rank's shard, or ranks quantize
one tensor differently. torchao reduces ``amax`` over the mesh a DTensor lives on. FSDP's float8
all-gather (``enable_fsdp_float8_all_gather``) casts each rank's shard with a scale that
:func:`precompute_float8_scales` computes over every mesh dim of the weight (dp_shard and tp) in one
all-reduce; the runner (engine/train/runner.py) calls it before the first step (after a checkpoint
load) and after every optimizer step. Without it torchao would reduce over the FSDP group only, which
under FSDP × TP is one tp shard's amax, and a scale left from before the step would be stale. The
float8 tensor-parallel styles cast DTensor activations with the amax reduced over tp; where the
backend cannot all-gather float8 (gloo) the family's styles stay, and the float8 linears cast the
all-gathered activation themselves: the same amax, the same float8 values.

torchao is imported only inside these functions: importing it loads its C++ extensions, which a run
with float8 off does not need.
"""

from __future__ import annotations

import torch.nn as nn

from parallelisms.float8_checks import float8_weight

__all__ = ["PRECOMPUTE_ATTR", "convert_to_float8", "float8_module_filter", "float8_tp_plan",
           "precompute_float8_scales", "torchao_float8"]

# Set on a model part whose float8 weights are all-gathered in float8 (engine/train/runner.py reads it).
PRECOMPUTE_ATTR = "float8_precompute_scales"


def float8_module_filter(filter_fqns: list[str]):
    """The rule of the module docstring as torchao's ``module_filter_fn``: ``(module, fqn) -> bool``,
    True for an ``nn.Linear`` to convert (no entry of ``filter_fqns`` is a substring of its fully
    qualified name, and its weight ``[out, in]`` has ``out % 16 == in % 16 == 0``)."""
    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and float8_weight(fqn, tuple(module.weight.shape), filter_fqns)

    return keep


def torchao_float8():
    """``torchao.float8``, imported with the warnings of torchao's import silenced (its CUDA-only C++
    extensions fail to load on other machines; torch warns about an Enum it registers): the run
    needs neither, and its log stays readable.

    Raises:
        ImportError: torchao is not installed (``pip install -e ".[float8]"``; the pre-flight refuses
            ``float8.enable`` without it, parallelisms/float8_checks.py).
    """
    import importlib
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.float8")
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _linear_config(float8_cfg):
    """torchao's ``Float8LinearConfig`` of ``[float8]``: the recipe, plus FSDP's float8 all-gather."""
    import dataclasses

    config = torchao_float8().Float8LinearConfig.from_recipe_name(float8_cfg.recipe)
    if float8_cfg.fsdp_all_gather:  # tensorwise only (parallelisms/float8_checks.py refuses rowwise)
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convert_to_float8(model: nn.Module, float8_cfg) -> list[str]:
    """Swap the chosen ``nn.Linear`` modules of ``model`` (any device, meta included) for torchao's
    ``Float8Linear`` in place (``torchao.float8.convert_to_float8_training``); parameter names, shapes
    and dtypes do not change, so checkpoints and initialization are those of the high-precision model.

    Args:
        model: a model or pipeline stage, before any parallelism is applied.
        float8_cfg: ``[float8]`` (recipe, filter_fqns, fsdp_all_gather).

    Returns:
        The fully qualified names of the converted linears, in module order.
    """
    keep = float8_module_filter(list(float8_cfg.filter_fqns))
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    torchao_float8().convert_to_float8_training(model, config=_linear_config(float8_cfg), module_filter_fn=keep)
    return chosen


def float8_tp_plan(plan: list) -> list:
    """A family's tensor-parallel plan (parallelisms/tensor_parallel.py ``TensorParallelPlan``) with
    torchao's float8 styles where they apply: ``ColwiseParallel`` / ``RowwiseParallel`` of a
    ``Float8Linear`` become ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, and a
    ``PrepareModuleInput`` of a module whose linears are all ``Float8Linear`` becomes
    ``PrepareFloat8ModuleInput``: the activation is cast once, with its amax reduced over tp, and
    all-gathered in float8 (tensorwise recipe only; torchao's float8 TP styles assume one scale per
    tensor). Other styles and high-precision linears keep the family's style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput,
    )

    def swap(module: nn.Module, name: str, style):
        target = module.get_submodule(name) if name else module
        if type(style) is ColwiseParallel and isinstance(target, Float8Linear):
            return _copy_style(style, Float8ColwiseParallel())
        if type(style) is RowwiseParallel and isinstance(target, Float8Linear):
            return _copy_style(style, Float8RowwiseParallel())
        if type(style) is PrepareModuleInput:
            linears = [m for m in target.modules() if isinstance(m, nn.Linear)]
            if linears and all(isinstance(m, Float8Linear) for m in linears):
                return _copy_style(style, PrepareFloat8ModuleInput())
        return style

    out = []
    for module, styles in plan:
        if isinstance(styles, dict):
            out.append((module, {name: swap(module, name, style) for name, style in styles.items()}))
        else:
            out.append((module, swap(module, "", styles)))
    return out


def _copy_style(source, target):
    """``target`` (a float8 subclass of ``source``'s style) with ``source``'s layouts and options."""
    for key, value in vars(source).items():
        setattr(target, key, value)
    return target


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After the optimizer step, the float8 scales of every FSDP-sharded float8 weight in one all-reduce
    (``torchao.float8.precompute_float8_dynamic_scale_for_fsdp``), for the next forward's float8
    all-gather. Only parts whose ``PRECOMPUTE_ATTR`` attribute is true (set by the rank build with
    ``fsdp_all_gather``) are visited, so a run without float8 never imports torchao."""
    marked = [part for part in model_parts if getattr(part, PRECOMPUTE_ATTR, False)]
    if not marked:
        return
    float8 = torchao_float8()
    for part in marked:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
