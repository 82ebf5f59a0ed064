"""The model's keyword inputs for ``[document_mask]``, derived per microbatch from its token ids.

Each microbatch's document ids come from its token ids (models/common/document_mask.py): every rank that
runs a model part has the microbatch's whole windows (the data loader gives each rank of a data-
parallel group the same [B, S] batch), so the ids are computed where they are used and nothing new
travels through the data pipeline, the checkpoints or the pipeline sends. They are handed to the
model as keyword arguments (every pipeline stage receives the keyword arguments of
``schedule.step``, cut into the same microbatches as the inputs): with ``enable``, ``documents``
(block-causal attention); with ``restart_positions``, ``positions`` (per-token RoPE positions of
this rank's tokens, which replace context parallel's table swap).
"""

from __future__ import annotations

import torch

from engine.data.tokenizer import require_bos
from models.common.document_mask import document_ids, document_positions


def document_inputs(document_mask_cfg, bos_id: int, context_parallel=None) -> "DocumentInputs | None":
    """``[document_mask]``'s model inputs for a run, or None when both settings are off."""
    if not (document_mask_cfg.enable or document_mask_cfg.restart_positions):
        return None
    return DocumentInputs(bos_id, document_mask_cfg.enable, document_mask_cfg.restart_positions, context_parallel)


class DocumentInputs:
    """Document ids and/or restarted RoPE positions of whole windows, for one run's layout.

    Args:
        bos_id: the tokenizer's BOS id (>= 0): packing begins every document with it.
        mask: hand the model the document ids (``document_mask.enable``: block-causal attention).
        restart_positions: hand the model RoPE positions restarting at 0 at each document.
        context_parallel: the run's ``ContextParallel`` or None; its rank's positions select the
            local tokens' RoPE positions (the document ids stay whole: attention needs the keys').
    """

    def __init__(self, bos_id: int, mask: bool, restart_positions: bool, context_parallel=None):
        require_bos(bos_id)
        self.bos_id = bos_id
        self.mask = mask
        self.restart_positions = restart_positions
        self.context_parallel = context_parallel

    def mask_ids(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """int32 [B, S] document ids of whole windows when ``mask`` (block-causal attention), else None."""
        return document_ids(tokens, self.bos_id) if self.mask else None

    def model_kwargs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"documents": int32 [B, S]}`` (with mask) and ``{"positions": int64 [B, S / cp]}`` (with
        restart_positions).

        Args:
            tokens: LongTensor [B, S] token ids of whole windows (before any context-parallel split).
        """
        documents = document_ids(tokens, self.bos_id)
        kwargs = {"documents": documents} if self.mask else {}
        if self.restart_positions:
            positions = document_positions(documents)
            if self.context_parallel is not None:
                positions = positions.index_select(1, self.context_parallel.local_positions.to(tokens.device))
            kwargs["positions"] = positions
        return kwargs
