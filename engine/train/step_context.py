"""What a training step needs from the parallel layout, built once per run (:class:`StepContext`):
the context-parallel sharding of inputs and labels and the RoPE rows of this rank's positions, bf16
autocast (when no FSDP/DDP mixed-precision policy applies it), tensor parallel's ``loss_parallel``, and
the document masking inputs of the model (engine/train/documents.py). The runners of
engine/train/runner.py run every microbatch through it."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from parallelisms.context_parallel import ContextParallel
from parallelisms.tensor_parallel import loss_parallel_context


class StepContext:
    """What a step needs from the layout, built once per run.

    Args:
        model_parts: this rank's model parts (their RoPE tables are swapped under context parallel).
        device: this rank's device.
        context_parallel: the run's cp layout, or None without context parallel.
        autocast_bf16: run forward under bf16 autocast (mixed precision without an FSDP/DDP policy).
        loss_parallel: tensor parallel leaves the logits sharded on the vocabulary dim.
        documents: document masking's inputs (``DocumentInputs``), or None for causal attention.
        loss_chunk_tokens: ``[loss] chunk_tokens``: > 0 fuses the output projection with the loss
            over chunks of this many tokens (engine/train/loss.py ``model_loss``); 0: full logits.
        z_loss: the run's ``engine.train.loss.ZLoss`` (``[loss] z_loss_weight``), or None.
    """

    def __init__(self, model_parts: list[nn.Module], device: torch.device, *,
                 context_parallel: ContextParallel | None, autocast_bf16: bool, loss_parallel: bool,
                 documents=None, loss_chunk_tokens: int = 0, z_loss=None):
        self.loss_chunk_tokens = loss_chunk_tokens
        self.z_loss = z_loss
        for part in model_parts:  # the fused loss of the part with the output head adds it in training
            part.z_loss = z_loss
        self.model_parts = model_parts
        self.device = device
        self.context_parallel = context_parallel
        self.autocast_bf16 = autocast_bf16
        self.loss_parallel = loss_parallel
        self.documents = documents
        # Parts whose objective needs more than the next token (e.g. multi-token prediction).
        self.window_parts = [part for part in model_parts if getattr(part, "needs_labels", False)]

    def shard(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """This rank's tokens of LongTensor[B, S] inputs and labels: [B, S / cp] under context
        parallel, unchanged otherwise; moved to the device. With ``[document_mask]`` on the inputs stay
        whole windows (their document ids need every token): :meth:`model_inputs` cuts them.

        Returns:
            (inputs, labels, window): ``window`` holds the model's keyword inputs that come from the
            whole windows (a part's ``window_inputs(tokens, labels, documents)``, e.g. multi-token
            prediction's shifted tokens and targets, [B, S, ...]), cut along the sequence like the
            labels: a shift computed after the cut would miss the other cp ranks' tokens. {} usually.
        """
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        window = {}
        for part in self.window_parts:
            window.update(part.window_inputs(inputs, labels, self.documents and self.documents.mask_ids(inputs)))
        if self.context_parallel is None:
            return inputs, labels, window
        window = {name: self.context_parallel.shard(value) for name, value in window.items()}
        if self.documents is not None:
            return inputs, self.context_parallel.shard(labels), window
        return self.context_parallel.shard(inputs), self.context_parallel.shard(labels), window

    def model_inputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(token ids the model embeds, keyword inputs of every model part) of :meth:`shard`'s inputs:
        ``(inputs, {})`` without ``[document_mask]``, else this rank's tokens and the document ids
        and/or restarted positions (engine/train/documents.py)."""
        if self.documents is None:
            return inputs, {}
        kwargs = self.documents.model_kwargs(inputs)
        if self.context_parallel is not None:
            inputs = self.context_parallel.shard(inputs)
        return inputs, kwargs

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for the forward, or a no-op."""
        if self.autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def loss_and_positions(self):
        """Around a microbatch's forward, loss and backward: ``loss_parallel()`` when the logits are
        vocab-sharded (its loss is a Replicate DTensor, see ``to_local``), and the RoPE rows of this
        cp rank's positions."""
        # Restarted document positions come as per-token positions instead (model_inputs).
        swap = self.context_parallel is not None and not (self.documents and self.documents.restart_positions)
        cp = self.context_parallel.rope_positions(self.model_parts) if swap else contextlib.nullcontext()
        with loss_parallel_context(self.loss_parallel), cp:
            yield
