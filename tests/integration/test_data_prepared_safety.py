"""Prepared data sets: the refusals (another tokenizer; missing, truncated or corrupted files; a
loader state of other data) and the checksum verification done once per file version
(engine/data/checksums.py)."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

import engine.data.checksums as checksums
from engine.data.checksums import verify_checksums
from engine.data.prepared import PreparedDataError, content_id, read_manifest
from tests.prepared_utils import (REPO, copy_set, flip_last_byte, loader, run_prepare_main, setup_check,
                                  sets)  # noqa: F401

pytestmark = pytest.mark.usefixtures("private_datasets_cache")


def other_tokenizer(folder) -> str:
    """A tiny Hugging Face tokenizer.json (vocabulary of 5) with BOS/EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "word": 4}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)
    return os.path.join(folder, "tokenizer.json")


def run_train(*args) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(REPO, "run_train.sh"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180)


def test_another_tokenizer_is_refused_before_any_rank_starts(sets, tmp_path):
    out = run_train("--data.path", sets["a"].folder, "--model.tokenizer_path", other_tokenizer(tmp_path / "tok"),
                    "--job.dump_folder", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.path=" in lines[0] and "was prepared with tokenizer" in lines[0], out.stderr
    assert "vocab_size 4096" in lines[0] and not os.path.exists(tmp_path / "run" / "config.toml")


@pytest.mark.parametrize("key, value, named", [("policy", "bos", "policy"), ("sha256", "0" * 64, "sha256"),
                                               ("eos_id", 7, "eos_id")])
def test_a_manifest_of_another_tokenizer_identity_is_refused(sets, tmp_path, key, value, named):
    folder = copy_set(sets, tmp_path)
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["tokenizer"][key] = value
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(PreparedDataError, match=f"was prepared with tokenizer .*{named}"):
        setup_check(folder, tmp_path)


def test_truncated_and_corrupted_shards_are_refused_by_name(sets, tok, tmp_path):
    folder = copy_set(sets, tmp_path)
    shard = os.path.join(folder, "tokens-00000.npy")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 2)
    for build in (lambda: setup_check(folder, tmp_path), lambda: loader(tok, folder),
                  lambda: loader(tok, "unused", mixture=[f"{folder}:1"])):
        with pytest.raises(PreparedDataError, match=f"tokens-00000.npy has {size - 2} bytes but the manifest records {size}"):
            build()
    folder = copy_set(sets, tmp_path, "flipped")
    flip_last_byte(os.path.join(folder, "tokens-00000.npy"))
    setup_check(folder, tmp_path)  # the pre-flight compares sizes only: no hashing before the ranks start
    for build in (lambda: loader(tok, folder), lambda: loader(tok, "unused", mixture=[f"{folder}:1"])):
        with pytest.raises(PreparedDataError, match=f"data.(path|mixture)='{folder}': tokens-00000.npy does not "
                                                    "match the checksum in its manifest"):
            build()
    assert verify_checksums(sets["a"].folder) == 2  # one shard and documents.npy, hashed
    with pytest.raises(PreparedDataError, match="tokens-00000.npy does not match"):
        verify_checksums(folder)
    assert run_prepare_main(["--verify", folder]) == 2


