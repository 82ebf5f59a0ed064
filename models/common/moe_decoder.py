"""Mixture-of-experts LLaMA: the LLaMA-3 Transformer with MoE feed-forwards from layer n_dense_layers on.

Everything but the feed-forward is LLaMA's (``models/common/decoder.py``: attention with RoPE and GQA,
RMSNorm, embeddings, output head, layout-independent init), so the layout rules hold unchanged:
blocks in ``layers`` keyed "0".."L-1", ``tok_embeddings`` / ``norm`` / ``output`` may be None on
pipeline stages. DeepSeek-V3 (arXiv 2412.19437) / Mixtral (arXiv 2401.04088) style; see
``models/common/moe.py`` for the layer itself.

After each optimizer step the trainer calls ``post_optimizer_step()`` (when a model part has it):
the MoE layers' token counts are summed over the ranks that saw different tokens, the load-balancing
biases are updated from those global counts, and the step's routing metrics are returned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.common.decoder import Transformer, TransformerBlock
from models.common.moe_args import MoEModelArgs
from models.common.moe import MoE

__all__ = ["MoETransformer", "MoETransformerBlock"]


class MoETransformerBlock(TransformerBlock):
    """LLaMA block whose ``feed_forward`` is an :class:`MoE` when ``args.is_moe_layer(layer_id)``.

    The attribute keeps the name ``feed_forward`` so the block's forward, init and checkpoint
    names stay LLaMA's (``layers.3.feed_forward.experts.w1``).
    """

    def __init__(self, layer_id: int, args: MoEModelArgs):
        super().__init__(layer_id, args)
        if args.is_moe_layer(layer_id):
            # Replaces the dense FeedForward built by the parent (free on the meta device, where
            # the trainer builds models).
            self.feed_forward = MoE(args)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.feed_forward, MoE)


class MoETransformer(Transformer):
    """LLaMA-3 Transformer with MoE blocks, or a pipeline stage of it.

    Attributes set by the parallelize driver (through models/common/moe_parallelize.py ``MOE_PLAN``):
    ``token_group``, the process group of the ranks whose tokens differ (data × context parallel;
    None on one process), over which the routing counts are summed.

    Raises:
        ValueError: from ``MoEModelArgs.validate()``.
    """

    block_cls = MoETransformerBlock

    def __init__(self, model_args: MoEModelArgs):
        super().__init__(model_args)
        self.token_group: dist.ProcessGroup | None = None
        # The tp group when the routed experts span tp: each tp rank then counts its own tokens.
        self.routed_tp_group: dist.ProcessGroup | None = None

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards of the blocks this part holds, in layer order."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_aux_loss_scale(self, sequences_per_step: int) -> None:
        """Make the balance loss a mean over the ``sequences_per_step`` sequences of an optimizer
        step (all ranks, all microbatches), so its gradient does not depend on the layout (under
        context parallel each cp rank adds its share of a sequence's loss, MoE._balance_loss)."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = 1.0 / sequences_per_step

    @torch.no_grad()
    def post_optimizer_step(self) -> dict[str, tuple[torch.Tensor, str]]:
        """Update the balancing biases from the step's global counts and report routing metrics.

        Must be called on every rank after every optimizer step (it all-reduces over
        ``token_group``, and ``routed_tp_group`` when set). Counts are routed slots (a token counts
        once per chosen expert).

        Returns:
            {name: (0-dim float64 tensor, on any device, how to merge with other parts / stages)}:
            ``moe_tokens_per_expert_min`` / ``_max`` ("min" / "max") over layers and experts;
            ``moe_tokens_per_expert_cv`` (std / mean of a layer's counts, averaged over the model's
            MoE layers, multi-token prediction's included: ``n_routed_blocks``, "sum"); ``moe_balance_loss``
            (the sequence-wise balance loss, mean over sequences, averaged over them, 1.0 when balanced;
            the objective adds aux_loss_coeff times it, "sum"); ``moe_dropped_slots`` (slots over
            capacity, "sum").
            A part without MoE layers returns neutral values, so every stage reports the same keys.
        """
        layers = self.moe_layers()
        n_total = self.model_args.n_routed_blocks
        if not layers:
            neutral = {"min": float("inf"), "max": float("-inf"), "sum": 0.0}
            return {name: (torch.tensor(neutral[op], dtype=torch.float64), op) for name, op in _METRIC_OPS.items()}
        stats = torch.stack([
            torch.cat([m.tokens_per_expert, m.balance_loss_sum.view(1), m.dropped_slots.view(1)]) for m in layers
        ]).double()  # [L, E + 2]; float64 keeps token counts exact
        if self.token_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.token_group)
        if self.routed_tp_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.routed_tp_group)
        counts = stats[:, :-2]
        for layer, layer_counts in zip(layers, counts):
            layer.update_bias(layer_counts)
            layer.reset_stats()
        cv = counts.std(dim=1, correction=0) / counts.mean(dim=1).clamp_min(1e-12)
        values = {
            "moe_tokens_per_expert_min": counts.min(),
            "moe_tokens_per_expert_max": counts.max(),
            "moe_tokens_per_expert_cv": cv.sum() / n_total,
            "moe_balance_loss": stats[:, -2].sum() / n_total,
            "moe_dropped_slots": stats[:, -1].sum(),
        }
        return {name: (values[name], op) for name, op in _METRIC_OPS.items()}

    @torch.no_grad()
    def discard_step(self) -> None:
        """A skipped optimizer step: drop its routing counts, leave the balancing biases as they are."""
        for layer in self.moe_layers():
            layer.reset_stats()


_METRIC_OPS = {
    "moe_tokens_per_expert_min": "min",
    "moe_tokens_per_expert_max": "max",
    "moe_tokens_per_expert_cv": "sum",
    "moe_balance_loss": "sum",
    "moe_dropped_slots": "sum",
}
