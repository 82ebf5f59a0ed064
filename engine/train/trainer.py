"""The training loop: build everything once, then per step batch → runner → clip → optimizer → log.

The loss of a step is the token-sum cross entropy over every microbatch on every data-parallel rank,
divided by the number of label tokens in the whole step (Σ_ranks Σ_microbatches tokens). Each rank
back-propagates its share ``loss_sum_local / global_tokens`` and data parallel *sums* gradients, so
the gradient equals the single-process gradient of the same global batch, independent of the number
of ranks and of gradient accumulation (the data-parallel mean of per-rank gradients, Li et al. 2020,
arXiv 2006.15704, weighted by each rank's tokens). Everything that depends on the parallel layout
per step lives in engine/train/runner.py; see engine/docs/architecture.md for the whole data flow.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import time

import torch
import torch.distributed as dist

from engine.observe.attribution import StepTimer
from engine.checkpoint import CheckpointManager
from engine.config import JobConfig, config_to_toml
from engine.config.fingerprint import run_fingerprint
from engine.data import build_dataloader, build_validation_dataloader
from engine.train.distributed import init_distributed, is_peer_failure
from engine.train.documents import document_inputs
from engine.train.downstream import DownstreamEvaluation
from engine.train.evaluation import evaluate_when_due, validation_loss
from engine.train.loss import IGNORE_INDEX, ZLoss
from engine.train.lr_scheduler import build_lr_scheduler
from engine.observe.metrics import MetricsLogger
from engine.observe.sinks import job_run_id
from engine.setup.model_builder import build_context_parallel, build_model_parts
from engine.train.optimizer import build_optimizer
from engine.setup.preflight import check_rank_setup
from engine.observe.profiling import StepProfiler
from engine.train.runner import PipelineRunner, SingleRunner, StepContext
from engine.train.signals import StopRequest
from engine.train.after_step import after_step_message, log_step
from engine.train.capsule import report_unhealthy
from engine.train.fault_tolerance import ReplicaGroup, data_ranks
from engine.train.step_health import StepHealth, advance_lr_schedule
from engine.train.recovery import RunRecovery
from parallelisms.comm_counter import group_names_by_mesh_dim
from parallelisms.data_parallel import mixed_precision_by_policy
from parallelisms.grad_norm import clip_grad_norm_
from engine.observe.record import StepRecorder

logger = logging.getLogger("quadra")

HISTORY_STEPS = 1000  # per-step records kept in memory (all of them are in metrics.jsonl)


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or Inf, or step_health.max_consecutive_skips steps in a row were skipped;
    raised on every rank at the same step (engine/train/step_health.py)."""


class AfterStepError(RuntimeError):
    """Reporting after a trained and saved step failed (profiler trace, metrics, validation); the
    message is one line naming the phase, the step, the reason and the newest complete checkpoint."""


