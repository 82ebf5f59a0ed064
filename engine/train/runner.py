"""The per-step seam between the trainer and the parallel layout: one step context and two runners.

The trainer never branches on the parallel style (the shape of OLMo-core's train modules):

- :class:`engine.train.step_context.StepContext` holds what every step needs from the layout, built
  once: context-parallel sharding, bf16 autocast, loss parallel and document masking's inputs.
- :class:`SingleRunner` (the whole model as one part) and :class:`PipelineRunner` (this rank's
  pipeline stages, driven by a ``torch.distributed.pipelining`` schedule) own the forward/backward
  of the step's microbatches, evaluation, the sum of the loss over pipeline stages and the
  post-optimizer hooks of the model parts.

The loss of a microbatch is its token-sum cross entropy divided by the step's global label-token
count (engine/train/loss.py), so the summed contributions are the step's mean token loss, independent of
the layout and of gradient accumulation. With pipeline parallel only the last stage sees it; the sum
over the pp group makes every rank log the true loss, never a placeholder.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.train.loss import IGNORE_INDEX, last_stage_loss, model_loss, row_sum_loss
from engine.train.step_context import StepContext
from parallelisms.data_parallel import sync_on_last_microbatch
from parallelisms.float8 import precompute_float8_scales
from parallelisms.pipeline import PipelinePlan, build_pipeline_schedule, evaluation_order
from parallelisms.pipeline_tied import sum_tied_gradients, tied_copies
from parallelisms.pipeline_timing import StageBusyTimer
from parallelisms.tensor_parallel import to_local


class _Runner:
    """What both runners share: the step loop over microbatches and the post-optimizer hooks."""

    pp_group = None  # the pipeline group (gradient norms and metrics are summed over it)
    _float8_scales_ready = False  # float8 all-gather: scales of the weights as trained (or loaded)

    def __init__(self, model_parts: list[nn.Module], context: StepContext):
        self.model_parts = model_parts
        self.context = context

    def forward_backward(self, inputs, labels, global_tokens, window=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch of a step (gradients accumulate).

        Args:
            microbatches: this rank's (inputs, labels, window) of :meth:`StepContext.shard`,
                LongTensor[local_batch_size, S / cp] inputs and labels.
            global_tokens: label tokens of the whole step (all dp ranks, all microbatches).

        Returns:
            This rank's share of the step loss (detached; 0 on pipeline ranks without the last stage).
        """
        if not self._float8_scales_ready:  # the first step (after a checkpoint load): whole-weight scales
            precompute_float8_scales(self.model_parts)  # (parallelisms/float8.py), as after every step
            self._float8_scales_ready = True
        loss = torch.zeros((), device=self.context.device)
        with self.accumulation(len(microbatches)) as before_each:
            for (inputs, labels, window), _ in zip(microbatches, before_each):
                with self.context.loss_and_positions():
                    loss += to_local(self.forward_backward(inputs, labels, global_tokens, window))
        return loss

    def accumulation(self, microbatches: int) -> contextlib.AbstractContextManager:
        """Context around a step's microbatches, yielding an iterator advanced before each one:
        here nothing happens between them (see :class:`SingleRunner`)."""
        return contextlib.nullcontext(itertools.repeat(None))

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """Identity without pipeline parallel (see :class:`PipelineRunner`)."""
        return value

    def uncounted_parameters(self) -> list[torch.Tensor]:
        """Parameters to clip but leave out of the gradient norm: none without pipeline parallel."""
        return []

    def post_optimizer_step(self) -> dict[str, float]:
        """Let model parts update state the optimizer does not own (e.g. MoE load-balancing biases).

        First, with float8 all-gather, the float8 weight scales of the next forward
        (parallelisms/float8.py). A part may define ``post_optimizer_step()`` returning its metrics of the step as
        ``{name: (0-dim tensor, "sum" | "min" | "max")}``; they are merged over this rank's parts and
        the pipeline ranks with that operation, so every rank logs the whole model's value.
        """
        precompute_float8_scales(self.model_parts)  # float8 all-gather: next forward's weight scales
        merged: dict[str, tuple[torch.Tensor, str]] = {}
        combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
        for part in self.model_parts:
            metrics = part.post_optimizer_step() if hasattr(part, "post_optimizer_step") else {}
            for name, (value, op) in metrics.items():
                value = value.detach().to(self.context.device, torch.float64)
                merged[name] = (combine[op](merged[name][0], value) if name in merged else value, op)
        if self.pp_group is not None:  # every stage reports the same names, in the same order
            for value, op in merged.values():
                dist.all_reduce(value, op=getattr(dist.ReduceOp, op.upper()), group=self.pp_group)
        return {name: value.item() for name, (value, _) in merged.items()}


    def discard_step(self) -> dict[str, float]:
        """A skipped step (engine/train/step_health.py): let model parts drop what the step's forward
        accumulated for ``post_optimizer_step`` without applying it (a part may define
        ``discard_step()``; e.g. MoE routing counts). No collective; returns no metrics."""
        for part in self.model_parts:
            if hasattr(part, "discard_step"):
                part.discard_step()
        return {}


