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
