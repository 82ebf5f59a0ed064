"""Attention alone: block-causal over packed documents (models/common/document_mask.py) vs plain causal SDPA.

One forward + backward of ``document_attention`` and of ``F.scaled_dot_product_attention(is_causal=True)``
on the same q, k, v at the debug model's shape (B sequences, 16 heads of 16 channels, S tokens),
alternating in blocks (scripts/benchmarks/harness.py ``interleave``); the windows hold documents of
the short-document corpus's median length (22 tokens + BOS/EOS).
"""

from __future__ import annotations

import time


def attention_step_seconds(batch: int, seq_len: int, rounds: int, reps: int = 5, heads: int = 16,
                           head_dim: int = 16, doc_len: int = 24) -> dict[str, list[float]]:
    """{"masked": [s], "causal": [s]}: seconds per forward + backward, ``reps`` per block, ``rounds`` blocks each."""
    import torch
    import torch.nn.functional as F

    from models.common.document_mask import document_attention
    from scripts.benchmarks.harness import interleave

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=gen).requires_grad_() for _ in range(3))
    documents = (torch.arange(seq_len) // doc_len).to(torch.int32).expand(batch, seq_len).contiguous()
    upstream = torch.randn(batch, heads, seq_len, head_dim, generator=gen)

    def block(fn):
        def run() -> list[float]:
            times = []
            for _ in range(reps + 1):  # the first of each block is a warm-up
                start = time.perf_counter()
                (fn() * upstream).sum().backward()
                times.append(time.perf_counter() - start)
            return times[1:]
        return run

    return interleave({
        "masked": block(lambda: document_attention(q, k, v, documents)),
        "causal": block(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }, rounds)
