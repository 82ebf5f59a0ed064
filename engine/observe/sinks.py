"""Where metrics records go besides the console: the upkeep of metrics.jsonl, and Weights & Biases.

W&B (https://docs.wandb.ai/ref/python/init): a job is one W&B run, across restarts, resumes and
layout changes. Its id (:func:`job_run_id`) is the one in the checkpoint being resumed, else the one in
``<run folder>/wandb_run_id`` (written by rank 0 when the job's first attempt starts, before any save),
else a fresh one. Rank 0 opens the run once per attempt (``resume="allow"``; under
``WANDB_MODE=offline`` each attempt writes an ``offline-run-*-<id>`` folder of that run, which
``wandb sync`` uploads into it). An attempt that trains again steps an earlier one logged (it resumed
from an older checkpoint, or from none) rewinds the run to the step before its first record
(``resume_from="<id>?_step=N"``, W&B's run rewind): W&B drops the run's history after step N and the
attempt's records replace those steps, as in metrics.jsonl. Every record metrics.jsonl gets is logged
under the keys TensorBoard uses, ``<kind>/<key>`` (``train/loss``, ``validation/loss``,
``eval/<task>/acc``), at its step; a record of an earlier step than W&B's current one (an attempt's
summary) goes to the run's summary instead, since W&B steps only increase.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

logger = logging.getLogger("quadra")

# <run folder>/wandb_run_id: the job's W&B run id, for its later attempts and launches (job_run_id).
RUN_ID_FILE = "wandb_run_id"


def drop_records_from(path: str, step: int) -> list[int]:
    """Rewrite the JSON-lines file ``path`` without the records whose ``step`` is ``step`` or later
    (atomically: a temporary file replaces it); a torn last line (a crash mid-write) goes too.
    Returns the steps of the records dropped. A missing file, or nothing to drop, leaves it as is."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as file:  # (any ASCII-compatible encoding alike: json.dumps writes ASCII)
        lines = file.readlines()
    kept, dropped, torn = [], [], False
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn = True
            continue
        logged = int(record.get("step", 0))
        if logged >= step:
            dropped.append(logged)
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if not dropped and not torn:
        return []
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as file:  # (alike, as above)
        file.writelines(kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    return dropped


def new_run_id() -> str:
    """A fresh W&B run id (wandb's ``generate_id``: 8 lowercase letters and digits)."""
    from wandb.sdk.lib.runid import generate_id

    return generate_id()


def job_run_id(checkpoint_id: str | None, run_folder: str, dist_info) -> str:
    """The job's W&B run id, the same on every rank and in every attempt and launch of ``run_folder``.

    Precedence: ``checkpoint_id`` (the id in the checkpoint being resumed, the same on every rank),
    else the id in ``<run folder>/wandb_run_id`` (an earlier attempt or launch wrote it: a restart
    before the first save continues its run), else a fresh one. Rank 0 chooses, broadcasts its choice
    when no checkpoint gave one (``torch.distributed.broadcast_object_list``: the ranks need not
    share the file system), and writes the file atomically when it does not hold that id.

    Args:
        checkpoint_id: the checkpoint's id (None: no checkpoint, or one saved with W&B off);
        run_folder: ``job.dump_folder``; dist_info: the process's ``DistInfo`` (``rank``, ``is_distributed``).
    """
    path = os.path.join(run_folder, RUN_ID_FILE)
    # rank 0 reads the file once (another rank's reading would change nothing: only rank 0's is used)
    stored = read_run_id(path) if dist_info.rank == 0 else None
    if checkpoint_id:
        run_id = checkpoint_id
    else:
        box = [(stored or new_run_id()) if dist_info.rank == 0 else None]
        if dist_info.is_distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(box, src=0)
        run_id = box[0]
    if dist_info.rank == 0 and stored != run_id:
        os.makedirs(run_folder, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as file:  # (any encoding alike: run ids are [a-z0-9])
            file.write(run_id + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    return run_id


def read_run_id(path: str) -> str | None:
    """The run id in the file ``path`` (:data:`RUN_ID_FILE`), or None when it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as file:  # (any encoding alike: run ids are [a-z0-9])
            return file.read().strip() or None
    except FileNotFoundError:
        return None


# W&B modes that open no connection, so need no credentials (wandb's Settings: ``_offline``, ``_noop``).
WANDB_MODES_WITHOUT_NETWORK = ("offline", "dryrun", "disabled")


def wandb_credentials_problem() -> str | None:
    """The pre-flight line for ``metrics.enable_wandb`` when ``wandb.init`` would find no credentials.

    W&B's settings are read as its own library reads them, without starting it or any network call:
    the settings files (``$WANDB_CONFIG_DIR/settings`` or ~/.config/wandb/settings, where ``wandb
    offline`` / ``wandb login --host`` write), then the ``WANDB_*`` variables. A mode that opens no
    connection (``WANDB_MODE`` offline, dryrun or disabled) needs nothing. Otherwise credentials are
    a non-empty ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``), or an entry in the netrc file
    (``$NETRC`` or ~/.netrc, which ``wandb login`` writes) for the server W&B will talk to
    (``WANDB_BASE_URL`` for a self-hosted one), read with wandb's own ``read_netrc_auth``. Without
    them ``wandb.init`` fails at the first record (after step 1: "No API key configured").

    Returns:
        one line naming ``metrics.enable_wandb`` and the fixes (``wandb login``, ``WANDB_API_KEY``,
        ``WANDB_MODE=offline`` or ``disabled``), or None when the run can open its W&B run. A
        ``WANDB_*`` value or netrc key that wandb itself rejects gives a line with wandb's reason.
    """
    from wandb.errors import Error as WandbError
    from wandb.sdk.lib import wbauth
    from wandb.sdk.wandb_settings import Settings

    try:
        settings = _wandb_settings(Settings)
    except (ValueError, WandbError) as error:  # pydantic's ValidationError (a ValueError), wandb's UsageError
        return f"metrics.enable_wandb = true but wandb refuses its settings: {' '.join(str(error).split())}"
    if settings.mode in WANDB_MODES_WITHOUT_NETWORK or settings.api_key or settings.identity_token_file:
        return None
    try:
        if wbauth.read_netrc_auth(host=settings.base_url):
            return None
    except (ValueError, WandbError) as error:  # AuthenticationError: a key of the wrong form
        return (f"metrics.enable_wandb = true but the netrc key for {settings.base_url} is not one W&B accepts "
                f"({' '.join(str(error).split())}): run `wandb login --relogin`, or set WANDB_API_KEY")
    netrc = os.environ.get("NETRC") or "~/.netrc"
    return (f"metrics.enable_wandb = true but W&B has no credentials for {settings.base_url} (WANDB_API_KEY is "
            f"unset and {netrc} has no entry for it) and WANDB_MODE is not offline: run `wandb login`, or set "
            "WANDB_API_KEY, or log locally with WANDB_MODE=offline (`wandb sync` uploads later) or turn W&B off "
            "with WANDB_MODE=disabled or metrics.enable_wandb = false")


def _wandb_settings(settings_class):
    """W&B's global settings as ``wandb.setup`` loads them (settings files, then ``WANDB_*``), without
    the library's singleton (which starts a thread) and without its "Loading settings" message."""
    import pathlib

    settings = settings_class(quiet=True)
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    settings.settings_system = str(pathlib.Path(config_dir).expanduser() / "settings" if config_dir
                                   else pathlib.Path("~", ".config", "wandb", "settings").expanduser())
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings


class WandbSink:
    """Rank 0's W&B run (module docstring).

    Args:
        cfg: the ``[metrics]`` section (``wandb_project``, ``wandb_entity``, ``wandb_run_name``,
            ``wandb_tags``); run_folder: the run folder (W&B writes its ``wandb/`` folder there);
        run_id: the job's run id (:func:`job_run_id`); config: the run's description for W&B's config;
        rewind_to: the last step an earlier attempt logged that this one does not train again, when it
            trains again steps that one logged (None: it does not): the run is rewound to it
            (``resume_from``) if W&B wrote a segment of this run into ``run_folder`` before. Where
            the server refuses the rewind (an online run; the feature is a preview W&B enables per
            account), a warning says so and the run continues without it.
    """

    def __init__(self, cfg, run_folder: str, run_id: str, config: dict[str, Any], rewind_to: int | None = None):
        import wandb

        settings = dict(project=cfg.wandb_project, entity=cfg.wandb_entity or None, id=run_id, dir=run_folder,
                        name=cfg.wandb_run_name or os.path.basename(os.path.abspath(run_folder)),
                        tags=list(cfg.wandb_tags), config=config)
        self.run = None
        if rewind_to is not None and glob.glob(os.path.join(run_folder, "wandb", f"*run-*-{glob.escape(run_id)}*")):
            try:
                self.run = wandb.init(resume_from=f"{run_id}?_step={rewind_to}", **settings)
                logger.info("W&B run %s rewound to step %d: this attempt's records of later steps replace the "
                            "earlier ones", run_id, rewind_to)
            except wandb.errors.Error as error:
                logger.warning("W&B refused to rewind run %s to step %d (%s): it continues without, and keeps "
                               "its first record of each step trained again", run_id, rewind_to,
                               " ".join(str(error).split()))
        if self.run is None:
            self.run = wandb.init(resume="allow", **settings)
        self.step = -1  # (any negative alike: steps are >= 0)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        """The numbers of one metrics.jsonl record, as ``<kind>/<key>`` at the record's step."""
        values = {f"{kind}/{key}": value for key, value in record.items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if not values:
            return
        step = int(record["step"])
        if step < self.step:
            self.run.summary.update(values)
            return
        self.step = step
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the run (offline: close its folder's ``.wandb`` file)."""
        self.run.finish()
