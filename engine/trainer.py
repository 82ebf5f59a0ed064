"""The training loop: one code path for every layout.

The loss of a step is the token-sum cross entropy over every microbatch on every data-parallel rank,
divided by the number of label tokens in the whole step (Σ_ranks Σ_microbatches tokens). Each rank
back-propagates its share ``loss_sum_local / global_tokens`` and data parallel *sums* gradients, so
the gradient equals the single-process gradient of the same global batch, independent of the number
of ranks and of gradient accumulation (DESIGN.md rule 7; SEED.md §5's ḡ = (1/W)·Σ gᵢ generalized to
uneven token counts).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from engine.checkpoint import CheckpointManager
from engine.config import JobConfig, config_to_toml
from engine.data import build_dataloader, build_validation_dataloader
from engine.distributed import init_distributed
from engine.lr_scheduler import build_lr_scheduler
from engine.metrics import MetricsLogger
from engine.loss import IGNORE_INDEX, token_sum_loss
from engine.model_builder import build_model_parts
from models.registry import load_ref
from engine.optimizer import build_optimizer
from engine.pipeline_runner import PipelineRunner, plan_model_pipeline
from engine.preflight import check_setup
from engine.signals import StopRequest
from engine.data.tokenizer import Tokenizer
from parallelisms.context_parallel import ContextParallel
from parallelisms.grad_norm import clip_grad_norm_
from parallelisms.tensor_parallel import loss_parallel_context, to_local

logger = logging.getLogger("quadra")

class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf; raised on every rank at the same step."""