class SingleRunner(_Runner):
    """The whole model as one part (every layout without pipeline parallel).

    Args:
        model_parts: ``[model]``; context: the step context.
        sync_each_microbatch: ``parallelism.grad_sync_each_microbatch``; False reduces the
            gradients of an accumulated step once, after its last microbatch
            (:func:`parallelisms.data_parallel.sync_on_last_microbatch`).
    """

    def __init__(self, model_parts: list[nn.Module], context: StepContext, *, sync_each_microbatch: bool = True):
        super().__init__(model_parts, context)
        self.sync_each_microbatch = sync_each_microbatch

    def accumulation(self, microbatches: int) -> contextlib.AbstractContextManager:
        """One gradient reduction per step unless ``sync_each_microbatch`` (or a single microbatch)."""
        if self.sync_each_microbatch or microbatches == 1:
            return super().accumulation(microbatches)
        return sync_on_last_microbatch(self.model_parts[0], microbatches)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor,
                         window: dict | None = None) -> torch.Tensor:
        """One microbatch: LongTensor[B, S] inputs/labels (and :meth:`StepContext.shard`'s window
        inputs) -> its loss contribution (detached)."""
        inputs, kwargs = self.context.model_inputs(inputs)
        with self.context.autocast():
            loss = model_loss(self.model_parts[0], inputs, labels, global_tokens,
                              chunk_tokens=self.context.loss_chunk_tokens, z_loss=self.context.z_loss,
                              **kwargs, **(window or {}))
        loss.backward()
        return loss.detach()

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 window: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-sum loss in fp64, label tokens) of one batch, forward only (the window inputs of
        training objectives are not needed)."""
        inputs, kwargs = self.context.model_inputs(inputs)
        with self.context.autocast(), self.context.loss_and_positions():
            loss = to_local(model_loss(self.model_parts[0], inputs, labels,
                                       chunk_tokens=self.context.loss_chunk_tokens, **kwargs)).double()
        return loss, (labels != IGNORE_INDEX).sum()

    @torch.no_grad()
    def evaluate_rows(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Float64 [B]: each row's cross-entropy sum over its label tokens (nats; this rank's tokens
        of the row under context parallel), forward only, from the full logits (also when the training
        loss is fused), vocab-sharded under loss parallel."""
        inputs, kwargs = self.context.model_inputs(inputs)
        with self.context.autocast(), self.context.loss_and_positions():
            return row_sum_loss(self.model_parts[0](inputs, **kwargs), labels)


class _StageLoss:
    """The pipeline schedule's loss function, switchable for evaluation: torch's schedules call it
    once per microbatch on the last stage, in microbatch order, and keep what it returns."""

    def __init__(self, fn):
        self.fn = self.training_fn = fn

    def __call__(self, output, target, **kwargs):
        return self.fn(output, target, **kwargs)

    @contextlib.contextmanager
    def use(self, fn):
        self.fn = fn
        try:
            yield
        finally:
            self.fn = self.training_fn


