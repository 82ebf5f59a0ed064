"""The checkpoint folder on disk: names, the completeness marker, atomic finish, discovery, pruning.

Layout (``<run folder>/<checkpoint.folder>/``)::

    step-500/            a complete checkpoint: DCP shards (*.distcp), DCP's .metadata, quadra.json
    step-1000.tmp/       a checkpoint being written, or left behind by a crash: never loaded

A save writes into ``step-N.tmp``; when every rank has finished writing (DCP's own metadata is the
last thing it writes, after gathering every rank's results), rank 0 writes ``quadra.json`` and renames
the folder to ``step-N``. The rename is atomic on POSIX file systems, and the marker is checked as
well, so a crash at any moment leaves either the old set of checkpoints or the old set plus a
complete new one; a ``.tmp`` folder is recognisable and removed (with a warning) at resume. A
``step-N`` folder without DCP's metadata or the marker was damaged after its save (or not written
by this engine): the manager reports it as damaged and falls back past it. ``quadra.json`` also
holds the manifest, the size and checksum of every file (engine/checkpoint/manifest.py).

Only plain file operations live here; the state that goes into a checkpoint is in
engine/checkpoint/state.py and the orchestration in engine/checkpoint/manager.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass

logger = logging.getLogger("quadra")

MARKER = "quadra.json"  # written last into a checkpoint folder: its presence means "complete"
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint's FileSystemWriter
TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded as asked; the message names the setting and the fix."""


def step_dir(folder: str, step: int) -> str:
    """``<folder>/step-<step>``: where the complete checkpoint of ``step`` lives."""
    return os.path.join(folder, f"step-{step}")


def tmp_dir(folder: str, step: int) -> str:
    """``<folder>/step-<step>.tmp``: where the checkpoint of ``step`` is written before the rename."""
    return step_dir(folder, step) + TMP_SUFFIX


def write_marker(path: str, info: dict) -> None:
    """Write ``info`` (JSON-serialisable) as ``<path>/quadra.json``, flushed and fsync'ed."""
    data = {"format": FORMAT_VERSION, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}
    target = os.path.join(path, MARKER)
    with open(target, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def read_marker(path: str) -> dict | None:
    """The ``quadra.json`` of a checkpoint folder, or None when it is missing or unreadable."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def is_complete(path: str) -> bool:
    """True when ``path`` holds DCP's metadata and a readable marker (the last two files written)."""
    return incomplete_reason(path) is None


def incomplete_reason(path: str) -> str | None:
    """None when ``path`` holds DCP's metadata and a readable marker, else which one it lacks."""
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        return f"{DCP_METADATA} is missing"
    if read_marker(path) is None:
        return f"{MARKER} is missing or not valid JSON"
    return None


def finish(tmp_path: str, final_path: str) -> None:
    """Rename a fully written ``step-N.tmp`` to ``step-N`` (replacing a stale ``step-N``, if any)."""
    if os.path.exists(final_path):
        # Only after a resume from an earlier step of the same run: the new save supersedes it.
        shutil.rmtree(final_path)
    os.replace(tmp_path, final_path)
    _fsync_dir(os.path.dirname(final_path))


def _fsync_dir(path: str) -> None:
    """Persist a rename: fsync the parent directory (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class FolderScan:
    """What a checkpoint folder holds, by step: complete checkpoints, and ``step-N`` folders without
    DCP's metadata or the marker (``incomplete``); ``partial``: the ``step-N.tmp`` folders."""

    complete: dict[int, str]
    partial: list[str]
    incomplete: dict[int, str]

    @property
    def latest(self) -> int | None:
        return max(self.complete) if self.complete else None


def scan(folder: str) -> FolderScan:
    """List ``folder``'s complete checkpoints, its ``step-N.tmp`` folders and incomplete ``step-N`` ones."""
    complete: dict[int, str] = {}
    partial: list[str] = []
    incomplete: dict[int, str] = {}
    if not os.path.isdir(folder):
        return FolderScan(complete, partial, incomplete)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        if _TMP_RE.match(name):
            partial.append(path)
        elif (match := _STEP_RE.match(name)) is not None:
            (complete if is_complete(path) else incomplete)[int(match.group(1))] = path
    return FolderScan(complete, partial, incomplete)


def remove_partial(scan_result: FolderScan) -> None:
    """Warn about, and delete, the ``*.tmp`` folders of a scan (saves that did not finish).

    Incomplete ``step-N`` folders are left alone: this engine's save renames only complete
    folders, so one was damaged later (or written by something else) and the user may inspect it.
    """
    for path in scan_result.partial:
        logger.warning("ignoring incomplete checkpoint %s (a save that did not finish); removing it", path)
        shutil.rmtree(path, ignore_errors=True)


def prune(folder: str, keep_latest_k: int, keep_step: int | None = None) -> list[int]:
    """Delete all but the newest ``keep_latest_k`` complete checkpoints; 0 keeps all. -> deleted steps.

    ``keep_step`` (the checkpoint just written) is never deleted, even when newer ones are left
    from before a resume with ``checkpoint.load_step``.
    """
    if keep_latest_k <= 0:
        return []
    steps = sorted(scan(folder).complete)
    doomed = [step for step in steps[:-keep_latest_k] if step != keep_step]
    for step in doomed:
        shutil.rmtree(step_dir(folder, step), ignore_errors=True)
    return doomed


def unwritable_folder_message(setting: str, folder: str, *, keep: bool = True) -> str | None:
    """One line for a checkpoint folder that cannot be written, or None: ``setting`` is the value of
    ``checkpoint.folder`` as configured, ``folder`` where it resolves (created when missing; with
    ``keep=False`` the folders the probe created are removed again, as a pre-flight or a dry run
    must leave nothing behind)."""
    problem = check_writable(folder, keep=keep)
    if problem is None:
        return None
    return (f"checkpoint.folder = {setting!r} resolves to {os.path.abspath(folder)!r}, which cannot be "
            f"written ({problem}). Fix: make it writable, or set checkpoint.folder (or job.dump_folder) "
            "to a writable place")


def check_writable(folder: str, *, keep: bool = True) -> str | None:
    """Create ``folder`` and write/delete a probe file; -> None, or the OS error as text. With
    ``keep=False`` the folders this call created (``folder`` and missing parents) are removed after."""
    created = []
    path = os.path.abspath(folder)
    while path != os.path.dirname(path) and not os.path.lexists(path):
        created.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-probe-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        if not keep:
            for made in created:  # deepest first; one holding something else now stays
                try:
                    os.rmdir(made)
                except OSError:
                    break
    return None