def test_training_start_refuses_a_corrupted_shard_in_one_line(sets, tmp_path):
    folder = copy_set(sets, tmp_path)
    flip_last_byte(os.path.join(folder, "tokens-00000.npy"))
    out = run_train("--data.path", folder, "--job.dump_folder", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tokens-00000.npy does not match the checksum" in lines[0], out.stderr
    assert f"data.path='{folder}'" in lines[0]


def counting(monkeypatch) -> list[str]:
    """Record the files engine/data/checksums.py hashes."""
    hashed, digest = [], checksums.file_digest

    def file_digest(path, algorithm):
        hashed.append(os.path.basename(path))
        return digest(path, algorithm)

    monkeypatch.setattr(checksums, "file_digest", file_digest)
    return hashed


def test_a_verified_set_is_hashed_once_and_a_changed_file_again(sets, tok, tmp_path, monkeypatch):
    folder = copy_set(sets, tmp_path)
    shard = os.path.join(folder, "tokens-00000.npy")
    hashed = counting(monkeypatch)
    loader(tok, folder)
    assert sorted(hashed) == ["documents.npy", "tokens-00000.npy"]
    assert os.path.isfile(os.path.join(folder, checksums.CACHE_NAME))
    loader(tok, folder, shuffle=True)
    loader(tok, "unused", mixture=[f"{folder}:1"])
    assert len(hashed) == 2  # trusted from the record: one os.stat per file
    os.utime(shard)  # touched: another version of the file, hashed again
    loader(tok, folder)
    assert hashed[2:] == ["tokens-00000.npy"]
    stamp = os.stat(shard)
    flip_last_byte(shard)
    os.utime(shard, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # same size and mtime: ctime tells
    with pytest.raises(PreparedDataError, match="tokens-00000.npy does not match"):
        loader(tok, folder)
    with pytest.raises(PreparedDataError, match="tokens-00000.npy does not match"):
        loader(tok, folder)  # a mismatch is never recorded
    flip_last_byte(shard)  # repaired: verified and recorded again
    loader(tok, folder)
    del hashed[:]
    loader(tok, folder)
    assert hashed == []
    manifest = read_manifest(folder)  # another manifest over the same files: its digests count, not the record's
    manifest["shards"][0]["xxh3_128"] = "0" * 32
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(PreparedDataError, match="tokens-00000.npy does not match"):
        loader(tok, folder)


def test_a_read_only_folder_is_recorded_in_the_user_cache(sets, tok, tmp_path, monkeypatch):
    folder = copy_set(sets, tmp_path)
    monkeypatch.setattr(checksums, "_writable", lambda path: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hashed = counting(monkeypatch)
    loader(tok, folder)
    records = sorted(os.listdir(tmp_path / "cache" / "quadra" / "verified"))
    assert len(records) == 2 and records[0].startswith("copy-") and records[1] == records[0] + ".lock" and not os.path.exists(os.path.join(folder, checksums.CACHE_NAME))
    loader(tok, folder)
    assert len(hashed) == 2


def test_a_v1_manifest_with_sha256_digests_is_read(sets, tok, tmp_path, monkeypatch):
    folder = copy_set(sets, tmp_path)
    path = os.path.join(folder, "manifest.json")
    manifest = read_manifest(folder)
    for entry in [*manifest["shards"], manifest["documents"]]:
        del entry["xxh3_128"]
        entry["sha256"] = checksums.file_digest(os.path.join(folder, entry["file"]), "sha256")
    manifest["format"] = "quadra-prepared-v1"
    with open(path, "w") as f:
        json.dump(manifest, f)
    v1_id = content_id(manifest)
    assert loader(tok, folder).state_dict()["data"] == f"prepared:{v1_id}"  # the id v1 sets had
    assert v1_id != content_id(read_manifest(sets["a"].folder))
    flip_last_byte(os.path.join(folder, "documents.npy"))
    with pytest.raises(PreparedDataError, match="documents.npy does not match"):
        loader(tok, folder)


def _verify_slowly(folder: str, start, results) -> None:
    digest = checksums.file_digest
    checksums.file_digest = lambda path, algorithm: (time.sleep(0.3), digest(path, algorithm))[1]
    manifest = read_manifest(folder)
    start.wait()
    results.put(checksums.verify_files(folder, manifest, "data.path"))


def test_the_processes_of_a_machine_hash_a_set_once(sets, tmp_path):
    folder = copy_set(sets, tmp_path)
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(3), context.Queue()
    workers = [context.Process(target=_verify_slowly, args=(folder, start, results)) for _ in range(3)]
    for worker in workers:
        worker.start()
    counts = sorted(results.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(10)
    assert counts == [0, 0, 2]  # one hashed both files while the others waited, then trusted its record


def test_a_state_of_other_data_is_refused(sets, tok):
    raw, prepared = loader(tok, sets["a"].raw, L=2), loader(tok, sets["a"].folder, L=2)
    raw.next_batch()
    prepared.next_batch()
    for other in (loader(tok, sets["b"].folder, L=2), loader(tok, "unused", L=2, mixture=[f"{sets['a'].folder}:1"])):
        with pytest.raises(ValueError, match=r"saved reading a prepared set \(content"):
            other.load_state_dict(prepared.state_dict())
    with pytest.raises(ValueError, match="saved reading raw files or a hub dataset but this run reads a prepared set "
                                         r"\(content [0-9a-f]{16}\) \(data.path / data.mixture changed\)"):
        loader(tok, sets["a"].folder, L=2).load_state_dict(raw.state_dict())
    with pytest.raises(ValueError, match=r"saved reading a prepared set \(content [0-9a-f]{16}\) but this run reads "
                                         "raw files or a hub dataset"):
        loader(tok, sets["a"].raw, L=2).load_state_dict(prepared.state_dict())
    with pytest.raises(ValueError, match="saved reading a data.mixture of 1 prepared set"):
        loader(tok, sets["a"].folder, L=2).load_state_dict(loader(tok, "unused", mixture=[f"{sets['a'].folder}:1"],
                                                                  L=2).state_dict())


def _switch_data(folder: str, first: str, second: str) -> dict:
    """In a test worker: 2 steps reading ``first`` (checkpointed), then the same run folder continued to
    step 3 reading ``second``; what the second start restored and the warnings it logged."""
    import logging

    from tests.checkpoint_utils import train_run
    from tests.training_utils import base_args

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("quadra").addHandler(handler)

    def argv(path, steps):
        return base_args(folder, {"data.path": path, "training.steps": steps, "checkpoint.enable": "true",
                                  "checkpoint.interval": 2})

    train_run(argv(first, 2))
    second_run = train_run(argv(second, 3))
    return {**second_run, "warnings": warnings}


@pytest.mark.parametrize("direction", ["raw to prepared", "prepared to raw"])
def test_a_run_switched_between_raw_and_prepared_data_keeps_its_model_and_restarts_the_data(sets, tmp_path,
                                                                                             direction):
    from engine.testing.processes import run_distributed

    paths = [sets["a"].raw, sets["a"].folder][::1 if direction == "raw to prepared" else -1]
    (result,) = run_distributed(_switch_data, 1, str(tmp_path / "run"), *paths, torchrun_env=False)
    assert (result["start_step"], result["start_position"]) == (2, 0)  # model, optimizer, step restored; data anew
    assert sorted(result["losses"]) == [3]
    said = [w for w in result["warnings"] if "cannot carry the data position over" in w]
    saved, now = ("raw files or a hub dataset", "a prepared set") if direction == "raw to prepared" else (
        "a prepared set", "raw files or a hub dataset")
    assert len(said) == 1 and f"saved reading {saved}" in said[0] and f"this run reads {now}" in said[0], result["warnings"]
    assert "starts at the first window of the current data" in said[0]


def test_without_xxhash_a_set_to_verify_is_refused_in_one_line(sets, tok, tmp_path, monkeypatch):
    folder = copy_set(sets, tmp_path)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash raises ImportError
    with pytest.raises(PreparedDataError, match="needs the xxhash package .*pip install xxhash"):
        loader(tok, folder)
