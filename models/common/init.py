"""Layout-independent, reproducible parameter initialization.

Why: a pipeline stage holding layers 3..5, a tensor-parallel shard, or an FSDP shard must start
from exactly the weights the single-device model would have. Drawing from the global RNG makes
the values depend on how many tensors were drawn before (i.e. on the layout). Instead every
parameter gets its own CPU generator seeded from (base seed, logical parameter name), the full
tensor is drawn on the CPU in float32, and each rank copies its part of it into the parameter.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["init_generator", "init_tensor_", "trunc_normal", "init_linear"]


def init_generator(seed: int, name: str) -> torch.Generator:
    """CPU generator seeded from (seed, name), e.g. (0, "layers.3.attention.wq.weight").

    The 63-bit seed is a SHA-256 of both, so it is stable across processes and Python runs
    (unlike `hash()`), and nearby names give unrelated streams.
    """
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


@torch.no_grad()
def init_tensor_(
    param: torch.Tensor,
    fn: Callable[[torch.Tensor, torch.Generator], object],
    generator: torch.Generator,
) -> torch.Tensor:
    """Fill `param` in place with `fn` applied to a full float32 CPU tensor of its global shape.

    Args:
        param: parameter or buffer to fill, of any device/dtype; a DTensor gets its local shard
            of the full tensor (no communication: every rank draws the same full tensor).
        fn: `fn(tensor, generator)` fills `tensor` in place, e.g.
            `lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)`.
        generator: CPU generator (see `init_generator`).
    Returns:
        `param`.
    Note: the full tensor is materialized on the CPU (and, for a DTensor, once on its device), one
    parameter at a time: 128256 x 16384 fp32 = 8.4 GB for the 405B embedding.
    """
    full = torch.empty(tuple(param.shape), dtype=torch.float32, device="cpu")
    fn(full, generator)
    # Imported here so that single-device use does not need torch.distributed to be usable.
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: each rank slices its own copy, no scatter/broadcast.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
    return param


def trunc_normal(std: float, cutoff: float | None = None):
    """Filler for `init_tensor_`: truncated normal(0, std) cut at +-cutoff*std (default +-2)."""
    a, b = (-2.0, 2.0) if cutoff is None else (-cutoff * std, cutoff * std)
    return lambda t, g: nn.init.trunc_normal_(t, mean=0.0, std=std, a=a, b=b, generator=g)


def init_linear(linear: nn.Linear, std: float, seed: int, name: str) -> None:
    """Init `linear.weight` (named `name` in the full model) with trunc_normal(0, std)."""
    init_tensor_(linear.weight, trunc_normal(std), init_generator(seed, f"{name}.weight"))
