"""Where metrics records go besides the console: the upkeep of metrics.jsonl, and Weights & Biases.

W&B (https://docs.wandb.ai/ref/python/init): rank 0 opens one run per launch with the run id the
checkpoint carries (``resume="allow"``: a resumed launch continues the same run; under
``WANDB_MODE=offline`` each launch writes an ``offline-run-*-<id>`` folder of that run, which
``wandb sync`` uploads into it). Every record metrics.jsonl gets is logged under the keys TensorBoard
uses, ``<kind>/<key>`` (``train/loss``, ``validation/loss``, ``eval/<task>/acc``), at its step; a
record of an earlier step than W&B's current one (an attempt's summary, a step trained again after a
restart) goes to the run's summary instead, since W&B steps only increase.
"""

from __future__ import annotations

import json
import os
from typing import Any


def drop_records_from(path: str, step: int) -> list[int]:
    """Rewrite the JSON-lines file ``path`` without the records whose ``step`` is ``step`` or later
    (atomically: a temporary file replaces it); a torn last line (a crash mid-write) goes too.
    Returns the steps of the records dropped. A missing file, or nothing to drop, leaves it as is."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as file:
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
    with open(tmp, "w", encoding="utf-8") as file:
        file.writelines(kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    return dropped


def new_run_id() -> str:
    """A fresh W&B run id (wandb's ``generate_id``: 8 lowercase letters and digits)."""
    from wandb.sdk.lib.runid import generate_id

    return generate_id()


def agreed_run_id(run_id: str | None, distributed: bool) -> str:
    """The run id every rank saves in checkpoints: ``run_id`` (from a checkpoint, the same on every
    rank) or rank 0's fresh one, broadcast (``torch.distributed.broadcast_object_list``)."""
    if run_id:
        return run_id
    if not distributed:
        return new_run_id()
    import torch.distributed as dist

    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        run_id: the run's id (:func:`agreed_run_id`); config: the run's description for W&B's config.
    """

    def __init__(self, cfg, run_folder: str, run_id: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None,
                              name=cfg.wandb_run_name or os.path.basename(os.path.abspath(run_folder)),
                              tags=list(cfg.wandb_tags), id=run_id, resume="allow", dir=run_folder, config=config)
        self.step = -1

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
        self.run.finish()
