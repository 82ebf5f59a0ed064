"""Start-up checks of ``[parallelism]`` against an MoE model: torch-free, so the launcher's
pre-flight (engine/setup/preflight.py) and every rank run the same rule before anything is built."""

from __future__ import annotations

from parallelisms.checks import validate_expert_parallel, validate_tensor_parallel


def validate_moe_parallelism(
    model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool
) -> None:
    """Start-up checks of ``[parallelism]`` against an MoE model, the same on every rank.

    Tensor parallel shards what it shards in a LLaMA model (heads, dims, dense feed-forward width,
    vocabulary, sequence) and the shared experts' width; expert parallel splits the routed experts.

    Raises:
        ExpertParallelError (a ValueError): ``num_experts`` not divisible by ``ep``. (``compile.enable``
            compiles the blocks' static-shape parts; routing stays eager: parallelisms/compile.py.)
        TensorParallelError (a ValueError): a size above not divisible by ``tp``, and the other
            tensor-parallel checks.
    """
    validate_expert_parallel(parallelism_cfg.ep, model_args.num_experts)
    divisible = {
        "dim": model_args.dim,
        "n_heads": model_args.n_heads,
        "n_kv_heads": model_args.kv_heads,
        "feed-forward width (ffn_hidden_dim)": model_args.ffn_hidden_dim,
    }
    if model_args.n_shared_experts > 0:
        divisible["shared experts' width (n_shared_experts × moe_inter_dim)"] = (
            model_args.n_shared_experts * model_args.moe_inter_dim
        )
    validate_tensor_parallel(
        parallelism_cfg, divisible=divisible, vocab_size=model_args.vocab_size, seq_len=seq_len,
        device_type=device_type, compile_enabled=compile_enabled,
    )
