"""LLaMA-3 decoder-only transformer, single-device code that parallelisms can slice and shard.

Architecture (Touvron et al. 2023; Grattafiori et al. 2024): token embedding -> n_layers x
[x + Attn(RMSNorm(x)); h + SwiGLU(RMSNorm(h))] -> RMSNorm -> output projection. Attention uses
RoPE (Su et al. 2021) and grouped-query attention (Ainslie et al. 2023).

Layout rules (engine/docs/architecture.md): blocks live in `layers`, an nn.ModuleDict keyed "0".."L-1"
so parameter names survive pipeline splits; `tok_embeddings`, `norm` and `output` may be set to
None on pipeline stages. Attention infers its local head count from the tensors it sees (view with
-1), so tensor parallel can shard heads without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.document_mask import attention_inputs, document_attention
from models.common.init import init_generator, init_linear, init_tensor_, trunc_normal
from models.common.linear_cross_entropy import linear_cross_entropy_sum
from models.common.args import LlamaModelArgs
from models.common.rope import apply_rope, precompute_rope, rope_frequencies

__all__ = [
    "Transformer", "TransformerBlock", "Attention", "FeedForward", "rope_frequencies", "precompute_rope", "apply_rope",
]


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    Weights: wq [n_heads*head_dim, dim], wk/wv [n_kv_heads*head_dim, dim], wo [dim, n_heads*head_dim];
    with ``args.qk_norm`` also q_norm / k_norm [head_dim]: RMSNorm of each head's queries and keys
    before RoPE (Qwen3). head_dim is ``args.head_dim`` (dim // n_heads unless ``head_size`` is set).
    """

    def __init__(self, args: LlamaModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Absent (not None-valued attributes of a module) for LLaMA, so its parameter names stay.
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        self.qk_norm = args.qk_norm
        # (q, k, v[, documents=]) -> out on [B, H, S, head_dim]; None is causal SDPA over the local
        # sequence. Context parallel binds a function that attends over the whole cp-split sequence.
        self.attention_fn = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents=None) -> torch.Tensor:
        """x: [B, S, dim]; cos/sin: [(B,) >= S, head_dim // 2] (rows for positions 0..); documents:
        None (causal), int [B, S_window] ids of the whole window (S_window = S except under context
        parallel) or, on CUDA, their BlockMask (block-causal: models/common/document_mask.py). Returns [B, S, dim].

        Raises:
            ValueError: the RoPE tables have fewer than S rows.
        """
        bs, seqlen, _ = x.shape
        # Only here is the full S known: under sequence parallel the blocks receive sequence shards
        # and tensor parallel gathers them just before attention, so the model hands over tables
        # covering every position and attention takes the first S rows.
        if seqlen > cos.shape[-2]:
            raise ValueError(
                f"attention over {seqlen} positions but the RoPE tables cover {cos.shape[-2]}: pass "
                f"positions for every token, or a sequence of at most max_seq_len tokens"
            )
        cos, sin = cos[..., :seqlen, :], sin[..., :seqlen, :]
        # -1, not n_heads: under tensor parallel each rank holds only its share of the heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.qk_norm:  # over each head's head_dim channels, before the rotation (Qwen3)
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)
        n_rep = xq.shape[2] // xk.shape[2]
        if n_rep > 1:
            # Explicit repeat instead of SDPA's enable_gqa: every backend (incl. the CPU flash
            # kernel and hand-written ring attention) then sees plain multi-head tensors.
            xk = xk.repeat_interleave(n_rep, dim=2)
            xv = xv.repeat_interleave(n_rep, dim=2)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if self.attention_fn is not None:
            extra = {} if documents is None else {"documents": documents}
            out = self.attention_fn(xq, xk, xv, **extra)
        elif documents is not None:
            out = document_attention(xq, xk, xv, documents)
        else:
            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)  # [B, H, S, head_dim]
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        """wq/wk/wv ~ trunc_normal(0.02); wo ~ trunc_normal(init_std) (TorchTitan's scheme); QK norms = 1."""
        for name in ("wq", "wk", "wv"):
            init_linear(getattr(self, name), 0.02, seed, f"{prefix}.{name}")
        init_linear(self.wo, init_std, seed, f"{prefix}.wo")
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x); w1/w3 [hidden, dim], w2 [dim, hidden]."""

    def __init__(self, args: LlamaModelArgs, hidden_dim: int | None = None):
        super().__init__()
        # hidden_dim overrides the dense width, e.g. for the shared experts of an MoE layer.
        hidden = args.ffn_hidden_dim if hidden_dim is None else hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, dim] -> [B, S, dim]."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        """w1 ~ trunc_normal(0.02); w2, w3 ~ trunc_normal(init_std) (TorchTitan's scheme)."""
        init_linear(self.w1, 0.02, seed, f"{prefix}.w1")
        init_linear(self.w2, init_std, seed, f"{prefix}.w2")
        init_linear(self.w3, init_std, seed, f"{prefix}.w3")


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))."""

    def __init__(self, layer_id: int, args: LlamaModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Residual-branch outputs get a smaller std so the residual stream does not grow with depth.
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents=None) -> torch.Tensor:
        """x: [B, S, dim]; cos/sin: [(B,) >= S, head_dim // 2]; documents: see Attention. Returns [B, S, dim].

        Under sequence parallel x and the result are sequence shards [B, S/tp, dim].
        """
        # documents by keyword: tensor parallel's input hook on attention lays out positional inputs only.
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, seed: int = 0) -> None:
        """Init this block from (seed, layer_id) only, so any pipeline layout gets equal weights."""
        prefix = f"layers.{self.layer_id}"
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std, seed, f"{prefix}.attention")
        self.feed_forward.init_weights(self.weight_init_std, seed, f"{prefix}.feed_forward")


class Transformer(nn.Module):
    """LLaMA-3 model, or a pipeline stage of it (some of tok_embeddings/norm/output set to None).

    Build on the meta device, parallelize, then `to_empty(device=...)` and `init_weights(seed)`.
    With `tie_embeddings`, `output.weight is tok_embeddings.weight` (re-tied after `.to()` /
    `to_empty()`, which would otherwise create two separate parameters).

    Raises:
        ValueError: from `LlamaModelArgs.validate()` for inconsistent settings.
    """

    # Model families that change only the block (e.g. models/moe) override this.
    block_cls = TransformerBlock
    # False on a pipeline stage after the first: its input is the previous stage's hidden state even
    # when it holds ``tok_embeddings`` (a copy for its output head's use, parallelisms/pipeline.py).
    embeds_tokens = True
    # Modules beside the output head that a pipeline split keeps on the last stage only (e.g.
    # DeepSeek-V3's multi-token prediction), and whether they read ``tok_embeddings``.
    head_modules: tuple[str, ...] = ()
    head_reads_embeddings = False
    shares_embeddings = False  # a pipeline stage whose tok_embeddings another stage also holds

    def __init__(self, model_args: LlamaModelArgs):
        super().__init__()
        model_args.validate()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict(
            {str(i): self.block_cls(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self._tie_weights()
        # Non-persistent: derived from the args, so checkpoints need not carry (or reshard) them.
        cos, sin = precompute_rope(model_args.head_dim, model_args.max_seq_len, model_args.rope_theta,
                                   scaling=model_args.rope_scaling_params, yarn=model_args.rope_yarn_params)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _tie_weights(self) -> None:
        if self.model_args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # nn.Module._apply replaces each module's parameter separately when the tensor type
        # changes (e.g. meta -> cpu in to_empty), which would silently untie the embeddings.
        result = super()._apply(fn, recurse)
        self._tie_weights()
        return result

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 256) -> torch.Tensor:
        """Run the (partial) model.

        Args:
            tokens: LongTensor [B, S] token ids if this part has tok_embeddings, else the float
                hidden state [B, S, dim] from the previous pipeline stage.
            positions: LongTensor [S] RoPE positions of the S tokens, or [B, S] per sequence (e.g.
                restarting at each document, models/common/document_mask.py); None means 0..S-1.
            documents: None for causal attention, or int [B, S_window] document ids of the whole
                packed window (block-causal attention; under context parallel S_window = S · cp).
            labels: LongTensor [B, S] targets (-100: no label), or None. Given to a part with
                `output`, the output projection and the cross entropy run fused, `loss_chunk_tokens`
                tokens at a time (models/common/linear_cross_entropy.py), and no logits are returned.
        Returns:
            with `output`: the fp32 token-sum cross entropy (0-dim) if `labels` is given, else the
            logits [B, S, vocab_size]; without `output`: the hidden state [B, S, dim].
        Raises:
            ValueError: wrong input rank/dtype for this part, or S > max_seq_len.
        """
        h, _ = self.trunk(tokens, positions, documents)
        return self.head(h, labels, loss_chunk_tokens)

    def trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
              documents: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """The embedding (when this part has it) and the blocks of :meth:`forward`: returns the hidden
        state [B, S, dim] before the final norm and (cos, sin, block keyword inputs), what further
        blocks on the same tokens take (e.g. DeepSeek-V3's multi-token prediction).

        Raises:
            ValueError: as :meth:`forward`.
        """
        embeds = self.tok_embeddings is not None and self.embeds_tokens
        if embeds:
            if tokens.dim() != 2 or tokens.is_floating_point():
                raise ValueError(
                    f"this model part embeds tokens: expected integer token ids [B, S], got "
                    f"{tokens.dtype} of shape {tuple(tokens.shape)}"
                )
            h = self.tok_embeddings(tokens)
        else:
            if tokens.dim() != 3 or not tokens.is_floating_point():
                raise ValueError(
                    f"this model part has no tok_embeddings: expected a float hidden state "
                    f"[B, S, dim], got {tokens.dtype} of shape {tuple(tokens.shape)}"
                )
            h = tokens
        # tokens.shape[1] is the full S for token ids; a hidden state from an earlier pipeline stage
        # may already be a sequence-parallel shard of it.
        cos, sin = self._rope_tables(tokens.shape[1], positions, exact=embeds)
        extra = {} if documents is None else {"documents": attention_inputs(documents, self.layers.values())}
        for layer in self.layers.values():
            h = layer(h, cos, sin, **extra)
        return h, (cos, sin, extra)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_chunk_tokens: int = 256) -> torch.Tensor:
        """The final norm and output of :meth:`forward` on the blocks' hidden state ``h`` [B, S, dim]."""
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and labels is not None:
            z_loss = getattr(self, "z_loss", None) if torch.is_grad_enabled() else None  # training only
            z_args = () if z_loss is None else (z_loss.weight, z_loss.add)
            return linear_cross_entropy_sum(h, self.output.weight, labels, loss_chunk_tokens, *z_args)
        if self.output is not None:
            h = self.output(h)
        return h

    def _rope_tables(
        self, seqlen: int, positions: torch.Tensor | None, exact: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [R, head_dim // 2]: all max_seq_len rows, or the rows of the given `positions`
        ([B, R, head_dim // 2] for per-sequence positions [B, R]).

        Attention takes the first S rows it needs (see `Attention.forward`). `seqlen` is the length
        of this part's input: the full S for token ids (then `positions` must have exactly S
        entries, `exact`), possibly a sequence-parallel shard of S for a hidden state (then at least
        `seqlen`).
        """
        if positions is None:
            if seqlen > self.model_args.max_seq_len:
                raise ValueError(
                    f"sequence of {seqlen} tokens exceeds the model's max_seq_len="
                    f"{self.model_args.max_seq_len}; lower training.seq_len or use a flavor "
                    f"with a larger max_seq_len"
                )
            return self.rope_cos, self.rope_sin
        n = positions.shape[-1]
        if positions.dim() not in (1, 2) or n < seqlen or (exact and n != seqlen):
            raise ValueError(
                f"positions must be a LongTensor [S={seqlen}] or [B, S], got shape {tuple(positions.shape)}"
            )
        return self.rope_cos[positions], self.rope_sin[positions]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every present parameter and the RoPE buffers, deterministically.

        Each parameter is drawn from a generator seeded by (seed, its name in the full model), so
        a pipeline stage or sharded copy gets the same values as the full single-device model
        (independent of the global torch RNG). TorchTitan's scheme: tok_embeddings ~ normal(0, 1);
        per-block scheme in TransformerBlock; norms = 1; output ~ trunc_normal(0, dim^-0.5)
        cut at +-3 std. A tied matrix gets the output init (normal(0, 1) logits would be
        sqrt(dim) too large).

        Args:
            seed: base seed (training.seed).
            buffer_device: device for the RoPE tables; None keeps their current device.
        Raises:
            ValueError: tie_embeddings with only one of tok_embeddings/output on this part.
        """
        args = self.model_args
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = precompute_rope(
            args.head_dim, args.max_seq_len, args.rope_theta, device=device, scaling=args.rope_scaling_params,
            yarn=args.rope_yarn_params
        )
        out_std = args.dim**-0.5
        if args.tie_embeddings:
            if (self.tok_embeddings is None) != (self.output is None):
                raise ValueError(
                    "model.tie_embeddings=True but this model part holds only one of "
                    "tok_embeddings/output (a pipeline split separates them); set "
                    "model.tie_embeddings=false to use pipeline parallel"
                )
            if self.tok_embeddings is not None:
                init_tensor_(
                    self.tok_embeddings.weight,
                    trunc_normal(out_std, cutoff=3.0),
                    init_generator(seed, "tok_embeddings.weight"),
                )
        else:
            if self.tok_embeddings is not None:
                init_tensor_(
                    self.tok_embeddings.weight,
                    lambda t, g: nn.init.normal_(t, mean=0.0, std=1.0, generator=g),
                    init_generator(seed, "tok_embeddings.weight"),
                )
            if self.output is not None:
                init_tensor_(
                    self.output.weight,
                    trunc_normal(out_std, cutoff=3.0),
                    init_generator(seed, "output.weight"),
                )
        for layer in self.layers.values():
            layer.init_weights(seed)
        if self.norm is not None:
            self.norm.reset_parameters()
