"""``./run_train.sh --dry_run``: the configured run's real model and plan, built without a GPU.

One process joins a fake process group of the run's full world size (``NGPU × NNODES``; torch's
``backend="fake"``, as TorchTitan's dry run), builds rank 0's (and, under pipeline parallel, the last
stage's) real parallelized model on the meta device (engine/planner/real_plan.py), so every rule the
ranks check at start-up and every rule the plan itself enforces runs, and prints the planner's report
for this one layout: per-rank parameter, gradient and optimizer bytes from the real plan's local
shards, activations, communication per mesh dim, bubble, step time, MFU and whether it fits the GPU.
Exit status 0 when it fits, 1 when it does not, 2 on a set-up error (one line).
"""

from __future__ import annotations

import os
import sys
import time

from engine.observe.hardware import GIB, HEADROOM, usable  # torch-free


def _gpu_for(cfg):
    from engine.observe.hardware import GPUS, HardwareError, get_gpu, gpu_from_device_name

    if cfg.job.dry_run_gpu:
        try:
            return get_gpu(cfg.job.dry_run_gpu), "job.dry_run_gpu"
        except HardwareError:
            raise HardwareError(f"job.dry_run_gpu = {cfg.job.dry_run_gpu!r} is not in the hardware table "
                                f"(engine/observe/hardware.py); use one of {', '.join(GPUS)}") from None
    detected = _detected_gpu_name()
    if detected:
        gpu = gpu_from_device_name(detected)
        if gpu is not None:
            return gpu, f"detected {detected}"
    return get_gpu("H100-80GB"), "the default; job.dry_run_gpu chooses"


def _detected_gpu_name() -> str | None:
    if "torch" not in sys.modules:
        return None
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def dry_run(cfg, world_size: int, *, gpus_per_node: int) -> int:
    """Build, check and report (module docstring); returns the exit status."""
    from engine.planner.estimate import estimate
    from engine.observe.hardware import HardwareError
    from engine.planner.layout import Layout
    from engine.planner.memory import MemoryEstimate, state_bytes
    from engine.planner.real_plan import build_real_plan, rank_of
    from engine.planner.report import table

    start = time.perf_counter()
    device_type = "cpu" if cfg.job.device == "cpu" else "cuda"
    from engine.setup.preflight import check_setup

    try:
        gpu, gpu_source = _gpu_for(cfg)
        setup = check_setup(cfg, world_size, device_type)  # every start-up rule, data paths included
        layout = Layout.from_config(cfg, world_size, device_type, setup=setup)
        built = [build_real_plan(cfg, world_size, 0, device_type=device_type, setup=setup)]
        if layout.pp > 1:  # the last stage holds the output head: build one of its ranks too
            dims = built[0].parallel_dims
            built.append(build_real_plan(cfg, world_size, rank_of({"pp": layout.pp - 1}, dims), device_type=device_type,
                                         setup=setup))
    except (ValueError, FileNotFoundError, HardwareError) as error:
        print(f"set-up error: {error}", file=sys.stderr)
        return 2
    est = estimate(layout, gpu, gpus_per_node)
    busiest = max(built, key=lambda r: r.state.total)
    real = busiest.state
    formula = state_bytes(layout, busiest.coords)
    mem = est.memory
    est.memory = MemoryEstimate(real.params, real.grads, real.optimizer, mem.activations, mem.transient,
                                 mem.reduction)
    est.fits = est.memory.total <= gpu.usable_bytes
    seconds = time.perf_counter() - start
    c = cfg
    print(f"dry run: {c.model.name} {c.model.flavor}, {world_size} rank{'s' if world_size > 1 else ''} "
          f"({gpus_per_node} per node), seq_len {layout.seq_len}, global batch {layout.global_batch_size}; "
          f"GPU {gpu.name} ({gpu_source})")
    from engine.planner.float8 import float8_summary

    float8_line = float8_summary(layout, gpu)
    if float8_line:
        print(f"  {float8_line}")
    for r in built:
        print(f"  real plan of rank {r.rank} {r.coords}: {r.state.n_tensors} parameter tensors, "
              f"{r.state.param_elements:,} local parameters of {r.unsharded_param_elements:,} on its stages")
    agree = "equal" if formula == real else f"DIFFER (formula {formula})"
    print(f"  planner formulas vs real plan (rank {busiest.rank}): {agree}")
    for warning in setup.warnings:  # e.g. a seq_len past the model's max_seq_len
        print(f"  warning: {warning}")
    print(table([est.as_dict()]))
    verdict = "fits" if est.fits else "does NOT fit"
    print(f"dry run: {verdict}: {est.memory.total / GIB:.1f} GiB per rank of {gpu.usable_bytes / GIB:.1f} GiB usable "
          f"({gpu.memory_bytes / GIB:.0f} GiB less {HEADROOM:.0%} headroom); "
          f"checked in {seconds:.1f} s")
    if not est.fits:
        print(f"dry run: {fit_hint(est.memory, gpu.memory_bytes)}")
    return 0 if est.fits else 1


