"""The training loop: build everything once, then per step batch → runner → clip → optimizer → log.

The loss of a step is the token-sum cross entropy over every microbatch on every data-parallel rank,
divided by the number of label tokens in the whole step (Σ_ranks Σ_microbatches tokens). Each rank
back-propagates its share ``loss_sum_local / global_tokens`` and data parallel *sums* gradients, so
the gradient equals the single-process gradient of the same global batch, independent of the number
of ranks and of gradient accumulation (the data-parallel mean of per-rank gradients, Li et al. 2020,
arXiv 2006.15704, weighted by each rank's tokens). Everything that depends on the parallel layout
per step lives in engine/train/runner.py, what happens around a step (recovery, checkpoint saving,
metrics, evaluation, profiling, gc, stop signals) in the services of engine/train/services.py, and
how each part is built in engine/train/building.py; see engine/docs/architecture.md for the whole data flow.
"""

from __future__ import annotations

import collections
import logging
import time

import torch
import torch.distributed as dist

from engine.config import JobConfig, config_to_toml
from engine.config.fingerprint import run_fingerprint
from engine.observe.attribution import StepTimer
from engine.observe.profiling import StepProfiler
from engine.observe.record import StepRecorder
from engine.setup.preflight import check_rank_setup
from engine.train.after_step import AfterStepError
from engine.train.building import TrainerBuilding
from engine.train.distributed import init_distributed
from engine.train.evaluation import validation_loss
from engine.train.fault_tolerance import ReplicaGroup
from engine.train.loss import IGNORE_INDEX, ZLoss
from engine.train.lr_scheduler import build_lr_scheduler
from engine.train.optimizer import build_optimizer
from engine.train.runner import PipelineRunner
from engine.train.services import Service, call, save_then_report
from engine.train.signals import StopRequest
from engine.train.step_health import StepHealth, TrainingDivergedError, advance_lr_schedule
from parallelisms.grad_norm import clip_grad_norm_

logger = logging.getLogger("quadra")

HISTORY_STEPS = 1000  # per-step records kept in memory (all of them are in metrics.jsonl)


__all__ = ["AfterStepError", "Trainer", "TrainingDivergedError"]


