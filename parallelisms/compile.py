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

DeepSeek-V3 (models/deepseek_v3/model.py) follows the same rule, as TorchTitan compiles it per
block: its multi-head latent attention (latent projections and RMSNorms, the RoPE key, YaRN's
cos/sin tables and softmax scale, causal or document-masked attention) is the ``attention``, its
group-limited router the ``router`` (group scores, top-k of groups and of experts: static shapes),
its shared experts the ``shared_experts``; its first ``n_dense_layers`` blocks are dense and
compiled whole. The blocks of the model's ``head_modules`` (multi-token prediction's depths,
models/deepseek_v3/mtp.py) are ordinary blocks run on the main blocks' inputs and are compiled
alike (:func:`compiled_blocks`); the rest of a depth (two RMSNorms, a concatenation, one
projection) stays eager like the embedding and the output head.
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


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :func:`apply_compile` compiles: those of ``model.layers``, then every instance of
    the model's ``block_cls`` inside its ``head_modules`` (e.g. DeepSeek-V3's multi-token-prediction
    depths ``mtp.<k>.block``; a pipeline stage without them has None there)."""
    blocks = list(model.layers.values())
    block_cls = getattr(model, "block_cls", None)
    for name in getattr(model, "head_modules", ()):
        head = getattr(model, name, None)
        if head is not None and block_cls is not None:
            blocks += [m for m in head.modules() if isinstance(m, block_cls)]
    return blocks


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """What :func:`apply_compile` compiles: each of :func:`compiled_blocks`, or its :func:`static_parts`."""
    return [module for block in compiled_blocks(model) for module in static_parts(block)]


def compile_summary(models: list[nn.Module], backend: str, cp: int = 1) -> str:
    """The start-up line saying what :func:`apply_compile` compiled on this rank's ``models`` (its
    pipeline stages or the one model): whole blocks, MoE blocks by their static parts, and under
    context parallel (``cp`` > 1) that the ring attention stays one opaque operator with eager
    send/recv (parallelisms/ring_attention.py)."""
    blocks = [block for model in models for block in compiled_blocks(model)]
    parts = [static_parts(block) for block in blocks]
    whole = sum(1 for block, p in zip(blocks, parts) if p == [block])
    moe = len(blocks) - whole
    what = []
    if whole:
        what.append(f"{whole} whole block{'s' if whole > 1 else ''}")
    if moe:
        what.append(f"{moe} MoE block{'s' if moe > 1 else ''} by their attention, router and shared experts "
                    "(token routing and the all-to-all stay eager)")
    if cp > 1:
        what.append(f"the ring attention (cp {cp}) is one opaque operator inside them, its send/recv eager")
    return (f"compile ({backend}, fullgraph): {sum(len(p) for p in parts)} modules per rank: {'; '.join(what)}; "
            "the first step compiles")


def apply_compile(model: nn.Module, backend: str = "inductor", *, distributed: bool = False) -> int:
    """Compile every module of :func:`compiled_modules` in place with ``fullgraph=True``; returns how
    many. ``fullgraph`` turns a graph break into an error at the first step instead of a silent slowdown.

    ``distributed`` (world size > 1) turns AOTAutograd's on-disk cache off for this process
    (``torch._functorch.config.enable_autograd_cache``): its key does not hold the process-group
    names that DTensor's redistributions and the functional collectives bake into the compiled code,
    and the ranks of one mesh dimension's different groups (tp "15" on ranks 0-1, "16" on ranks 2-3)
    then share entries, so a rank loads code naming a group it is not in: "Could not resolve the
    process group registered under the name 16" (MoE under ep 2 × tp 2, inductor, at the first
    evaluation or the next run). Inductor's FX graph cache, keyed on the graph after AOTAutograd, group
    names included, stays on: a restarted run still reuses the generated kernels.
    """
    if distributed:
        import torch._functorch.config

        torch._functorch.config.enable_autograd_cache = False
    modules = compiled_modules(model)
    for module in modules:
        module.compile(backend=backend, fullgraph=True)
    return len(modules)
