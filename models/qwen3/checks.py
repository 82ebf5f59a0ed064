"""Start-up checks of ``[parallelism]`` against a Qwen3 or Qwen3-MoE model: torch-free, so the
launcher's pre-flight and every rank run the same rule before anything is built.

The plans are LLaMA's and the MoE model's (models/common/parallelize.py, models/common/moe_parallelize.py),
so the rules are theirs: tensor parallel gives every rank 1/tp of the query and key/value heads, of
the feed-forward width and of the vocabulary; expert parallel 1/ep of the routed experts. The QK-norm
weights ([head_dim]) are replicated on the tp ranks and need no rule; ``head_dim`` itself is never
split.
"""

from __future__ import annotations

from parallelisms.checks import ExpertParallelError, validate_expert_parallel, validate_tensor_parallel

__all__ = ["validate_qwen3_parallelism", "validate_qwen3_moe_parallelism"]


def _validate_tp(model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool) -> None:
    divisible = {
        "dim": model_args.dim,
        "n_heads": model_args.n_heads,
        "n_kv_heads": model_args.kv_heads,
    }
    if getattr(model_args, "n_dense_layers", 0) > 0 or not hasattr(model_args, "num_experts"):
        divisible["feed-forward width (ffn_hidden_size)"] = model_args.ffn_hidden_dim
    if getattr(model_args, "n_shared_experts", 0) > 0:
        divisible["shared experts' width (n_shared_experts × moe_inter_dim)"] = (
            model_args.n_shared_experts * model_args.moe_inter_dim)
    validate_tensor_parallel(parallelism_cfg, divisible=divisible, vocab_size=model_args.vocab_size,
                             seq_len=seq_len, device_type=device_type, compile_enabled=compile_enabled)


def validate_qwen3_parallelism(
    model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool
) -> None:
    """Start-up checks of ``[parallelism]`` against a dense Qwen3 model.

    Args:
        model_args: ``Qwen3ModelArgs`` after ``resolve_model_args``; parallelism_cfg: ``[parallelism]``;
        seq_len: ``training.seq_len`` (tokens); device_type: "cuda"/"cpu"; compile_enabled: ``compile.enable``.

    Raises:
        ExpertParallelError (a ValueError): ``ep > 1`` (a dense model has no experts).
        TensorParallelError (a ValueError): a sharded size not divisible by tp, and the other
            tensor-parallel rules of parallelisms/checks.py.
    """
    if parallelism_cfg.ep > 1:
        raise ExpertParallelError(
            f"parallelism.ep = {parallelism_cfg.ep}: model.name = \"qwen3\" is dense and has no experts to "
            "spread over ranks. Set parallelism.ep = 1, or train model.name = \"qwen3_moe\"."
        )
    _validate_tp(model_args, parallelism_cfg, seq_len=seq_len, device_type=device_type,
                 compile_enabled=compile_enabled)


def validate_qwen3_moe_parallelism(
    model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool
) -> None:
    """Start-up checks of ``[parallelism]`` against a Qwen3-MoE model (arguments as
    :func:`validate_qwen3_parallelism`).

    Raises:
        ExpertParallelError (a ValueError): ``num_experts`` not divisible by ``ep`` (``compile.enable``
            compiles the blocks' static-shape parts, parallelisms/compile.py).
        TensorParallelError (a ValueError): as for the dense model.
    """
    validate_expert_parallel(parallelism_cfg.ep, model_args.num_experts)
    _validate_tp(model_args, parallelism_cfg, seq_len=seq_len, device_type=device_type,
                 compile_enabled=compile_enabled)
