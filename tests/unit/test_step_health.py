"""Step health (engine/train/step_health.py): non-finite and spiking steps are skipped or stop the run,
the same way on every layout, with the decision state checkpointed, a record and a capsule per step.

Non-finite gradients and spikes are injected by the hook of engine/testing/faults.py.
"""

from __future__ import annotations

import json
import math
import os
import types

import pytest

from engine.config import ConfigError, load_config
from engine.train.step_health import StepHealth
from engine.testing.processes import run_distributed
from engine.testing.faults import inject
from tests.step_health_utils import bitwise_differences, state_snapshot, train_injected
from tests.training_utils import PARITY_STEPS, base_args


def _policy(**overrides):
    values = dict(on_nonfinite="skip", loss_spike_sigma=3.0, grad_norm_spike_sigma=0.0, window=4,
                  max_consecutive_skips=0)
    values.update(overrides)
    return types.SimpleNamespace(**values)


# ---------------------------------------------------------------------------- the rules, on numbers
def test_spike_rule_waits_for_half_a_window_and_keeps_skipped_steps_out_of_it():
    health = StepHealth(_policy(window=4))
    assert health.judge(1, 5.0, 1.0).reason is None
    assert health.judge(2, 50.0, 1.0).reason is None  # one accepted step: no statistics yet (min 2)
    # window [5, 50]: mean 27.5, std 31.8; 3 sigma above is 123
    verdict = health.judge(3, 124.0, 1.0)
    assert (verdict.reason, verdict.skip, verdict.value) == ("loss_spike", True, 124.0)
    assert verdict.zscore == pytest.approx((124.0 - 27.5) / math.sqrt(2 * 22.5 ** 2))
    assert health.judge(4, 122.0, 1.0).reason is None  # the skipped 124 did not widen the window
    assert [loss for loss, _ in health.window] == [5.0, 50.0, 122.0]
    assert health.summary() == "1 step skipped (loss_spike 1)"


def test_nonfinite_values_stop_or_skip_and_consecutive_skips_stop():
    stop = StepHealth(_policy(on_nonfinite="stop"))
    verdict = stop.judge(7, float("nan"), 1.0)
    assert verdict.skip and verdict.reason == "nonfinite_loss"
    assert verdict.fatal.startswith("loss is nan (grad_norm 1.0) at step 7: training diverged")
    assert "training.max_norm" not in verdict.fatal  # clipping is on: no hint to turn it on
    unclipped = StepHealth(_policy(on_nonfinite="stop"), clipping=False).judge(7, float("nan"), 1.0).fatal
    assert ", set training.max_norm to clip gradients, or set step_health.on_nonfinite" in unclipped
    skip = StepHealth(_policy(max_consecutive_skips=2))
    first = skip.judge(1, 1.0, float("inf"))
    assert (first.reason, first.skip, first.fatal) == ("nonfinite_grad_norm", True, None)
    assert skip.judge(2, 2.0, 1.0).fatal is None  # accepted: the count of skips in a row restarts
    assert skip.judge(3, float("nan"), 1.0).fatal is None
    fatal = skip.judge(4, 1.0, float("nan")).fatal
    assert fatal.startswith("step_health.max_consecutive_skips = 2 reached: steps 3-4 were all skipped"), fatal
    assert "\n" not in fatal


def test_state_round_trips_exactly_and_a_shorter_window_keeps_the_newest():
    health = StepHealth(_policy(window=8, loss_spike_sigma=0.0))
    for step, loss in enumerate([1 / 3, 2 / 7, 0.1 + 0.2, 5e-324, 1e300], start=1):
        health.judge(step, loss, loss * 3)
    health.judge(6, float("nan"), 1.0)
    again = StepHealth(_policy(window=8, loss_spike_sigma=0.0))
    again.load_state_dict(health.state_dict())
    assert list(again.window) == list(health.window) and again.state_dict() == health.state_dict()
    short = StepHealth(_policy(window=2, loss_spike_sigma=0.0))
    short.load_state_dict(health.state_dict())
    assert list(short.window) == list(health.window)[-2:] and short.skipped == 1


@pytest.mark.parametrize("key, value, expected", [
    ("loss_spike_sigma", "-1", "step_health.loss_spike_sigma = -1.0: must be >= 0"),
    ("grad_norm_spike_sigma", "-0.5", "step_health.grad_norm_spike_sigma = -0.5: must be >= 0"),
    ("window", "1", "step_health.window = 1: must be >= 2"),
    ("max_consecutive_skips", "-1", "step_health.max_consecutive_skips = -1: must be >= 0"),
    ("on_nonfinite", "ignore", "step_health.on_nonfinite = 'ignore' is not an allowed value"),
])
def test_bad_settings_are_refused_with_one_line(key, value, expected):
    with pytest.raises(ConfigError) as error:
        load_config([f"--step_health.{key}", value]).validate()
    assert str(error.value).startswith(expected) and "\n" not in str(error.value), str(error.value)


