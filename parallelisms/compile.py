"""Per-block ``torch.compile``.

Compiling each transformer block separately (rather than the whole model) keeps graphs small, lets
FSDP's per-block hooks stay outside the compiled regions, and makes all blocks share one compiled
artifact because they have identical structure (TorchTitan's approach). ``Module.compile`` compiles
in place, so parameter names and state-dict keys are unchanged.

Blocks with routed experts (the MoE families) are compiled by their static-shape parts: the
attention, the router's scores and top-k, and the shared experts (the RMSNorms are torch.nn modules,
which Dynamo does not compile as a frame of their own; they stay eager). Token routing (sorting tokens
by expert, the grouped expert matmuls over data-dependent token counts) and expert parallel's
all-to-all (whose split sizes are data too) stay eager: compiling them needs dynamic shapes and
unbacked symbols for every count, a recompilation or graph break per distinct routing, where the
static parts hold most of a block's elementwise work, which is what inductor fuses. Context
parallel's ring is one custom operator (parallelisms/ring_attention.py), opaque to the compiler:
a block that calls it stays one ``fullgraph`` graph.
"""

from __future__ import annotations

import torch.nn as nn


def static_parts(block: nn.Module) -> list[nn.Module]:
    """The submodules of an MoE block (one whose ``feed_forward`` has ``experts``) with static
    shapes: attention, router, shared experts; ``[block]`` for any other block. An activation
    checkpoint wrapper is looked through (its inner block's submodules are compiled)."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    ffn = getattr(inner, "feed_forward", None)
    if ffn is None or not hasattr(ffn, "experts"):
        return [block]
    parts = (getattr(inner, "attention", None), getattr(ffn, "router", None), getattr(ffn, "shared_experts", None))
    return [m for m in parts if m is not None]


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every block of ``model.layers`` in place with ``fullgraph=True`` (an MoE block: its
    :func:`static_parts`); returns the number of modules compiled.

    ``fullgraph`` turns a graph break into an error at the first step instead of a silent slowdown.
    """
    compiled = 0
    for block in model.layers.values():
        for module in static_parts(block):
            module.compile(backend=backend, fullgraph=True)
            compiled += 1
    return compiled
