"""How the :class:`engine.train.trainer.Trainer` builds its parts, once, in ``__init__``'s order: the
data loaders, the model parts, the runner, the downstream tasks, the metrics, the checkpoint manager,
the run's recovery and the services around the step (engine/train/services.py). Split from
engine/train/trainer.py, which keeps the order of the build, the step and the loop."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from engine.checkpoint import CheckpointManager
from engine.config import config_to_toml
from engine.data import build_dataloader, build_validation_dataloader
from engine.observe.metrics import MetricsLogger
from engine.observe.sinks import job_run_id
from engine.setup.model_builder import build_context_parallel, build_model_parts
from engine.train.capsule import UnhealthyStepReport
from engine.train.documents import document_inputs
from engine.train.downstream import DownstreamEvaluation
from engine.train.evaluation import Evaluation
from engine.train.fault_tolerance import data_ranks
from engine.train.recovery import Layout, RunRecovery
from engine.train.runner import PipelineRunner, SingleRunner
from engine.train.step_context import StepContext
from engine.train.services import CheckpointSaving, GarbageCollection, Metrics, Profiling, Service, StopSignals
from parallelisms.comm_counter import group_names_by_mesh_dim
from parallelisms.data_parallel import mixed_precision_by_policy

logger = logging.getLogger("quadra")


class TrainerBuilding:
    """The ``_build_*`` steps of ``Trainer.__init__`` (a mixin: each reads the parts built before it)."""

    def _build_layout(self, setup) -> None:
        """This rank's place in the layout, from the pre-flight's ``SetupPlan`` (``setup``): the degrees
        and mesh, the data-parallel ranks of the loaders, context parallel, this rank's pipeline stages."""
        self.parallel_dims, self.model_spec, self.model_args = setup.parallel_dims, setup.model_spec, setup.model_args
        self.global_batch_size = setup.global_batch_size
        self.model_record, self.model_label = setup.model_record, setup.model_label
        self.setup = setup
        if self.dist.is_distributed:
            self.parallel_dims.build_mesh(self.device.type)
        self._group_dims = group_names_by_mesh_dim(self.parallel_dims)  # for time attribution
        self.dp_rank = self.parallel_dims.mesh("dp").get_local_rank() if self.dist.is_distributed else 0
        self.data_dp, self.data_dp_rank = data_ranks(self.cfg.fault_tolerance, self.parallel_dims.dp, self.dp_rank)
        self.context_parallel = build_context_parallel(self.cfg, self.parallel_dims)
        pp_rank = self.parallel_dims.mesh("pp").get_local_rank() if self.parallel_dims.pp_enabled else 0
        self.pp_plan = setup.pipeline_plan(pp_rank)  # this rank's stages (None without pipeline parallel)
        self.tokenizer = setup.tokenizer  # loaded once per process, by check_setup

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
        # Logged steps are attributed (engine/observe/attribution.py) with metrics.time_attribution on and no
        # compiled code (dispatch modes do not mix with it).
        self.attribute_time = self.cfg.metrics.time_attribution and not self.cfg.compile.enable
        dims = self.parallel_dims
        return MetricsLogger(
            self.cfg.metrics, self.run_folder, rank=self.dist.rank, is_logging_rank=self.dist.rank == 0,
            device=self.device, flops_per_token=self.flops_per_token, training_steps=self.cfg.training.steps,
            # The devices that share one dp rank's samples: tokens/s per device divides by them.
            devices_per_dp_rank=dims.cp * dims.tp * dims.pp, float8=self.cfg.float8.enable,
        )

    def _build_checkpointer(self) -> CheckpointManager:
        return CheckpointManager(
            self.cfg.checkpoint, run_folder=self.run_folder, model_parts=self.model_parts,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            trainer=self, dist_info=self.dist, parallel_dims=self.parallel_dims,
            config_toml=config_to_toml(self.cfg), model_record=self.model_record, fingerprint=self.fingerprint,
        )

    def _resume(self) -> None:
        """Load the newest checkpoint of the run folder (if any); W&B and torchft follow its step, and
        the metrics' first record says which config this launch trains."""
        self.checkpointer.load()
        if self.cfg.metrics.enable_wandb:  # one W&B run per job: the checkpoint's id, else the run folder's
            self.metrics.wandb_run_id = job_run_id(self.metrics.wandb_run_id, self.run_folder, self.dist)
        if self.ft is not None:  # what heals a peer, or is healed (engine/train/fault_tolerance.py)
            self.ft.attach(model_parts=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                           dataloader=self.dataloader, state_dict=self.state_dict, load_state_dict=self.load_state_dict)
            self.ft.resume_at(self.step)
        self.metrics.run_info = {"fingerprint": self.fingerprint}
        if self.checkpointer.fingerprint_change:
            self.metrics.run_info["fingerprint_change"] = self.checkpointer.fingerprint_change

    def _build_recovery(self) -> RunRecovery:
        layout = Layout(self.parallel_dims, self.cfg.training.local_batch_size, self.global_batch_size,
                        self.grad_accum_steps)
        return RunRecovery(self.cfg.comm.hang_timeout_seconds, self.run_folder, rank=self.dist.rank,
                           world_size=self.dist.world_size, resumed_step=self.step, layout=layout,
                           loaded_marker=getattr(self.checkpointer, "loaded_marker", None), replica_group=self.ft)

    def _build_services(self) -> list[Service]:
        """What happens around each step, in the order its hooks run; and the step's health report."""
        cfg = self.cfg
        self.saving = CheckpointSaving(self.checkpointer, enabled=cfg.checkpoint.enable, last_step=cfg.training.steps,
                                       timing=self.recovery.checkpointing)
        self.signals = StopSignals(self.stop_request)
        self.report_unhealthy = UnhealthyStepReport(
            self.run_folder, rank=self.dist.rank, world_size=self.dist.world_size, parallel_dims=self.parallel_dims,
            dataloader=self.dataloader, fingerprint=self.fingerprint, checkpoint_folder=self.saving.folder,
            thresholds=dataclasses.asdict(cfg.step_health), metrics=self.metrics, step_health=self.step_health)
        evaluation = Evaluation(cfg.validation, lambda: self.validate(),  # late-bound: a test may wrap validate
                                self.downstream, model_parts=self.model_parts, device=self.device,
                                metrics=self.metrics, timing=self.recovery.evaluating)
        return [self.recovery, self.saving, Profiling(self.profiler), Metrics(self.metrics, self.dataloader),
                GarbageCollection(cfg.training.gc_freq), evaluation, self.signals]
