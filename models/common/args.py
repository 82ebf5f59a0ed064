"""Hyper-parameters of the LLaMA-3 decoder every dense and MoE family builds on (FLOPs per token:
models/common/shapes.py ``training_flops_per_token``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaModelArgs", "ffn_hidden_dim"]


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Hidden width of the SwiGLU feed-forward, as in Meta's LLaMA reference code.

    hidden = int(2 * 4 * dim / 3) (SwiGLU keeps the parameter count of a 4*dim GELU MLP, Shazeer
    2020), scaled by `ffn_dim_multiplier` if set, then rounded *up* to a multiple of `multiple_of`.
    E.g. dim 4096, multiplier 1.3, multiple_of 1024 -> 14336 (LLaMA-3 8B).
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class LlamaModelArgs:
    """LLaMA-3 architecture settings (Grattafiori et al. 2024, "The Llama 3 Herd of Models").

    Attributes:
        dim: model (residual stream) width.
        n_layers: number of transformer blocks.
        n_heads: query heads; head_dim = dim // n_heads unless ``head_size`` is set.
        n_kv_heads: key/value heads for grouped-query attention; None means n_heads (plain MHA).
        vocab_size: rows of the embedding and of the output projection (tokens).
        multiple_of: the SwiGLU hidden width is rounded up to a multiple of this.
        ffn_dim_multiplier: optional factor on the SwiGLU hidden width (None = 1).
        norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base frequency (Su et al. 2021); LLaMA-3 uses 500000.
        rope_scaling: "none", or "llama3": Llama 3.1's long-context frequency scaling (Grattafiori
            et al. 2024; Meta's reference `apply_scaling`): wavelengths above
            rope_original_max_seq_len / rope_low_freq_factor are divided by rope_scaling_factor,
            those below rope_original_max_seq_len / rope_high_freq_factor kept, those between
            interpolated smoothly (see `models.common.decoder.rope_frequencies`); or "yarn" (Peng et al.
            2023, arXiv 2309.00071; Qwen3's long-context scaling, models/common/rope.py
            ``yarn_frequencies``): factor rope_scaling_factor over rope_original_max_seq_len, ramp
            bounds rope_yarn_beta_fast / rope_yarn_beta_slow, tables times 0.1·ln(factor) + 1.
        rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor: its factors (Llama 3.1:
            8, 1, 4; Llama 3.2: 32, 1, 4; YaRN reads the factor only: Qwen3 publishes 4).
        rope_original_max_seq_len: the context length (tokens) of pre-training before scaling (8192).
        rope_yarn_beta_fast, rope_yarn_beta_slow: YaRN's α, β (rotations; 32 and 1 as published).
        max_seq_len: longest sequence (tokens) the RoPE tables cover.
        tie_embeddings: share one [vocab, dim] matrix between tok_embeddings and output.
        ffn_hidden_size: explicit SwiGLU hidden width (Hugging Face's `intermediate_size`); None
            computes it from multiple_of and ffn_dim_multiplier.
        head_size: explicit width of one attention head (Hugging Face's ``head_dim``, e.g. Qwen3's
            128 with hidden 1024 and 16 heads); None means dim // n_heads. q/k/v then have
            n_heads * head_size (n_kv_heads * head_size) channels, and wo maps them back to dim.
        qk_norm: RMSNorm (weight [head_dim], eps ``norm_eps``) on each head's queries and keys
            before RoPE (Qwen3; Dehghani et al. 2023, "Scaling Vision Transformers to 22B
            Parameters"); False for LLaMA.
        depth_init: True: output projections (wo, w2, w3) of block i get init std
            0.02 / sqrt(2 * (i + 1)); False: 0.02 / sqrt(2 * n_layers) for every block (TorchTitan).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    ffn_hidden_size: int | None = None
    depth_init: bool = True
    head_size: int | None = None
    qk_norm: bool = False

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_size`` when set, else dim // n_heads."""
        if self.head_size is not None:
            return self.head_size
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads with the None default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def rope_scaling_params(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_seq_len) with llama3 scaling, else None."""
        if self.rope_scaling != "llama3":
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_seq_len)

    @property
    def rope_yarn_params(self) -> tuple[float, int, float, float] | None:
        """(factor, original_max_seq_len, beta_fast, beta_slow) with YaRN, else None."""
        if self.rope_scaling != "yarn":
            return None
        return (self.rope_scaling_factor, self.rope_original_max_seq_len, self.rope_yarn_beta_fast,
                self.rope_yarn_beta_slow)

    @property
    def rope_summary(self) -> str:
        """The RoPE frequencies in words, for messages: "llama3 scaling (factor 8, ...)" or "none"."""
        if self.rope_scaling == "none":
            return f"none (rope_theta {self.rope_theta:g}, unscaled)"
        if self.rope_scaling == "yarn":
            return (f"YaRN (factor {self.rope_scaling_factor:g}, "
                    f"original_max_seq_len {self.rope_original_max_seq_len}, "
                    f"beta_fast {self.rope_yarn_beta_fast:g}, beta_slow {self.rope_yarn_beta_slow:g})")
        return (f"llama3 scaling (factor {self.rope_scaling_factor:g}, low_freq_factor {self.rope_low_freq_factor:g}, "
                f"high_freq_factor {self.rope_high_freq_factor:g}, "
                f"original_max_seq_len {self.rope_original_max_seq_len})")

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden width: `ffn_hidden_size` when set, else see `ffn_hidden_dim`."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def validate(self) -> None:
        """Check that the settings describe a buildable model.

        Raises:
            ValueError: naming the field, its value and what it must satisfy.
        """
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaModelArgs.{name}={value!r} must be a positive integer")
        if self.n_kv_heads is not None and (
            not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0
        ):
            raise ValueError(
                f"LlamaModelArgs.n_kv_heads={self.n_kv_heads!r} must be a positive integer or None"
            )
        if self.head_size is not None and (
            not isinstance(self.head_size, int) or isinstance(self.head_size, bool) or self.head_size <= 0
        ):
            raise ValueError(f"LlamaModelArgs.head_size={self.head_size!r} must be a positive integer or None")
        if self.head_size is None and self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaModelArgs.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads dividing dim so that every head has dim // n_heads channels"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"LlamaModelArgs.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.kv_heads}; grouped-query attention shares each key/value head "
                f"between n_heads // n_kv_heads query heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaModelArgs head_dim = {self.head_dim} is odd; RoPE rotates channel pairs, so "
                f"choose dim and n_heads (or head_size) with an even head_dim"
            )
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ValueError(
                f"LlamaModelArgs.ffn_dim_multiplier={self.ffn_dim_multiplier!r} must be > 0 or None"
            )
        if not self.norm_eps > 0:
            raise ValueError(f"LlamaModelArgs.norm_eps={self.norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaModelArgs.rope_theta={self.rope_theta!r} must be > 0")
        if self.ffn_hidden_size is not None and (
            not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size <= 0
        ):
            raise ValueError(
                f"LlamaModelArgs.ffn_hidden_size={self.ffn_hidden_size!r} must be a positive integer or None"
            )
        if self.rope_scaling not in ("none", "llama3", "yarn"):
            raise ValueError(
                f"LlamaModelArgs.rope_scaling={self.rope_scaling!r}: choose \"none\", \"llama3\" or \"yarn\""
            )
        if self.rope_scaling == "yarn" and not (
            self.rope_scaling_factor >= 1 and self.rope_original_max_seq_len > 0
            and self.rope_yarn_beta_fast > self.rope_yarn_beta_slow > 0
        ):
            raise ValueError(
                f"LlamaModelArgs yarn RoPE scaling needs factor >= 1, original_max_seq_len > 0 and "
                f"beta_fast > beta_slow > 0; got factor={self.rope_scaling_factor}, "
                f"original_max_seq_len={self.rope_original_max_seq_len}, "
                f"beta_fast={self.rope_yarn_beta_fast}, beta_slow={self.rope_yarn_beta_slow}"
            )
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor > 0 and self.rope_original_max_seq_len > 0
            and self.rope_high_freq_factor > self.rope_low_freq_factor > 0
        ):
            raise ValueError(
                f"LlamaModelArgs llama3 RoPE scaling needs factor > 0, original_max_seq_len > 0 and "
                f"high_freq_factor > low_freq_factor > 0; got factor={self.rope_scaling_factor}, "
                f"original_max_seq_len={self.rope_original_max_seq_len}, "
                f"low={self.rope_low_freq_factor}, high={self.rope_high_freq_factor}"
            )
