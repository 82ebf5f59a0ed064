"""The planner's view of a Qwen3 / Qwen3-MoE model, torch-free: every parameter's shape and how the
plan shards it, and the training FLOPs per token.

:func:`param_shapes` lists the fields of engine/planner/params.py's ``ParamSpec`` (name, shape,
layer, tp_dim, expert, norm) in module order. The plan is LLaMA's and the MoE model's
(models/llama/parallelize.py, models/moe/parallelize.py): wq/wk/wv/w1/w3 column-parallel
(``tp_dim`` 0 of the [out, in] weight), wo/w2 row-parallel (``tp_dim`` 1), the vocab-parallel
embedding and output head ``tp_dim`` 0, RMSNorm weights replicated, routed experts sharded over ep.
What Qwen3 adds: q/k/v/o widths of ``n_heads * head_dim`` with head_dim free of dim / n_heads, and
the QK-norm weights [head_dim] per block, replicated on every tp rank whether or not sequence
parallel is on (their gradient is all-reduced over tp in both cases, a Replicate DTensor), so they
are ``norm`` entries.
"""

from __future__ import annotations

__all__ = ["param_shapes", "flops_per_token"]


def _spec(name: str, shape: tuple[int, ...], layer: int | None, tp_dim: int | None = None,
          expert: bool = False, norm: bool = False) -> dict:
    return {"name": name, "shape": shape, "layer": layer, "tp_dim": tp_dim, "expert": expert, "norm": norm}


def _block(args, layer: int) -> list[dict]:
    p, dim, hd = f"layers.{layer}.", args.dim, args.head_dim
    out = [
        _spec(p + "attention.wq.weight", (args.n_heads * hd, dim), layer, tp_dim=0),
        _spec(p + "attention.wk.weight", (args.kv_heads * hd, dim), layer, tp_dim=0),
        _spec(p + "attention.wv.weight", (args.kv_heads * hd, dim), layer, tp_dim=0),
        _spec(p + "attention.wo.weight", (dim, args.n_heads * hd), layer, tp_dim=1),
    ]
    if args.qk_norm:
        out += [_spec(p + "attention.q_norm.weight", (hd,), layer, norm=True),
                _spec(p + "attention.k_norm.weight", (hd,), layer, norm=True)]
    if hasattr(args, "num_experts") and args.is_moe_layer(layer):
        e, h = args.num_experts, args.moe_inter_dim
        out += [
            _spec(p + "feed_forward.router.gate.weight", (e, dim), layer),
            _spec(p + "feed_forward.experts.w1", (e, dim, h), layer, expert=True),
            _spec(p + "feed_forward.experts.w2", (e, h, dim), layer, expert=True),
            _spec(p + "feed_forward.experts.w3", (e, dim, h), layer, expert=True),
        ]
        if args.n_shared_experts > 0:
            hs = h * args.n_shared_experts
            out += [_spec(p + "feed_forward.shared_experts.w1.weight", (hs, dim), layer, tp_dim=0),
                    _spec(p + "feed_forward.shared_experts.w2.weight", (dim, hs), layer, tp_dim=1),
                    _spec(p + "feed_forward.shared_experts.w3.weight", (hs, dim), layer, tp_dim=0)]
    else:
        f = args.ffn_hidden_dim
        out += [_spec(p + "feed_forward.w1.weight", (f, dim), layer, tp_dim=0),
                _spec(p + "feed_forward.w2.weight", (dim, f), layer, tp_dim=1),
                _spec(p + "feed_forward.w3.weight", (f, dim), layer, tp_dim=0)]
    return out + [_spec(p + "attention_norm.weight", (dim,), layer, norm=True),
                  _spec(p + "ffn_norm.weight", (dim,), layer, norm=True)]


def param_shapes(args) -> list[dict]:
    """Every parameter of the whole model (a tied output head once, as ``named_parameters``), in
    module order, as ``ParamSpec`` keyword dicts.

    Args:
        args: ``Qwen3ModelArgs`` or ``Qwen3MoEModelArgs`` (any LLaMA / MoE arguments work).
    """
    out = [_spec("tok_embeddings.weight", (args.vocab_size, args.dim), None, tp_dim=0)]
    for layer in range(args.n_layers):
        out += _block(args, layer)
    out.append(_spec("norm.weight", (args.dim,), None, norm=True))
    if not args.tie_embeddings:
        out.append(_spec("output.weight", (args.vocab_size, args.dim), None, tp_dim=0))
    return out


def flops_per_token(args, seq_len: int) -> int:
    """Training FLOPs per token of the whole model at ``seq_len`` tokens per sequence.

    6 · N_active_nonembedding + 12 · n_layers · n_heads · head_dim · seq_len (PaLM, Chowdhery et al.
    2022, App. B; ``LlamaModelArgs.get_nparams_and_flops``): the attention term uses head_dim, not
    dim / n_heads (Qwen3-0.6B: 16 · 128 = 2048 channels on a width of 1024). N leaves out the
    embedding lookup unless tied (then the matrix does the output matmul), and counts only the
    top_k routed experts a token uses (``MoEModelArgs.get_nparams_and_flops``).

    Raises:
        ValueError: seq_len not positive.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive (tokens per sequence)")
    n = 0
    for spec in param_shapes(args):
        numel = 1
        for size in spec["shape"]:
            numel *= size
        if spec["name"] == "tok_embeddings.weight" and not args.tie_embeddings:
            continue
        n += numel * args.top_k // args.num_experts if spec["expert"] else numel
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