# ---------------------------------------------------------------------------- one process, bitwise
SKIP = {"step_health.on_nonfinite": "skip", "validation.enable": "false"}
K = 3  # the injected step


def _skip_against_never_applied(folder: str, model: str) -> dict:
    """Run A skips step K (NaN gradient); run B never trains step K (its batch is read and dropped,
    the LR schedule stepped, by hand). Returns what the test compares."""
    from engine.config import load_config
    from engine.train.trainer import Trainer

    def build(name, overrides):
        cfg = load_config(base_args(f"{folder}/{name}", {"model.name": model, **overrides}))
        cfg.validate()
        return Trainer(cfg)

    a = build("a", SKIP)
    inject(a, {K: "nan_grad"})
    a.train(K - 1)
    before = state_snapshot(a)
    a.train(1)
    at_k = bitwise_differences(before, state_snapshot(a))
    a.train()
    b = build("b", {"validation.enable": "false"})
    b.train(K - 1)
    for _ in range(b.grad_accum_steps):
        b.dataloader.next_batch()
    b.lr_scheduler.step()
    b.step += 1
    b.train()
    runs = {}
    for name, trainer in (("a", a), ("b", b)):
        trainer.close()
        runs[name] = [(h["step"], h["loss"], h["grad_norm"], h["lr"]) for h in trainer.history]
    with open(f"{folder}/a/metrics.jsonl") as f:
        events = [json.loads(line) for line in f if '"skipped_step"' in line]
    return {"at_k": at_k, "buffers": [n for n in before if ".buffer." in n], "runs": runs,
            "final": bitwise_differences(state_snapshot(a), state_snapshot(b)), "events": events,
            "capsule": os.path.exists(f"{folder}/a/capsules/step-{K}.json")}


@pytest.mark.parametrize("model", ["llama", "moe"])
def test_skipped_step_changes_no_bit_and_the_run_equals_one_without_that_update(tmp_path, model):
    (got,) = run_distributed(_skip_against_never_applied, 1, str(tmp_path), model, torchrun_env=False)
    assert got["at_k"] == [], f"step {K} was skipped but changed {got['at_k'][:5]}"
    if model == "moe":  # the load-balancing biases are among the state held bitwise
        assert any("expert_bias" in name for name in got["buffers"]), got["buffers"]
    a, b = got["runs"]["a"], got["runs"]["b"]
    assert [s for s, *_ in a] == list(range(1, PARITY_STEPS + 1))
    assert math.isnan(a[K - 1][2])
    # Every other step is bitwise the run that never applied step K (same LR, same data after it).
    assert [r for r in a if r[0] != K] == [r for r in b], (a, b)
    assert got["final"] == [], f"final states differ: {got['final'][:5]}"
    assert [(e["step"], e["reason"], e["value"]) for e in got["events"]] == [(K, "nonfinite_grad_norm", None)]
    assert got["capsule"]


# ---------------------------------------------------------------------------- resume
RESUME = {"step_health.on_nonfinite": "skip", "step_health.loss_spike_sigma": "3", "step_health.window": "2",
          "validation.enable": "false", "training.steps": "6", "checkpoint.enable": "true",
          "checkpoint.interval": "2"}
RESUME_PLAN = {4: "loss_spike", 5: "nan_grad"}


def _full_and_resumed(folder: str) -> tuple[dict, dict, dict]:
    full = train_injected(base_args(f"{folder}/full", RESUME), RESUME_PLAN)
    train_injected(base_args(f"{folder}/resumed", RESUME), {}, steps=2)  # saves step-2 and stops
    resumed = train_injected(base_args(f"{folder}/resumed", RESUME), RESUME_PLAN)
    with open(f"{folder}/full/capsules/step-4.json") as f:
        capsule = json.load(f)
    return full, resumed, capsule


def _exact(history):
    """Records with floats as their exact repr (NaN equal to NaN)."""
    return [tuple(repr(v) for v in record) for record in history]


