"""DeepSeek-V3 (arXiv 2412.19437): the MoE Transformer with multi-head latent attention and
group-limited sigmoid routing; single-device code that the parallelisms slice and shard.

Everything else is the MoE model's (models/common/moe_decoder.py) and so LLaMA's: blocks in ``layers``
keyed "0".."L-1", ``tok_embeddings`` / ``norm`` / ``output`` may be None on pipeline stages, the
fused output projection + cross entropy, per-name deterministic init, the routing statistics and
the auxiliary-loss-free bias after each optimizer step. Block ``i < n_dense_layers``
(``first_k_dense_replace``) keeps the dense SwiGLU.

MLA data flow for x [B, S, dim] (DeepSeek-V2, arXiv 2405.04434 §2.1; H heads, local under tensor
parallel):
    q  = wq(x) or wq_b(q_norm(wq_a(x)))                    [B, S, H, nope + rope]
    c, k_pe = split(wkv_a(x), [kv_lora_rank, rope])        latent, one RoPE key shared by the heads
    k_nope, v = split(wkv_b(kv_norm(c)), [nope, v_head])   [B, S, H, ·]
    k = [k_nope, RoPE(k_pe) broadcast over heads]; q = [q_nope, RoPE(q_pe)]
    out = wo(softmax(q·kᵀ · softmax_scale) v)              softmax_scale: args.softmax_scale
The attention kernels (SDPA, document masking, ring attention) use 1/sqrt(q width); a YaRN scale
is applied by multiplying q by softmax_scale · sqrt(qk_head_dim) first.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F

from models.common.document_mask import document_attention
from models.common.init import init_linear
from models.common.rope import apply_rope
from models.deepseek_v3.args import DeepseekV3ModelArgs
from models.deepseek_v3.mtp import MTPModule, mtp_targets, token_sum_cross_entropy
from models.deepseek_v3.yarn import deepseek_rope_tables
from models.common.moe import MoE, TokenChoiceRouter
from models.common.moe_decoder import MoETransformer, MoETransformerBlock

__all__ = ["DeepseekV3Transformer", "MLAttention", "RopeKey", "GroupLimitedRouter", "DeepseekV3MoE"]

def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local value (the vocab-parallel loss is a Replicate DTensor under tensor parallel)."""
    return value.to_local() if hasattr(value, "to_local") else value


_LATENT_NORM_EPS = 1e-6  # the latent RMSNorms' eps in DeepSeek's code and transformers, whatever rms_norm_eps


class RopeKey(nn.Module):
    """The rotated key part shared by every head: k_pe [B, S, rope] -> RoPE(k_pe) [B, S, 1, rope].

    A module of its own so that tensor parallel can mark its input: each tp rank's heads give only
    a part of k_pe's gradient (models/deepseek_v3/parallelize.py sums them)."""

    def forward(self, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(k_pe.unsqueeze(2), cos, sin)


class MLAttention(nn.Module):
    """Causal multi-head latent attention (module docstring).

    Weights: wq [H·qk_head_dim, dim] (q_lora_rank 0) or wq_a [q_lora_rank, dim], q_norm
    [q_lora_rank], wq_b [H·qk_head_dim, q_lora_rank]; wkv_a [kv_lora_rank + rope, dim], kv_norm
    [kv_lora_rank], wkv_b [H·(nope + v_head_dim), kv_lora_rank]; wo [dim, H·v_head_dim].
    """

    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope, self.v_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        qk = args.qk_head_dim
        if self.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.rope_key = RopeKey()
        self.q_scale = args.softmax_scale * qk ** 0.5  # 1.0 without YaRN's mscale
        # (q, k, v[, documents=]) -> out on [B, H, S, ·]; None is causal SDPA over the local sequence;
        # context parallel binds attention over the whole cp-split sequence (v width may differ).
        self.attention_fn = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        """x: [B, S, dim]; cos/sin: [(B,) >= S, rope // 2]; documents as LLaMA's ``Attention``.
        Returns [B, S, dim].

        Raises:
            ValueError: the RoPE tables have fewer than S rows.
        """
        bs, seqlen, _ = x.shape
        if seqlen > cos.shape[-2]:
            raise ValueError(f"attention over {seqlen} positions but the RoPE tables cover {cos.shape[-2]}: pass "
                             "positions for every token, or a sequence of at most max_seq_len tokens")
        cos, sin = cos[..., :seqlen, :], sin[..., :seqlen, :]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        q_nope, q_pe = q.view(bs, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k_pe = self.rope_key(k_pe, cos, sin)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.attention_fn is not None:
            out = self.attention_fn(q, k, v, **({} if documents is None else {"documents": documents}))
        elif documents is not None:
            out = document_attention(q, k, v, documents)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float, seed: int, prefix: str) -> None:
        """Input projections ~ trunc_normal(0.02), wo ~ trunc_normal(init_std) (TorchTitan's scheme); norms = 1."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                init_linear(getattr(self, name), 0.02, seed, f"{prefix}.{name}")
        init_linear(self.wo, init_std, seed, f"{prefix}.wo")
        self.kv_norm.reset_parameters()
        if self.q_lora_rank:
            self.q_norm.reset_parameters()


class GroupLimitedRouter(TokenChoiceRouter):
    """DeepSeek-V3's router (arXiv 2412.19437 eq. 13-16 and §2.1.2 "node-limited routing"): sigmoid
    scores; the E experts form n_group groups, a group scores the sum of its 2 best biased scores,
    a token picks its top_k among the experts of its topk_group best groups (others masked to -inf);
    weights are the plain scores of the chosen experts, renormalized (route_norm), times route_scale
    (routed_scaling_factor). Buffer ``expert_bias`` [E] always exists (a checkpoint's
    ``e_score_correction_bias``); it is updated only when load_balance_coeff > 0.
    """

    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__(args)
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens x [T, dim]; returns (weights [T, K], expert_ids [T, K], scores [T, E]) as
        ``TokenChoiceRouter.forward``."""
        logits = self.gate(x)
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        choice = (scores + self.expert_bias.to(scores.dtype)).detach()
        if self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best_groups, True)
            choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(choice)
        expert_ids = torch.topk(choice, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, expert_ids)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights * self.route_scale, expert_ids, scores


