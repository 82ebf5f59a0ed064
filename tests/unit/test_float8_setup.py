"""``[float8]`` before any rank starts: the pre-flight's refusals, and the planner's float8 reading
(which weights are float8, their all-gather bytes, the float8 peak). One process, no training."""

from __future__ import annotations

import importlib.util

import pytest

from engine.config import load_config
from engine.setup.preflight import check_setup
from tests.extras import require_extra


def _cfg(*argv: str):
    cfg = load_config(["--model.flavor", "debugmodel_tiny", "--job.print_config", "false", *argv])
    cfg.validate()
    return cfg


@pytest.mark.parametrize("argv, world_size, fragments", [
    (["--float8.enable", "true", "--float8.recipe", "rowwise", "--float8.fsdp_all_gather", "true",
      "--parallelism.dp_shard", "2"], 2, ("float8.fsdp_all_gather = true", '"rowwise"', "--float8.recipe tensorwise")),
    (["--float8.enable", "true", "--float8.fsdp_all_gather", "true", "--parallelism.dp_shard", "1",
      "--parallelism.tp", "2"], 2, ("no FSDP shards the weights", "--float8.fsdp_all_gather false")),
    (["--float8.fsdp_all_gather", "true", "--parallelism.dp_shard", "2"], 2,
     ("float8.enable = false", "--float8.enable true")),
    (["--float8.enable", "true", "--training.mixed_precision_param", "float64",
      "--training.mixed_precision_reduce", "float64"], 1, ("float64", "torch._scaled_mm", "--float8.enable false")),
    (["--float8.enable", "true", "--float8.recipe", "rowwise", "--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
     2, ('float8.recipe = "rowwise" with parallelism.tp = 2', "--float8.recipe tensorwise")),
    (["--float8.enable", "true", "--float8.filter_fqns", "router.gate"], 1,
     ("converts the output head", "fused loss", 'add "output" to float8.filter_fqns')),
    (["--float8.enable", "true", "--float8.filter_fqns", "router.gate", "--loss.chunk_tokens", "0",
      "--model.tie_embeddings", "true"], 1, ("tied embedding", 'add "output"')),
])
def test_what_cannot_compose_is_refused_in_one_line(argv, world_size, fragments):
    with pytest.raises(ValueError) as info:
        check_setup(_cfg(*argv), world_size, "cpu", check_data=False)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_float8_without_torchao_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError) as info:
        check_setup(_cfg("--float8.enable", "true"), 1, "cpu", check_data=False)
    assert str(info.value).startswith("float8.enable = true needs torchao") and \
        'pip install -e ".[float8]"' in str(info.value) and "\n" not in str(info.value)
    check_setup(_cfg(), 1, "cpu", check_data=False)  # float8 off: torchao is not asked for


@pytest.mark.parametrize("model, flavor", [("llama", "debugmodel"), ("moe", "debugmodel_tiny")])
def test_planner_float8_weights_are_the_converted_ones(model, flavor):
    """The planner's rule (engine/planner/float8.py) picks exactly the weights the real conversion
    (parallelisms/float8.py, on the meta model) turns into Float8Linear: not the output head, the
    embedding, the router gate or the routed experts."""
    require_extra("torchao")
    from engine.planner.float8 import is_float8_param
    from engine.planner.layout import Layout
    from engine.setup.model_builder import build_meta_model
    from parallelisms.float8 import convert_to_float8

    cfg = _cfg("--model.name", model, "--model.flavor", flavor, "--float8.enable", "true")
    layout = Layout.from_config(cfg, 1, "cpu")
    planned = {p.name[: -len(".weight")] for p in layout.params if is_float8_param(layout, p)}
    converted = set(convert_to_float8(build_meta_model(layout.model_spec, layout.model_args), cfg.float8))
    assert planned == converted and converted, (sorted(planned ^ converted), len(converted))
    assert not any(name == "output" or "gate" in name or ".experts" in name for name in converted), converted
    if model == "moe":  # the shared experts are plain linears: float8
        assert any("shared_experts" in name for name in converted), converted


