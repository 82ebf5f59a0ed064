"""engine/observe/metrics.py, console.py and flops.py: console line, jsonl, TensorBoard, MFU, peak FLOPS."""

import json
import logging
import os
import re
import types

import pytest
import torch

from engine.observe.flops import compute_mfu, compute_tflops, get_peak_flops, lookup_peak_tflops
from engine.observe.console import format_duration, init_logging
from engine.observe.metrics import MetricsLogger, device_memory_stats


def _cfg(**overrides):
    values = dict(log_freq=2, enable_tensorboard=True, save_tb_folder="tb", peak_tflops=0.0, log_all_ranks=False)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _logger(tmp_path, **kw):
    args = dict(rank=0, is_logging_rank=True, flops_per_token=6e6, training_steps=10)
    cfg = kw.pop("cfg", _cfg())
    args.update(kw)
    return MetricsLogger(cfg, str(tmp_path), **args)


# Dense bf16 tensor-core peak = SMs x dense FLOPs per clock per SM x boost clock, from NVIDIA's
# architecture whitepapers (A100: 108 SMs, 2048 FLOP/clk/SM, 1.41 GHz; H100 SXM5 and H200: 132 SMs,
# 4096 FLOP/clk/SM, 1.83 GHz; H100 PCIe: 114 SMs, 1.62 GHz): the table must agree within 0.5 %.
@pytest.mark.parametrize("name, sms, flops_per_clock, ghz", [
    ("NVIDIA A100-SXM4-80GB", 108, 2048, 1.41),
    ("NVIDIA A100 80GB PCIe", 108, 2048, 1.41),
    ("NVIDIA H100 80GB HBM3", 132, 4096, 1.83),
    ("NVIDIA H200", 132, 4096, 1.83),
    ("NVIDIA H100 PCIe", 114, 4096, 1.62),
])
def test_peak_tflops_follow_the_chip(name, sms, flops_per_clock, ghz):
    assert lookup_peak_tflops(name) == pytest.approx(sms * flops_per_clock * ghz / 1e3, rel=5e-3)


def test_peak_table_patterns_cannot_shadow_each_other():
    """First match wins, so a pattern that occurs inside a later one ("H100" in "H100 NVL") must come
    after it; and a GPU name matches only whole tokens."""
    from engine.observe.flops import PEAK_BF16_TFLOPS

    patterns = [pattern for pattern, _ in PEAK_BF16_TFLOPS]
    assert len(set(patterns)) == len(patterns)
    for i, earlier in enumerate(patterns):
        for later in patterns[i + 1:]:
            assert lookup_peak_tflops(f"NVIDIA {later}") == dict(PEAK_BF16_TFLOPS)[later], (earlier, later)
    assert lookup_peak_tflops("NVIDIA RTX A4000") is None  # not "A40"
    assert lookup_peak_tflops("NVIDIA GB200") == dict(PEAK_BF16_TFLOPS)["GB200"]  # not "B200"
    assert lookup_peak_tflops("Tesla V100-SXM2-16GB") is None  # no bf16 tensor cores


def test_get_peak_flops(caplog):
    assert get_peak_flops("cuda", "NVIDIA H100 80GB HBM3", 0.0) == 989e12
    assert get_peak_flops("cpu", None, 0.0) is None
    assert get_peak_flops("cpu", None, 2.5) == 2.5e12  # override wins everywhere
    assert get_peak_flops("cuda", "NVIDIA H100 PCIe", 100.0) == 100e12
    assert get_peak_flops("cuda", "Mystery GPU", 0.0) is None
    assert "metrics.peak_tflops" in caplog.text
    with pytest.raises(ValueError, match="metrics.peak_tflops=-1"):
        get_peak_flops("cuda", "NVIDIA H200", -1)


def test_mfu_math():
    # 1e9 FLOPs/token * 1e5 token/s = 1e14 FLOP/s = 100 TFLOPS = 10% of a 1000-TFLOPS device.
    assert compute_tflops(1e9, 1e5) == pytest.approx(100.0)
    assert compute_mfu(1e9, 1e5, 1000e12) == pytest.approx(10.0)
    assert compute_mfu(1e9, 1e5, None) is None


def test_format_duration():
    assert format_duration(83.4) == "0:01:23"
    assert format_duration(90000) == "25:00:00"


