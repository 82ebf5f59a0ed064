"""Batch arithmetic of a step: global batch, data-parallel degree and gradient accumulation.

Torch-free, so the launcher's pre-flight (engine/setup/preflight.py) refuses a batch that does not divide
before any rank starts; the data loader (engine/data/loader.py) applies the same rule.
"""

from __future__ import annotations


def resolve_batch_sizes(local_batch_size: int, global_batch_size: int, dp_degree: int) -> tuple[int, int]:
    """(G, A): global batch size in sequences and gradient-accumulation steps per optimizer step.

    G = -1 means local_batch_size * dp_degree (A = 1).

    Raises:
        ValueError: non-positive sizes, or G not a multiple of local_batch_size * dp_degree.
    """
    if local_batch_size <= 0:
        raise ValueError(f"training.local_batch_size={local_batch_size} must be > 0")
    if dp_degree <= 0:
        raise ValueError(f"dp degree {dp_degree} must be >= 1")
    per_micro = local_batch_size * dp_degree
    if global_batch_size == -1:
        return per_micro, 1
    if global_batch_size <= 0 or global_batch_size % per_micro:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} must be -1 or a positive multiple of "
            f"training.local_batch_size * dp degree = {local_batch_size} * {dp_degree} = {per_micro}; "
            f"set it to e.g. {per_micro * max(1, global_batch_size // per_micro)}"
        )
    return global_batch_size, global_batch_size // per_micro
