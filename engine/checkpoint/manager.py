"""Checkpointing with torch Distributed Checkpoint (DCP): save, exact resume, resume on another layout.

A checkpoint (``<run folder>/<checkpoint.folder>/step-N``) holds, through ``dcp.save``:

- ``model``: every model part of every rank, by canonical FQN (sharded tensors stay DTensors);
- ``optimizer``: the flattened optimizer state (``get_state_dict``), resharded like the model;
- ``lr_scheduler``, ``trainer`` (step, tokens seen), ``dataloader`` (the global data position: the
  same on every data-parallel rank, checked at save, stored once);
- ``rng.rank<r>``: each rank's torch RNG states (restored only under the same world size);

plus ``quadra.json`` (step, tokens, degrees, the config TOML, and the manifest: the size and
checksum of every file) written last; see engine/checkpoint/files.py for the atomic write,
engine/checkpoint/manifest.py for the manifest and engine/checkpoint/state.py for the state dicts.

On start-up the newest complete checkpoint of the run folder is loaded (or ``checkpoint.load_step``,
or else ``checkpoint.initial_load_path``; engine/checkpoint/selection.py), verified first; a damaged
one is named and the run falls back to the next older one (engine/checkpoint/loading.py, the load
side of :class:`CheckpointManager`). DCP reshards model and optimizer to the current degrees, and the data
loader continues at the saved global window position, so a run saved under one layout continues
under another without repeating or skipping a sample.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine.checkpoint import files, manifest
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.loading import LoadingMixin
from engine.checkpoint.state import ModelAndOptimizer, rng_state

logger = logging.getLogger("quadra")

__all__ = ["CheckpointError", "CheckpointManager"]


@dataclass
class _PendingSave:
    """An async save in flight: its future (done when this rank's files are written and hashed) and
    what to do when it completes."""

    future: object
    step: int
    marker: dict
    started: float
    finished: bool = False


class CheckpointManager(LoadingMixin):
    """Saves and loads the training state of one rank; every public method is called on every rank.

    Loading (``load``) is in engine/checkpoint/loading.py.

    Args:
        cfg: the ``[checkpoint]`` section (enable, folder, interval, keep_latest_k, async_mode,
            load_step, initial_load_path, initial_load_model_only).
        run_folder: the run folder; checkpoints go to ``<run_folder>/<cfg.folder>/step-N``.
        model_parts, optimizer, lr_scheduler, dataloader: the state to save (see module docstring).
        trainer: has ``state_dict()`` / ``load_state_dict()`` for the step and tokens seen.
        dist_info: the rank's ``engine.train.distributed.DistInfo``.
        parallel_dims: the degrees (recorded in the marker; the pp group checks model keys).
        config_toml: the run's config as TOML, stored with every checkpoint.
        model_record: the model's architecture (``models.resolve.model_record``), stored with every
            checkpoint as quadra.json's "model" so tools and later runs know what it holds.

    Raises:
        CheckpointError (a ValueError), on every rank: the checkpoint folder cannot be written.
    """

    def __init__(self, cfg, *, run_folder: str, model_parts, optimizer, lr_scheduler, dataloader,
                 trainer, dist_info, parallel_dims, config_toml: str, model_record: dict | None = None,
                 fingerprint: str | None = None):
        self.cfg = cfg
        self.enabled = bool(cfg.enable)
        self.folder = os.path.join(run_folder, cfg.folder)
        self.state = ModelAndOptimizer(model_parts, optimizer)
        self.lr_scheduler, self.dataloader, self.trainer = lr_scheduler, dataloader, trainer
        self.dist, self.parallel_dims, self.config_toml = dist_info, parallel_dims, config_toml
        self.model_record = model_record
        self.fingerprint = fingerprint  # engine/config/fingerprint.py; recorded in every checkpoint
        self.fingerprint_change: dict | None = None  # set by a load whose checkpoint had another one
        self.device = dist_info.device
        self.last_saved_step = -1
        self._pending: _PendingSave | None = None
        self._hasher: ThreadPoolExecutor | None = None  # async saves: hashes this rank's files
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
        if self.fingerprint is not None:
            marker["fingerprint"] = self.fingerprint
        tmp, started = files.tmp_dir(self.folder, step), time.perf_counter()
        no_dist = not self.dist.is_distributed
        if self.cfg.async_mode == "async":
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_group, no_dist=no_dist)
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quadra-checkpoint-hash")
            # Each rank hashes its files in the background once DCP has written them all.
            hashed = self._hasher.submit(self._hash_share, future, tmp)
            self._pending = _PendingSave(hashed, step, marker, started)
        else:
            dcp.save(state, checkpoint_id=tmp, no_dist=no_dist)
            self._hash_share(None, tmp)
            self._barrier()  # every rank's share of the manifest is written
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

    def _hash_share(self, future, tmp: str) -> None:
        """After DCP's save (``future``: async, its future): hash this rank's files into its share."""
        if future is not None:
            future.result()  # re-raises a failed write
        manifest.write_share(tmp, files.MARKER, self.dist.rank, self.dist.world_size)

    def _finish(self, step: int, marker: dict, started: float) -> None:
        """Rank 0, once every rank has written and hashed its files: manifest + marker, rename, prune."""
        if self.dist.rank != 0:
            return
        tmp, final = files.tmp_dir(self.folder, step), files.step_dir(self.folder, step)
        marker = {**marker, manifest.KEY: manifest.collect(tmp, files.MARKER, self.dist.world_size)}
        files.write_marker(tmp, marker)
        files.finish(tmp, final)
        deleted = files.prune(self.folder, self.cfg.keep_latest_k, keep_step=step)
        logger.info("saved checkpoint %s in %.2f s%s", final, time.perf_counter() - started,
                    f" (deleted step {', '.join(map(str, deleted))})" if deleted else "")

    def _barrier(self) -> None:
        if self.dist.is_distributed:
            dist.barrier()

    def _poll(self) -> None:
        """Rank 0 completes an async save whose files are all written and hashed (no collective)."""
        pending = self._pending
        if (pending is not None and not pending.finished and self.dist.rank == 0 and pending.future.done()
                and manifest.shares_ready(files.tmp_dir(self.folder, pending.step), self.dist.world_size)):
            pending.future.result()  # re-raises a failed write
            self._finish(pending.step, pending.marker, pending.started)
            pending.finished = True

    def wait(self) -> None:
        """Block until the save in flight (async mode) is complete on disk; collective."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.future.result()
        self._barrier()  # every rank's share of the manifest is written
        if not pending.finished:
            self._finish(pending.step, pending.marker, pending.started)
        self._barrier()

    def close(self) -> None:
        """Finish the save in flight; call on every rank before the process group is destroyed."""
        self.wait()
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
