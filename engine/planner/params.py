"""Every parameter of a model with its placement under the model's parallelize plan, torch-free.

The plan is models/llama/parallelize.py (Megatron-LM TP, arXiv 1909.08053: wq/wk/wv/w1/w3
column-parallel = ``Shard(0)`` of the [out, in] weight, wo/w2 row-parallel = ``Shard(1)``; the
vocab-parallel embedding and the output head ``Shard(0)``; norms replicated) and
models/moe/parallelize.py (routed experts ``Shard(0)`` over the ``ep`` mesh and FSDP-sharded over the
remaining ``dp_shard·cp/ep`` ranks on dim 0, or dim 1 when the local experts do not divide; router gate
and, without ep, the experts replicated on tp; shared experts as the dense feed-forward). FSDP2 then
shards the TP-local tensor's dim 0 over ``dp_shard × cp`` (parallelisms/data_parallel.py).

Shards follow ``torch.chunk``: a dim of size n over k ranks gives chunks of ceil(n/k), the last ones
shorter or empty (DTensor ``Shard`` and FSDP2 both split this way; FSDP2 pads each all-gather input to
the full chunk size, which :func:`padded_numel` gives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``name`` (as in ``named_parameters``), global ``shape``, ``layer`` (block index;
    None for the embedding, final norm and output), ``tp_dim`` (dim sharded over tp; None when
    replicated), ``expert`` (a routed-experts tensor [E, ...], sharded over ep when ep > 1),
    ``norm`` (an RMSNorm weight: a replicated DTensor under sequence parallel)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    tp_dim: int | None = None
    expert: bool = False
    norm: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def chunk_size(n: int, k: int, index: int) -> int:
    """Length of chunk ``index`` when ``torch.chunk`` splits n elements into k chunks."""
    size = -(-n // k)
    return max(0, min(size, n - index * size))


def padded_numel(shape: tuple[int, ...], dim: int, k: int) -> int:
    """Elements of ``shape`` with ``dim`` padded up to a multiple of k (FSDP2's all-gather buffer)."""
    padded = list(shape)
    padded[dim] = -(-shape[dim] // k) * k
    return math.prod(padded)


def model_params(args) -> list[ParamSpec]:
    """The parameters of a LLaMA (``LlamaModelArgs``) or MoE (``MoEModelArgs``) model in module order.

    Shapes are [out_features, in_features] for linear weights (nn.Linear), [vocab, dim] for the
    embedding and the output head, [E, dim, hidden] / [E, hidden, dim] for routed experts
    (models/moe/layers.py ``GroupedExperts``).
    """
    dim, head_dim = args.dim, args.head_dim
    moe = hasattr(args, "num_experts")
    params = [ParamSpec("tok_embeddings.weight", (args.vocab_size, dim), None, tp_dim=0)]
    for layer in range(args.n_layers):
        p = f"layers.{layer}."
        params += [
            ParamSpec(p + "attention.wq.weight", (args.n_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wk.weight", (args.kv_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wv.weight", (args.kv_heads * head_dim, dim), layer, tp_dim=0),
            ParamSpec(p + "attention.wo.weight", (dim, args.n_heads * head_dim), layer, tp_dim=1),
        ]
        if moe and args.is_moe_layer(layer):
            e, h = args.num_experts, args.moe_inter_dim
            params += [
                ParamSpec(p + "feed_forward.router.gate.weight", (e, dim), layer),
                ParamSpec(p + "feed_forward.experts.w1", (e, dim, h), layer, expert=True),
                ParamSpec(p + "feed_forward.experts.w2", (e, h, dim), layer, expert=True),
                ParamSpec(p + "feed_forward.experts.w3", (e, dim, h), layer, expert=True),
            ]
            if args.n_shared_experts > 0:
                hs = h * args.n_shared_experts
                params += [
                    ParamSpec(p + "feed_forward.shared_experts.w1.weight", (hs, dim), layer, tp_dim=0),
                    ParamSpec(p + "feed_forward.shared_experts.w2.weight", (dim, hs), layer, tp_dim=1),
                    ParamSpec(p + "feed_forward.shared_experts.w3.weight", (hs, dim), layer, tp_dim=0),
                ]
        else:
            hidden = args.ffn_hidden_dim
            params += [
                ParamSpec(p + "feed_forward.w1.weight", (hidden, dim), layer, tp_dim=0),
                ParamSpec(p + "feed_forward.w2.weight", (dim, hidden), layer, tp_dim=1),
                ParamSpec(p + "feed_forward.w3.weight", (hidden, dim), layer, tp_dim=0),
            ]
        params += [ParamSpec(p + "attention_norm.weight", (dim,), layer, norm=True),
                   ParamSpec(p + "ffn_norm.weight", (dim,), layer, norm=True)]
    params.append(ParamSpec("norm.weight", (dim,), None, norm=True))
    if not args.tie_embeddings:
        params.append(ParamSpec("output.weight", (args.vocab_size, dim), None, tp_dim=0))
    return params


@dataclass(frozen=True)
class LocalParam:
    """A parameter as one rank holds it.

    Attributes:
        spec: the :class:`ParamSpec`.
        tp_local: shape after tensor/expert parallel (what FSDP shards); unsharded = gathered size.
        fsdp_dim: the dim FSDP shards (0, or 1 for experts whose local count does not divide).
        fsdp_size: ranks sharing it over FSDP (1: not sharded).
        local_numel: elements this rank stores.
        unit: FSDP unit ("root", "layers.N", "layers.N.experts").
    """

    spec: ParamSpec
    tp_local: tuple[int, ...]
    fsdp_dim: int
    fsdp_size: int
    local_numel: int
    unit: str


def stage_param_specs(args, layers: tuple[int, ...] | None, first: bool, last: bool) -> list[ParamSpec]:
    """The parameters a pipeline stage holds: its layers, the embedding on the first stage, the final
    norm and output head on the last (parallelisms/pipeline.py ``build_stage_module``)."""
    keep = None if layers is None else set(layers)
    out = []
    for spec in model_params(args):
        if spec.layer is not None:
            if keep is None or spec.layer in keep:
                out.append(spec)
        elif spec.name.startswith("tok_embeddings"):
            if first:
                out.append(spec)
        elif last:
            out.append(spec)
    return out


def local_params(specs: list[ParamSpec], layout, coords: dict | None = None) -> list[LocalParam]:
    """Each parameter's local shard on the rank at mesh ``coords`` (default: coordinate 0 everywhere,
    the rank with the largest shards).

    Args:
        specs: from :func:`stage_param_specs`; layout: an ``engine.planner.layout.Layout``.
        coords: {"tp": i, "dp_shard": j, "cp": k, ...}.
    """
    coords = coords or {}
    tp_rank, cp_rank = coords.get("tp", 0), coords.get("cp", 0)
    shard_rank = coords.get("dp_shard", 0) * layout.cp + cp_rank  # rank in dp_shard × cp
    fsdp = layout.dp_shard * layout.cp
    ep = layout.ep
    out = []
    for spec in specs:
        shape = list(spec.shape)
        unit = "root" if spec.layer is None else f"layers.{spec.layer}"
        if spec.expert and ep > 1:
            in_ep = ep // layout.cp
            ep_rank = (coords.get("dp_shard", 0) % in_ep) * layout.cp + cp_rank
            shape[0] = chunk_size(shape[0], ep, ep_rank)
            size = fsdp // ep
            mod_rank = coords.get("dp_shard", 0) // in_ep
            dim = 1 if (shape[0] % size != 0 and shape[1] % size == 0) else 0
            tp_local = tuple(shape)
            if size > 1:
                shape[dim] = chunk_size(shape[dim], size, mod_rank)
            out.append(LocalParam(spec, tp_local, dim, size, math.prod(shape), unit + ".experts"))
            continue
        if spec.tp_dim is not None and layout.tp > 1:
            shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], layout.tp, tp_rank)
        tp_local = tuple(shape)
        if fsdp > 1:
            shape[0] = chunk_size(shape[0], fsdp, shard_rank)
        out.append(LocalParam(spec, tp_local, 0, fsdp if fsdp > 1 else 1, math.prod(shape), unit))
    return out
