"""Per-rank bytes of the loss phase with the fused, chunked linear cross entropy (``[loss] chunk_tokens``
> 0; models/common/linear_cross_entropy.py), the planner's counterpart of the unfused ``head_peak_bytes``
(engine/planner/activations.py).

With T tokens per microbatch and rank, width h, vocabulary V over t = tp ranks, chunks of c tokens,
activation bytes B (training.mixed_precision_param):

    head  =  T·h·(2/t' + g)·B             final norm input and output (sequence shards under SP, t' = t)
                                          and, under tp, its all-gathered copy (g = 1, else 0)
          +  T·h·B                        G_h, the hidden states' gradient, computed in the forward
          +  V/t·h·4                      G_W, the output weight's gradient, accumulated in fp32
          +  min(c, T)·V/t·(4 + B')       one chunk's logits: one fp32 buffer (logits, exp, softmax
                                          gradient in place), plus the matmul's output when B < 4 (B' = B)
          +  T·4·3                        per-token log-sum-exp, target logit, labels (fp32 / int)

G_W takes the place of the unfused loss's output-weight gradient; no [T, V] tensor exists. Liger's
method (Hsu et al. 2024, arXiv 2410.10989 §3.2) computes G_h and G_W in the forward, so under a
pipeline schedule that runs several forwards of the last stage before their backwards (GPipe) each
microbatch in flight holds its own G_h and G_W. The constants are the tensors torch's MemTracker sees
alive at the peak in the CPU runs of tests/integration/test_planner_runs.py.
"""

from __future__ import annotations


def fused_loss_bytes(layout, tokens: int) -> int:
    """Peak bytes of the fused loss phase on one rank (module docstring), with the G_h and G_W of
    the other microbatches in flight under GPipe.

    Args:
        layout: the resolved ``Layout`` (engine/planner/layout.py); its ``cfg.loss.chunk_tokens`` > 0.
        tokens: T, tokens of one microbatch on this rank (sequences × seq_len / cp).
    """
    a = layout.model_args
    t, bb = layout.tp, layout.param_bytes
    tsp = t if layout.sequence_parallel else 1
    gathered = a.dim if t > 1 else 0
    chunk = min(layout.cfg.loss.chunk_tokens, tokens)
    logits_bytes = 4 + (bb if bb < 4 else 0)
    norm = tokens * (2 * a.dim // tsp + gathered) * bb
    grads = tokens * a.dim * bb + a.vocab_size // t * a.dim * 4
    earlier = 0
    if layout.pp > 1 and layout.cfg.parallelism.pp_schedule.lower() == "gpipe":  # all forwards first
        earlier = (layout.pp_microbatches - 1) * grads
    return norm + grads + earlier + chunk * (a.vocab_size // t) * logits_bytes + 12 * tokens
