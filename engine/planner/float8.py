"""The planner's view of ``[float8]`` (parallelisms/float8.py): which weights are float8, their
all-gather bytes under FSDP's float8 all-gather, and the share of the step's FLOPs in float8 matmuls.

Torch-free. The conversion rule is parallelisms/float8_checks.py ``float8_weight``, read here on the
family's parameter list (``ModelSpec.param_shapes``): a 2-D weight of a linear (``<fqn>.weight``, not
a norm, not a routed expert, not the token embedding) whose name no ``float8.filter_fqns`` entry
matches and whose dims are multiples of 16.

- FSDP all-gather with ``float8.fsdp_all_gather``: 1 byte per element of a float8 weight instead of
  ``training.mixed_precision_param``'s bytes; its scale travels as all-gather metadata, and the scales
  of all float8 weights are computed in one all-reduce of one float32 amax per weight after the
  optimizer step (torchao ``precompute_float8_dynamic_scale_for_fsdp``).
- Memory: the gathered copy of a float8 weight under float8 all-gather is 1 byte per element
  (:func:`gathered_bytes_per_element`); state, gradients and saved activations stay high precision.
- FLOPs: each float8 weight's 6 FLOPs per token (forward and both backward matmuls, PaLM App. B) run
  at the GPU's float8 peak (engine/observe/hardware.py); the rest at its bf16 peak.
"""

from __future__ import annotations

from parallelisms.float8_checks import float8_weight

FLOAT8_BYTES, SCALE_BYTES = 1, 4


def is_float8_param(layout, spec) -> bool:
    """Whether the parameter ``spec`` (a ``models.common.planning.ParamSpec``) is a float8 linear's weight."""
    f8 = layout.cfg.float8
    if not f8.enable or spec.expert or spec.norm or not spec.name.endswith(".weight"):
        return False
    fqn = spec.name[: -len(".weight")]
    return "embed" not in fqn and float8_weight(fqn, tuple(spec.shape), list(f8.filter_fqns))


def float8_all_gather(layout) -> bool:
    """Whether FSDP all-gathers float8 weights (float8 on with ``fsdp_all_gather``, FSDP sharding)."""
    return layout.cfg.float8.enable and layout.cfg.float8.fsdp_all_gather and layout.fsdp > 1


def gathered_bytes_per_element(layout, spec) -> int:
    """Bytes per element of the parameter ``spec`` as FSDP all-gathers it for compute: 1 for a float8
    weight under float8 all-gather (torchao's ``fsdp_post_all_gather`` hands the module a float8
    tensor, which the float8 matmul uses as is and autograd saves for backward), else
    ``training.mixed_precision_param``'s bytes. Without float8 all-gather the gathered weight is high
    precision and its float8 copies live inside one matmul each (torchao's ``Float8Linear`` saves the
    high-precision input and weight for backward), below the planner's resolution: measured on CPU,
    the peak of a float8 fsdp2 run equals the same run's without float8 (tests/integration/test_planner_runs.py)."""
    return FLOAT8_BYTES if float8_all_gather(layout) and is_float8_param(layout, spec) else layout.param_bytes


def float8_flops_per_token(layout) -> float:
    """Training FLOPs per token of the whole model's float8 matmuls: 6 × the float8 weights' elements."""
    if not layout.cfg.float8.enable:
        return 0.0
    return 6.0 * sum(p.numel for p in layout.params if is_float8_param(layout, p))


def float8_summary(layout, gpu, *, search: bool = False) -> str | None:
    """One line for the plan's reader on what ``[float8]`` changes, or None when it is off: the recipe,
    how many weights' matmuls run at the float8 peak, float8 all-gather, and that MFU divides by the
    float8 peak (engine/observe/hardware.py ``GPU.mfu_peak_flops``); a warning instead when ``gpu`` has
    no float8 matmuls (no float8 peak in the table: torch's ``_scaled_mm`` needs an Ada, Hopper or
    Blackwell GPU). ``search``: the planner's search, which keeps only FSDP layouts under float8
    all-gather (it needs FSDP's shards)."""
    f8 = layout.cfg.float8
    if not f8.enable:
        return None
    if not gpu.float8_peak_flops:
        return (f"warning: float8.enable = true, but the GPU table has no float8 peak for {gpu.name} (no float8 "
                "matmuls before Ada / Hopper): planned at the bf16 peak, and torchao's float8 will not run there")
    weights = sum(1 for p in layout.params if is_float8_param(layout, p))
    gather = ", weights all-gathered in float8 (1 byte per element)" if f8.fsdp_all_gather else ""
    only_fsdp = "; only FSDP layouts are candidates (float8.fsdp_all_gather)" if search and f8.fsdp_all_gather else ""
    return (f"float8 {f8.recipe}: {weights} weights' matmuls at the float8 peak{gather}; MFU against the float8 "
            f"peak, {gpu.float8_peak_flops / 1e12:.0f} TFLOPS{only_fsdp}")
