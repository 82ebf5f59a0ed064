"""engine/train/lr_scheduler.py: the schedule values, driven through LambdaLR like a training loop."""

import math
import pickle
import types

import pytest
import torch
from torch import nn

from engine.train.lr_scheduler import build_lr_scheduler, lr_factor

LR = 1e-3


def _cfg(**overrides):
    values = dict(warmup_steps=4, decay_type="linear", decay_ratio=0.2, min_lr=1e-4)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _lrs_used(cfg, steps, lr=LR):
    """lr that each optimizer step 1..steps actually ran with, in training-loop order."""
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}], lr=lr
    )
    sched = build_lr_scheduler(opt, cfg, steps)
    used = []
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        used.append([g["lr"] for g in opt.param_groups])  # what opt.step() reads
        opt.step()
        sched.step()
        opt.zero_grad()
    for per_group in used:
        assert per_group[0] == per_group[1]  # every param group follows the same schedule
    return [u[0] for u in used]


def test_warmup_is_linear_and_ends_at_lr():
    lrs = _lrs_used(_cfg(decay_type="constant"), 10)
    assert lrs[:4] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])
    assert lrs[4:] == pytest.approx([LR] * 6)


def test_linear():
    # W=4, T=12: decay over 8 steps from LR at step 4 to min_lr at step 12.
    lrs = _lrs_used(_cfg(decay_type="linear"), 12)
    assert lrs[0] == pytest.approx(LR / 4)
    assert lrs[3] == pytest.approx(LR)
    assert lrs[7] == pytest.approx(LR + (1e-4 - LR) * 0.5)  # step 8: half way
    assert lrs[11] == pytest.approx(1e-4)  # last step = min_lr
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))


def test_cosine():
    lrs = _lrs_used(_cfg(decay_type="cosine", min_lr=0.0), 12)
    assert lrs[0] == pytest.approx(LR / 4)
    assert lrs[3] == pytest.approx(LR)
    assert lrs[7] == pytest.approx(LR / 2)  # cos(pi/2): half way
    assert lrs[5] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi / 4)))  # step 6: p = 2/8
    assert lrs[11] == pytest.approx(0.0, abs=1e-15)


def test_wsd():
    # T=20, decay_ratio=0.25 -> last 5 steps decay: stable through step 15, min_lr at 20.
    lrs = _lrs_used(_cfg(decay_type="wsd", decay_ratio=0.25), 20)
    assert lrs[0] == pytest.approx(LR / 4)
    assert lrs[3:15] == pytest.approx([LR] * 12)
    assert lrs[15] == pytest.approx(LR + (1e-4 - LR) / 5)  # step 16
    assert lrs[19] == pytest.approx(1e-4)


def test_no_warmup_starts_on_the_decay_curve():
    lrs = _lrs_used(_cfg(warmup_steps=0, decay_type="linear", min_lr=0.0), 4)
    assert lrs == pytest.approx([0.75 * LR, 0.5 * LR, 0.25 * LR, 0.0])
    assert _lrs_used(_cfg(warmup_steps=0, decay_type="constant"), 3) == pytest.approx([LR] * 3)


def test_pure_function_matches_and_clamps_past_the_end():
    kw = dict(warmup_steps=2, decay_type="cosine", decay_ratio=0.2, training_steps=10, lr=LR,
              min_lr=1e-4)
    assert lr_factor(1, **kw) == 0.5
    assert lr_factor(2, **kw) == 1.0
    assert lr_factor(10, **kw) == pytest.approx(0.1)
    assert lr_factor(11, **kw) == lr_factor(10, **kw)  # scheduler.step() after the last step
    with pytest.raises(ValueError, match="step=0"):
        lr_factor(0, **kw)


def test_state_dict_round_trip_resumes_the_schedule():
    cfg, steps = _cfg(decay_type="cosine"), 12
    reference = _lrs_used(cfg, steps)

    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = build_lr_scheduler(opt, cfg, steps)
    for _ in range(5):
        opt.step()
        sched.step()
    blob = pickle.dumps({"sched": sched.state_dict(), "opt": opt.state_dict()})

    # "Restart": fresh objects from the config, then load the saved state.
    model2 = nn.Linear(2, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
    sched2 = build_lr_scheduler(opt2, cfg, steps)
    saved = pickle.loads(blob)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    resumed = []
    for _ in range(5, steps):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(reference[5:])


@pytest.mark.parametrize("overrides, steps, match", [
    ({"warmup_steps": -1}, 10, "lr_scheduler.warmup_steps=-1"),
    ({"decay_type": "step"}, 10, r"lr_scheduler.decay_type='step'.*cosine"),
    ({"min_lr": 2 * LR}, 10, "lr_scheduler.min_lr"),
    ({"decay_ratio": 1.5}, 10, "lr_scheduler.decay_ratio=1.5"),
    ({}, 0, "training.steps=0"),
])
def test_bad_config(overrides, steps, match):
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=LR)
    with pytest.raises(ValueError, match=match):
        build_lr_scheduler(opt, _cfg(**overrides), steps)


@pytest.mark.parametrize("overrides, steps, expected", [
    # A warmup as long as the run or longer is clamped to it: the lr rises to the peak at the last step.
    ({"warmup_steps": 10, "decay_type": "cosine"}, 3, [LR / 3, 2 * LR / 3, LR]),
    ({"warmup_steps": 10, "decay_type": "linear"}, 1, [LR]),
    # wsd keeps its decay: warmup 8 + round(0.5 * 10) decay steps > 10, so the warmup becomes 5.
    ({"warmup_steps": 8, "decay_type": "wsd", "decay_ratio": 0.5}, 10,
     [LR * s / 5 for s in range(1, 6)] + [LR * (1 - k / 5) for k in range(1, 6)]),
])
def test_warmup_longer_than_the_run_is_clamped(overrides, steps, expected):
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=LR)
    sched = build_lr_scheduler(opt, _cfg(min_lr=0.0, **overrides), steps)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(expected)


def test_groups_with_different_lrs_are_rejected():
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1.0}], lr=LR)
    with pytest.raises(ValueError, match="one peak lr"):
        build_lr_scheduler(opt, _cfg(), 10)
