"""From ``[model]`` settings to parallelized, initialized model parts.

Steps: resolve the flavor's arguments and check them against the
tokenizer and ``seq_len`` (cheap, so every rank fails fast on bad input) → build on the meta device
(no memory) → parallelize (the model's own plan) → ``to_empty`` on the real device → ``init_weights``
with a layout-independent seed, so every layout starts from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.registry import ModelSpec, load_ref, resolve_model_args  # noqa: F401  (re-exported)


def build_meta_model(spec: ModelSpec, args) -> nn.Module:
    """The whole model on the meta device: shapes only, no memory, no initialization."""
    with torch.device("meta"):
        return load_ref(spec.model_cls)(args)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate a (parallelized) meta model on ``device`` and initialize it from ``seed``.

    Initialization draws each parameter from a generator keyed by (seed, parameter name), so the
    weights do not depend on sharding or on which layers a pipeline stage holds.
    """
    model.to_empty(device=device)
    model.init_weights(seed=seed, buffer_device=device)
    model.train()
    return model


def build_model_parts(spec: ModelSpec, args, *, plan, parallelize, device: torch.device, seed: int):
    """The model parts this rank trains, parallelized and initialized.

    Args:
        spec, args: from :func:`resolve_model_args`.
        plan: a ``PipelinePlan`` (this rank's stages), or None for the whole model as one part.
        parallelize: ``part -> None``, the model's plan with its settings bound (TP, CP, AC, compile,
            FSDP/DDP), applied to every part on the meta device before allocation.
        device: where the parts live; seed: initialization seed (``training.seed``).

    Returns:
        (parts, nparams, flops_per_token): FLOPs and parameters of the *whole* model, since MFU
        divides by every device that shares a sample (pipeline ranks included).
    """
    from parallelisms.pipeline import build_stage_module

    model = build_meta_model(spec, args)
    nparams, flops_per_token = args.get_nparams_and_flops(model, args.max_seq_len)
    if plan is None:
        parts = [model]
    else:
        last = plan.num_stages - 1
        parts = [build_stage_module(model, plan.stage_layers[s], s == 0, s == last) for s in plan.local_stages]
    for part in parts:
        parallelize(part)
        materialize(part, device, seed)
    return parts, nparams, flops_per_token