def test_cpu_memory_is_max_rss():
    stats = device_memory_stats("cpu")
    assert list(stats) == ["mem_max_rss_gib"]
    assert 0.01 < stats["mem_max_rss_gib"] < 1024  # a Python process with torch: tens of MiB+


def test_cuda_path_with_faked_allocator(tmp_path, monkeypatch, caplog):
    """No GPU here: fake torch.cuda's query functions to check the CUDA branch end to end."""
    caplog.set_level(logging.INFO, logger="quadra")
    resets = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 2})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    log = _logger(tmp_path, cfg=_cfg(enable_tensorboard=False), device="cuda:0", flops_per_token=1e9)
    assert log.peak_flops == 989e12
    log.record_step(tokens=98_900, step_seconds=1.0)
    record = log.log(1, {"loss": 3.0})
    log.close()
    # 1e9 * 98,900 tok/s = 98.9 TFLOPS = 10% of 989.
    assert record["mfu_pct"] == pytest.approx(10.0)
    assert record["mem_peak_allocated_gib"] == 3.0 and record["mem_peak_reserved_gib"] == 4.5
    assert record["mem_alloc_retries"] == 2.0
    assert len(resets) == 2  # at construction and after the interval's read
    line = caplog.records[-1].getMessage()
    assert "mfu: 10.00%  mem: 4.50GiB" in line, line


def test_console_line_jsonl_and_tensorboard(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="quadra")
    log = _logger(tmp_path, devices_per_dp_rank=2)
    assert log.peak_flops is None  # CPU without override
    assert [s for s in range(1, 11) if log.should_log(s)] == [1, 2, 4, 6, 8, 10]
    for _ in range(2):
        log.record_step(tokens=4000, step_seconds=1.0, data_seconds=0.05)
    record = log.log(2, {"loss": torch.tensor(5.43214), "grad_norm": 1.23, "lr": 8e-4})

    # 8000 tokens / 2 s / 2 devices per dp rank = 2000 tok/s/dev; 6e6 * 2000 = 0.012 TFLOPS.
    assert record["tok_per_s_per_dev"] == pytest.approx(2000)
    assert record["tflops_per_dev"] == pytest.approx(0.012)
    assert record["mfu_pct"] is None
    assert record["data_pct"] == pytest.approx(5.0)
    assert record["eta_s"] == pytest.approx(8.0)  # 1 s/step * 8 remaining steps
    line = caplog.records[-1].getMessage()
    assert re.fullmatch(
        r"step: 2  loss: 5\.4321  grad_norm: 1\.2300  lr: 8\.0000e-04  tok/s/dev: 2,000  "
        r"tflops: 0\.01  mfu: n/a  mem: \d+\.\d\dGiB  data: 5\.0%  eta: 0:00:08",
        line,
    ), line

    log.log_validation(2, 5.0, 148.41)
    assert caplog.records[-1].getMessage() == "step: 2  val_loss: 5.0000  val_perplexity: 148.41"
    log.close()
    log.close()  # idempotent

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["step"]) for x in lines] == [("train", 2), ("validation", 2)]
    assert lines[0]["loss"] == pytest.approx(5.43214) and lines[0]["mfu_pct"] is None
    assert lines[1] == {"kind": "validation", "step": 2, "loss": 5.0, "perplexity": 148.41}
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_tensorboard_scalars_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = _logger(tmp_path, cfg=_cfg(save_tb_folder="board"))
    for step in (1, 2):
        log.record_step(tokens=100, step_seconds=0.5)
        log.log(step, {"loss": 4.0 - step, "lr": 1e-3})
    log.log_validation(2, 3.5, 33.1)
    log.close()
    acc = EventAccumulator(str(tmp_path / "board"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tok_per_s_per_dev", "train/mem_max_rss_gib",
            "validation/loss", "validation/perplexity"} <= set(tags)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]