class Trainer(TrainerBuilding):
    """Builds everything from a validated :class:`JobConfig`, then trains ``training.steps`` steps.

    Attributes used by callers and tests: ``step`` (completed optimizer steps), ``model_parts``
    (list of modules; one without pipeline parallel), ``runner`` (engine/train/runner.py), ``history``
    (the last ``HISTORY_STEPS`` per-step records), ``parallel_dims``, ``dist``, ``tokens_seen``
    (label tokens of all completed steps), ``checkpointer``, ``stopped_by`` (the signal name when
    a stop signal ended ``train`` early), ``stop_saved`` (whether that stop saved a checkpoint),
    ``step_health`` (the skip/stop decisions and their counters, engine/train/step_health.py) and
    ``services`` (what happens around each step, in the order its hooks run: engine/train/services.py).

    Raises (from ``__init__``, on every rank, before the model is allocated):
        ValueError and subclasses: bad degrees, tokenizer/model mismatch, seq_len too long,
        missing or empty dataset, batch sizes that do not divide (engine/setup/preflight.py).
    """

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.run_folder = cfg.run_folder
        comm = cfg.comm
        self.dist = init_distributed(cfg.job.device, comm.backend, comm.init_timeout_seconds, comm.hang_timeout_seconds)
        self.device = self.dist.device
        # torchft (engine/train/fault_tolerance.py), first: its heartbeat makes the lighthouse wait for us.
        self.ft = ReplicaGroup(cfg.fault_tolerance, rank=self.dist.rank, world_size=self.dist.world_size,
                               device=self.device) if cfg.fault_tolerance.enable else None
        # The launcher's pre-flight rules once more, for ranks started some other way.
        self._build_layout(check_rank_setup(cfg, self.dist.world_size, self.device.type, self.dist.rank))
        self.dataloader = self._build_dataloader()
        self.grad_accum_steps = self.dataloader.grad_accum_steps
        self._val_loader = self._build_validation_loader() if cfg.validation.enable else None  # bad path: fails now
        self.model_parts = self._build_model()
        self.z_loss = ZLoss(cfg.loss.z_loss_weight)  # PaLM's z-loss: added by the loss, logged apart
        self.runner = self._build_runner()
        self.downstream = self._build_downstream() if cfg.eval.enable else None  # bad task file: fails now
        self.recorder = StepRecorder(cfg.record, self.run_folder, self.model_parts, self.parallel_dims,
                                     self.context_parallel, self.dist.rank)
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer, whole_model=not self.parallel_dims.pp_enabled)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step, self.tokens_seen = 0, 0
        self.step_health = StepHealth(cfg.step_health, clipping=cfg.training.max_norm > 0)
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_STEPS)
        # What this run trains (engine/config/fingerprint.py), in metrics.jsonl and every checkpoint.
        self.fingerprint = run_fingerprint(config_to_toml(cfg), self.global_batch_size)
        if self.dist.rank == 0:
            self._write_run_config()
        self.metrics = self._build_metrics()
        self.profiler = StepProfiler(cfg.profiling, self.run_folder, self.dist.rank, self.device)
        self.stop_request = StopRequest(self.device, self.dist.is_distributed)
        self.stop_saved = False
        self.checkpointer = self._build_checkpointer()
        self._resume()  # continue where an earlier run of this folder stopped, if it saved
        self.recovery = self._build_recovery()  # says why this attempt runs and from where; the ledger
        self.services: list[Service] = self._build_services()  # around the step (engine/train/services.py)

    # ------------------------------------------------------------------ one step
    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the loss-reduction mesh (dp × cp), then over torchft's replica groups."""
        mesh = self.parallel_dims.mesh("dp_cp") if self.dist.is_distributed else None
        if mesh is not None and mesh.size() > 1:  # (a one-rank group's all-reduce is a no-op collective)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return value if self.ft is None else self.ft.sum_(value)

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns loss, grad_norm and timings
        (on attributed steps also ``phases``, the input of ``engine.observe.attribution.step_attribution``)."""
        measure = self.attribute_time and self.metrics.should_log(self.step + 1)  # (engine/observe/attribution.py)
        timer = StepTimer(measure=measure, device=self.device, distributed=self.dist.is_distributed,
                          group_dims=self._group_dims)
        if self.ft is not None:
            self.ft.start_step(self.step + 1)  # the step's quorum; a group behind its peers heals here
        with timer.phase("data"):
            batches = [self.dataloader.next_batch() for _ in range(self.grad_accum_steps)]
            self.recorder.begin(self.step + 1, batches)  # [record] step only (engine/observe/record.py)
            microbatches = [self.runner.context.shard(*batch) for batch in batches]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in microbatches)
        global_tokens = self._dp_sum(torch.tensor(float(local_tokens), device=self.device))
        with timer.phase("forward_backward"):
            loss = self.runner.step(microbatches, global_tokens)
        self.recorder.end()
        with timer.phase("optimizer"):
            params = [p for part in self.model_parts for p in part.parameters()]
            if self.ft is not None:
                self.ft.sum_gradients(params)
            grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_group=self.runner.pp_group,
                                        uncounted=self.runner.uncounted_parameters())
            lr = self.lr_scheduler.get_last_lr()[0]
            # The step's one read of loss and grad norm (every rank holds the reduced values), before the
            # update so that engine/train/step_health.py can withhold it; z-loss only when it is on.
            reduce = lambda x: self.runner.sum_over_stages(self._dp_sum(x))  # noqa: E731
            loss, grad_norm = reduce(loss).item(), grad_norm.item()
            z_loss = self.z_loss.step_mean(reduce, global_tokens, self.device)
            verdict = self.step_health.judge(self.step + 1, loss, grad_norm)
            committed = self.ft is None or self.ft.should_commit()  # torchft: else the step is discarded
            if verdict.skip or not committed:  # parameters, optimizer state and model buffers stay as they are
                model_metrics = self.runner.discard_step()
                if committed:  # a skipped step still advances the schedule; a discarded one is retried
                    advance_lr_schedule(self.lr_scheduler)
            else:
                self.optimizer.step()
                model_metrics = self.runner.post_optimizer_step()
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += int(committed)
        if verdict.reason is not None:  # a capsule and a record (engine/train/capsule.py); a fatal one stops here
            path = self.report_unhealthy(verdict, lr)
            if verdict.fatal is not None:
                raise TrainingDivergedError(f"{verdict.fatal}; capsule {path}")
        record = {"loss": loss, "z_loss": z_loss, "grad_norm": grad_norm, "lr": lr, "tokens": local_tokens,
                  "skipped": verdict.reason, "global_tokens": int(global_tokens.item()),
                  "data_seconds": timer.seconds["data"], "epoch": self.dataloader.epoch,
                  "model_metrics": model_metrics, "committed": committed}
        if self.ft is not None:
            record["replicas"] = self.ft.participants
        compute_seconds = timer.seconds["forward_backward"]
        if isinstance(self.runner, PipelineRunner):
            record["pp_bubble_fraction"] = self.runner.bubble_fraction(compute_seconds)
        if timer.measure:
            record["phases"] = timer.phases(idle_s=record.get("pp_bubble_fraction", 0.0) * compute_seconds)
        return record

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss (nats) over ``validation.steps`` global batches of the validation split,
        evaluated in batches of ``training.local_batch_size`` (the shapes training runs)."""
        if self._val_loader is None:  # each iteration of the loader restarts the split
            self._val_loader = self._build_validation_loader()
        return validation_loss(self.runner, self._val_loader, self.model_parts, self.cfg.training.local_batch_size,
                               self.device, lambda x: self.runner.sum_over_stages(self._dp_sum(x)))

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> dict:
        """The loop's own state: completed steps, tokens seen, the W&B run id (components save theirs)."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "step_health": self.step_health.state_dict()}
        return {**state, "wandb_run_id": self.metrics.wandb_run_id} if self.cfg.metrics.enable_wandb else state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        if "step_health" in state:  # absent from checkpoints saved before [step_health] existed
            self.step_health.load_state_dict(state["step_health"])
        self.metrics.wandb_run_id = state.get("wandb_run_id") or self.metrics.wandb_run_id

    # ------------------------------------------------------------------ the loop
    @property
    def stopped_by(self) -> str | None:
        """The stop signal's name when one ended ``train`` early (every rank agrees), else None."""
        return self.signals.stopped_by

    def train(self, steps: int | None = None) -> list[dict]:
        """Run until ``training.steps`` (or ``steps`` more steps); returns the per-step records kept
        in ``history`` (the last ``HISTORY_STEPS``; metrics.jsonl has every logged step). The services
        (engine/train/services.py) are called at the fixed points below."""
        last = self.cfg.training.steps if steps is None else self.step + steps
        if self.cfg.training.stop_after_step > 0:  # the schedule still spans training.steps
            last = min(last, self.cfg.training.stop_after_step)
        try:
            call(self.services, "on_start", self.step, last)
            while self.step < last and not self.stopped_by:
                call(self.services, "before_step", self.step + 1)
                start = time.perf_counter()
                record = self.train_step()
                if not record["committed"]:  # torchft discarded it: the next step retries the same step number
                    continue
                record.update(step_seconds=time.perf_counter() - start, step=self.step)
                self.tokens_seen += record["global_tokens"]
                self.history.append(record)
                call(self.services, "on_step", record)
                save_then_report(self.saving, self.services, record)  # a failure never loses the saved step
                if self.stopped_by:  # every rank agrees: save together
                    self.stop_saved = self.saving.save_now(self.step)
        except BaseException as error:
            call(self.services, "on_end", error)
            raise
        call(self.services, "on_end", None)
        return list(self.history)

    def close(self, wait: bool = True) -> None:
        """Stop the data read-ahead thread, then close the services in order: finish a checkpoint in flight (``wait``:
        skipped after a failure, since it may need other ranks), the profiler, the metrics files, and last the signal
        handlers (a SIGTERM cannot cut W&B)."""
        self.dataloader.close()
        call(self.services, "close", wait)
        if self.cfg.training.mixed_precision_param == "float64":
            torch.set_default_dtype(torch.float32)
