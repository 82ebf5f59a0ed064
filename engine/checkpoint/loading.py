"""Loading a checkpoint: choose, verify, read, fall back past damaged ones; the ranks always agree.

:class:`LoadingMixin` is the load side of :class:`engine.checkpoint.manager.CheckpointManager`
(which provides the attributes it reads: ``cfg``, ``folder``, ``dist``, ``device``, ``state``,
``lr_scheduler``, ``dataloader``, ``trainer``, ``parallel_dims``, ``last_saved_step``).

1. Rank 0 lists the candidates, newest first (engine/checkpoint/selection.py) and broadcasts them.
2. Each candidate is verified: every rank checks the sizes and checksums of its share of the files
   against the manifest (engine/checkpoint/manifest.py; a checkpoint saved before manifests existed
   is checked against the file extents in DCP's metadata), then reads DCP's metadata and the state.
   Every verdict is agreed across ranks (the lowest failing rank's reason reaches all), and DCP
   gathers read errors from all ranks, so all ranks take the same decision and never wait on each
   other in different collectives.
3. A damaged candidate is named in one warning line (file and reason) and the next older one is
   tried; success after a fall-back says so in one line; damage of the only candidate a setting
   names (``load_step``, ``initial_load_path``), or of every candidate, raises CheckpointError.

A model that does not fit the checkpoint, or a full load of a weights-only folder, is not damage:
it raises CheckpointError at once.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from engine.checkpoint import files, manifest, selection
from engine.config.fingerprint import convergence_changes, describe
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.selection import Candidate
from engine.checkpoint.state import (
    changed_settings, first_model_mismatch, optimizer_settings, reapply_lr, restore_optimizer_settings,
    rng_state, saved_model_keys, set_rng_state,
)

logger = logging.getLogger("quadra")


def _saved_loader_keys(metadata, mine: dict) -> dict:
    """The data loader state to ask DCP for: the keys the checkpoint holds, not those this loader
    has. A loader of other sources has other keys (a prepared set adds ``data``, a raw path has
    none): DCP refuses a missing key, and would never show the loader a saved one it did not ask
    for. The loader's ``load_state_dict`` then judges the state as saved (None fills in for DCP)."""
    saved = [fqn.split(".", 1)[1] for fqn in metadata.state_dict_metadata if fqn.startswith("dataloader.")]
    return {key: mine.get(key) for key in saved}


