"""The noise floor of a precision that is not exact (float8, bfloat16, Muon's bfloat16 Newton-Schulz):
how far two one-process runs of one config drift apart when only the order of floating-point sums
changes, and the tolerance a layout is judged by against it (torch-free).

Why a floor. A float8 or bfloat16 rounding is a step function of its float32 input: another float32
summation order (another layout, another CPU's kernels) moves an input by an ulp, flips some
roundings to the neighbouring value (2^-3 apart in e4m3, 2^-8 in bfloat16), and the following steps
amplify the flips. How far they grow depends on the model, the learning rate, the data and the
machine's kernels, so no fixed number holds everywhere (a float8 tolerance measured on an AVX2 CPU
failed on an AVX-512 one). The floor is measured where the comparison runs, on the same config.

The twins. The floor is the largest difference between the reference and a *twin*: the same run in
another float order, the same arithmetic in exact numbers:

- **reordered sequences** (:data:`REORDER`, any device): ``data.sequence_order_seed`` reorders every
  microbatch's sequences (engine/data/order.py). Every loss term is a sum over sequences and a
  tensorwise float8 scale is an amax (order-free), so the step is the same in exact arithmetic; the
  weight gradients' and the loss's sums over tokens run in another order: the noise of a layout
  that sums over the batch in pieces (FSDP, DDP, accumulation).
- **capped CPU kernels** (:func:`kernel_twin_env`, CPU runs only): ATen's kernels without
  vectorization, MKL's SSE4.2 code path and oneDNN's SSE4.1 one, set in the environment before the
  process starts. The same operators with another blocking of every sum, forward and backward
  included: the noise of a layout that splits a matmul's inner sum (tensor parallel) or attention
  (context parallel), and of another CPU (what a user on an AVX-512 or AMX machine sees against an
  AVX2 one). A process already capped gets the default kernels as its twin.

Tolerance. For step s (1-based) the floor F_s is the largest relative difference of loss or grad
norm between the reference and any twin at any step up to s (a running maximum: a step where the
twins agree by chance does not make a later one strict). A layout passes step s when it is within
``MARGIN x max(F_s, EPSILON)`` of the reference; its final parameters within ``MARGIN x max(P,
EPSILON)``, P the twins' largest parameter difference (max|a - b| / max|b| per tensor). EPSILON,
float32's machine epsilon 2^-23, is the smallest relative difference a float32 value can show: two
twins that agree bitwise still leave one ulp of room. MARGIN = 10: the floor is one or two samples of
a chaotic drift whose size varies about 5x between equivalent orders (measured: three sequence
orders of the float8 test model moved its step-3 grad norm by 7e-5 to 4e-4), so a layout's drift,
another sample, stays below 10x the largest of them, while a real defect moves step 1, which the
twins leave within a few ulps (a float8 weight scale taken from one FSDP shard: 1e-4 at step 1
against a step-1 tolerance of 7e-6 or less).
"""

from __future__ import annotations

MARGIN = 10.0
EPSILON = 2.0 ** -23
REORDER = {"data.sequence_order_seed": 1}
KERNEL_CAP_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                  "ONEDNN_MAX_CPU_ISA": "SSE41"}


def kernel_twin_env(environ=None) -> dict[str, str | None]:
    """The environment changes that start a process on the other CPU kernels: the capped ones
    (:data:`KERNEL_CAP_ENV`), or, where ``environ`` (default ``os.environ``) is capped already
    (``ATEN_CPU_CAPABILITY=default``: a run of scripts/cpu_kernels.sh), the default ones (None: the
    variable removed), so the twin's kernels always differ from the reference's."""
    import os
    import tempfile

    environ = os.environ if environ is None else environ
    capped = environ.get("ATEN_CPU_CAPABILITY") == KERNEL_CAP_ENV["ATEN_CPU_CAPABILITY"]
    twin: dict[str, str | None] = {name: None for name in KERNEL_CAP_ENV} if capped else dict(KERNEL_CAP_ENV)
    # inductor's cache keys miss the kernel choice: code generated for AVX-512 and reused by a capped
    # process fails to build ("'at::vec' has not been declared"), so each choice gets its own cache (a
    # temporary folder; its name only has to differ between the choices: scripts/mutation.sh's
    # mutants of its spelling are equivalent)
    twin["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                   f"quadra-inductor-{'default' if capped else 'capped'}-kernels")
    return twin


def inexact_settings(cfg) -> list[str]:
    """The settings of a job config whose arithmetic is not exact to float32 (what needs a floor),
    as ``section.key = value`` strings; empty when the run computes in float32 or float64.

    Args:
        cfg: a JobConfig (reads ``float8.enable``, ``training.mixed_precision_param`` / ``_reduce``,
            ``optimizer.name`` and ``optimizer.muon_ns_dtype``).
    """
    found = []
    if cfg.float8.enable:
        found.append(f"float8.enable = true ({cfg.float8.recipe})")
    for key in ("mixed_precision_param", "mixed_precision_reduce"):
        if getattr(cfg.training, key) == "bfloat16":
            found.append(f"training.{key} = bfloat16")
    if cfg.optimizer.name.lower() == "muon" and cfg.optimizer.muon_ns_dtype == "bfloat16":
        found.append("optimizer.muon_ns_dtype = bfloat16 (Muon)")
    return found


def history_floor(reference: list[tuple[float, float]], twins: list[list[tuple[float, float]]]) -> list[float]:
    """F_s of the module docstring for every step of ``reference``.

    Args:
        reference, twins: [(loss, grad_norm)] per step (1-based order); a twin shorter than the
            reference leaves the later steps to the earlier ones' maximum.

    Returns:
        [F_1, ..., F_n], non-decreasing, relative (unitless); inf where a value is not finite.
    """
    from engine.parity.compare import relative_difference

    floor, worst = [], 0.0
    for step, (loss, norm) in enumerate(reference):
        for twin in twins:
            if step < len(twin):
                worst = max(worst, relative_difference(twin[step][0], loss), relative_difference(twin[step][1], norm))
        floor.append(worst)
    return floor


def tolerance_of(floor: float) -> float:
    """The relative tolerance a floor allows: ``MARGIN x max(floor, EPSILON)``."""
    return MARGIN * max(floor, EPSILON)


def step_tolerances(floor: list[float]) -> list[float]:
    """Per-step relative tolerances from :func:`history_floor`'s floor."""
    return [tolerance_of(value) for value in floor]
