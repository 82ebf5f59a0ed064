"""Training-run recipes at published ratios, against a hand count or a formula from the logits: a new
phase from a checkpoint at DeepSeek-V3's first context extension ratio (4K -> 32K: 8x) where the
tokens read do not fill a whole window of the new length, and validation with PaLM's z-loss weight
on (engine/docs/optimizers.md: "validation reports the cross entropy alone"), one process and a pipeline.
Unit-level recipes (routing, YaRN, MTP, the goodput ledger): tests/unit/test_published_hparams.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine.testing.processes import run_distributed
from tests.training_utils import base_args, quadra_log_lines

PALM_Z_LOSS = 1e-4  # Chowdhery et al. 2022, Sec. 5


@contextlib.contextmanager
def _trainer(argv):
    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    try:
        yield trainer
    finally:
        trainer.close()


def test_new_phase_at_eight_times_the_length_continues_after_a_partial_window(tmp_path):
    """Phase 1: 3 steps of 3 sequences of 8 tokens, checkpoint at step 3. Phase 2 at 64 tokens (x8,
    DeepSeek-V3's 4K -> 32K), ``initial_load_lr restart``: hand count, the checkpoint read 3 x 3 x 8 = 72
    tokens, 1.125 windows of 64, so the data continues at window ceil(72 / 64) = 2 (the first that
    holds no token already counted; the existing test's 256 tokens in windows of 32 divide exactly);
    step count 0 and the warmup restarts: the first step's lr is lr · 1/W = 3e-2 / 2 (W = 2 of 2 steps)."""
    common = {"training.local_batch_size": 3, "training.global_batch_size": 3, "validation.enable": "false",
              "checkpoint.enable": "true"}
    with _trainer(base_args(str(tmp_path / "short"), {**common, "training.seq_len": 8, "training.steps": 3,
                                                      "checkpoint.interval": 3})) as first:
        first.train()
        assert first.dataloader.state_dict()["position"] == 9  # 3 steps x 3 windows
    phase = base_args(str(tmp_path / "long"), {
        **common, "training.seq_len": 64, "training.steps": 2,
        "checkpoint.initial_load_path": str(tmp_path / "short" / "checkpoint" / "step-3"),
        "checkpoint.initial_load_model_only": "false", "checkpoint.initial_load_lr": "restart"})
    with quadra_log_lines("new phase from") as lines, _trainer(phase) as second:
        assert (second.step, second.dataloader.state_dict()["position"]) == (0, 2)
        (line,) = [text for _, text in lines]
        assert "seq_len 8 -> 64" in line and "data continues after 72 tokens (window 2)" in line, line
        (record,) = second.train(steps=1)
        assert record["lr"] == pytest.approx(3e-2 / 2, rel=1e-12)
        assert second.dataloader.state_dict()["position"] == 2 + 3


def _validation_batch_loss(trainer) -> tuple[float, float]:
    """(mean cross entropy, mean z-loss term) per label token over the validation batches, written
    from the logits of the trainer's one model part (float64)."""
    model = trainer.model_parts[0]
    ce = z = tokens = 0.0
    model.eval()
    with torch.no_grad():
        for inputs, labels in trainer._build_validation_loader():
            logits = model(inputs).double().flatten(0, 1)
            ce += F.cross_entropy(logits, labels.flatten(), reduction="sum").item()
            z += PALM_Z_LOSS * torch.logsumexp(logits, dim=-1).square().sum().item()
            tokens += labels.numel()
    model.train()
    return ce / tokens, z / tokens


_Z_ON = {"loss.z_loss_weight": PALM_Z_LOSS, "training.steps": 1, "validation.steps": 1}


@pytest.fixture(scope="module")
def one_process_validation(tmp_path_factory):
    """The validation loss of the initial model, with the z-loss on, through the unfused and the fused
    loss, the z-loss sum left in the run's accumulator, and the formula's (CE, z) from the logits."""
    folder = tmp_path_factory.mktemp("z_on")
    with _trainer(base_args(str(folder), {**_Z_ON, "loss.chunk_tokens": 0})) as trainer:
        want = _validation_batch_loss(trainer)
        unfused = trainer.validate()
        trainer.runner.context.loss_chunk_tokens = 48  # the fused loss (the default path), same weights
        fused = trainer.validate()
        left = float(trainer.z_loss.take())
    return {"unfused": unfused, "fused": fused}, left, want


@pytest.mark.parametrize("loss", ["unfused", "fused"])
def test_validation_with_the_z_loss_on_reports_the_cross_entropy_alone(one_process_validation, loss):
    """engine/docs/optimizers.md ("validation reports the cross entropy alone"): the validation loss equals the mean
    token cross entropy from the logits (fp64 formula, 1e-5), not CE + weight · logsumexp², which
    is 8e-4 of it at PaLM's weight, and validation adds nothing to the step's logged z-loss."""
    got, left, (ce, z) = one_process_validation
    assert got[loss] == pytest.approx(ce, rel=1e-5)
    assert z > 5e-4 * ce  # the z-loss term would show
    assert left == 0.0


def _validate_initial(argv):
    """In a forked rank: (validation loss of the initial model, z-loss sum left in the accumulator)."""
    with _trainer(argv) as trainer:
        return trainer.validate(), float(trainer.z_loss.take())


def test_pipeline_validation_with_the_z_loss_on_reports_the_cross_entropy_alone(one_process_validation, tmp_path):
    """pp2 with the unfused loss (the last stage's loss function is engine/train/loss.py's
    token_sum_loss with the run's z-loss): the validation loss of the initial model equals one
    process's cross entropy (the same per-name initialisation) and leaves no z-loss sum behind (it
    reported CE + z-loss, 16.58 for 8.83 at weight 0.1, and added the sum to the next step's z_loss)."""
    _, _, (ce, _) = one_process_validation
    ranks = run_distributed(_validate_initial, 2, base_args(str(tmp_path), {
        **_Z_ON, "loss.chunk_tokens": 0, "parallelism.pp": 2, "parallelism.dp_shard": 1}))
    for got, left in ranks:
        assert got == pytest.approx(ce, rel=1e-5) and left == 0.0, ranks


def test_the_unfused_loss_takes_the_z_loss_in_training_only():
    """engine/train/loss.py ``token_sum_loss``, the unfused loss and a pipeline's last-stage loss
    function: with grad mode on, CE + weight · Σ logsumexp² (counted in the run's ZLoss); under
    ``torch.no_grad()`` (evaluation) the cross entropy alone, nothing counted (the fast tier's guard of
    the pipeline test above)."""
    from engine.train.loss import ZLoss, token_sum_loss

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 11, generator=g, dtype=torch.float64), torch.randint(0, 11, (2, 5), generator=g)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    z_sum = PALM_Z_LOSS * torch.logsumexp(logits, dim=-1).square().sum()
    z_loss = ZLoss(PALM_Z_LOSS)
    assert torch.allclose(token_sum_loss(logits, labels, z_loss=z_loss), ce + z_sum, rtol=1e-12, atol=0)
    assert torch.allclose(z_loss.take(), z_sum, rtol=1e-12, atol=0)
    with torch.no_grad():
        assert torch.allclose(token_sum_loss(logits, labels, z_loss=z_loss), ce, rtol=1e-12, atol=0)
    assert z_loss.take() == 0.0