class PipelineRunner(_Runner):
    """This rank's stages of ``plan``, driven by the planned torch schedule.

    Args:
        plan: the split; model_parts: this rank's parallelized, materialized stage modules (plan
        order); pp_mesh: the pp sub-mesh; context: the step context.
    """

    def __init__(self, plan: PipelinePlan, model_parts: list[nn.Module], pp_mesh, context: StepContext):
        super().__init__(model_parts, context)
        self.stage_takes_labels, loss_fn = last_stage_loss(context)  # engine/train/loss.py
        self.stage_loss = _StageLoss(loss_fn)
        self.schedule, stages = build_pipeline_schedule(plan, model_parts, pp_mesh, context.device, self.stage_loss)
        self.plan, self.pp_size = plan, pp_mesh.size()
        self.has_first = 0 in plan.local_stages
        self.has_last = plan.num_stages - 1 in plan.local_stages
        self.pp_group = pp_mesh.get_group()
        self.timer = StageBusyTimer(stages, context.device)

    def step(self, microbatches, global_tokens):
        """As :meth:`_Runner.step`; also times the stages for :meth:`bubble_fraction`."""
        self.timer.reset()
        loss = super().step(microbatches, global_tokens)
        sum_tied_gradients(self.model_parts, self.plan, self.pp_group)  # the embedding's copy beside the head
        return loss

    def uncounted_parameters(self) -> list[torch.Tensor]:
        """Copies of another stage's parameter (parallelisms/pipeline_tied.py): clipped, not counted in the norm."""
        return tied_copies(self.model_parts)

    def bubble_fraction(self, compute_seconds: float) -> float:
        """Share of the last step's forward/backward time this rank spent idle (waiting on stages)."""
        return max(0.0, 1.0 - self.timer.busy_seconds() / compute_seconds)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor,
                         window: dict | None = None) -> torch.Tensor:
        """One schedule step over a [local_batch_size, S] batch cut into the plan's microbatches
        (``window``: :meth:`StepContext.shard`'s window inputs, given to every local stage).

        Returns:
            The batch's loss contribution (token sum / global_tokens) on the last stage, 0 elsewhere.
        """
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        inputs, kwargs = self.context.model_inputs(inputs)  # kwargs reach every stage, cut per microbatch
        args = (inputs,) if self.has_first else ()
        with self.context.autocast():
            self.schedule.step(
                *args,
                target=labels if self.has_last else None,
                losses=losses,
                return_outputs=False,
                loss_kwargs={"global_tokens": global_tokens},
                **kwargs,
                **(window or {}),
                **self._model_kwargs(labels),
            )
        if losses:
            return torch.stack([to_local(loss.detach()) for loss in losses]).sum()
        return torch.zeros((), device=self.context.device)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 window: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only (``schedule.eval``): (token-sum loss, label tokens) on the last stage, zeros
        elsewhere (:meth:`sum_over_stages` shares them); ``window`` is not needed."""
        losses: list[torch.Tensor] = []
        inputs, kwargs = self.context.model_inputs(inputs)
        args = (inputs,) if self.has_first else ()
        with (self.context.autocast(), self.context.loss_and_positions(),
              evaluation_order(self.schedule, self.plan, self.pp_size)):
            # return_outputs=False reaches step() through eval()'s keywords: the losses are all we
            # read, and the fused loss's 0-dim stage outputs cannot be concatenated into a batch.
            self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses,
                               return_outputs=False, **kwargs, **self._model_kwargs(labels))
        total = torch.zeros((), device=self.context.device, dtype=torch.float64)
        for loss in losses:  # a Replicate DTensor under loss parallel (tensor parallel on the last stage)
            total += to_local(loss).double()
        tokens = ((labels != IGNORE_INDEX).sum() if self.has_last
                  else torch.zeros((), dtype=torch.int64, device=labels.device))
        return total, tokens

    @torch.no_grad()
    def evaluate_rows(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """As :meth:`SingleRunner.evaluate_rows` through the schedule's forward-only path
        (``schedule.eval``): the rows' sums on the last stage, zeros elsewhere (:meth:`sum_over_stages`
        shares them). The stages return logits (no labels keyword), the loss function gives each
        microbatch's rows."""
        rows: list[torch.Tensor] = []
        inputs, kwargs = self.context.model_inputs(inputs)
        args = (inputs,) if self.has_first else ()
        with self.context.autocast(), self.context.loss_and_positions(), \
                evaluation_order(self.schedule, self.plan, self.pp_size), self.stage_loss.use(row_sum_loss):
            self.schedule.eval(*args, target=labels if self.has_last else None, losses=rows,
                               return_outputs=False, **kwargs)
        if not self.has_last:
            return torch.zeros(labels.shape[0], device=self.context.device, dtype=torch.float64)
        return torch.cat(rows)

    def _model_kwargs(self, labels: torch.Tensor) -> dict:
        """Keywords of every stage's forward: the labels and chunk size of the fused loss or of an
        objective that needs the labels (stages without the output head ignore them), else none."""
        if not self.stage_takes_labels:
            return {}
        return {"labels": labels, "loss_chunk_tokens": self.context.loss_chunk_tokens}

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM over the pp group, in place (the last stage's value reaches every rank)."""
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.pp_group)
        return value
