"""Start-up checks of ``[parallelism]`` against a LLaMA model: torch-free, so the launcher's
pre-flight (engine/setup/preflight.py) and every rank run the same rule before anything is built."""

from __future__ import annotations

from parallelisms.checks import ExpertParallelError, validate_tensor_parallel


def validate_llama_parallelism(
    model_args, parallelism_cfg, *, seq_len: int, device_type: str, compile_enabled: bool
) -> None:
    """Start-up checks of ``[parallelism]`` against a LLaMA model, before anything is built.

    Tensor parallel gives every rank ``1/tp`` of the query heads, of the key/value heads (GQA), of
    the feed-forward width and of the vocabulary, and (with sequence parallel) of each sequence;
    ``dim`` is checked too, as the issue's contract (it follows from ``n_heads % tp`` here).

    Args:
        model_args: ``LlamaModelArgs`` after ``resolve_model_args`` (vocab_size as trained).
        parallelism_cfg: ``[parallelism]``.
        seq_len: ``training.seq_len`` (tokens); device_type: "cuda"/"cpu"; compile_enabled: ``compile.enable``.

    Raises:
        TensorParallelError (a ValueError): naming the setting, the value and the fix.
        ExpertParallelError (a ValueError): ``ep > 1`` (a dense model has no experts to spread).
    """
    if parallelism_cfg.ep > 1:
        raise ExpertParallelError(
            f"parallelism.ep = {parallelism_cfg.ep}: model.name = \"llama\" is dense and has no experts to "
            "spread over ranks. Set parallelism.ep = 1, or train a mixture-of-experts model (model.name = \"moe\")."
        )
    validate_tensor_parallel(
        parallelism_cfg,
        divisible={
            "dim": model_args.dim,
            "n_heads": model_args.n_heads,
            "n_kv_heads": model_args.kv_heads,
            "feed-forward width (ffn_hidden_dim)": model_args.ffn_hidden_dim,
        },
        vocab_size=model_args.vocab_size,
        seq_len=seq_len,
        device_type=device_type,
        compile_enabled=compile_enabled,
    )