class Trainer:
    """Builds everything from a validated :class:`JobConfig`, then trains ``training.steps`` steps.

    Attributes used by callers and tests: ``step`` (completed optimizer steps), ``model_parts``
    (list of modules; one without pipeline parallel), ``runner`` (engine/train/runner.py), ``history``
    (the last ``HISTORY_STEPS`` per-step records), ``parallel_dims``, ``dist``, ``tokens_seen``
    (label tokens of all completed steps), ``checkpointer``, ``stopped_by`` (the signal name when
    a stop signal ended ``train`` early), ``stop_saved`` (whether that stop saved a checkpoint) and
    ``step_health`` (the skip/stop decisions and their counters, engine/train/step_health.py).

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
        self.ft = ReplicaGroup(cfg.fault_tolerance, self, rank=self.dist.rank, world_size=self.dist.world_size,
                               device=self.device) if cfg.fault_tolerance.enable else None
        # The launcher's pre-flight rules once more, for ranks started some other way.
        setup = check_rank_setup(cfg, self.dist.world_size, self.device.type, self.dist.rank)
        self.parallel_dims, self.model_spec, self.model_args = setup.parallel_dims, setup.model_spec, setup.model_args
        self.global_batch_size = setup.global_batch_size
        self.model_record, self.model_label = setup.model_record, setup.model_label
        self.setup = setup
        if self.dist.is_distributed:
            self.parallel_dims.build_mesh(self.device.type)
        self._group_dims = group_names_by_mesh_dim(self.parallel_dims)  # for time attribution
        self.dp_rank = self.parallel_dims.mesh("dp").get_local_rank() if self.dist.is_distributed else 0
        self.data_dp, self.data_dp_rank = data_ranks(cfg.fault_tolerance, self.parallel_dims.dp, self.dp_rank)
        self.context_parallel = build_context_parallel(cfg, self.parallel_dims)
        pp_rank = self.parallel_dims.mesh("pp").get_local_rank() if self.parallel_dims.pp_enabled else 0
        self.pp_plan = setup.pipeline_plan(pp_rank)  # this rank's stages (None without pipeline parallel)
        self.tokenizer = setup.tokenizer  # loaded once per process, by check_setup
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
        self.stopped_by: str | None = None
        self.stop_saved = False
        self.checkpointer = self._build_checkpointer()
        self.checkpointer.load()  # continue where an earlier run of this folder stopped, if it saved
        if cfg.metrics.enable_wandb:  # one W&B run per job: the checkpoint's id, else the run folder's
            self.metrics.wandb_run_id = job_run_id(self.metrics.wandb_run_id, self.run_folder, self.dist)
        if self.ft is not None:
            self.ft.resume_at(self.step)
        self.recovery = RunRecovery(cfg, self)  # says why this attempt runs and from where; the ledger
        self.metrics.run_info = {"fingerprint": self.fingerprint}
        if self.checkpointer.fingerprint_change:
            self.metrics.run_info["fingerprint_change"] = self.checkpointer.fingerprint_change

    # ------------------------------------------------------------------ building
    def _build_dataloader(self):
        t = self.cfg.training
        return build_dataloader(self.cfg.data, self.tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                                global_batch_size=t.global_batch_size, dp_rank=self.data_dp_rank,
                                dp_degree=self.data_dp, seed=t.seed)

    def _build_validation_loader(self):
        """Batches of global_batch_size / dp sequences per rank: a validation step covers the same
        windows whatever local_batch_size and dp are (``validate`` cuts them to local batches)."""
        return build_validation_dataloader(self.cfg.validation, self.cfg.data, self.tokenizer,
                                           seq_len=self.cfg.training.seq_len,
                                           local_batch_size=self.global_batch_size // self.data_dp,
                                           dp_rank=self.data_dp_rank, dp_degree=self.data_dp)

    def _build_model(self) -> list[torch.nn.Module]:
        t = self.cfg.training
        torch.manual_seed(t.seed)
        if t.mixed_precision_param == "float64":  # the float64 reference mode: parameters, buffers,
            torch.set_default_dtype(torch.float64)  # activations and optimizer state (restored by close)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        parts, self.nparams, self.flops_per_token = build_model_parts(
            self.cfg, self.model_spec, self.model_args, parallel_dims=self.parallel_dims, pp_plan=self.pp_plan,
            context_parallel=self.context_parallel, global_batch_size=self.global_batch_size,
            backend=self.dist.backend, device=self.device)
        return parts

    def _build_runner(self):
        dims = self.parallel_dims
        t = self.cfg.training
        by_policy = mixed_precision_by_policy(dims, t.mixed_precision_param, t.mixed_precision_reduce)
        context = StepContext(
            self.model_parts, self.device, context_parallel=self.context_parallel,
            autocast_bf16=t.mixed_precision_param == "bfloat16" and not by_policy,
            loss_parallel=dims.tp_enabled and self.cfg.parallelism.loss_parallel,
            documents=document_inputs(self.cfg.document_mask, self.tokenizer.bos_id, self.context_parallel),
            loss_chunk_tokens=self.cfg.loss.chunk_tokens, z_loss=self.z_loss,
        )
        if self.pp_plan is None:
            return SingleRunner(self.model_parts, context,
                                sync_each_microbatch=self.cfg.parallelism.grad_sync_each_microbatch)
        return PipelineRunner(self.pp_plan, self.model_parts, dims.mesh("pp"), context)

    def _build_downstream(self) -> DownstreamEvaluation:
        reduce = lambda x: self.runner.sum_over_stages(self._dp_sum(x))  # noqa: E731
        return DownstreamEvaluation(self.cfg.eval, self.tokenizer, seq_len=self.cfg.training.seq_len,
                                    rows_per_batch=self.cfg.training.local_batch_size, dp_rank=self.dp_rank,
                                    dp_degree=self.parallel_dims.dp, runner=self.runner, reduce=reduce,
                                    row_multiple=self.parallel_dims.tp,
                                    fixed_length=self.parallel_dims.pp_enabled or self.parallel_dims.cp_enabled)

    def _build_checkpointer(self) -> CheckpointManager:
        return CheckpointManager(
            self.cfg.checkpoint, run_folder=self.run_folder, model_parts=self.model_parts,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            trainer=self, dist_info=self.dist, parallel_dims=self.parallel_dims,
            config_toml=config_to_toml(self.cfg), model_record=self.model_record, fingerprint=self.fingerprint,
        )

    def _write_run_config(self) -> None:
        """``<run folder>/config.toml``: the merged config of this run (rank 0)."""
        os.makedirs(self.run_folder, exist_ok=True)
        with open(os.path.join(self.run_folder, "config.toml"), "w") as f:
            f.write(config_to_toml(self.cfg))
        if self.cfg.job.print_config:
            logger.info("config:\n%s", config_to_toml(self.cfg))
        logger.info("model %s: %s parameters, %.3g training FLOPs per token; world_size %d %s; fingerprint %s",
                    self.model_label, f"{self.nparams:,}", self.flops_per_token,
                    self.dist.world_size, self.parallel_dims, self.fingerprint)

    def _build_metrics(self) -> MetricsLogger:
        dims = self.parallel_dims
        return MetricsLogger(
            self.cfg.metrics, self.run_folder, rank=self.dist.rank, is_logging_rank=self.dist.rank == 0,
            device=self.device, flops_per_token=self.flops_per_token, training_steps=self.cfg.training.steps,
            # The devices that share one dp rank's samples: tokens/s per device divides by them.
            devices_per_dp_rank=dims.cp * dims.tp * dims.pp, float8=self.cfg.float8.enable,
        )

    # ------------------------------------------------------------------ one step
    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the loss-reduction mesh (dp × cp), then over torchft's replica groups."""
        mesh = self.parallel_dims.mesh("dp_cp") if self.dist.is_distributed else None
        if mesh is not None and mesh.size() > 1:  # (a one-rank group's all-reduce is a no-op collective)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return value if self.ft is None else self.ft.sum_(value)

    def _measures_time(self) -> bool:
        """Whether the coming step is attributed (engine/observe/attribution.py): a logged step, with
        ``metrics.time_attribution`` on and no compiled code (dispatch modes do not mix with it)."""
        return (self.cfg.metrics.time_attribution and not self.cfg.compile.enable
                and self.metrics.should_log(self.step + 1))

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns loss, grad_norm and timings
        (on attributed steps also ``phases``, the input of ``engine.observe.attribution.step_attribution``)."""
        timer = StepTimer(measure=self._measures_time(), device=self.device, distributed=self.dist.is_distributed,
                          group_dims=self._group_dims)
        if self.ft is not None:
            self.ft.start_step()  # the step's quorum; a group behind its peers heals here
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
        if verdict.reason is not None:
            self._report_unhealthy(verdict, lr)
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

    def _report_unhealthy(self, verdict, lr: float) -> None:
        """A skipped or fatal step: console line, metrics record and capsule (engine/train/capsule.py);
        raises :class:`TrainingDivergedError` on every rank, naming the capsule, when the verdict stops the run."""
        path = report_unhealthy(self, verdict, lr)
        if verdict.fatal is not None:
            raise TrainingDivergedError(f"{verdict.fatal}; capsule {path}")

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
    def train(self, steps: int | None = None) -> list[dict]:
        """Run until ``training.steps`` (or ``steps`` more steps); returns the per-step records kept
        in ``history`` (the last ``HISTORY_STEPS``; metrics.jsonl has every logged step)."""
        last = self.cfg.training.steps if steps is None else self.step + steps
        if self.cfg.training.stop_after_step > 0:  # the schedule still spans training.steps
            last = min(last, self.cfg.training.stop_after_step)
        gc_freq = self.cfg.training.gc_freq
        if gc_freq > 0:
            gc.disable()  # collect at fixed steps so ranks do not stall each other at random times
        try:
            self.stopped_by = self.stop_request.agreed()  # a signal during set-up: train no step
            self.recovery.start()
            while self.step < last and not self.stopped_by:
                self.recovery.step_started(self.step + 1)
                start = time.perf_counter()
                self.profiler.step_begin(self.step + 1)
                try:
                    record = self.train_step()
                except torch.OutOfMemoryError:
                    self.profiler.dump_memory_snapshot(self.step + 1)
                    raise
                if not record["committed"]:  # torchft discarded it: the next step retries the same step number
                    continue
                record["step_seconds"] = time.perf_counter() - start
                self.recovery.step_done(self.step, record["step_seconds"])
                self.profiler.step_end(self.step)
                record["step"] = self.step
                self.tokens_seen += record["global_tokens"]
                self.history.append(record)
                # The step is done: save it before anything that can fail after it (reports,
                # validation, trace files), so that a failure there never loses it.
                final = self.step == self.cfg.training.steps
                try:
                    self._after_step_phase = "checkpoint save"
                    with self.recovery.checkpointing():
                        self.checkpointer.maybe_save(self.step, final=final)
                        if final:
                            self.checkpointer.wait()  # the last step is complete on disk before validation
                    self._after_step(record, last)
                except Exception as error:
                    if is_peer_failure(error):
                        raise
                    raise AfterStepError(after_step_message(
                        error, getattr(self, "_after_step_phase", "reporting"), self.step,
                        self.checkpointer.folder if self.cfg.checkpoint.enable else None)) from error
                self.stopped_by = self.stop_request.agreed()
                if self.stopped_by and self.cfg.checkpoint.enable:  # every rank agrees: save together
                    with self.recovery.checkpointing():
                        self.checkpointer.save(self.step, wait=True)
                    self.stop_saved = True
        finally:
            self.recovery.stop()
            if gc_freq > 0:
                gc.enable()
        return list(self.history)

    def _after_step(self, record: dict, last: int) -> None:
        """What follows a saved step: the profiler's trace, metrics and (when due) validation."""
        self._after_step_phase = "profiler"
        self.profiler.write(self.step)
        self._after_step_phase = "metrics"
        log_step(self.metrics, self.step, record, self.dataloader)
        if self.cfg.training.gc_freq > 0 and self.step % self.cfg.training.gc_freq == 0:
            gc.collect(1)
        evaluate_when_due(self, last)  # validation and the [eval] tasks (engine/train/evaluation.py)

    def close(self, wait: bool = True) -> None:
        """Stop the data read-ahead thread, finish a checkpoint in flight (``wait``: skipped after a failure, since
        it may need other ranks), close the metrics files, restore signal handlers (last: a SIGTERM cannot cut W&B)."""
        self.dataloader.close()
        if wait:
            self.checkpointer.close()
        self.profiler.close()
        self.metrics.close()
        self.stop_request.restore()
        if self.cfg.training.mixed_precision_param == "float64":
            torch.set_default_dtype(torch.float32)