class DeepseekV3MoE(MoE):
    """models/moe's ``MoE`` (experts, shared experts, balance loss, statistics) with the group-limited router."""

    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__(args)
        self.router = GroupLimitedRouter(args)


class DeepseekV3Block(MoETransformerBlock):
    """Pre-norm block with MLA and, from layer n_dense_layers on, the DeepSeek-V3 MoE (names as LLaMA's:
    ``attention``, ``feed_forward``, ``attention_norm``, ``ffn_norm``)."""

    def __init__(self, layer_id: int, args: DeepseekV3ModelArgs):
        super().__init__(layer_id, args)
        self.attention = MLAttention(args)
        if args.is_moe_layer(layer_id):
            self.feed_forward = DeepseekV3MoE(args)


class DeepseekV3Transformer(MoETransformer):
    """DeepSeek-V3 model or pipeline stage; RoPE tables [max_seq_len, qk_rope_head_dim // 2] (YaRN's
    when ``rope_scaling = "yarn"``). Build on meta, parallelize, ``to_empty``, ``init_weights(seed)``.

    With ``num_nextn_predict_layers`` D > 0, ``mtp`` holds the multi-token-prediction modules
    (models/deepseek_v3/mtp.py; keys "0".."D-1") and, in training with labels, :meth:`forward`
    returns the main token sum plus ``mtp_weight`` times the mean over depths of theirs (given the
    labels, the loss is computed here on full logits too when ``loss_chunk_tokens`` is 0; the
    trainer passes them, ``needs_labels``). ``mtp_weight`` is set by the trainer (``[loss]
    mtp_weight``); the depths' token sums and target counts of a step are reported by
    :meth:`post_optimizer_step` as ``mtp_loss`` (mean token cross entropy, averaged over depths).

    Raises:
        ValueError: from ``DeepseekV3ModelArgs.validate()``.
    """

    block_cls = DeepseekV3Block
    head_modules = ("mtp",)  # a pipeline split keeps them on the last stage, with a copy of the embedding

    def __init__(self, model_args: DeepseekV3ModelArgs):
        super().__init__(model_args)
        self.rope_cos, self.rope_sin = deepseek_rope_tables(model_args, device=self.rope_cos.device)
        depths = model_args.num_nextn_predict_layers
        self.mtp = nn.ModuleDict({str(k): MTPModule(model_args.n_layers + k, model_args, self.block_cls)
                                  for k in range(depths)}) if depths else None
        self.mtp_weight = 0.0
        # Per depth: Σ token cross entropy and target count of the step's microbatches (detached).
        self.register_buffer("mtp_stats", torch.zeros(2, max(depths, 1), dtype=torch.float64), persistent=False)

    @property
    def needs_labels(self) -> bool:
        """This part's objective needs the labels beyond the next token (it holds MTP modules)."""
        return self.mtp is not None

    @property
    def head_reads_embeddings(self) -> bool:
        """The MTP modules embed tokens t+k beside the output head (parallelisms/pipeline.py)."""
        return self.mtp is not None

    def window_inputs(self, tokens: torch.Tensor, labels: torch.Tensor,
                      documents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The MTP inputs of whole windows, before any context-parallel split (a shift along the
        sequence must see the neighbouring ranks' tokens): ``mtp_tokens`` [B, S, D] (token t+k at
        position t, depth k = 1..D) and ``mtp_labels`` [B, S, D] (``mtp_targets``); {} without MTP.

        Args:
            tokens, labels: LongTensor [B, S] of whole windows; documents: int [B, S] document ids
                (``[document_mask] enable``) or None.
        """
        if self.mtp is None:
            return {}
        depths = range(1, len(self.mtp) + 1)
        return {"mtp_tokens": torch.stack([tokens.roll(-k, dims=1) for k in depths], dim=-1),
                "mtp_labels": torch.stack([mtp_targets(labels, k, documents) for k in depths], dim=-1)}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 256, mtp_tokens: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """``Transformer.forward``; with MTP modules, in training, given labels: the main token sum
        plus ``mtp_weight`` · (1/D) Σ_k (depth k's token sum), fp32 0-dim (arXiv 2412.19437 eq. 25).

        ``mtp_tokens`` / ``mtp_labels`` [B, S_local, D]: :meth:`window_inputs` of the whole windows,
        cut like the tokens (context parallel); None: computed here from ``tokens`` / ``labels``,
        which must then be whole windows of token ids. A part without MTP modules ignores them.

        Raises:
            ValueError: MTP on a part whose input is a hidden state (a pipeline stage) without ``mtp_tokens``.
        """
        if self.mtp is None or labels is None:
            return super().forward(tokens, positions, documents, labels, loss_chunk_tokens)
        h, (cos, sin, extra) = self.trunk(tokens, positions, documents)
        # the run's z-loss on the main head's logits, in training only (as Transformer.head); the MTP
        # depths' heads take none (DeepSeek-V3 uses no z-loss; PaLM's is on the model's prediction)
        z_loss = getattr(self, "z_loss", None) if torch.is_grad_enabled() else None
        main = self._token_sum(self.norm(h), labels, loss_chunk_tokens, z_loss)
        if not self.training:
            return main
        if mtp_tokens is None:
            if tokens.is_floating_point():
                raise ValueError("multi-token prediction on a pipeline stage needs mtp_tokens / mtp_labels "
                                 "(DeepseekV3Transformer.window_inputs of the whole windows)")
            window = self.window_inputs(tokens, labels, documents)
            mtp_tokens, mtp_labels = window["mtp_tokens"], window["mtp_labels"]
        mtp_sum = self._mtp_token_sum(h, mtp_tokens, mtp_labels, (cos, sin, extra), loss_chunk_tokens)
        return main + self.mtp_weight * mtp_sum

    def _token_sum(self, h: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, z_loss=None) -> torch.Tensor:
        """Σ cross entropy of the shared head on normed ``h`` (``token_sum_cross_entropy``, with the
        run's ``z_loss`` when given). Under
        tensor parallel the head is vocab-sharded: the fused loss is Megatron's vocab-parallel one
        (models/common/linear_cross_entropy.py); the unfused loss takes vocab-sharded logits inside the
        runner's ``loss_parallel()`` and returns a Replicate DTensor."""
        return token_sum_cross_entropy(h, self.output.weight, targets, chunk_tokens, z_loss)

    def _mtp_token_sum(self, h, mtp_tokens, mtp_labels, block_inputs, chunk_tokens: int) -> torch.Tensor:
        """(1/D) Σ_k depth k's token-sum cross entropy (models/deepseek_v3/mtp.py); adds each depth's
        sum and target count to ``mtp_stats``."""
        cos, sin, extra = block_inputs
        total = torch.zeros((), dtype=torch.float32, device=mtp_labels.device)
        for k, module in enumerate(self.mtp.values()):
            h = module(h, self.tok_embeddings(mtp_tokens[..., k]), cos, sin, extra)
            targets = mtp_labels[..., k]
            depth_sum = self._token_sum(module.norm(h), targets, chunk_tokens)
            with torch.no_grad():
                self.mtp_stats[0, k] += _local(depth_sum).detach().double()
                self.mtp_stats[1, k] += (targets != -100).sum().double()
            total = total + depth_sum
        return total / len(self.mtp)

    @torch.no_grad()
    def post_optimizer_step(self) -> dict[str, tuple[torch.Tensor, str]]:
        """The MoE metrics (``MoETransformer.post_optimizer_step``) and, with MTP modules,
        ``mtp_loss``: Σ over the step's tokens and ranks (``token_group``) of each depth's cross
        entropy over its targets, averaged over depths ("sum" over model parts)."""
        metrics = super().post_optimizer_step()
        if self.mtp is None:  # a pipeline stage before the MTP modules reports nothing to their sum
            if self.model_args.num_nextn_predict_layers:
                metrics["mtp_loss"] = (torch.zeros((), dtype=torch.float64, device=self.mtp_stats.device), "sum")
            return metrics
        stats = self.mtp_stats.clone()
        if self.token_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.token_group)
        metrics["mtp_loss"] = ((stats[0] / stats[1].clamp_min(1)).mean(), "sum")
        self.mtp_stats.zero_()
        return metrics

    @torch.no_grad()
    def discard_step(self) -> None:
        """A skipped step: drop the routing counts and the MTP sums."""
        super().discard_step()
        self.mtp_stats.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """``Transformer.init_weights``, the MTP modules, then this family's RoPE tables on ``buffer_device``."""
        super().init_weights(seed, buffer_device)
        if self.mtp is not None:
            for module in self.mtp.values():
                module.init_weights(seed)
            self.mtp_stats.zero_()
        self.rope_cos, self.rope_sin = deepseek_rope_tables(self.model_args, device=self.rope_cos.device)