def test_a_resume_before_the_skip_takes_the_same_decisions_bitwise(tmp_path):
    (got,) = run_distributed(_full_and_resumed, 1, str(tmp_path), torchrun_env=False)
    full, resumed, capsule = got
    assert [h[3] for h in full["history"]] == [None, None, None, "loss_spike", "nonfinite_grad_norm", None]
    # The resumed run trains steps 3-6 from checkpoint step-2: every record and the final state agree.
    assert _exact(resumed["history"]) == _exact(full["history"][2:]), (resumed["history"], full["history"])
    assert resumed["state"] == full["state"]
    assert full["skipped"] == "2 steps skipped (loss_spike 1, nonfinite_grad_norm 1)"
    # The capsule of step 4: the windows of its batch, the checkpoint to replay it from, the statistics.
    assert capsule["data"]["positions"] == [24, 32] and capsule["data"]["loader_state_before"]["position"] == 24
    assert capsule["replay_from"]["step"] == 2 and capsule["replay_from"]["steps_to_replay"] == 2
    assert capsule["replay_from"]["checkpoint"].endswith(os.path.join("checkpoint", "step-2"))
    assert capsule["statistics"]["count"] == 2 and capsule["zscore"] > 3
    assert len(capsule["fingerprint"]) == 16 and capsule["action"] == "skipped"


# ---------------------------------------------------------------------------- every layout decides alike
LAYOUT_POLICY = {"step_health.on_nonfinite": "skip", "step_health.loss_spike_sigma": "3",
                 "step_health.grad_norm_spike_sigma": "100", "step_health.window": "2",
                 "step_health.max_consecutive_skips": "3"}
# Step 2: a NaN in one gradient element of every rank's first local shard; 4: the loss x 10; 5: the
# gradients x 100 (a grad-norm spike measured through each layout's norm reduction).
LAYOUT_PLAN = {2: "nan_grad", 4: "loss_spike", 5: "grad_spike"}
WANT = [None, "nonfinite_grad_norm", None, "loss_spike", "grad_norm_spike"]
LAYOUTS = {
    "fsdp2": {"parallelism.dp_shard": 2, "training.local_batch_size": 4},
    "tp2": {"parallelism.tp": 2, "parallelism.dp_shard": 1},
    "pp2": {"parallelism.pp": 2, "parallelism.dp_shard": 1, "parallelism.pp_microbatch_size": 4},
    "cp2": {"parallelism.cp": 2, "parallelism.dp_shard": 1},
}