def test_planner_float8_all_gather_bytes_and_peak():
    """With float8 all-gather each float8 weight crosses dp_shard at 1 byte per element instead of 4
    (float32 here), plus one 4-byte amax all-reduce per weight; float8 matmuls shorten the compute
    time, and MFU is taken against the GPU's float8 peak."""
    from engine.observe.hardware import get_gpu
    from engine.planner.comm import comm_bytes
    from engine.planner.estimate import estimate
    from engine.planner.float8 import float8_flops_per_token, is_float8_param
    from engine.planner.layout import Layout
    from engine.planner.params import padded_numel, rank_params

    base = ("--parallelism.dp_shard", "2", "--float8.enable", "true")
    plain = Layout.from_config(_cfg(*base), 2, "cpu")
    gathered = Layout.from_config(_cfg(*base, "--float8.fsdp_all_gather", "true"), 2, "cpu")
    f8 = [p for p in rank_params(gathered) if is_float8_param(gathered, p.spec)]
    f8_elements = sum(padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size) for p in f8)
    before, after = comm_bytes(plain)["dp_shard_cp"], comm_bytes(gathered)["dp_shard_cp"]
    gathers = 2  # one forward, one backward per step: every block but the last resharded ...
    saved = before["kinds"]["all_gather"] - after["kinds"]["all_gather"]
    last_block = [p for p in f8 if p.unit == max((q.unit for q in f8), key=lambda u: int(u.split(".")[1]))]
    last = sum(padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size) for p in last_block)
    assert saved == 3 * (gathers * f8_elements - last), (saved, f8_elements, last)  # ... the last block once
    assert after["kinds"]["all_reduce"] - before["kinds"]["all_reduce"] == 4 * len(f8)

    h100 = get_gpu("H100-80GB")
    off = estimate(Layout.from_config(_cfg("--parallelism.dp_shard", "2"), 2, "cpu"), h100, 8)
    on = estimate(plain, h100, 8)
    share = float8_flops_per_token(plain) / on.layout.model_spec.get("flops_per_token")(plain.model_args, plain.seq_len)
    assert 0 < share < 1
    ratio = h100.peak_flops / h100.float8_peak_flops  # 989 / 1979 TFLOP/s
    assert on.compute_s == pytest.approx(off.compute_s * (1 - share + share * ratio), rel=1e-9)
    assert on.mfu == pytest.approx(off.mfu * off.step_time_s / on.step_time_s * ratio, rel=1e-9)


def test_planner_holds_float8_gathered_weights_at_one_byte():
    """Under float8 all-gather each FSDP unit's gathered copy holds its float8 weights at 1 byte per
    element instead of the parameter dtype's (engine/planner/float8.py): both phases of the peak shrink
    by exactly that, in the loss phase's two gathered units and in every unit's reduction; float8
    without all-gather leaves the planned memory as it is. (tests/integration/test_planner_runs.py checks both
    layouts against measured CPU runs: fsdp2 with float8 peaks exactly where it does without.)"""
    import math

    from engine.planner.float8 import is_float8_param
    from engine.planner.layout import Layout
    from engine.planner.memory import peak_nonstate_bytes, transient_bytes
    from engine.planner.params import padded_numel, rank_params
    from engine.planner.reduction import rank_units, reduction_bytes

    base = ("--parallelism.dp_shard", "2", "--training.local_batch_size", "4")
    plain = Layout.from_config(_cfg(*base), 2, "cpu")
    f8 = Layout.from_config(_cfg(*base, "--float8.enable", "true"), 2, "cpu")
    gathered = Layout.from_config(_cfg(*base, "--float8.enable", "true", "--float8.fsdp_all_gather", "true"), 2, "cpu")
    assert peak_nonstate_bytes(f8) == peak_nonstate_bytes(plain) and reduction_bytes(f8) == reduction_bytes(plain)
    pb = plain.param_bytes
    units, units_f8 = rank_units(f8), rank_units(gathered)
    saved = {}
    for name, u in units.items():
        f8_params = [p for p in rank_params(gathered) if p.unit == name and is_float8_param(gathered, p.spec)]
        assert u.gathered - units_f8[name].gathered == sum(math.prod(p.tp_local) for p in f8_params) * (pb - 1)
        saved[name] = sum(padded_numel(p.tp_local, p.fsdp_dim, p.fsdp_size) for p in f8_params) * (pb - 1)
    assert saved["root"] == 0 and all(saved[n] > 0 for n in saved if n != "root")
    # The loss phase's gathered units are the root and the last block.
    last = max((n for n in saved if n != "root"), key=lambda n: int(n.split(".")[1]))
    assert transient_bytes(f8) - transient_bytes(gathered) == saved[last]
    assert reduction_bytes(gathered) < reduction_bytes(f8)