def test_a_resumed_run_logs_each_step_once(tmp_path, caplog):
    """A launch that logged steps 1-4 but saved only step 2 (then crashed mid-line): the resumed
    launch trains 3-4 again, and metrics.jsonl and TensorBoard hold each step once. A launch that
    logs nothing (e.g. a finished run started again) changes nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = _logger(tmp_path)
    for step in range(1, 5):
        log.log(step, {"loss": float(step)})
    log.log_validation(4, 2.0, 7.39)
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write('{"kind": "train", "step": 5, "lo')  # torn by a crash
    before = (tmp_path / "metrics.jsonl").read_text()
    _logger(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert len(os.listdir(tmp_path / "tb")) == 1
    log = _logger(tmp_path)
    for step in (3, 4):
        log.log(step, {"loss": 10.0 + step})
    log.close()
    assert "dropped 3 records of steps 3-4 that an earlier launch logged" in caplog.text
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["step"], x["loss"]) for x in lines] == [
        ("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 13.0), ("train", 4, 14.0)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert "validation/loss" not in acc.Tags()["scalars"] or not acc.Scalars("validation/loss")


def test_mfu_with_override_and_jsonl_appends(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="quadra")
    # 1e9 FLOPs/token * 1000 tok/s = 1 TFLOPS = 50% of a 2-TFLOPS "device".
    cfg = _cfg(peak_tflops=2.0, enable_tensorboard=False)
    log = _logger(tmp_path, cfg=cfg, flops_per_token=1e9)
    log.record_step(tokens=1000, step_seconds=1.0)
    record = log.log(1, {"loss": float("nan")})
    assert record["mfu_pct"] == pytest.approx(50.0)
    assert "mfu: 50.00%" in caplog.records[-1].getMessage()
    log.close()
    log = _logger(tmp_path, cfg=cfg)  # a resumed run appends
    log.log(3, {"loss": 1.0})  # nothing recorded: throughput is unknown, not an error
    assert "tok/s/dev: n/a" in caplog.records[-1].getMessage()
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 3]
    assert lines[0]["loss"] is None  # NaN written as null: strict JSON
    assert not (tmp_path / "tb").exists()


def test_non_logging_rank_writes_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="quadra")
    log = _logger(tmp_path / "run", rank=1, is_logging_rank=False)
    log.record_step(tokens=10, step_seconds=0.1)
    record = log.log(1, {"loss": 2.0})
    assert record["tok_per_s_per_dev"] == pytest.approx(100)
    log.close()
    assert not (tmp_path / "run").exists()
    assert caplog.records == []


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="metrics.log_freq=0"):
        _logger(tmp_path, cfg=_cfg(log_freq=0))
    log = _logger(tmp_path, cfg=_cfg(enable_tensorboard=False))
    with pytest.raises(ValueError, match="mfu_pct"):
        log.log(1, {"mfu_pct": 3.0})
    with pytest.raises(TypeError, match="'loss' must be a scalar"):
        log.log(1, {"loss": torch.ones(2)})
    with pytest.raises(ValueError, match="non-negative"):
        log.record_step(tokens=-1, step_seconds=1.0)
    log.close()


def test_init_logging_prefixes_rank(capsys):
    quadra = init_logging(3)
    init_logging(3)  # idempotent: still one handler of ours
    try:
        quadra.info("hello")
        out = capsys.readouterr().out
        assert re.fullmatch(r"\[rank3\] \d\d:\d\d:\d\d INFO hello\n", out), out
    finally:
        for h in list(quadra.handlers):
            quadra.removeHandler(h)


@pytest.mark.parametrize("log_all_ranks", [False, True])
def test_other_ranks_print_only_when_asked(tmp_path, caplog, log_all_ranks):
    caplog.set_level(logging.INFO, logger="quadra")
    log = _logger(tmp_path, rank=1, is_logging_rank=False, cfg=_cfg(log_all_ranks=log_all_ranks))
    log.record_step(tokens=100, step_seconds=1.0)
    log.log(1, {"loss": 5.0})
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: 1  loss: 5.0000")]
    assert len(printed) == int(log_all_ranks)
    assert not (tmp_path / "metrics.jsonl").exists()  # files stay rank 0's
    log.close()


def test_mfu_and_the_planner_read_one_gpu_table():
    """The planner's GPUs (engine/observe/hardware.py) and MFU's peaks are the same table: a driver's
    name gives the same peak FLOP/s to both."""
    from engine.observe.hardware import GPUS, gpu_from_device_name

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe",
                 "NVIDIA B200"):
        gpu = gpu_from_device_name(name)
        assert gpu is not None and gpu.name in GPUS
        assert get_peak_flops("cuda", name, 0.0) == gpu.peak_flops
