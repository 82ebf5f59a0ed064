"""The training loss: token-sum cross entropy over a step's global label-token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label value that contributes neither loss nor a token to the count


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Σ cross entropy (nats) over the label tokens of ``logits`` [B, S, V] / ``labels`` [B, S],
    divided by ``global_tokens`` (the step's label-token count over all ranks and microbatches).

    Summing this over every microbatch of every data-parallel rank gives the mean token loss of the
    global batch, so gradients do not depend on how the batch is split (engine/train/trainer.py). With the
    default ``global_tokens = 1`` it is the plain token sum (evaluation). Computed in float32, or
    float64 for float64 logits (the float64 reference mode).
    """
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    return loss_sum / global_tokens
