"""The one-process engine against a plain PyTorch loop written from the papers, not from the engine.

Every layout test compares with the engine's own one-process run, so a bug shared by all layouts
(the label shift, the data window, the loss normalisation, clipping, the optimizer groups) would
pass them all. Here the reference is a loop a researcher would write: documents tokenized with
SentencePiece as [BOS] + ids + [EOS] and concatenated, windows of seq_len + 1 consecutive tokens,
``F.cross_entropy(reduction="sum")`` over the step's label tokens, torch's gradient clipping and
``torch.optim.AdamW`` (decay on matrices only, GPT-3 App. B), with the model class and its init.
"""

from __future__ import annotations

import json
import os

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import (
    EPS, FLAVOR, LR, MAX_NORM, PARITY_STEPS, REPO, SEQ_LEN, SMALL_CORPUS, assert_parity, base_args, clipping_sides,
    train_and_record,
)


GLOBAL_BATCH = 8
SETTINGS = {"data.shuffle": "false", "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_type": "constant",
            "optimizer.lr": LR, "optimizer.implementation": "for-loop"}


def _plain_loop(local_batch_size: int, float8_recipe: str | None = None) -> list[tuple[float, float]]:
    """The loop of the module docstring; with ``float8_recipe`` (tests/integration/test_float8.py) torchao's
    float8 linears replace every nn.Linear but the output head (the model's are all multiples of 16)."""
    import sentencepiece as spm
    import torch
    import torch.nn.functional as F

    from models import get_model_args
    from models.common.decoder import Transformer

    sp = spm.SentencePieceProcessor(model_file=os.path.join(REPO, "assets", "tokenizer", "shakespeare.model"))
    stream = []
    with open(SMALL_CORPUS, encoding="utf-8") as f:
        for line in f:
            stream += [sp.bos_id(), *sp.encode(json.loads(line)["text"]), sp.eos_id()]
    stream = torch.tensor(stream)

    torch.manual_seed(0)
    args = get_model_args("llama", FLAVOR)
    args.max_seq_len = SEQ_LEN
    with torch.device("meta"):
        model = Transformer(args)
    if float8_recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8_recipe),
                                   module_filter_fn=lambda module, fqn: fqn != "output")
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=EPS, foreach=False,
    )
    history = []
    for step in range(PARITY_STEPS):
        windows = torch.stack([stream[w * SEQ_LEN: w * SEQ_LEN + SEQ_LEN + 1]
                               for w in range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)])
        inputs, labels = windows[:, :-1], windows[:, 1:]
        tokens = labels.numel()
        loss_sum = 0.0
        for micro in range(0, GLOBAL_BATCH, local_batch_size):
            logits = model(inputs[micro: micro + local_batch_size])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[micro: micro + local_batch_size].flatten(),
                                   reduction="sum") / tokens
            loss.backward()
            loss_sum += loss.item()
        # The norm in fp64: torch's fp32 CPU vector_norm is 2e-4 off on the embedding gradient here
        # (the engine sums in fp64, parallelisms/grad_norm.py); the clipping itself is torch's.
        norm = torch.nn.utils.get_total_norm([p.grad.double() for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss_sum, norm.item()))
    return history


@pytest.mark.parametrize("local_batch_size", [8, 4], ids=["one_microbatch", "accumulation2"])
def test_engine_equals_a_plain_pytorch_loop(local_batch_size, tmp_path):
    argv = base_args(str(tmp_path), {**SETTINGS, "training.local_batch_size": local_batch_size})
    (engine,) = run_distributed(train_and_record, 1, argv, torchrun_env=False)
    (plain,) = run_distributed(_plain_loop, 1, local_batch_size, torchrun_env=False)
    # Both sides of the threshold: clipped steps, and steps a clip must leave alone.
    above, below = clipping_sides(plain)
    assert above >= 1 and below >= 1, f"max_norm {MAX_NORM} is not between the steps' norms: {plain}"
    assert_parity(engine, plain)