class Trainer:
    """Builds everything from a validated :class:`JobConfig`, then trains ``training.steps`` steps.

    Attributes used by callers and tests: ``step`` (completed optimizer steps), ``model_parts``
    (list of modules; one without pipeline parallel), ``history`` (per-step dicts with loss and
    grad_norm), ``parallel_dims``, ``dist``, ``tokens_seen`` (label tokens of all completed steps),
    ``checkpointer`` and ``stopped_by`` (the signal name when SIGTERM/SIGUSR1 ended ``train`` early).

    Raises (from ``__init__``, on every rank, before the model is allocated):
        ValueError and subclasses: bad degrees, tokenizer/model mismatch, seq_len too long,
        missing or empty dataset, batch sizes that do not divide.
    """

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.run_folder = cfg.run_folder
        self.dist = init_distributed(cfg.job.device, cfg.comm.backend, cfg.comm.init_timeout_seconds)
        self.device = self.dist.device
        # The same checks as the launcher's pre-flight, for ranks started some other way.
        setup = check_setup(cfg, self.dist.world_size, self.device.type, check_data=False)
        self.parallel_dims, self.model_spec, self.model_args = setup.parallel_dims, setup.model_spec, setup.model_args
        tokenizer = Tokenizer(cfg.model.tokenizer_path)
        if self.dist.is_distributed:
            self.parallel_dims.build_mesh(self.device.type)
        self.context_parallel = (
            ContextParallel(self.parallel_dims.mesh("cp"), cfg.training.seq_len, cfg.parallelism.cp_load_balance)
            if self.parallel_dims.cp_enabled
            else None
        )
        self.pp_plan = self._plan_pipeline()
        self.dp_rank = self._dp_rank()
        self._build_data(tokenizer)
        self.model_parts = self._build_model()
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step = 0
        self.history: list[dict] = []
        self.metrics = self._build_metrics()
        self.tokens_seen = 0
        self.stop_request = StopRequest(self.device, self.dist.is_distributed)
        self.stopped_by: str | None = None
        self.stop_saved = False  # whether the stop saved a checkpoint
        self.checkpointer = self._build_checkpointer()
        self.checkpointer.load()  # continue where an earlier run of this folder stopped, if it saved

    # ------------------------------------------------------------------ building
    def _dp_rank(self) -> int:
        return self.parallel_dims.mesh("dp").get_local_rank() if self.dist.is_distributed else 0

    def _plan_pipeline(self):
        """Validate pipeline settings before any heavy work; None without pipeline parallel."""
        if not self.parallel_dims.pp_enabled:
            return None
        return plan_model_pipeline(
            self.cfg.parallelism, self.model_args, local_batch_size=self.cfg.training.local_batch_size,
            pp_rank=self.parallel_dims.mesh("pp").get_local_rank(),
        )

    def _build_data(self, tokenizer: Tokenizer) -> None:
        t = self.cfg.training
        self.dataloader = build_dataloader(
            self.cfg.data,
            tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=t.global_batch_size,
            dp_rank=self.dp_rank,
            dp_degree=self.parallel_dims.dp,
            seed=t.seed,
        )
        self.grad_accum_steps = self.dataloader.grad_accum_steps
        self.tokenizer = tokenizer
        self._val_loader = None
        if self.cfg.validation.enable:  # built now so a bad validation.path fails before training
            self._build_validation_loader()

    def _build_validation_loader(self) -> None:
        self._val_loader = build_validation_dataloader(
            self.cfg.validation,
            self.cfg.data,
            self.tokenizer,
            seq_len=self.cfg.training.seq_len,
            local_batch_size=self.cfg.training.local_batch_size,
            dp_rank=self.dp_rank,
            dp_degree=self.parallel_dims.dp,
        )

    def _build_model(self) -> list[torch.nn.Module]:
        cfg = self.cfg
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        parts, self.nparams, self.flops_per_token = build_model_parts(
            self.model_spec, self.model_args, plan=self.pp_plan, device=self.device, seed=cfg.training.seed,
            parallelize=lambda part: load_ref(self.model_spec.parallelize_fn)(
                part, self.parallel_dims, parallelism_cfg=cfg.parallelism, training_cfg=cfg.training,
                ac_cfg=cfg.activation_checkpoint, compile_cfg=cfg.compile, backend=self.dist.backend,
            ),
        )
        self.pipeline = (
            PipelineRunner(self.pp_plan, parts, self.parallel_dims.mesh("pp"), self.device)
            if self.pp_plan is not None
            else None
        )
        return parts

    def _build_checkpointer(self) -> CheckpointManager:
        return CheckpointManager(
            self.cfg.checkpoint, run_folder=self.run_folder, model_parts=self.model_parts,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            trainer=self, dist_info=self.dist, parallel_dims=self.parallel_dims,
            config_toml=config_to_toml(self.cfg),
        )

    def _build_metrics(self) -> MetricsLogger:
        is_logging_rank = self.dist.rank == 0
        if is_logging_rank:
            os.makedirs(self.run_folder, exist_ok=True)
            with open(os.path.join(self.run_folder, "config.toml"), "w") as f:
                f.write(config_to_toml(self.cfg))
            if self.cfg.job.print_config:
                logger.info("config:\n%s", config_to_toml(self.cfg))
            logger.info(
                "model %s/%s: %s parameters, %.3g training FLOPs per token; world_size %d %s",
                self.cfg.model.name, self.cfg.model.flavor, f"{self.nparams:,}", self.flops_per_token,
                self.dist.world_size, self.parallel_dims,
            )
        return MetricsLogger(
            self.cfg.metrics,
            self.run_folder,
            rank=self.dist.rank,
            is_logging_rank=is_logging_rank,
            device=self.device,
            flops_per_token=self.flops_per_token,
            training_steps=self.cfg.training.steps,
            # The devices that share one dp rank's samples: tokens/s per device divides by them.
            devices_per_dp_rank=self.parallel_dims.cp * self.parallel_dims.tp * self.parallel_dims.pp,
        )

    # ------------------------------------------------------------------ collectives
    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the loss-reduction mesh (dp × cp); identity on one process."""
        if self.dist.is_distributed:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.parallel_dims.mesh("dp_cp").get_group())
        return value

    def _pp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over pipeline ranks: brings the last stage's loss to every rank (others hold 0)."""
        return self.pipeline.sum_over_stages(value) if self.pipeline is not None else value

    def _autocast(self):
        """bf16 autocast when mixed precision is asked for and no FSDP/DDP policy applies it."""
        wrapped = self.parallel_dims.fsdp_enabled or self.parallel_dims.ddp_enabled
        if self.cfg.training.mixed_precision_param == "bfloat16" and not wrapped:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _cp_shard(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's tokens of a [B, S] batch (unchanged without context parallel)."""
        if self.context_parallel is None:
            return inputs, labels
        return self.context_parallel.shard(inputs), self.context_parallel.shard(labels)

    def _cp_context(self):
        """RoPE rows of this cp rank's positions for the forward and backward (CP), else a no-op."""
        if self.context_parallel is None:
            return contextlib.nullcontext()
        return self.context_parallel.rope_positions(self.model_parts)

    def _loss_context(self):
        """``loss_parallel()`` when TP leaves the logits sharded on the vocab dim, else a no-op.

        The cross entropy on those logits and its backward must both run inside it; the loss it
        gives is a Replicate DTensor, which ``to_local`` turns back into the plain value.
        """
        return loss_parallel_context(self.parallel_dims.tp_enabled and self.cfg.parallelism.loss_parallel)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one microbatch.

        Args:
            inputs, labels: LongTensor[local_batch_size, seq_len].
            global_tokens: number of label tokens in the whole step (all dp ranks, all microbatches).

        Returns:
            This microbatch's contribution to the step loss (detached): token-sum CE / global_tokens.
        """
        if self.pipeline is not None:  # the loss is only known on the last stage (0 elsewhere)
            with self._autocast():
                return self.pipeline.forward_backward(inputs, labels, global_tokens)
        with self._autocast():
            logits = self.model_parts[0](inputs)
        loss = token_sum_loss(logits, labels, global_tokens)
        del logits
        loss.backward()
        return loss.detach()

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns loss and grad_norm."""
        data_start = time.perf_counter()
        microbatches = [
            self._cp_shard(*(t.to(self.device, non_blocking=True) for t in self.dataloader.next_batch()))
            for _ in range(self.grad_accum_steps)
        ]
        data_seconds = time.perf_counter() - data_start
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
        global_tokens = self._dp_sum(torch.tensor(float(local_tokens), device=self.device))

        loss = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            self.pipeline.timer.reset()
        compute_start = time.perf_counter()
        for inputs, labels in microbatches:
            # Around the whole call: the loss and its backward (also inside a pipeline schedule).
            with self._loss_context(), self._cp_context():
                loss += to_local(self.forward_backward(inputs, labels, global_tokens))
        compute_seconds = time.perf_counter() - compute_start
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.pipeline.group if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_group=pp_group)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        model_metrics = self._post_optimizer_step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        loss = self._pp_sum(self._dp_sum(loss)).item()
        grad_norm = grad_norm.item()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            clip = "" if self.cfg.training.max_norm > 0 else ", or set training.max_norm to clip gradients"
            raise TrainingDivergedError(
                f"loss is {loss} (grad_norm {grad_norm}) at step {self.step}: training diverged. Lower "
                f"optimizer.lr or raise lr_scheduler.warmup_steps{clip}."
            )
        record = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": local_tokens,
            "global_tokens": int(global_tokens.item()),
            "data_seconds": data_seconds,
            "epoch": self.dataloader.epoch,
            "model_metrics": model_metrics,
        }
        if self.pipeline is not None:
            # Share of the forward/backward time this rank spent idle (waiting on other stages).
            busy = self.pipeline.timer.busy_seconds()
            record["pp_bubble_fraction"] = max(0.0, 1.0 - busy / compute_seconds)
        return record

    def _post_optimizer_step(self) -> dict[str, float]:
        """Let model parts update state the optimizer does not own (e.g. MoE load-balancing biases).

        A part may define ``post_optimizer_step()`` returning its metrics of the step as
        ``{name: (0-dim tensor, "sum" | "min" | "max")}``; they are merged over this rank's parts and
        the pipeline ranks with that operation, so every rank logs the whole model's value.
        """
        merged: dict[str, tuple[torch.Tensor, str]] = {}
        combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
        for part in self.model_parts:
            metrics = part.post_optimizer_step() if hasattr(part, "post_optimizer_step") else {}
            for name, (value, op) in metrics.items():
                value = value.detach().to(self.device, torch.float64)
                merged[name] = (combine[op](merged[name][0], value) if name in merged else value, op)
        if self.pipeline is not None:  # every stage reports the same names, in the same order
            for value, op in merged.values():
                dist.all_reduce(value, op=getattr(dist.ReduceOp, op.upper()), group=self.pipeline.group)
        return {name: value.item() for name, (value, _) in merged.items()}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss (nats) over ``validation.steps`` batches of the validation split."""
        if self._val_loader is None:  # each iteration of the loader restarts the split
            self._build_validation_loader()
        for part in self.model_parts:
            part.eval()
        # [loss sum, label tokens]; with PP only the last stage counts, and _pp_sum shares it.
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for inputs, labels in self._val_loader:
            inputs, labels = self._cp_shard(inputs.to(self.device), labels.to(self.device))
            with self._autocast(), self._loss_context(), self._cp_context():
                if self.pipeline is None:
                    totals[0] += to_local(token_sum_loss(self.model_parts[0](inputs), labels)).double()
                else:
                    totals[0] += self.pipeline.evaluate(inputs, labels)
            if self.pipeline is None or self.pipeline.has_last:
                totals[1] += (labels != IGNORE_INDEX).sum()
        for part in self.model_parts:
            part.train()
        self._pp_sum(self._dp_sum(totals))
        return float(totals[0] / totals[1].clamp_min(1))

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> dict:
        """The loop's own state: completed steps and tokens seen (components save theirs)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])

    # ------------------------------------------------------------------ the loop
    def train(self, steps: int | None = None) -> list[dict]:
        """Run until ``training.steps`` (or ``steps`` more steps); returns the per-step history."""
        last = self.cfg.training.steps if steps is None else self.step + steps
        gc_freq = self.cfg.training.gc_freq
        if gc_freq > 0:
            gc.disable()  # collect at fixed steps so ranks do not stall each other at random times
        try:
            self.stopped_by = self.stop_request.agreed()  # a signal during set-up: train no step
            while self.step < last and not self.stopped_by:
                start = time.perf_counter()
                record = self.train_step()
                record["step_seconds"] = time.perf_counter() - start
                record["step"] = self.step
                self.tokens_seen += record["global_tokens"]
                self.history.append(record)
                self.metrics.record_step(
                    tokens=record["tokens"], step_seconds=record["step_seconds"], data_seconds=record["data_seconds"]
                )
                if self.metrics.should_log(self.step):
                    keys = ("loss", "grad_norm", "lr", "epoch", "pp_bubble_fraction")
                    logged = {key: record[key] for key in keys if key in record}
                    self.metrics.log(self.step, {**logged, **record["model_metrics"]})
                if gc_freq > 0 and self.step % gc_freq == 0:
                    gc.collect(1)
                v = self.cfg.validation
                if v.enable and (self.step % v.freq == 0 or self.step == last):
                    val_loss = self.validate()
                    self.metrics.log_validation(self.step, val_loss, math.exp(min(val_loss, 50.0)))
                self.checkpointer.maybe_save(self.step, final=self.step == self.cfg.training.steps)
                self.stopped_by = self.stop_request.agreed()
                if self.stopped_by and self.cfg.checkpoint.enable:  # every rank agrees: save together
                    self.checkpointer.save(self.step, wait=True)
                    self.stop_saved = True
        finally:
            if gc_freq > 0:
                gc.enable()
        return self.history

    def close(self) -> None:
        """Finish a checkpoint in flight, restore signal handlers, close the metrics files."""
        self.checkpointer.close()
        self.stop_request.restore()
        self.metrics.close()