class LoadingMixin:
    """The load side of CheckpointManager, and the collectives both sides use; see the module docstring."""

    # ------------------------------------------------------------------ collectives
    def _agree(self, message: str | None) -> str | None:
        """The lowest failing rank's message on every rank (None when no rank has one); collective."""
        if not self.dist.is_distributed:
            return message
        world = self.dist.world_size
        failing = torch.tensor([self.dist.rank if message else world], device=self.device)
        dist.all_reduce(failing, op=dist.ReduceOp.MIN)
        src = int(failing.item())
        if src == world:
            return None
        box = [message]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _raise_on_every_rank(self, message: str | None) -> None:
        """Raise CheckpointError with the lowest failing rank's message on every rank, if any failed."""
        message = self._agree(message)
        if message:
            raise CheckpointError(message)

    def _pp_group(self):
        dims = self.parallel_dims
        return dims.mesh("pp").get_group() if self.dist.is_distributed and dims.pp_enabled else None

    # ------------------------------------------------------------------ choosing what to load
    def _choose(self) -> selection.LoadPlan | None:
        """What to try loading, in order (engine/checkpoint/selection.py); decided by rank 0."""
        decision: tuple | None = None
        if self.dist.rank == 0:
            try:
                decision = ("ok", selection.plan_load(self.cfg, self.folder))
            except CheckpointError as error:
                decision = ("error", str(error))
        if self.dist.is_distributed:
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        kind, payload = decision
        self._raise_on_every_rank(payload if kind == "error" else None)
        return payload

    # ------------------------------------------------------------------ loading
    def load(self) -> int | None:
        """Load the checkpoint chosen by the config (see module docstring); -> its step, or None.

        A damaged newest checkpoint (fails verification or cannot be read) is named in a warning
        line; the run falls back to the next older one that loads and says so.

        Raises:
            CheckpointError, on every rank: ``load_step`` missing or damaged, ``initial_load_path``
                not a DCP folder or damaged, every checkpoint of the folder damaged, or a checkpoint
                of an incompatible model (names the first differing key).
        """
        if not self.enabled:
            return None
        plan = self._choose()
        if plan is None:
            return None
        damaged: list[tuple[Candidate, str]] = []
        for candidate in plan.candidates:
            start = time.perf_counter()
            if damaged and candidate.model_only:
                # A failed full read may have filled optimizer state in part; a model-only load
                # starts the optimizer fresh, as it is before any load.
                for optimizer in self.state.optimizers:
                    optimizer.state.clear()
            problem = candidate.problem or self._verify(candidate)
            verified = time.perf_counter() - start
            if problem is None:
                problem = self._load_candidate(candidate)
            if problem is None:
                if damaged:
                    self._log_once(selection.fallback_line(candidate, [c for c, _ in damaged]), level=logging.WARNING)
                self._log_loaded(candidate, time.perf_counter() - start, verified)
                return self.trainer.step if not candidate.model_only else int(candidate.marker.get("step", 0))
            if plan.setting:
                raise CheckpointError(selection.refusal(plan, problem))
            self._log_once(selection.damaged_line(candidate, problem), level=logging.WARNING)
            damaged.append((candidate, problem))
        raise CheckpointError(selection.all_damaged(self.folder, damaged))

    def _log_loaded(self, candidate: Candidate, seconds: float, verified: float) -> None:
        if candidate.model_only:
            self._log_once("loaded model weights from %s (%.1f s, verified in %.2f s); optimizer, schedule and "
                           "data start fresh at step 0", candidate.path, seconds, verified)
            return
        self._log_once("%s %s in %.1f s (verified in %.2f s): step %d, %d tokens seen",
                       "new phase loaded from" if candidate.initial else "resumed from", candidate.path,
                       seconds, verified, self.trainer.step, self.trainer.tokens_seen)
        self._log_changed_settings(candidate.marker or {}, phase=candidate.initial)
        # Its layout, which engine/train/recovery.py compares to say the group continues on another
        # world size; a new phase's layout is the user's choice, already listed as changed settings.
        self.loaded_marker = {} if candidate.initial else (candidate.marker or {})
        self.last_saved_step = self.trainer.step  # do not save the same step again

    def _verify(self, candidate: Candidate) -> str | None:
        """Every rank checks its share of the manifest (sizes, checksums); -> the agreed problem."""
        entries = (candidate.marker or {}).get(manifest.KEY)
        if entries is None:
            # Saved before manifests existed (or by another tool): the files are checked against
            # DCP's metadata when it is read.
            logger.debug("%s has no manifest: sizes are checked against DCP's metadata", candidate.path)
            return None
        world, rank = self.dist.world_size, self.dist.rank
        mine = {name: entry for name, entry in entries.items() if manifest.owner(name, world) == rank}
        return self._agree(manifest.check(candidate.path, mine))

    def _load_candidate(self, candidate: Candidate) -> str | None:
        """Read ``candidate`` into the live state; -> None, or the problem every rank agrees on.

        Raises:
            CheckpointError, on every rank: the checkpoint does not fit this model, or a full load
                of a checkpoint that holds model weights only.
        """
        path = candidate.path
        metadata, problem = None, None
        try:
            metadata = dcp.FileSystemReader(path).read_metadata()
        except Exception as error:  # noqa: BLE001 - any failure to read it is damage
            problem = f"{files.DCP_METADATA} cannot be read ({_error_text(error)})"
        if metadata is not None and manifest.KEY not in (candidate.marker or {}):
            problem = manifest.extent_problem(path, _extents(metadata))
        problem = self._agree(problem)
        if problem:
            return problem
        self._check_model(path, metadata)
        if candidate.model_only:
            model = self.state.model_state_dict()
            problem = self._dcp_load({"model": model}, path)
            if problem is None:
                self.state.load_model_state_dict(model)
            return problem
        return self._load_full(path, metadata, candidate.marker or {}, initial=candidate.initial)

    def _log_once(self, message: str, *args, level: int = logging.INFO) -> None:
        if self.dist.rank == 0:
            logger.log(level, message, *args)

    def _dcp_load(self, state: dict, path: str) -> str | None:
        """``dcp.load`` into ``state``; -> None, or the read error every rank agrees on.

        DCP gathers the read results of all ranks, so a read error raises on every rank; other
        failures (e.g. planning: keys that do not match) are not damage and propagate.
        """
        problem = None
        try:
            dcp.load(state, checkpoint_id=path, no_dist=not self.dist.is_distributed)
        except CheckpointException as error:
            if error.args[0] != "read":
                raise
            rank, (cause, _) = min(error.failures.items())
            problem = f"reading it failed on rank {rank} ({_error_text(cause)})"
        return self._agree(problem)

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

    def _load_full(self, path: str, metadata, marker: dict, initial: bool = False) -> str | None:
        """Read and put back the whole training state; -> None, or the read error (see _dcp_load).
        ``initial`` (another run's checkpoint, ``checkpoint.initial_load_path``): the step, LR schedule
        and data position follow ``initial_load_lr`` / ``initial_load_data`` (:meth:`_start_phase`)."""
        for key in ("trainer.step", "lr_scheduler.last_epoch", "dataloader.position"):
            if key not in metadata.state_dict_metadata:
                raise CheckpointError(
                    f"checkpoint {path!r} holds no training state ({key} is missing), only model "
                    "weights: set checkpoint.initial_load_model_only = true to start from its weights")
        # Hyperparameters come from this run's config and the state (moments, step counts, schedule
        # position) from the checkpoint: the same values when nothing changed, and a changed
        # optimizer or schedule setting takes effect from the first resumed step.
        settings, base_lrs = optimizer_settings(self.state.optimizers), list(self.lr_scheduler.base_lrs)
        fresh_schedule, fresh_loader = self.lr_scheduler.state_dict(), self.dataloader.state_dict()
        state = self._training_state()
        state["dataloader"] = _saved_loader_keys(metadata, state["dataloader"])
        # A checkpoint from before a trainer key existed (e.g. step_health) lacks it: ask only for saved ones.
        state["trainer"] = {k: v for k, v in state["trainer"].items() if f"trainer.{k}" in metadata.state_dict_metadata}
        rank_key = f"rank{self.dist.rank}"
        same_world = marker.get("world_size") == self.dist.world_size
        if same_world and f"rng.{rank_key}.cpu" in metadata.state_dict_metadata:
            state["rng"] = {rank_key: rng_state(self.device)}
        elif marker.get("world_size"):
            saved_world = marker.get("world_size")
            self._log_once("RNG states were saved by %s rank%s and are per rank: with %d ranks each keeps "
                           "its seeded state (training itself draws no random numbers)",
                           saved_world, "" if saved_world == 1 else "s", self.dist.world_size)
        problem = self._dcp_load(state, path)
        if problem:
            return problem
        self.state.load_state_dict(state)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        restore_optimizer_settings(self.state.optimizers, settings)
        self.lr_scheduler.base_lrs = base_lrs
        reapply_lr(self.lr_scheduler)
        self.trainer.load_state_dict(state["trainer"])
        if initial:
            self._start_phase(path, state["dataloader"], fresh_schedule, fresh_loader)
        else:
            self._load_data_position(state["dataloader"])
        if "rng" in state:
            set_rng_state(state["rng"][rank_key], self.device)
        return None

    def _start_phase(self, path: str, saved: dict, fresh_schedule: dict, fresh_loader: dict) -> None:
        """A new phase from another run's full checkpoint (e.g. context extension at a longer
        ``training.seq_len``): weights and optimizer state are loaded; the step and LR schedule
        continue or restart (``checkpoint.initial_load_lr``), the data continues after the tokens
        the checkpoint consumed (``seq_len`` × windows, in windows of this run's length) or restarts
        (``initial_load_data``). Says which in one line."""
        cfg, step = self.cfg, self.trainer.step
        if cfg.initial_load_lr == "restart":
            self.trainer.step = 0
            self.lr_scheduler.load_state_dict(fresh_schedule)
            reapply_lr(self.lr_scheduler)
        old, new = saved["seq_len"], fresh_loader["seq_len"]
        tokens = saved["position"] * old
        data = "data restarts at the first window"
        if cfg.initial_load_data == "continue":
            if old != new:
                saved = {**saved, "seq_len": new, "windows_per_epoch": fresh_loader["windows_per_epoch"],
                         "position": -(-tokens // new), "microbatch": 0}
            self._load_data_position(saved)
            data = f"data continues after {tokens} tokens (window {self.dataloader.state_dict()['position']})"
        lr = (f"LR schedule continues at step {step}" if cfg.initial_load_lr == "continue"
              else f"step count and LR schedule restart at 0 (the checkpoint was at step {step})")
        self._log_once("new phase from %s: seq_len %d -> %d; weights and optimizer state loaded; %s; %s",
                       path, old, new, lr, data)

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
            self._log_once("cannot carry the data position over (%s); the data loader starts at the first "
                           "window of the current data, model and optimizer are restored", error, level=logging.WARNING)
            return
        layout = ("global_batch_size", "local_batch_size", "dp_degree")
        if any(saved[k] != mine[k] for k in layout):
            self._log_once("data position carried over exactly: next window %d of the global sequence "
                           "(saved with %s, now %s); no window is repeated or skipped", saved["position"],
                           {k: saved[k] for k in layout}, {k: mine[k] for k in layout})

    def _log_changed_settings(self, marker: dict, phase: bool = False) -> None:
        """Name what changed since the checkpoint's run: every setting (one line), and the convergence
        ones, which give this run another fingerprint (engine/config/fingerprint.py): a warning on a
        resume, one information line for a new phase (``phase``: ``checkpoint.initial_load_path``,
        which starts another run by design; its own ``checkpoint.initial_load_*`` keys are not named)."""
        changes = changed_settings(marker["config"], self.config_toml) if marker.get("config") else []
        if phase:  # a new run by design: its own folder and the keys that start it are no news
            starts = ("checkpoint.initial_load", "job.dump_folder")
            changes = [change for change in changes if not change.startswith(starts)]
        if changes:
            self._log_once("settings changed since the checkpoint (the new values apply): %s", "; ".join(changes))
        saved = marker.get("fingerprint")
        if saved is None or self.fingerprint is None or saved == self.fingerprint:
            return
        # Not refused: researchers do change the learning rate on resume; it must be visible.
        keys = convergence_changes(marker["config"], self.config_toml) if marker.get("config") else []
        if phase:
            keys = [change for change in keys if not change[0].startswith("checkpoint.initial_load")]
        named = describe(keys) or ("the resolved global batch size "
                                   "(training.global_batch_size = -1 under other dp degrees)")
        self.fingerprint_change = {"from": saved, "to": self.fingerprint, "keys": [key for key, *_ in keys]}
        if phase:
            self._log_once("the new phase trains with another convergence fingerprint than the checkpoint's run "
                           "(%s -> %s): %s", saved, self.fingerprint, named)
            return
        self._log_once("resuming a run with another convergence fingerprint (%s -> %s): it no longer trains "
                       "the model the checkpoint's run trained: %s", saved, self.fingerprint, named,
                       level=logging.WARNING)


def _extents(metadata) -> dict[str, int]:
    """{file: bytes needed} from DCP metadata: the end of the last item stored in each file."""
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            ends[path] = max(ends.get(path, 0), info.offset + info.length)
    return ends


def _error_text(error: BaseException) -> str:
    """``Type: first sentence of the message`` (torch's read errors go on for several sentences)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(text) > 120 and ". " in text:
        text = text.split(". ", 1)[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