def test_logged_mfu_divides_by_the_peak_the_planner_uses(tmp_path, caplog):
    """The trainer's MFU (engine/observe/metrics.py) with float8 on divides by the GPU's float8 peak, the
    planner's rule (``GPU.mfu_peak_flops``); a GPU without float8 matmuls, float8 off, or
    metrics.peak_tflops keep their peak; the first log line says which peak it is."""
    import logging

    from engine.observe.flops import compute_mfu, get_peak_flops
    from engine.observe.hardware import get_gpu
    from engine.observe.metrics import MetricsLogger

    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    assert get_peak_flops("cuda", h100, 0.0, float8=True) == get_gpu("H100-80GB").float8_peak_flops == 1979e12
    assert get_peak_flops("cuda", h100, 0.0) == get_gpu("H100-80GB").peak_flops == 989e12
    assert get_peak_flops("cuda", a100, 0.0, float8=True) == get_peak_flops("cuda", a100, 0.0) == 312e12
    assert get_peak_flops("cuda", h100, 500.0, float8=True) == 500e12  # the user's number wins
    assert get_peak_flops("cpu", None, 0.0, float8=True) is None
    # Planner and trainer: the same MFU for the same achieved FLOP/s.
    gpu = get_gpu("H100-80GB")
    achieved = 3e14  # FLOP/s per device
    assert compute_mfu(achieved, 1.0, get_peak_flops("cuda", h100, 0.0, float8=True)) == \
        pytest.approx(100 * achieved / gpu.mfu_peak_flops(True), rel=1e-12)

    cfg = _cfg().metrics
    with caplog.at_level(logging.INFO, logger="quadra"):
        logger = MetricsLogger(cfg, str(tmp_path), rank=0, is_logging_rank=True, flops_per_token=1.0,
                               training_steps=1, device="cpu", float8=True)
    assert logger.peak_flops is None and "MFU against" not in caplog.text  # CPU: n/a
    cfg.peak_tflops = 123.0
    with caplog.at_level(logging.INFO, logger="quadra"):
        logger = MetricsLogger(cfg, str(tmp_path), rank=0, is_logging_rank=True, flops_per_token=1.0,
                               training_steps=1, device="cpu", float8=True)
    assert logger.peak_flops == 123e12 and "MFU against 123.0 TFLOPS per device (metrics.peak_tflops)" in caplog.text


def test_float8_tp_styles_replace_the_familys_on_float8_linears():
    """parallelisms/float8.py ``float8_tp_plan`` (used where the backend all-gathers float8, i.e. on
    CUDA): each Colwise/RowwiseParallel of a Float8Linear becomes torchao's float8 style with the same
    layouts, each block input's PrepareModuleInput the float8 one; the output head (high precision)
    and the embedding keep the family's styles."""
    require_extra("torchao")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput,
    )

    from engine.planner.layout import Layout
    from engine.setup.model_builder import build_meta_model
    from models.common.parallelize import llama_tp_plan
    from parallelisms.float8 import convert_to_float8, float8_tp_plan

    cfg = _cfg("--float8.enable", "true")
    layout = Layout.from_config(cfg, 1, "cpu")
    model = build_meta_model(layout.model_spec, layout.model_args)
    convert_to_float8(model, cfg.float8)
    plan = llama_tp_plan(model, sequence_parallel=True, loss_parallel=True)
    swapped = float8_tp_plan(plan)
    outer, block = swapped[0][1], swapped[1][1]
    assert type(outer["output"]) is ColwiseParallel and outer["output"].use_local_output is False
    assert type(block["attention.wq"]) is Float8ColwiseParallel
    assert type(block["feed_forward.w2"]) is Float8RowwiseParallel
    assert type(block["attention"]) is PrepareFloat8ModuleInput is type(block["feed_forward"])
    for name, style in plan[1][1].items():  # same layouts as the family's style
        new = block[name]
        assert all(getattr(new, k) == v for k, v in vars(style).items()), name
    assert sum(isinstance(s, (Float8ColwiseParallel, Float8RowwiseParallel)) for _, p in swapped[1:]
               for s in p.values()) == 7 * layout.model_args.n_layers
    assert not any(isinstance(s, (Float8ColwiseParallel, Float8RowwiseParallel)) for s in outer.values())
    family_wo = plan[1][1]["attention.wo"]  # the family's plan is not changed in place
    assert type(family_wo) is RowwiseParallel and not isinstance(family_wo, Float8RowwiseParallel)


def test_the_plan_says_float8_is_on_and_warns_where_the_gpu_has_no_float8():
    """engine/planner/float8.py ``float8_summary``, printed by ./run_train.sh --dry_run and scripts/plan.py:
    the float8 weights, float8 all-gather and the peak MFU divides by; a warning on a GPU without float8
    matmuls; nothing with float8 off."""
    from engine.observe.hardware import get_gpu
    from engine.planner.float8 import float8_summary, is_float8_param
    from engine.planner.layout import Layout

    on = Layout.from_config(_cfg("--parallelism.dp_shard", "2", "--float8.enable", "true",
                                 "--float8.fsdp_all_gather", "true"), 2, "cpu")
    weights = sum(1 for p in on.params if is_float8_param(on, p))
    line = float8_summary(on, get_gpu("H100-80GB"), search=True)
    assert line == (f"float8 tensorwise: {weights} weights' matmuls at the float8 peak, weights all-gathered in "
                    "float8 (1 byte per element); MFU against the float8 peak, 1979 TFLOPS; only FSDP layouts are "
                    "candidates (float8.fsdp_all_gather)"), line
    assert float8_summary(on, get_gpu("A100-80GB")).startswith("warning: float8.enable = true, but the GPU table "
                                                                "has no float8 peak for A100-80GB")
    assert float8_summary(Layout.from_config(_cfg(), 1, "cpu"), get_gpu("H100-80GB")) is None
