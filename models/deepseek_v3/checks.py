"""Start-up checks of ``[parallelism]`` against a DeepSeek-V3 model: torch-free, so the launcher's
pre-flight and every rank run the same rule before anything is built.

Tensor parallel (models/deepseek_v3/parallelize.py) splits MLA's heads (wq / wq_b, wkv_b, wo),
the dense layers' feed-forward width, the shared experts' width and the vocabulary; the query and
key-value latents (wq_a, wkv_a, their RMSNorms) are replicated and need no rule. Expert parallel
splits the routed experts.
"""

from __future__ import annotations

from parallelisms.checks import validate_expert_parallel, validate_tensor_parallel

__all__ = ["validate_deepseek_v3_parallelism"]


def validate_deepseek_v3_parallelism(
    model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool
) -> None:
    """Start-up checks of ``[parallelism]`` against a ``DeepseekV3ModelArgs``.

    Args:
        model_args: after ``resolve_model_args``; parallelism_cfg: ``[parallelism]``; seq_len:
        ``training.seq_len`` (tokens); device_type: "cuda"/"cpu"; compile_enabled: ``compile.enable``.

    Raises:
        ExpertParallelError (a ValueError): ``num_experts`` not divisible by ``ep``. (``compile.enable``
            compiles the blocks' static-shape parts, the multi-token-prediction blocks' too; routing
            stays eager: parallelisms/compile.py.)
        TensorParallelError (a ValueError): n_heads, dim, the dense or shared-expert width or the
            vocabulary not divisible by tp, and the other tensor-parallel rules of parallelisms/checks.py.
    """
    validate_expert_parallel(parallelism_cfg.ep, model_args.num_experts)
    divisible = {"dim": model_args.dim, "n_heads": model_args.n_heads}
    if model_args.n_shared_experts > 0:
        divisible["shared experts' width (n_shared_experts × moe_inter_dim)"] = (
            model_args.n_shared_experts * model_args.moe_inter_dim)
    if model_args.n_dense_layers > 0:
        divisible["feed-forward width (ffn_hidden_size)"] = model_args.ffn_hidden_dim
    validate_tensor_parallel(parallelism_cfg, divisible=divisible, vocab_size=model_args.vocab_size,
                             seq_len=seq_len, device_type=device_type, compile_enabled=compile_enabled)
