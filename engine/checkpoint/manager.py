"""Checkpointing with torch Distributed Checkpoint (DCP): save, exact resume, resume on another layout.

A checkpoint (``<run folder>/<checkpoint.folder>/step-N``) holds, through ``dcp.save``:

- ``model``: every model part of every rank, by canonical FQN (sharded tensors stay DTensors);
- ``optimizer``: the flattened optimizer state (``get_state_dict``), resharded like the model;
- ``lr_scheduler``, ``trainer`` (step, tokens seen), ``dataloader`` (the global data position: the
  same on every data-parallel rank, checked at save, stored once);
- ``rng.rank<r>``: each rank's torch RNG states (restored only under the same world size);

plus ``quadra.json`` (step, tokens, degrees, the config TOML) written last; see
engine/checkpoint/files.py for the atomic write and engine/checkpoint/state.py for the state dicts.

On start-up the newest complete checkpoint of the run folder is loaded (or ``checkpoint.load_step``,
or else ``checkpoint.initial_load_path``). DCP reshards model and optimizer to the current degrees,
and the data loader continues at the saved global window position, so a run saved under one layout
continues under another without repeating or skipping a sample.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine.checkpoint import files
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.state import (
    ModelAndOptimizer, changed_settings, first_model_mismatch, optimizer_settings, reapply_lr,
    restore_optimizer_settings, rng_state, saved_model_keys, set_rng_state,
)

logger = logging.getLogger("quadra")

__all__ = ["CheckpointError", "CheckpointManager"]


@dataclass
class _PendingSave:
    """An async save in flight: its future and what to do when it completes."""

    future: object
    step: int
    marker: dict
    started: float
    finished: bool = False


class CheckpointManager:
    """Saves and loads the training state of one rank; every public method is called on every rank.

    Args:
        cfg: the ``[checkpoint]`` section (enable, folder, interval, keep_latest_k, async_mode,
            load_step, initial_load_path, initial_load_model_only).
        run_folder: the run folder; checkpoints go to ``<run_folder>/<cfg.folder>/step-N``.
        model_parts, optimizer, lr_scheduler, dataloader: the state to save (see module docstring).
        trainer: has ``state_dict()`` / ``load_state_dict()`` for the step and tokens seen.
        dist_info: the rank's ``engine.train.distributed.DistInfo``.
        parallel_dims: the degrees (recorded in the marker; the pp group checks model keys).
        config_toml: the run's config as TOML, stored with every checkpoint.
        model_record: the model's architecture (``models.registry.model_record``), stored with every
            checkpoint as quadra.json's "model" so tools and later runs know what it holds.

    Raises:
        CheckpointError (a ValueError), on every rank: the checkpoint folder cannot be written.
    """

    def __init__(self, cfg, *, run_folder: str, model_parts, optimizer, lr_scheduler, dataloader,
                 trainer, dist_info, parallel_dims, config_toml: str, model_record: dict | None = None):
        self.cfg = cfg
        self.enabled = bool(cfg.enable)
        self.folder = os.path.join(run_folder, cfg.folder)
        self.state = ModelAndOptimizer(model_parts, optimizer)
        self.lr_scheduler, self.dataloader, self.trainer = lr_scheduler, dataloader, trainer
        self.dist, self.parallel_dims, self.config_toml = dist_info, parallel_dims, config_toml
        self.model_record = model_record
        self.device = dist_info.device
        self.last_saved_step = -1
        self._pending: _PendingSave | None = None
        self._async_group = None
        if not self.enabled:
            return
        if not self.dist.is_distributed:
            # DCP warns at every single-process save/load (also from the async writer thread) that it
            # assumes one process: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        problem = files.unwritable_folder_message(cfg.folder, self.folder) if self.dist.rank == 0 else None
        self._raise_on_every_rank(problem)
        if cfg.async_mode == "async" and self.dist.is_distributed:
            # DCP's collectives in the writer thread must not share a group with training's
            # collectives, or the two interleave and deadlock (seen with gloo on torch 2.13).
            self._async_group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ collectives
    def _raise_on_every_rank(self, message: str | None) -> None:
        """Raise CheckpointError with the lowest failing rank's message on every rank, if any failed."""
        if self.dist.is_distributed:
            world = self.dist.world_size
            failing = torch.tensor([self.dist.rank if message else world], device=self.device)
            dist.all_reduce(failing, op=dist.ReduceOp.MIN)
            src = int(failing.item())
            if src == world:
                return
            box = [message]
            dist.broadcast_object_list(box, src=src)
            message = box[0]
        if message:
            raise CheckpointError(message)

    def _pp_group(self):
        dims = self.parallel_dims
        return dims.mesh("pp").get_group() if self.dist.is_distributed and dims.pp_enabled else None

    # ------------------------------------------------------------------ choosing what to load
    def _choose(self) -> tuple[str, bool, dict] | None:
        """(path, model_only, marker) to load, or None for a fresh start; decided by rank 0."""
        decision: tuple | None = None
        if self.dist.rank == 0:
            try:
                decision = ("ok", self._choose_here())
            except CheckpointError as error:
                decision = ("error", str(error))
        if self.dist.is_distributed:
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        kind, payload = decision
        self._raise_on_every_rank(payload if kind == "error" else None)
        return payload

    def _choose_here(self) -> tuple[str, bool, dict] | None:
        cfg = self.cfg
        found = files.scan(self.folder)
        files.remove_partial(found)
        if cfg.load_step >= 0:
            if cfg.load_step not in found.complete:
                raise CheckpointError(
                    f"checkpoint.load_step = {cfg.load_step}: there is no complete checkpoint step-"
                    f"{cfg.load_step} in {self.folder!r} (complete: {sorted(found.complete) or 'none'}). "
                    "Fix: pick one of those steps, or set checkpoint.load_step = -1 for the newest")
            path = found.complete[cfg.load_step]
            newer = [step for step in found.complete if step > cfg.load_step]
            if newer:
                logger.warning("checkpoint.load_step = %d: the newer checkpoints %s stay until this run "
                               "saves over them (a restart without load_step resumes from the newest)",
                               cfg.load_step, sorted(newer))
        elif found.latest is not None:
            path = found.complete[found.latest]
        elif cfg.initial_load_path:
            path = cfg.initial_load_path
            if not os.path.isfile(os.path.join(path, files.DCP_METADATA)):
                raise CheckpointError(
                    f"checkpoint.initial_load_path = {path!r} is not a DCP checkpoint folder (no "
                    f"{files.DCP_METADATA} in it). Fix: point it at a step-N folder of another run, or "
                    "at a folder written by scripts/convert_checkpoint.py from-torch")
            # A full load of a weights-only folder fails in _load_full with a clear message.
            return path, cfg.initial_load_model_only, files.read_marker(path) or {"step": 0}
        else:
            logger.info("no checkpoint in %s: starting from step 0", self.folder)
            return None
        marker = files.read_marker(path)
        return path, bool(marker.get("model_only")), marker

    # ------------------------------------------------------------------ loading
    def load(self) -> int | None:
        """Load the checkpoint chosen by the config (see module docstring); -> its step, or None.

        Raises:
            CheckpointError, on every rank: ``load_step`` missing, ``initial_load_path`` not a DCP
                folder, or a checkpoint of an incompatible model (names the first differing key).
        """
        if not self.enabled:
            return None
        choice = self._choose()
        if choice is None:
            return None
        path, model_only, marker = choice
        start = time.perf_counter()
        metadata = dcp.FileSystemReader(path).read_metadata()
        self._check_model(path, metadata)
        if model_only:
            model = self.state.model_state_dict()
            self._dcp_load({"model": model}, path)
            self.state.load_model_state_dict(model)
            self._log_once("loaded model weights from %s (%.1f s); optimizer, schedule and data start "
                           "fresh at step 0", path, time.perf_counter() - start)
            return int(marker.get("step", 0))
        self._load_full(path, metadata, marker)
        self._log_once("resumed from %s in %.1f s: step %d, %d tokens seen", path, time.perf_counter() - start,
                       self.trainer.step, self.trainer.tokens_seen)
        self.last_saved_step = self.trainer.step  # do not save the same step again
        return self.trainer.step

    def _log_once(self, message: str, *args) -> None:
        if self.dist.rank == 0:
            logger.info(message, *args)

    def _dcp_load(self, state: dict, path: str) -> None:
        dcp.load(state, checkpoint_id=path, no_dist=not self.dist.is_distributed)

    def _check_model(self, path: str, metadata) -> None:
        """Every rank: this model's keys and shapes against the checkpoint's; error on every rank."""
        model = self.state.model_state_dict()
        problem = first_model_mismatch(metadata, model)
        saved = saved_model_keys(metadata)
        count = torch.tensor([len(model)], device=self.device)
        group = self._pp_group()
        if group is not None:  # pipeline stages hold disjoint keys: the model is their union
            dist.all_reduce(count, group=group)
        if int(count.item()) != len(saved):
            mine = [list(model)]
            if group is not None:
                mine = [None] * dist.get_world_size(group)
                dist.all_gather_object(mine, list(model), group=group)
            known = {key for keys in mine for key in keys}
            extra = [key for key in saved if key not in known]
            if extra and problem is None:
                problem = f"the checkpoint has model weight {extra[0]!r} that this model lacks"
        if problem:
            problem = (f"checkpoint {path!r} does not fit this model: {problem}. It was saved with other "
                       "[model] settings; resume with those, or start elsewhere (checkpoint.folder, "
                       "job.dump_folder, checkpoint.initial_load_path)")
        self._raise_on_every_rank(problem)

    def _load_full(self, path: str, metadata, marker: dict) -> None:
        for key in ("trainer.step", "lr_scheduler.last_epoch", "dataloader.position"):
            if key not in metadata.state_dict_metadata:
                raise CheckpointError(
                    f"checkpoint {path!r} holds no training state ({key} is missing), only model "
                    "weights: set checkpoint.initial_load_model_only = true to start from its weights")
        # Hyperparameters come from this run's config and the state (moments, step counts, schedule
        # position) from the checkpoint: the same values when nothing changed, and a changed
        # optimizer or schedule setting takes effect from the first resumed step.
        settings, base_lrs = optimizer_settings(self.state.optimizers), list(self.lr_scheduler.base_lrs)
        state = self._training_state()
        rank_key = f"rank{self.dist.rank}"
        same_world = marker.get("world_size") == self.dist.world_size
        if same_world and f"rng.{rank_key}.cpu" in metadata.state_dict_metadata:
            state["rng"] = {rank_key: rng_state(self.device)}
        elif marker.get("world_size"):
            self._log_once("RNG states were saved by %s ranks and are per rank: with %d ranks each keeps "
                           "its seeded state (training itself draws no random numbers)",
                           marker.get("world_size"), self.dist.world_size)
        self._dcp_load(state, path)
        self.state.load_state_dict(state)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        restore_optimizer_settings(self.state.optimizers, settings)
        self.lr_scheduler.base_lrs = base_lrs
        reapply_lr(self.lr_scheduler)
        self._load_data_position(state["dataloader"])
        self.trainer.load_state_dict(state["trainer"])
        if "rng" in state:
            set_rng_state(state["rng"][rank_key], self.device)
        self._log_changed_settings(marker)

    def _training_state(self) -> dict:
        """What a full checkpoint holds besides the RNG: the dict given to dcp.save, or filled by dcp.load."""
        state = self.state.state_dict()
        state.update(lr_scheduler=self.lr_scheduler.state_dict(), dataloader=self.dataloader.state_dict(),
                     trainer=self.trainer.state_dict())
        return state

    def _load_data_position(self, saved: dict) -> None:
        mine = self.dataloader.state_dict()
        try:
            self.dataloader.load_state_dict(saved)
        except ValueError as error:
            # The saved position addresses windows of other data: no exact carry-over exists.
            logger.warning("cannot carry the data position over (%s); the data loader starts at the first "
                           "window of the current data, model and optimizer are restored", error)
            return
        layout = ("global_batch_size", "local_batch_size", "dp_degree")
        if any(saved[k] != mine[k] for k in layout):
            self._log_once("data position carried over exactly: next window %d of the global sequence "
                           "(saved with %s, now %s); no window is repeated or skipped", saved["position"],
                           {k: saved[k] for k in layout}, {k: mine[k] for k in layout})

    def _log_changed_settings(self, marker: dict) -> None:
        changes = changed_settings(marker["config"], self.config_toml) if marker.get("config") else []
        if changes:
            self._log_once("settings changed since the checkpoint (the new values apply): %s", "; ".join(changes))

    # ------------------------------------------------------------------ saving
    def maybe_save(self, step: int, *, final: bool = False) -> None:
        """After each optimizer step: save at every ``interval`` steps and at the final step."""
        if not self.enabled:
            return
        self._poll()
        if final or step % self.cfg.interval == 0:
            self.save(step)

    def save(self, step: int, *, wait: bool = False) -> None:
        """Save the state after ``step`` (no-op if already saved); ``wait`` blocks until complete.

        Sync mode returns once the checkpoint is complete on disk. Async mode copies the state to
        CPU memory before returning (so the next optimizer step cannot leak into it) and writes in a
        background thread; one save is in flight at a time.
        """
        if not self.enabled:
            return
        if step == self.last_saved_step:
            if wait:
                self.wait()
            return
        self.wait()
        self._check_data_agreement()
        state = self._training_state()
        state["rng"] = {f"rank{self.dist.rank}": rng_state(self.device)}
        dims = self.parallel_dims
        marker = {"step": step, "tokens_seen": self.trainer.tokens_seen, "model_only": False,
                  "world_size": self.dist.world_size, "torch": torch.__version__, "config": self.config_toml,
                  "degrees": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}}
        if self.model_record is not None:
            marker["model"] = self.model_record
        tmp, started = files.tmp_dir(self.folder, step), time.perf_counter()
        no_dist = not self.dist.is_distributed
        if self.cfg.async_mode == "async":
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_group, no_dist=no_dist)
            self._pending = _PendingSave(future, step, marker, started)
        else:
            dcp.save(state, checkpoint_id=tmp, no_dist=no_dist)
            self._finish(step, marker, started)
            self._barrier()
        self.last_saved_step = step
        if wait:
            self.wait()

    def _check_data_agreement(self) -> None:
        """Every rank must be at the same global data position (it is saved once, for all)."""
        if not self.dist.is_distributed:
            return
        position = self.dataloader.state_dict()["position"]
        spread = torch.tensor([position, -position], dtype=torch.int64, device=self.device)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        if int(spread[0]) != -int(spread[1]):
            raise RuntimeError(f"data loaders disagree on the global position ({-int(spread[1])}.."
                               f"{int(spread[0])}); the data loader state is not layout independent")

    def _finish(self, step: int, marker: dict, started: float) -> None:
        """Rank 0, once every rank has written: marker, rename, prune old checkpoints."""
        if self.dist.rank != 0:
            return
        tmp, final = files.tmp_dir(self.folder, step), files.step_dir(self.folder, step)
        files.write_marker(tmp, marker)
        files.finish(tmp, final)
        deleted = files.prune(self.folder, self.cfg.keep_latest_k, keep_step=step)
        logger.info("saved checkpoint %s in %.2f s%s", final, time.perf_counter() - started,
                    f" (deleted step {', '.join(map(str, deleted))})" if deleted else "")

    def _barrier(self) -> None:
        if self.dist.is_distributed:
            dist.barrier()

    def _poll(self) -> None:
        """Rank 0 completes an async save whose writes have finished (no collective)."""
        pending = self._pending
        if pending is not None and not pending.finished and self.dist.rank == 0 and pending.future.done():
            pending.future.result()  # re-raises a failed write
            self._finish(pending.step, pending.marker, pending.started)
            pending.finished = True

    def wait(self) -> None:
        """Block until the save in flight (async mode) is complete on disk; collective."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.future.result()
        if not pending.finished:
            self._finish(pending.step, pending.marker, pending.started)
        self._barrier()

    def close(self) -> None:
        """Finish the save in flight; call on every rank before the process group is destroyed."""
        self.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
