"""Damaged checkpoints: the manifest (sizes, checksums), the line that names the damage, the
fall-back to an earlier checkpoint, and the refusals.

Fast tier: the manifest on plain files. Slow tier (training in forked workers): a 10-step run with
checkpoints at steps 5 and 10, whose step-10 is then truncated, corrupted (same size) or loses a
shard; the same command must name the file, fall back to step-5 and continue bitwise like the
uninterrupted run. Checkpoints written before manifests existed still load (and a DCP read error in
one falls back too); ``load_step`` naming a damaged checkpoint and a folder of damaged checkpoints
refuse. Two ranks: the damaged shard is verified by rank 1 only, and both ranks fall back together.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from engine.checkpoint import files, manifest
from tests.checkpoint_utils import STEPS, STOP, ckpt_args, train_run, write_tiny_corpus
from engine.testing.processes import run_distributed

SHARD = "__0_0.distcp"


# ---------------------------------------------------------------- damage, as a disk or a copy does it
def test_side_files_being_written_are_not_checkpoint_files(tmp_path):
    """Another rank's side file is written as <name>.tmp then renamed: a listing made meanwhile must
    skip it (rank 0 hashed it, then crashed when it vanished, or put it in the manifest, which made a
    sound checkpoint fail verification: new-user trial)."""
    for name in ("__0_0.distcp", ".metadata", manifest.share_name(1), manifest.share_name(1) + ".tmp", "quadra.json"):
        (tmp_path / name).write_text("x")
    assert manifest.checkpoint_files(str(tmp_path), "quadra.json") == [".metadata", "__0_0.distcp"]


def truncate(path: str) -> None:
    """Cut the file to half its size (a partial copy)."""
    os.truncate(path, os.path.getsize(path) // 2)


def corrupt(path: str) -> None:
    """Flip 16 bytes in the middle of the file; its size stays the same (a bad disk)."""
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        data = fh.read(16)
        fh.seek(-len(data), os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in data))


def delete(path: str) -> None:
    os.remove(path)


DAMAGE = {
    "truncate": (truncate, "has {half} bytes, the manifest says {size} (truncated)"),
    "corrupt": (corrupt, "fails its checksum (xxh3_64 "),
    "delete": (delete, "is missing (the manifest lists it with {size} bytes)"),
}


def _expected(kind: str, path: str) -> str:
    size = os.path.getsize(path)
    return f"{os.path.basename(path)} " + DAMAGE[kind][1].format(size=size, half=size // 2)


# ---------------------------------------------------------------- fast: the manifest on plain files
def _fake_checkpoint(folder: str, world_size: int) -> dict:
    """A folder of DCP-like files, its manifest made the way a save makes it (each rank's share)."""
    os.makedirs(folder)
    for name, size in ((".metadata", 300), ("__0_0.distcp", 5000), ("__1_0.distcp", 7000)):
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(os.urandom(size))
    files.write_marker(folder, {"step": 1})  # never part of the manifest (it holds it)
    for rank in range(world_size):
        manifest.write_share(folder, files.MARKER, rank, world_size)
    assert manifest.shares_ready(folder, world_size)
    return manifest.collect(folder, files.MARKER, world_size)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_manifest_names_the_file_and_the_damage(kind, tmp_path):
    folder = str(tmp_path / "step-1")
    entries = _fake_checkpoint(folder, world_size=2)
    assert sorted(entries) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # side files merged, gone
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp", files.MARKER]
    assert manifest.check(folder, entries) is None
    target = os.path.join(folder, "__1_0.distcp")
    expected = _expected(kind, target)
    DAMAGE[kind][0](target)
    problem = manifest.check(folder, entries)
    assert problem is not None and problem.startswith(expected), problem
    # Rank 1 of 2 owns that shard at load; rank 0 does not see it.
    assert manifest.owner("__1_0.distcp", 2) == 1 and manifest.owner(".metadata", 2) == 0
    assert [manifest.owner(f"__0_{i}.distcp", 3) for i in range(4)] == [0, 1, 2, 0]  # a conversion's files
    assert manifest.check(folder, {k: v for k, v in entries.items() if manifest.owner(k, 2) == 0}) is None


def test_manifest_without_xxhash_and_with_unknown_checksums(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "ALGORITHM", "crc32")  # what a process without xxhash writes
    folder = str(tmp_path / "step-1")
    entries = _fake_checkpoint(folder, world_size=1)
    assert all(set(entry) == {"bytes", "crc32"} for entry in entries.values())
    unknown = {"__0_0.distcp": {"bytes": entries["__0_0.distcp"]["bytes"], "sha3": "0"}}
    corrupt(os.path.join(folder, "__0_0.distcp"))
    assert manifest.check(folder, entries).startswith("__0_0.distcp fails its checksum (crc32 ")
    assert manifest.check(folder, unknown) is None  # size checked only


def test_extents_of_a_checkpoint_without_manifest(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 100)
    assert manifest.extent_problem(str(tmp_path), {"a.distcp": 100}) is None
    assert manifest.extent_problem(str(tmp_path), {"a.distcp": 101}) == \
        "a.distcp has 100 bytes, DCP's .metadata needs 101 (truncated)"
    assert manifest.extent_problem(str(tmp_path), {"b.distcp": 1}) == "b.distcp is missing (DCP's .metadata refers to it)"


# ---------------------------------------------------------------- slow: training runs that resume
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _resume(argv: list[str]) -> dict:
    """In a worker: train (resuming), -> the result of train_run and the quadra log lines, or the
    CheckpointError's message."""
    from engine.checkpoint.files import CheckpointError

    handler = _Lines()
    quadra = logging.getLogger("quadra")
    quadra.setLevel(logging.INFO)
    quadra.addHandler(handler)
    try:
        result = train_run(argv)
    except CheckpointError as error:
        result = {"error": str(error)}
    result["lines"] = [line for line in handler.lines if "checkpoint" in line or "resumed" in line]
    return result


def _run(world_size: int, argv: list[str]) -> list[dict]:
    return run_distributed(_resume, world_size, argv, torchrun_env=world_size > 1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_tiny_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> tuple[str, dict]:
    """The uninterrupted single-process run: (run folder, result); checkpoints step-5 and step-10."""
    folder = str(tmp_path_factory.mktemp("reference"))
    (result,) = _run(1, ckpt_args(folder, corpus))
    assert sorted(result["losses"]) == list(range(1, STEPS + 1))
    return folder, result


def _copy(run: str, tmp_path, without_manifest: bool = False) -> tuple[str, str]:
    """A copy of a run's checkpoint folder in a new run folder; -> (run folder, checkpoint folder)."""
    folder = str(tmp_path / "run")
    shutil.copytree(os.path.join(run, "checkpoint"), os.path.join(folder, "checkpoint"))
    checkpoints = os.path.join(folder, "checkpoint")
    if without_manifest:  # as saved before manifests existed
        for step in (STOP, STEPS):
            path = os.path.join(checkpoints, f"step-{step}")
            marker = files.read_marker(path)
            del marker[manifest.KEY]
            with open(os.path.join(path, files.MARKER), "w") as fh:
                json.dump(marker, fh)
    return folder, checkpoints


def _assert_fell_back(result: dict, reference: dict, checkpoints: str, reason: str) -> None:
    """One line names step-10, the file and ``reason`` (its start); one says the run falls back to
    step-5; the run continues from step 5 exactly as the uninterrupted one did."""
    damaged = [line for line in result["lines"] if "is damaged" in line]
    assert len(damaged) == 1, result["lines"]
    assert damaged[0].startswith(f"WARNING checkpoint {checkpoints}/step-{STEPS} is damaged: {reason}"), damaged
    fallback = [line for line in result["lines"] if "falling back" in line]
    assert fallback == [f"WARNING falling back to checkpoint step-{STOP}, the newest that verifies: steps "
                        f"{STOP + 1}-{STEPS} are trained again; the damaged step-{STEPS} is left in place until this run saves that step again"], result["lines"]
    assert result["start_step"] == STOP
    assert result["losses"] == {s: reference["losses"][s] for s in range(STOP + 1, STEPS + 1)}  # bitwise


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back(kind, corpus, reference, tmp_path):
    ref_folder, ref = reference
    folder, checkpoints = _copy(ref_folder, tmp_path)
    shard = os.path.join(checkpoints, f"step-{STEPS}", SHARD)
    reason = _expected(kind, shard)
    DAMAGE[kind][0](shard)
    (result,) = _run(1, ckpt_args(folder, corpus))
    _assert_fell_back(result, ref, checkpoints, reason)
    # The run saved step-10 again, over the damaged one: it verifies now.
    new = os.path.join(checkpoints, f"step-{STEPS}")
    assert manifest.check(new, files.read_marker(new)[manifest.KEY]) is None


def test_damaged_checkpoints_refuse_instead_of_falling_back(corpus, reference, tmp_path):
    ref_folder, _ = reference
    folder, checkpoints = _copy(ref_folder, tmp_path)
    corrupt(os.path.join(checkpoints, f"step-{STEPS}", SHARD))
    (named,) = _run(1, ckpt_args(folder, corpus, {"checkpoint.load_step": STEPS}))
    assert named["error"].startswith(f"checkpoint.load_step = {STEPS}: checkpoint '{checkpoints}/step-{STEPS}' "
                                     f"is damaged: {SHARD} fails its checksum"), named
    assert "Fix: restore it from a copy, or choose another step" in named["error"]
    start_from = os.path.join(checkpoints, f"step-{STEPS}")
    (initial,) = _run(1, ckpt_args(str(tmp_path / "fresh"), corpus, {"checkpoint.initial_load_path": start_from}))
    assert initial["error"].startswith(f"checkpoint.initial_load_path = '{start_from}' is damaged: {SHARD} fails "
                                       "its checksum"), initial
    assert os.listdir(tmp_path / "fresh" / "checkpoint") == []  # nothing trained or saved
    os.remove(os.path.join(checkpoints, f"step-{STOP}", files.DCP_METADATA))
    (every,) = _run(1, ckpt_args(folder, corpus))
    assert every["error"].startswith(f"every checkpoint in '{checkpoints}' is damaged (step-{STEPS}: {SHARD} fails "
                                     "its checksum"), every
    assert f"; step-{STOP}: .metadata is missing); the run does not start over" in every["error"]
    first, second = [line for line in every["lines"] if "is damaged" in line]
    assert first.startswith(f"WARNING checkpoint {checkpoints}/step-{STEPS} is damaged: {SHARD} fails its checksum")
    assert second == f"WARNING checkpoint {checkpoints}/step-{STOP} is damaged: .metadata is missing"
    assert sorted(os.listdir(checkpoints)) == [f"step-{STEPS}", f"step-{STOP}"]  # nothing trained or saved
    assert "\n" not in named["error"] + initial["error"] + every["error"]


def _break_zip_of_an_item(path: str, shard: str) -> None:
    """Overwrite the end (zip directory) of the largest item stored in ``shard``: torch.load fails."""
    from torch.distributed.checkpoint import FileSystemReader

    items = [info for info in FileSystemReader(path).read_metadata().storage_data.values()
             if info.relative_path == shard]
    largest = max(items, key=lambda info: info.length)
    with open(os.path.join(path, shard), "r+b") as fh:
        fh.seek(largest.offset + largest.length - 22)
        fh.write(b"\0" * 22)


@pytest.mark.parametrize("kind", ["zip", "truncate"])
def test_checkpoints_without_manifest_load_and_fall_back(kind, corpus, reference, tmp_path):
    """Saved before manifests existed: step-5 loads; a step-10 that DCP cannot read (its data
    partly read into the live state by then) or a truncated one falls back to it, bitwise."""
    ref_folder, ref = reference
    folder, checkpoints = _copy(ref_folder, tmp_path, without_manifest=True)
    path = os.path.join(checkpoints, f"step-{STEPS}")
    if kind == "zip":
        _break_zip_of_an_item(path, SHARD)
        reason = "reading it failed on rank 0 (RuntimeError: PytorchStreamReader failed reading zip archive"
    else:
        needed = os.path.getsize(os.path.join(path, SHARD))
        truncate(os.path.join(path, SHARD))
        reason = f"{SHARD} has {needed // 2} bytes, DCP's .metadata needs {needed} (truncated)"
    (result,) = _run(1, ckpt_args(folder, corpus))
    _assert_fell_back(result, ref, checkpoints, reason)


def test_two_ranks_agree_on_a_shard_only_one_of_them_verifies(corpus, tmp_path):
    """FSDP over 2 ranks, async saves: step-10's rank-1 shard is corrupted; rank 1 checks it (rank 0
    does not) and both ranks fall back to step-5 together, continuing like the uninterrupted run."""
    overrides = {"parallelism.dp_shard": 2, "training.local_batch_size": 4, "checkpoint.async_mode": "async"}
    uninterrupted = str(tmp_path / "uninterrupted")
    full = _run(2, ckpt_args(uninterrupted, corpus, overrides))[0]
    folder, checkpoints = _copy(uninterrupted, tmp_path)
    shard = os.path.join(checkpoints, f"step-{STEPS}", "__1_0.distcp")
    corrupt(shard)
    resumed = _run(2, ckpt_args(folder, corpus, overrides))
    _assert_fell_back(resumed[0], full, checkpoints, "__1_0.distcp fails its checksum")
    assert resumed[1]["start_step"] == STOP and resumed[1]["losses"] == resumed[0]["losses"]


def test_fall_back_to_a_seed_checkpoint_starts_the_optimizer_fresh(corpus, tmp_path):
    """step-0 is a seed (model weights only) and step-5, without manifest, cannot be read: by the
    time DCP fails, the optimizer state exists and is partly filled; the run from the seed must
    still equal a run that only ever saw the seed."""
    from engine.convert.tools import save_seed_checkpoint
    from engine.config import load_config

    seeded = str(tmp_path / "seeded")
    save_seed_checkpoint(load_config(ckpt_args(seeded, corpus)))
    folder = str(tmp_path / "run")
    shutil.copytree(os.path.join(seeded, "checkpoint"), os.path.join(folder, "checkpoint"))
    (from_seed,) = _run(1, ckpt_args(seeded, corpus))
    assert from_seed["start_step"] == 0 and sorted(from_seed["losses"]) == list(range(1, STEPS + 1))
    step5 = os.path.join(folder, "checkpoint", f"step-{STOP}")
    shutil.copytree(os.path.join(seeded, "checkpoint", f"step-{STOP}"), step5)
    marker = files.read_marker(step5)
    del marker[manifest.KEY]
    with open(os.path.join(step5, files.MARKER), "w") as fh:
        json.dump(marker, fh)
    _break_zip_of_an_item(step5, SHARD)
    (result,) = _run(1, ckpt_args(folder, corpus))
    assert [line for line in result["lines"] if "falling back" in line] == [
        f"WARNING falling back to checkpoint step-0, the newest that verifies: steps 1-{STOP} are trained again; "
        f"the damaged step-{STOP} is left in place until this run saves that step again"], result["lines"]
    assert result["start_step"] == 0 and result["losses"] == from_seed["losses"]
