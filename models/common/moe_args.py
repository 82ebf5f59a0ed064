"""Hyper-parameters of the mixture-of-experts (MoE) LLaMA family and their parameter / FLOP accounting.

An MoE model is a LLaMA-3 model (``LlamaModelArgs``: attention, RMSNorm, RoPE, dense SwiGLU) whose
feed-forward, in every layer from ``n_dense_layers`` on, is replaced by a mixture of SwiGLU experts:
a router picks ``top_k`` of ``num_experts`` routed experts for each token (token choice, Switch
Transformer arXiv 2101.03961, GShard arXiv 2006.16668, Mixtral arXiv 2401.04088) and
``n_shared_experts`` always-on experts are added (DeepSeekMoE / DeepSeek-V3, arXiv 2412.19437).
All MoE settings live in the flavor: a run picks them with ``model.flavor``.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # flavors stay importable without torch (the launcher's pre-flight)
    import torch.nn as nn

from models.common.args import LlamaModelArgs

__all__ = ["MoEModelArgs"]

_SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEModelArgs(LlamaModelArgs):
    """LLaMA-3 settings plus the mixture-of-experts ones.

    Attributes (in addition to ``LlamaModelArgs``; the dense layers use its ``ffn_hidden_dim``):
        num_experts: routed experts per MoE layer.
        top_k: routed experts each token is sent to (1 <= top_k <= num_experts).
        moe_inter_dim: hidden width of one routed expert's SwiGLU (and of each shared expert).
        n_shared_experts: experts every token goes through, fused into one SwiGLU of width
            n_shared_experts * moe_inter_dim (DeepSeekMoE); 0 = none.
        n_dense_layers: the first this many layers keep the dense feed-forward (DeepSeek-V3 keeps
            the first 3): routing is unstable on the raw embeddings.
        score_func: "softmax" over all experts (Switch, Mixtral) or per-expert "sigmoid"
            (DeepSeek-V3).
        route_norm: renormalize the top_k gate weights of a token to sum to 1 (Mixtral, DeepSeek-V3).
        route_scale: constant factor on the gate weights (DeepSeek-V3 uses 2.5 with 256 experts).
        load_balance_coeff: step size u of the auxiliary-loss-free balancing bias (arXiv 2408.15664):
            after each optimizer step bias_i += u * sign(mean load - load_i), from the global token
            counts of the step; the bias changes which experts are chosen, never the gate weights
            or the gradients. 0 disables it.
        aux_loss_coeff: weight of the sequence-wise balance loss (Switch's f·P loss per sequence,
            DeepSeek-V3 eq. 17-20) added to the training objective; 0 only logs it.
        capacity_factor: 0 = no capacity, no token is ever dropped. > 0: each expert takes at most
            ceil(capacity_factor * seq_len * top_k / num_experts) tokens of one sequence (GShard),
            later tokens of that sequence are dropped for that expert, counted and logged.
    """

    num_experts: int = 8
    top_k: int = 2
    moe_inter_dim: int = 1408
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float = 0.0
    aux_loss_coeff: float = 0.0
    capacity_factor: float = 0.0

    def is_moe_layer(self, layer_id: int) -> bool:
        """True if block ``layer_id`` (0-based) has the MoE feed-forward."""
        return layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE blocks in the whole model."""
        return max(self.n_layers - self.n_dense_layers, 0)

    @property
    def n_routed_blocks(self) -> int:
        """MoE feed-forwards in the whole model, every block that routes tokens (the routing metrics'
        average runs over them): :attr:`n_moe_layers` here; DeepSeek-V3 adds its MTP depths' blocks."""
        return self.n_moe_layers

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: w1, w3 [dim, moe_inter_dim] and w2 [moe_inter_dim, dim]."""
        return 3 * self.dim * self.moe_inter_dim

    def validate(self) -> None:
        """Check the LLaMA settings, then the MoE ones.

        Raises:
            ValueError: naming the flavor field, its value and what it must satisfy.
        """
        super().validate()
        for name in ("num_experts", "top_k", "moe_inter_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEModelArgs.{name}={value!r} must be a positive integer")
        for name in ("n_shared_experts", "n_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MoEModelArgs.{name}={value!r} must be an integer >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEModelArgs.top_k={self.top_k} exceeds num_experts={self.num_experts}: each token "
                f"is sent to top_k different experts; choose a flavor with top_k <= num_experts"
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(
                f"MoEModelArgs.score_func={self.score_func!r}: choose one of {', '.join(_SCORE_FUNCS)}"
            )
        for name in ("load_balance_coeff", "aux_loss_coeff", "capacity_factor"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"MoEModelArgs.{name}={getattr(self, name)!r} must be >= 0 (0 disables it)")
        if not self.route_scale > 0:
            raise ValueError(f"MoEModelArgs.route_scale={self.route_scale!r} must be > 0")
        if self.n_moe_layers == 0:
            raise ValueError(
                f"MoEModelArgs.n_dense_layers={self.n_dense_layers} leaves no MoE layer among "
                f"n_layers={self.n_layers}; lower n_dense_layers or use model.name = \"llama\""
            )

    def count_params(self, model: nn.Module) -> tuple[int, int]:
        """(total, active) parameters of ``model`` (the whole model or a pipeline stage).

        Active = what one token uses: every parameter except the routed experts it is not sent to,
        i.e. total - (num_experts - top_k) * expert_params for each MoE layer present. Embeddings
        count in both (one row is used, as in the usual "active parameters" figures). Works on
        meta-device and DTensor parameters (numel is the global size).
        """
        total = sum(p.numel() for p in model.parameters())
        layers = getattr(model, "layers", None)
        layer_ids = [int(key) for key in layers.keys()] if layers is not None else range(self.n_layers)
        n_moe = sum(1 for i in layer_ids if self.is_moe_layer(i))
        inactive = n_moe * (self.num_experts - self.top_k) * self.expert_params
        return total, total - inactive
