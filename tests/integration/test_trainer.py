"""Trainer behaviour beyond parity: divergence stops every rank, mixed precision runs, gradient
accumulation is exact."""

from __future__ import annotations

import math

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import SMALL_CORPUS, base_args, run_in_turn, train_and_record



def _poison_then_step(argv: list[str]) -> str:
    """Make rank 0's shard of one weight NaN, take a step, return the error every rank raised."""
    import torch

    from engine.config import load_config
    from engine.train.trainer import Trainer, TrainingDivergedError

    cfg = load_config(argv)
    cfg.validate()
    trainer = Trainer(cfg)
    trainer.train_step()
    weight = trainer.model_parts[0].layers["0"].attention.wq.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    if trainer.dist.rank == 0:
        with torch.no_grad():
            local[0, 0] = float("nan")
    try:
        trainer.train_step()
    except TrainingDivergedError as error:
        return str(error)
    finally:
        trainer.close()
    return "no error"


@pytest.mark.parametrize("world_size", [1, 2])
def test_nan_loss_stops_every_rank(world_size, tmp_path):
    overrides = {"parallelism.dp_shard": world_size, "training.local_batch_size": 8 // world_size}
    argv = base_args(str(tmp_path), overrides)
    messages = run_distributed(_poison_then_step, world_size, argv, torchrun_env=world_size > 1)
    for message in messages:
        assert "loss is nan" in message and "at step 2" in message and "optimizer.lr" in message


def _losses(argv):
    from tests.training_utils import train_and_record

    return [loss for loss, _ in train_and_record(argv)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_bfloat16_mixed_precision_trains_close_to_fp32(world_size, reference, tmp_path):
    """bf16 compute (autocast on one process, FSDP MixedPrecisionPolicy on two) tracks fp32 closely."""
    overrides = {
        "training.mixed_precision_param": "bfloat16",
        "parallelism.dp_shard": world_size,
        "training.local_batch_size": 8 // world_size,
        # Two steps keep it cheap (bf16 autocast is slow on CPU); step 1 does not depend on the LR.
        "training.steps": 2,
        "lr_scheduler.warmup_steps": 1,
    }
    argv = base_args(str(tmp_path), overrides)
    losses = run_distributed(_losses, world_size, argv, torchrun_env=world_size > 1)[0]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    ref_loss = reference[0][0]
    # bf16 has an 8-bit mantissa: ~0.4% per rounding; the loss stays well within 2%.
    assert abs(losses[0] - ref_loss) / ref_loss < 2e-2, (losses, reference)
    assert losses[0] != ref_loss, "bf16 run is bit-identical to fp32: mixed precision not applied"


def test_bfloat16_gradient_reduction_trains_close_to_fp32(reference, tmp_path):
    """FSDP2 reduce-scatters bf16 gradients (training.mixed_precision_reduce): close to, not equal to, fp32."""
    overrides = {"training.mixed_precision_reduce": "bfloat16", "parallelism.dp_shard": 2,
                 "training.local_batch_size": 4, "training.steps": 2, "lr_scheduler.warmup_steps": 1}
    histories = run_distributed(train_and_record, 2, base_args(str(tmp_path), overrides))
    norm, ref_norm = histories[0][0][1], reference[0][1]
    assert histories[0][0][0] == pytest.approx(reference[0][0], rel=1e-5)  # step 1's loss: fp32 forward
    # bf16 keeps 8 mantissa bits: the reduced gradients, hence the norm, move by ~1e-3, not 1e-7.
    assert norm != ref_norm and abs(norm - ref_norm) / ref_norm < 2e-2, (norm, ref_norm)


def _validation_loss(argv):
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    try:
        trainer.train(steps=1)
        return trainer.validate()
    finally:
        trainer.close()


def _validation_losses(folder: str, runs: dict[str, dict]) -> dict[str, float | str]:
    """{name: validation loss after one step} of each run in turn, in the same ranks."""
    return run_in_turn(runs, lambda name, overrides: _validation_loss(base_args(f"{folder}/{name}", overrides)))


VALIDATION = {"validation.enable": "true", "validation.path": SMALL_CORPUS, "validation.steps": 2}
VALIDATION_LAYOUTS = {
    # name: (model, overrides); 2 ranks each
    "tp2": ({}, {"parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "cp2": ({}, {"parallelism.cp": 2, "parallelism.dp_shard": 1}),
    "fsdp2": ({}, {"parallelism.dp_shard": 2, "training.local_batch_size": 4}),
    "moe_ep2": ({"model.name": "moe"}, {"parallelism.dp_shard": 2, "parallelism.ep": 2, "training.local_batch_size": 4}),
}


@pytest.fixture(scope="module")
def validation_losses(tmp_path_factory):
    """(one process's loss per model, every rank's {layout: loss}): one run per model on one process,
    the layouts in turn in one set of 2 forked ranks."""
    folder = str(tmp_path_factory.mktemp("validation"))
    models = {"llama": VALIDATION, "moe": {**VALIDATION, "model.name": "moe"}}
    (single,) = run_distributed(_validation_losses, 1, f"{folder}/one", models, torchrun_env=False)
    layouts = {name: {**VALIDATION, **model, **overrides} for name, (model, overrides) in VALIDATION_LAYOUTS.items()}
    return single, run_distributed(_validation_losses, 2, f"{folder}/many", layouts, timeout=300)


@pytest.mark.parametrize("layout", list(VALIDATION_LAYOUTS))
def test_validation_under_a_layout_equals_one_process(layout, validation_losses):
    """Validation shards the split over dp and the sequence over cp, sums the loss over tp's
    vocabulary shards, and routes tokens to experts on other ranks under ep: the mean token loss
    must be the one process's."""
    single, ranks = validation_losses
    want = single[VALIDATION_LAYOUTS[layout][0].get("model.name", "llama")]
    assert not isinstance(want, str), want
    for rank, losses in enumerate(ranks):
        assert not isinstance(losses[layout], str), f"rank {rank}:\n{losses[layout]}"
        assert losses[layout] == pytest.approx(want, rel=1e-5), (rank, losses[layout], want)
