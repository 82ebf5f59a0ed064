"""The ``loss`` case of scripts/benchmark.py: the fused, chunked linear cross entropy
(models/common/linear_cross_entropy.py, ``[loss] chunk_tokens``) against the unfused loss (full logits,
engine/train/loss.py ``token_sum_loss``) at a large-vocabulary shape.

- peak bytes of the loss phase: forward + backward of output projection and loss on fixed final
  hidden states [1, S, dim] and output weight [vocab, dim], counted by torch's ``MemTracker``
  (every tensor the phase allocates, its gradients of hidden states and weight included; the inputs
  themselves excluded), in a fresh process per variant;
- step time of the whole engine step (debugmodel's layers at that vocabulary), fused over unfused,
  measured by the caller with interleaved rounds.
"""

from __future__ import annotations

VOCAB = 128_256  # Llama 3's vocabulary
SEQ_LEN = 2048


def engine_overrides(chunk_tokens: int) -> dict:
    """Engine settings of the comparison: debugmodel's layers at Llama 3's vocabulary, one sequence of
    :data:`SEQ_LEN` tokens per step, the given ``loss.chunk_tokens`` (0: unfused)."""
    return {"model.vocab_size": VOCAB, "training.seq_len": SEQ_LEN, "training.local_batch_size": 1,
            "training.global_batch_size": 1, "loss.chunk_tokens": chunk_tokens}


def loss_phase_peak_bytes(chunk_tokens: int, dim: int = 256, tokens: int = SEQ_LEN, vocab: int = VOCAB) -> int:
    """Peak bytes the loss phase allocates (forward + backward; ``chunk_tokens`` 0: unfused), fp32.

    Runs in the calling process; call it in a fresh one per variant (engine/testing/processes.py).
    """
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from engine.train.loss import model_loss

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)

    def head(h, labels=None, loss_chunk_tokens=0):  # the model's last step: hidden states -> logits or loss
        if labels is None:
            return h @ weight.t()
        from models.common.linear_cross_entropy import linear_cross_entropy_sum

        return linear_cross_entropy_sum(h, weight, labels, loss_chunk_tokens)

    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        model_loss(head, hidden, labels, float(tokens), chunk_tokens=chunk_tokens).backward()
    peak = tracker.get_tracker_snapshot("peak")
    (per_device,) = peak.values()
    inputs = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return per_device["Total"] - inputs
