"""Start-up rules of tensor, context and expert parallel: numbers in, one clear error out.

They need only the config and the model's sizes, never a tensor, and this module imports nothing
from torch, so the launcher's pre-flight (engine/setup/preflight.py) checks a layout before any rank
starts, in the time it takes to read the config. The parallelisms themselves live in
tensor_parallel.py, context_parallel.py and expert_parallel.py, which re-export these names; the
pipeline's rules are in pipeline_plan.py and the degrees' in parallel_dims.py.
"""

from __future__ import annotations

__all__ = [
    "ROTATE_METHODS",
    "ContextParallelError",
    "ExpertParallelError",
    "TensorParallelError",
    "validate_context_parallel",
    "validate_expert_parallel",
    "validate_tensor_parallel",
]


# ---------------------------------------------------------------- tensor parallel
class TensorParallelError(ValueError):
    """A ``[parallelism]`` tensor-parallel setting that cannot work with this model or run."""


def validate_tensor_parallel(
    parallelism_cfg,
    *,
    divisible: dict[str, int],
    vocab_size: int,
    seq_len: int,
    device_type: str,
    compile_enabled: bool,
) -> None:
    """Check the tensor-parallel settings before anything is built; raises the same error on every rank.

    Args:
        parallelism_cfg: ``[parallelism]`` (tp, sequence_parallel, loss_parallel, async_tp).
        divisible: model sizes that the plan shards over tp, by the name the user knows them by
            (e.g. ``{"dim": 256, "n_heads": 16}``); each must be a multiple of tp.
        vocab_size: rows of the embedding / output projection (tokens); the plan shards them over tp.
        seq_len: tokens per sequence (``training.seq_len``); sequence parallel shards it over tp.
        device_type: "cuda" or "cpu"; compile_enabled: ``compile.enable``.

    Raises:
        TensorParallelError: naming the setting, its value and the fix, for: a size in ``divisible``
            or ``vocab_size`` not divisible by tp, ``seq_len % tp != 0`` with sequence parallel,
            ``async_tp`` with tp = 1, without sequence parallel, without CUDA or without compile.
    """
    cfg = parallelism_cfg
    tp = cfg.tp
    if cfg.async_tp:
        # Async TP overlaps the sequence-parallel all-gather / reduce-scatter with the matmuls: it
        # is an inductor pass over CUDA symmetric-memory collectives, so it needs all of these.
        missing = []
        if tp <= 1:
            missing.append(f"parallelism.tp > 1 (it is {tp})")
        if not cfg.sequence_parallel:
            missing.append("parallelism.sequence_parallel = true (its collectives are what it overlaps)")
        if device_type != "cuda":
            missing.append(f"CUDA devices (this run uses {device_type})")
        if not compile_enabled:
            missing.append("compile.enable = true (the overlap is a torch.compile pass)")
        if missing:
            raise TensorParallelError(
                "parallelism.async_tp = true needs " + ", ".join(missing)
                + ". Set parallelism.async_tp = false, or meet those conditions."
            )
    if tp <= 1:
        return
    for name, size in divisible.items():
        if size % tp != 0:
            raise TensorParallelError(
                f"parallelism.tp = {tp} does not divide the model's {name} = {size}: tensor parallel "
                f"gives every rank {name} / tp of it. Choose a tp that divides {size}, or another flavor."
            )
    if vocab_size % tp != 0:
        padded = -(-vocab_size // tp) * tp
        raise TensorParallelError(
            f"parallelism.tp = {tp} does not divide the vocabulary size {vocab_size}: the embedding and "
            "the output projection (and, with parallelism.loss_parallel, the logits) are sharded over "
            f"the vocabulary. Pad it: set model.vocab_size = {padded} (ids the tokenizer never emits "
            "are harmless), or choose a tp that divides it."
        )
    if cfg.sequence_parallel and seq_len % tp != 0:
        raise TensorParallelError(
            f"training.seq_len = {seq_len} is not divisible by parallelism.tp = {tp}: sequence parallel "
            "gives every rank seq_len / tp tokens of each sequence. Choose a seq_len that is a multiple "
            "of tp, or set parallelism.sequence_parallel = false."
        )


# ---------------------------------------------------------------- context parallel
ROTATE_METHODS = ("ring", "allgather")


class ContextParallelError(ValueError):
    """A context-parallel setting that cannot serve this sequence length or attention."""


def validate_context_parallel(seq_len: int, cp: int, tp: int, load_balance: bool, rotate_method: str,
                              compile_enabled: bool = False) -> None:
    """Start-up checks: divisibility of seq_len by 2·cp·tp (cp·tp without load balancing) — each
    cp shard is split again over tp by sequence parallel — and a known rotate method.

    ``compile_enabled`` is accepted with any cp: the ring is one custom operator that compiled
    blocks call opaquely, and the all-gather method's collectives are functional (traceable).

    Raises:
        ContextParallelError: naming the numbers and the fix.
    """
    if rotate_method not in ROTATE_METHODS:
        raise ContextParallelError(
            f"parallelism.cp_rotate_method = {rotate_method!r}: Quadra's context parallel offers "
            f"{' and '.join(ROTATE_METHODS)} (all-to-all rotation is not implemented)."
        )
    parts = (2 if load_balance else 1) * cp * tp
    if seq_len % parts != 0:
        what = "2·cp·tp" if load_balance else "cp·tp"
        raise ContextParallelError(
            f"training.seq_len = {seq_len} must be divisible by {what} = {parts} with parallelism.cp = {cp}"
            f" and tp = {tp}; change seq_len (e.g. {parts * max(1, seq_len // parts)}) or the degrees."
        )


# ---------------------------------------------------------------- expert parallel
class ExpertParallelError(ValueError):
    """A ``[parallelism] ep`` setting that cannot work with this model."""


def validate_expert_parallel(ep: int, num_experts: int) -> None:
    """Start-up check, the same on every rank.

    Raises:
        ExpertParallelError: ``num_experts`` not divisible by ``ep``.
    """
    if ep > 1 and num_experts % ep != 0:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ExpertParallelError(
            f"parallelism.ep = {ep} does not divide the model's num_experts = {num_experts}: each ep "
            f"rank holds num_experts / ep experts. Set parallelism.ep to one of {divisors}."
        )