def fit_hint(memory, gpu_bytes: int) -> str:
    """What to change when ``memory`` (a planner ``MemoryEstimate``, bytes per rank) exceeds
    ``gpu_bytes``: shard the state over more ranks when parameters + gradients + optimizer state alone
    exceed it (no activation setting helps then), else cut the activations."""
    state = memory.params + memory.grads + memory.optimizer
    if state > gpu_bytes:
        return (f"the parameters, gradients and optimizer state alone need {state / GIB:.1f} GiB per rank: shard "
                "them over more GPUs (a larger world size for parallelism.dp_shard), or add tp or pp "
                "(./scripts/plan.py ranks layouts)")
    return ("try activation_checkpoint.mode = \"full\", a smaller training.local_batch_size, more tp or pp "
            "(./scripts/plan.py ranks layouts)")


def fit_message(cfg, world_size: int, *, gpus_per_node: int, gpu, gpu_bytes: int, gpu_name: str,
                setup=None) -> str | None:
    """The warning line when the planner's per-rank total for ``cfg`` exceeds what a layout may use of
    ``gpu_bytes`` (engine/observe/hardware.py ``usable``), else None.

    Args:
        gpu: the hardware table entry (bandwidths and peak for the estimate); gpu_bytes: the
            device's memory in bytes; gpu_name: as the driver names it; setup: the pre-flight's
            ``SetupPlan`` when the caller has it (else the pre-flight runs again).

    Raises:
        ValueError: what the pre-flight refuses (the launcher has reported it already).
    """
    from engine.planner.estimate import estimate
    from engine.planner.layout import Layout

    m = estimate(Layout.from_config(cfg, world_size, "cuda", setup=setup), gpu, gpus_per_node).memory
    if m.total <= usable(gpu_bytes):
        return None
    return (f"the planner predicts {m.total / GIB:.1f} GiB per GPU (params {m.params / GIB:.1f}, grads "
            f"{m.grads / GIB:.1f}, optimizer {m.optimizer / GIB:.1f}, activations {m.activations / GIB:.1f}, FSDP "
            f"buffers {m.transient / GIB:.1f}; gradient reduction {m.reduction / GIB:.1f}) but {gpu_name} has "
            f"{gpu_bytes / GIB:.1f} GiB ({usable(gpu_bytes) / GIB:.1f} usable, {HEADROOM:.0%} kept for the CUDA "
            f"context, NCCL and fragmentation): expect out-of-memory; {fit_hint(m, gpu_bytes)}")


def fit_warning(cfg, world_size: int, *, gpus_per_node: int, setup=None) -> str | None:
    """:func:`fit_message` for the detected GPU (formulas only: milliseconds, no model is built); None
    when no GPU of the hardware table family is detected. Never raises: advice must not stop a launch."""
    try:
        from engine.observe.hardware import gpu_from_device_name

        name = _detected_gpu_name()
        gpu = gpu_from_device_name(name) if name else None
        if gpu is None:
            return None
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        return fit_message(cfg, world_size, gpus_per_node=gpus_per_node, gpu=gpu, gpu_bytes=gpu_bytes, gpu_name=name,
                           setup=setup)
    except Exception:  # noqa: BLE001 - advice only
        return None


if __name__ == "__main__":  # python -m engine.launch.dry_run --job.config_file X [overrides]
    from engine.config import load_config

    _cfg = load_config(sys.argv[1:])
    _cfg.validate()
    _n = int(os.environ.get("NGPU", "8"))  # WORLD_SIZE from NGPU × NNODES
    sys.exit(dry_run(_cfg, _n * int(os.environ.get("NNODES", "1")), gpus_per_node=_n))
