"""Prepared data sets: the folder layout, its manifest, and the checks run before any token is read.

A prepared folder (written by scripts/prepare_data.py through engine/data/prepare.py) holds

- ``manifest.json``: format, tokenizer identity (path, sha256 of its file, vocab size, BOS/EOS ids
  and policy), token dtype, token and document counts, the sources, and per file its size in
  bytes and its digest (``xxh3_128``; sets of format v1 record ``sha256``, and are read as well);
- ``tokens-NNNNN.npy``: the packed token stream (exactly what engine/data/packing.py's
  ``pack_documents`` gives for the same documents and tokenizer) cut into shards, 1-D ``.npy``
  arrays of the smallest unsigned dtype that holds the vocabulary (uint16 up to 65536 ids);
- ``documents.npy``: int64 [documents + 1], document d spans tokens [offsets[d], offsets[d+1]).

Checks, cheapest first: at every open (the launcher's pre-flight and every rank) the manifest is
read and every file's size compared with it, so a truncated or extended shard is refused with its
file name. Ranks then compare every file with its digest (engine/data/checksums.py): hashed the
first time a file is seen (per file version: size, mtime, ctime, inode), trusted from a cached
record afterwards, so a corrupted shard is refused by name and a launch on a verified set costs one
``os.stat`` per file; numpy checks each shard's header. ``scripts/prepare_data.py --verify FOLDER``
hashes everything again, whatever the record says.

Standard library only: the launcher's pre-flight (engine/setup/preflight.py) imports this module, and it
must not import torch or numpy.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"
FORMAT = "quadra-prepared-v2"  # written; v1 (sha256 digests) is read too
READABLE_FORMATS = ("quadra-prepared-v1", FORMAT)
DOCUMENTS = "documents.npy"


class PreparedDataError(ValueError):
    """A prepared folder that cannot be used: unreadable manifest, missing, truncated or corrupted
    file, or a tokenizer other than the run's. The message is one line naming the setting and fix."""


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a folder with a prepared set's manifest."""
    return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def file_sha256(path: str, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file's bytes (read in 16 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def bos_eos_policy(bos_id: int, eos_id: int) -> str:
    """How documents are wrapped (engine/data/packing.py): "bos+eos", or "bos" when BOS is EOS."""
    return "bos" if bos_id == eos_id else "bos+eos"


def tokenizer_identity(tokenizer) -> dict:
    """What a prepared set records of its tokenizer, and what a run's tokenizer must match.

    Args:
        tokenizer: an engine/data/tokenizer.py ``Tokenizer``.

    Returns:
        {"path", "sha256" (of the tokenizer file), "vocab_size", "bos_id", "eos_id", "policy"}.
    """
    return {"path": os.path.abspath(tokenizer.path), "sha256": file_sha256(tokenizer.path),
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "policy": bos_eos_policy(tokenizer.bos_id, tokenizer.eos_id)}


def read_manifest(folder: str, setting: str = "data.path") -> dict:
    """The manifest of a prepared folder, checked for its keys.

    Raises:
        PreparedDataError: no manifest, not JSON, another format, or keys missing.
    """
    path = os.path.join(os.path.expanduser(folder), MANIFEST)
    where = f"{setting}={folder!r}"
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise PreparedDataError(f"{where} has no {MANIFEST}; prepare it with scripts/prepare_data.py") from None
    except (OSError, ValueError) as err:
        raise PreparedDataError(f"{where}: {MANIFEST} is unreadable ({err}); prepare the folder again") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise PreparedDataError(f"{where}: {MANIFEST} is not a {FORMAT} manifest; prepare the folder again with "
                                "scripts/prepare_data.py")
    missing = [k for k in ("tokenizer", "dtype", "num_tokens", "num_documents", "shards", "documents")
               if k not in manifest]
    if missing:
        raise PreparedDataError(f"{where}: {MANIFEST} lacks {missing}; prepare the folder again")
    digest = "sha256" if manifest["format"] == READABLE_FORMATS[0] else "xxh3_128"
    for entry in [*manifest["shards"], manifest["documents"]]:
        if not (isinstance(entry, dict) and {"file", "bytes", digest} <= entry.keys()):
            raise PreparedDataError(f"{where}: {MANIFEST} has a file entry without file, bytes and {digest} "
                                    f"({str(entry)[:80]}); prepare the folder again")
    return manifest


def check_files(folder: str, manifest: dict, setting: str = "data.path") -> None:
    """Every file the manifest lists exists with the recorded size (O(files), no reading).

    Raises:
        PreparedDataError: naming the first missing or mis-sized file.
    """
    where = f"{setting}={folder!r}"
    for entry in [*manifest["shards"], manifest["documents"]]:
        path = os.path.join(os.path.expanduser(folder), entry["file"])
        try:
            size = os.path.getsize(path)
        except OSError:
            raise PreparedDataError(f"{where}: {entry['file']} is missing; the folder is incomplete, prepare it "
                                    "again with scripts/prepare_data.py") from None
        if size != entry["bytes"]:
            raise PreparedDataError(f"{where}: {entry['file']} has {size} bytes but the manifest records "
                                    f"{entry['bytes']} (truncated or overwritten); prepare the folder again")


def check_tokenizer(manifest: dict, identity: dict, folder: str, setting: str = "data.path") -> None:
    """Refuse a prepared set whose tokenizer, vocabulary or BOS/EOS policy differ from the run's.

    Args:
        identity: ``tokenizer_identity`` of the run's tokenizer.

    Raises:
        PreparedDataError: one line with the first difference and the fix.
    """
    made = manifest["tokenizer"]
    for key in ("vocab_size", "bos_id", "eos_id", "policy", "sha256"):
        if made.get(key) != identity[key]:
            what = "the tokenizer file's sha256" if key == "sha256" else key
            raise PreparedDataError(
                f"{setting}={folder!r} was prepared with tokenizer {made.get('path')!r} ({what} "
                f"{made.get(key)!r}) but model.tokenizer_path={identity['path']!r} has {identity[key]!r}; "
                "train with the tokenizer it was made with, or prepare the data again with this one")


def open_checked(folder: str, setting: str = "data.path", identity: dict | None = None) -> dict:
    """``read_manifest`` + ``check_files`` (+ ``check_tokenizer`` when ``identity`` is given)."""
    manifest = read_manifest(folder, setting)
    check_files(folder, manifest, setting)
    if identity is not None:
        check_tokenizer(manifest, identity, folder, setting)
    return manifest


def content_id(manifest: dict) -> str:
    """A short id of a prepared set's content (its files' checksums), stored in the loader state so
    that a resume on other data is told apart (v1 sets keep the id they had)."""
    digests = [[e["file"], e["sha256"] if "sha256" in e else f"xxh3_128:{e['xxh3_128']}"]
               for e in [*manifest["shards"], manifest["documents"]]]
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:16]


def parse_mixture(entries: list[str], setting: str = "data.mixture") -> list[tuple[str, float]]:
    """``["path:weight", ...]`` -> [(path, weight)] (the weight after the last colon).

    Raises:
        PreparedDataError: an entry without a weight, a weight that is not a positive number, or
            a path named twice.
    """
    out: list[tuple[str, float]] = []
    for entry in entries:
        path, sep, text = entry.rpartition(":")
        try:
            weight = float(text) if sep and path else float("nan")
        except ValueError:
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            raise PreparedDataError(f"{setting} entry {entry!r} is not PATH:WEIGHT with a positive weight; write "
                                    'e.g. ["out/web:0.7", "out/code:0.3"] (CLI: out/web:0.7,out/code:0.3)')
        if path in [p for p, _ in out]:
            raise PreparedDataError(f"{setting} names {path!r} twice; give each prepared set once")
        out.append((path, weight))
    return out
