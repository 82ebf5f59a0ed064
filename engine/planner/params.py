"""Every parameter of a model with its placement on one rank, torch-free.

The family lists its parameters and their tensor/expert-parallel placement (``ModelSpec.param_shapes``,
e.g. models/common/shapes.py, as :class:`models.common.planning.ParamSpec`); this module shards them the
way the parallelisms do. FSDP2 shards the TP-local tensor's dim 0 over ``dp_shard × cp``
(parallelisms/data_parallel.py); routed experts (``ParamSpec.expert``) are ``Shard(0)`` over the
``ep`` mesh and FSDP-sharded over the remaining ``dp_shard·cp/ep`` ranks (``dp_shard·cp·tp/ep`` when ep
spans tp) on dim 0, or dim 1 when the local experts do not divide.

Shards follow ``torch.chunk``: a dim of size n over k ranks gives chunks of ceil(n/k), the last ones
shorter or empty (DTensor ``Shard`` and FSDP2 both split this way; FSDP2 pads each all-gather input to
the full chunk size, which :func:`padded_numel` gives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models.common.planning import ParamSpec  # noqa: F401  (re-exported: the planner's parameter record)
from parallelisms.parallel_dims import ep_spans_tp


def chunk_size(n: int, k: int, index: int) -> int:
    """Length of chunk ``index`` when ``torch.chunk`` splits n elements into k chunks."""
    size = -(-n // k)
    return max(0, min(size, n - index * size))


def padded_numel(shape: tuple[int, ...], dim: int, k: int) -> int:
    """Elements of ``shape`` with ``dim`` padded up to a multiple of k (FSDP2's all-gather buffer)."""
    padded = list(shape)
    padded[dim] = -(-shape[dim] // k) * k
    return math.prod(padded)


def model_params(spec, args) -> list[ParamSpec]:
    """The parameters of model family ``spec`` (a ``ModelSpec``) with ``args``, in module order
    (``ModelSpec.param_shapes``).

    Raises:
        ValueError: the family gives no ``param_shapes``.
    """
    return spec.get("param_shapes")(args)


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


def stage_param_specs(params: list[ParamSpec], layers: tuple[int, ...] | None, first: bool,
                      last: bool) -> list[ParamSpec]:
    """The parameters (of :func:`model_params`) a pipeline stage holds: its layers, the embedding on the
    first stage (and its copy on the last when ``ParamSpec.on_last_stage``), the final norm and output
    head on the last (parallelisms/pipeline.py ``build_stage_module``)."""
    keep = None if layers is None else set(layers)
    out = []
    for spec in params:
        if spec.layer is not None:
            if keep is None or spec.layer in keep:
                out.append(spec)
        elif spec.name.startswith("tok_embeddings"):
            if first or (last and spec.on_last_stage):
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
            # Over tp too (parallelisms/parallel_dims.py ep_spans_tp): ep = dp_shard_in_ep × cp × tp.
            over_tp = ep_spans_tp(layout.dp_shard, layout.cp, layout.tp, ep)
            inner = layout.cp * layout.tp if over_tp else layout.cp
            in_ep = ep // inner
            ep_rank = (coords.get("dp_shard", 0) % in_ep) * inner + (cp_rank * layout.tp + tp_rank if over_tp
                                                                      else cp_rank)
            shape[0] = chunk_size(shape[0], ep, ep_rank)
            size = layout.dp_shard // in_ep
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


def rank_params(layout, coords: dict | None = None):
    """The :class:`LocalParam` list of the rank at ``coords`` (all its stages)."""
    coords = coords or {}
    out = []
    for layers, first, last in layout.stages_of(coords.get("pp", 0)):
        out += local_params(stage_param_specs(layout.params, layers, first, last), layout, coords)
    return out
