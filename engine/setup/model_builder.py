"""The one recipe that builds a rank's model: from ``[model]`` settings to parallelized parts.

Steps: meta model (no memory) → float8 linears when ``[float8] enable`` (parallelisms/float8.py) →
this rank's pipeline stages → the shared parallelize driver
(parallelisms/parallelize.py: TP, EP, CP, AC, compile, FSDP/HSDP/DDP) with the family's plan
(models/<family>/parallelize.py) and the run's settings →
``to_empty`` on the real device → ``init_weights`` with a layout-independent seed, so every layout
starts from the same weights. The trainer, the dry run's real plan (engine/planner/real_plan.py, on
the meta device, nothing allocated) and the seed-checkpoint tool (engine/convert/tools.py, one
process, no parallelism) all call :func:`build_model_parts`; what they build from (model arguments,
pipeline plan, batch geometry) is resolved once per process by engine/setup/preflight.py ``check_setup``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from models.registry import ModelSpec, load_ref


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


def build_context_parallel(cfg, parallel_dims):
    """The run's ``ContextParallel`` (parallelisms/context_parallel.py) on the built mesh, or None
    without context parallel."""
    if not parallel_dims.cp_enabled:
        return None
    from parallelisms.context_parallel import ContextParallel

    return ContextParallel(parallel_dims.mesh("cp"), cfg.training.seq_len, cfg.parallelism.cp_load_balance)


def build_model_parts(cfg, spec: ModelSpec, args, *, parallel_dims=None, pp_plan=None, context_parallel=None,
                      global_batch_size: int = 0, backend: str = "gloo", device: torch.device | None = None):
    """The model parts one rank trains, built by the recipe of the module docstring.

    Args:
        cfg: the ``JobConfig`` (its parallelism, activation_checkpoint, compile and training sections
            reach the parallelize driver; ``training.seed`` seeds the weights; ``[float8]`` converts
            the chosen linears).
        spec, args: the family's ``ModelSpec`` and the arguments as trained (``check_setup``).
        parallel_dims: the ``ParallelDims`` with its mesh built, or None: not parallelized (one
            process, e.g. the seed-checkpoint tool).
        pp_plan: this rank's ``PipelinePlan`` (``SetupPlan.pipeline_plan``), or None for the whole
            model as one part.
        context_parallel: from :func:`build_context_parallel`; global_batch_size: sequences per step;
            backend: the collective backend ("nccl", "gloo"); all three go to the parallelize driver.
        device: where the parts are allocated and initialized; None leaves them on the meta device.

    Returns:
        (parts, nparams, flops_per_token): FLOPs and parameters of the *whole* model, since MFU
        divides by every device that shares a sample (pipeline ranks included).
    """
    from parallelisms.parallelize import parallelize
    from parallelisms.pipeline import build_stage_module

    model = build_meta_model(spec, args)
    nparams = sum(p.numel() for p in model.parameters())  # unique: a tied matrix once
    flops_per_token = spec.get("flops_per_token")(args, args.max_seq_len)
    float8 = cfg.float8.enable
    if float8:  # after the meta build, before pipeline split and parallelisms (parallelisms/float8.py)
        from parallelisms.float8 import convert_to_float8

        linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        converted = convert_to_float8(model, cfg.float8)
        logging.getLogger("quadra").info(
            "float8 %s%s: %d of %d linears run their matmuls in float8 (torchao Float8Linear); the others stay in "
            "high precision (float8.filter_fqns, a dim not divisible by 16)", cfg.float8.recipe,
            " with FSDP all-gather in float8" if cfg.float8.fsdp_all_gather else "", len(converted), linears)
    if pp_plan is None:
        parts = [model]
    else:
        last = pp_plan.num_stages - 1
        parts = [build_stage_module(model, pp_plan.stage_layers[s], s == 0, s == last) for s in pp_plan.local_stages]
        del model
    plan = load_ref(spec.parallelize_plan) if parallel_dims is not None else None
    t = cfg.training
    for part in parts:
        if plan is not None:
            parallelize(part, parallel_dims, plan, parallelism_cfg=cfg.parallelism, ac_cfg=cfg.activation_checkpoint,
                        compile_cfg=cfg.compile, param_dtype=t.mixed_precision_param,
                        reduce_dtype=t.mixed_precision_reduce, context_parallel=context_parallel,
                        global_batch_size=global_batch_size, backend=backend,
                        float8_tensorwise=float8 and cfg.float8.recipe == "tensorwise")
        if float8 and cfg.float8.fsdp_all_gather:  # runner.post_optimizer_step precomputes its scales
            from parallelisms.float8 import PRECOMPUTE_ATTR

            setattr(part, PRECOMPUTE_ATTR, True)
        if device is not None:
            materialize(part, device, t.seed)
        if hasattr(part, "mtp_weight"):  # a model with multi-token prediction: [loss] mtp_weight
            part.mtp_weight = cfg.loss.mtp_weight
    if plan is not None and cfg.compile.enable:
        from parallelisms.compile import compile_summary

        logging.getLogger("quadra").info(compile_summary(parts, cfg.compile.backend, cfg.parallelism.cp))
    return parts, nparams, flops_per_token
