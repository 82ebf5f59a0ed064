"""Start-up checks of ``[parallelism]`` against a decoder built on models/common: torch-free, so the
launcher's pre-flight (engine/setup/preflight.py) and every rank run the same rule before anything
is built.

The plans (models/common/parallelize.py, models/common/moe_parallelize.py, and a family's own
attention plan) shard the same things in every family, so one table says what tensor parallel
splits (Megatron-LM, arXiv 1909.08053): the query heads and ``dim``; grouped key/value heads when
the attention has them; the dense feed-forward width when some block is dense; the fused shared
experts' width; and the vocabulary (parallelisms/checks.py). Expert parallel splits the routed
experts. Replicated tensors (norms, QK-norm, MLA's latents, the router) need no rule.
"""

from __future__ import annotations

from typing import Callable

from parallelisms.checks import ExpertParallelError, validate_expert_parallel, validate_tensor_parallel

__all__ = ["tensor_parallel_sizes", "decoder_parallelism_check"]


def tensor_parallel_sizes(model_args) -> dict[str, int]:
    """What tensor parallel splits in a decoder of ``model_args`` (``LlamaModelArgs`` or a subclass),
    as {"name in the message": size}: each size must be divisible by tp.

    Grouped key/value heads count when ``n_kv_heads`` is set (MLA leaves it unset: one key/value per
    head, already covered by ``n_heads``); the dense feed-forward width when some block is dense (an
    MoE model with ``n_dense_layers`` 0 has none); the shared experts' fused width when present.
    """
    sizes = {"dim": model_args.dim, "n_heads": model_args.n_heads}
    if model_args.n_kv_heads is not None:
        sizes["n_kv_heads"] = model_args.kv_heads
    routed = hasattr(model_args, "num_experts")
    if not routed or model_args.n_dense_layers > 0:
        sizes["feed-forward width (ffn_hidden_dim)"] = model_args.ffn_hidden_dim
    if routed and model_args.n_shared_experts > 0:
        sizes["shared experts' width (n_shared_experts × moe_inter_dim)"] = (
            model_args.n_shared_experts * model_args.moe_inter_dim)
    return sizes


def decoder_parallelism_check(family: str, *, sparse_family: str | None = None) -> Callable:
    """``ModelSpec.validate_parallelism_fn`` of a family built on models/common.

    Args:
        family: the family's ``model.name``, for the messages.
        sparse_family: for a dense family, the ``model.name`` of its mixture-of-experts sibling, which
            an ``ep > 1`` refusal suggests (e.g. "moe" for "llama").

    Returns:
        ``check(model_args, parallelism_cfg, *, seq_len, device_type, compile_enabled)``; seq_len in
        tokens, device_type "cuda"/"cpu". It raises ExpertParallelError (a ValueError) for ``ep > 1``
        on a dense model or ``num_experts`` not divisible by ep, and TensorParallelError (a
        ValueError) for a size of :func:`tensor_parallel_sizes` not divisible by tp and the other
        rules of parallelisms/checks.py, each naming the setting, the value and the fix.
    """

    def check(model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool) -> None:
        if hasattr(model_args, "num_experts"):
            validate_expert_parallel(parallelism_cfg.ep, model_args.num_experts)
        elif parallelism_cfg.ep > 1:
            instead = f', or train a mixture-of-experts model (model.name = "{sparse_family}")' if sparse_family else ""
            raise ExpertParallelError(
                f'parallelism.ep = {parallelism_cfg.ep}: model.name = "{family}" is dense and has no experts to '
                f"spread over ranks. Set parallelism.ep = 1{instead}.")
        validate_tensor_parallel(parallelism_cfg, divisible=tensor_parallel_sizes(model_args),
                                 vocab_size=model_args.vocab_size, seq_len=seq_len, device_type=device_type,
                                 compile_enabled=compile_enabled)

    check.__qualname__ = check.__name__ = f"validate_{family}_parallelism"
    return check