def _layouts(folder: str) -> dict:
    from tests.training_utils import run_in_turn

    return run_in_turn(LAYOUTS, lambda name, overrides: train_injected(
        base_args(f"{folder}/{name}", {**LAYOUT_POLICY, **overrides}), LAYOUT_PLAN))


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("step_health_layouts"))
    (single,) = run_distributed(train_injected, 1, base_args(f"{folder}/single", LAYOUT_POLICY), LAYOUT_PLAN,
                                torchrun_env=False)
    return single, run_distributed(_layouts, 2, folder, timeout=600.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_of_every_layout_takes_the_single_process_decisions(layout_runs, layout):
    single, ranks = layout_runs
    assert [h[3] for h in single["history"]] == WANT, single["history"]
    for rank, results in enumerate(ranks):
        got = results[layout]
        assert not isinstance(got, str), f"layout {layout} rank {rank}:\n{got}"
        assert [h[3] for h in got["history"]] == WANT, (layout, rank, got["history"])
        for (step, loss, norm, _), (_, ref_loss, ref_norm, _) in zip(got["history"], single["history"]):
            tol = 1e-5 if step == 1 else 1e-4
            assert math.isclose(loss, ref_loss, rel_tol=tol), f"{layout} rank {rank} step {step}: loss {loss} vs {ref_loss}"
            assert math.isclose(norm, ref_norm, rel_tol=tol) or (math.isnan(norm) and math.isnan(ref_norm)), \
                f"{layout} rank {rank} step {step}: grad_norm {norm} vs {ref_norm}"
        assert json.loads(got["state"])["skipped_by_reason"] == json.loads(single["state"])["skipped_by_reason"]


# ---------------------------------------------------------------------------- stop
def _stop_through_main(folder: str, error_dir: str) -> int:
    """engine.train.main.main with a NaN gradient at step 3 (the trainer class patched to inject it)."""
    import engine.train.trainer as trainer_module
    from engine.train.main import main

    class Injected(trainer_module.Trainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            inject(self, {3: "nan_grad"})

    os.environ["QUADRA_ERROR_DIR"] = error_dir
    trainer_module.Trainer = Injected
    return main(base_args(folder, {"parallelism.dp_shard": 2, "training.local_batch_size": 4,
                                   "validation.enable": "false"}))


def test_stop_ends_every_rank_with_one_line_and_leaves_a_capsule(tmp_path):
    error_dir = tmp_path / "errors"
    error_dir.mkdir()
    statuses = run_distributed(_stop_through_main, 2, str(tmp_path / "run"), str(error_dir))
    assert statuses == [1, 1]
    for rank in range(2):
        lines = (error_dir / f"rank{rank}.err").read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith("training stopped: loss is ") and \
            "at step 3: training diverged" in lines[0] and "grad_norm nan" in lines[0] and \
            lines[0].endswith(f"; capsule {tmp_path / 'run' / 'capsules' / 'step-3.json'}"), lines
    capsule = json.loads((tmp_path / "run" / "capsules" / "step-3.json").read_text())
    assert (capsule["action"], capsule["reason"], capsule["value"]) == ("stopped", "nonfinite_grad_norm", "nan")
    assert capsule["layout"]["world_size"] == 2 and capsule["layout"]["dp_shard"] == 2
    assert sorted(os.listdir(tmp_path / "run" / "capsules")) == ["step-3.json"]


def test_consecutive_skips_stop_the_run(tmp_path):
    policy = {**SKIP, "step_health.max_consecutive_skips": "2"}
    (got,) = run_distributed(train_injected, 1, base_args(str(tmp_path), policy), {2: "nan_grad", 3: "grad_spike", 4: "nan_grad"},
                             torchrun_env=False)
    # Step 3's spike is not judged (grad_norm_spike_sigma = 0): only 2 and 4 skip, not in a row.
    assert got["error"] is None and [h[3] for h in got["history"]][1:4] == ["nonfinite_grad_norm", None, "nonfinite_grad_norm"]
    (got,) = run_distributed(train_injected, 1, base_args(str(tmp_path / "b"), policy), {2: "nan_grad", 3: "nan_grad"},
                             torchrun_env=False)
    assert got["step"] == 3 and got["error"].startswith(
        "step_health.max_consecutive_skips = 2 reached: steps 2-3 were all skipped (last: nonfinite_grad_norm, value nan)")
    capsule = json.loads((tmp_path / "b" / "capsules" / "step-3.json").read_text())
    assert capsule["action"] == "stopped" and capsule["statistics"]["consecutive_skips"] == 2


def _resume_a_checkpoint_without_step_health(folder: str) -> dict:
    """Save step-2 with a trainer state lacking "step_health" (as checkpoints made before it did), resume."""
    import engine.train.trainer as trainer_module

    original = trainer_module.Trainer.state_dict
    trainer_module.Trainer.state_dict = lambda self: {k: v for k, v in original(self).items() if k != "step_health"}
    try:
        train_injected(base_args(folder, RESUME), {}, steps=2)
    finally:
        trainer_module.Trainer.state_dict = original
    return train_injected(base_args(folder, RESUME), {})


def test_a_checkpoint_from_before_step_health_resumes_with_fresh_statistics(tmp_path):
    (got,) = run_distributed(_resume_a_checkpoint_without_step_health, 1, str(tmp_path), torchrun_env=False)
    # DCP refuses to load a key the checkpoint lacks: the load asks only for the trainer keys saved.
    assert [(h[0], h[3]) for h in got["history"]] == [(3, None), (4, None), (5, None), (6, None)]
    assert got["error"] is None and got["step"] == 6


def test_skip_records_reach_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from engine.observe.metrics import MetricsLogger

    cfg = types.SimpleNamespace(log_freq=1, enable_tensorboard=True, save_tb_folder="tb", peak_tflops=0.0,
                                log_all_ranks=False)
    log = MetricsLogger(cfg, str(tmp_path), rank=0, is_logging_rank=True, flops_per_token=1.0, training_steps=9)
    log.log_event("skipped_step", {"step": 4, "reason": "loss_spike", "value": 85.6, "zscore": 441.2, "skipped_total": 1})
    log.log_event("skipped_step", {"step": 5, "reason": "nonfinite_grad_norm", "value": float("nan"), "zscore": None,
                                   "skipped_total": 2})
    log.close()
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["kind"], r["step"], r["reason"], r["value"], r["zscore"]) for r in records] == [
        ("skipped_step", 4, "loss_spike", 85.6, 441.2), ("skipped_step", 5, "nonfinite_grad_norm", None, None)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 1)) for e in acc.Scalars("skipped_step/zscore")] == [(4, 441.2)]
    assert [(e.step, e.value) for e in acc.Scalars("skipped_step/skipped_total")] == [(4, 1.0), (5, 2.0)]
