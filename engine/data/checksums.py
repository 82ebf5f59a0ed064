"""Content checksums of prepared sets, verified once per file version and remembered.

A prepared folder's manifest (engine/data/prepared.py) records each file's digest: xxh3-128
(``xxh3_128``, from the ``xxhash`` package that ``datasets`` depends on) since format v2, sha256
in v1 manifests. Before a run reads a token, ``verify_files`` compares every file with its
recorded digest, so a corrupted shard is refused with its name instead of being trained on.

Hashing reads the whole set (measured on this repository's 2-core machine: xxh3-128 about 1.8 GB/s
from the page cache on one core, sha256 0.5 GB/s, blake2b 0.2 GB/s, zlib.crc32 0.65 GB/s), so the
result is cached: a file that matched is recorded with its size, mtime_ns, ctime_ns and inode, and
a later open trusts a file whose four values are unchanged (one ``os.stat`` per file). Any write
changes mtime and ctime (ctime even when mtime is set back, e.g. ``touch -d`` or ``os.utime``), and
a copy gets a new inode, so such a file is hashed again. A change that leaves all four values alone
(bit rot below the file system, a device swapped under the same inode numbers) is not seen; run
``scripts/prepare_data.py --verify`` for a full check.

The cache is ``.quadra-verified.json`` in the prepared folder, or, when the folder is not writable,
``$XDG_CACHE_HOME/quadra/verified/<folder name>-<hash of its real path>.json`` (default
``~/.cache``). It is replaced atomically (write, then ``os.replace``). Processes that find files to
hash take an exclusive ``fcntl.flock`` on ``<cache>.lock`` first, so the ranks of one machine hash
a set once: the first hashes (a few threads, one file each), the others wait and then find the
result. Where the file system refuses ``flock`` each process hashes by itself.

Standard library plus ``xxhash``, imported when hashing; no numpy or torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from engine.data.prepared import PreparedDataError, open_checked

logger = logging.getLogger("quadra.data")

CACHE_NAME = ".quadra-verified.json"
DIGEST = "xxh3_128"  # what new manifests record (format v2)
_KNOWN = (DIGEST, "sha256")
_CHUNK = 8 << 20  # bytes read per call
_THREADS = 4  # files hashed at once (reading a network file system in parallel helps; more rarely does)


def recorded_digest(entry: dict) -> tuple[str, str]:
    """(algorithm, hex digest) a manifest entry records: xxh3_128 (v2) or sha256 (v1).

    Raises:
        KeyError: the entry records neither.
    """
    for name in _KNOWN:
        if name in entry:
            return name, entry[name]
    raise KeyError(f"{entry.get('file')}: no checksum ({' or '.join(_KNOWN)}) in the manifest")


def new_hasher(algorithm: str):
    """A streaming hasher (``update(bytes)``, ``hexdigest()``) of ``algorithm`` (xxh3_128 or sha256)."""
    if algorithm == DIGEST:
        try:
            import xxhash
        except ImportError:
            raise PreparedDataError("checking a prepared set's xxh3-128 digests needs the xxhash package (a "
                                    "dependency in pyproject.toml); install it: pip install xxhash") from None
        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def file_digest(path: str, algorithm: str) -> str:
    """Hex digest of a file's bytes, read in 8 MiB chunks into one reused buffer."""
    hasher, buf = new_hasher(algorithm), bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


def _stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def cache_path(folder: str) -> str:
    """Where the verification record of ``folder`` lives (see the module docstring)."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if _writable(folder):
        return os.path.join(folder, CACHE_NAME)
    real = os.path.realpath(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = f"{os.path.basename(real) or 'root'}-{hashlib.sha256(real.encode()).hexdigest()[:16]}.json"
    return os.path.join(base, "quadra", "verified", name)


def _writable(folder: str) -> bool:
    return os.access(folder, os.W_OK)


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data["files"] if isinstance(data, dict) and isinstance(data.get("files"), dict) else {}
    except (OSError, ValueError, KeyError):
        return {}  # absent or damaged: everything is hashed again


def _write_cache(path: str, files: dict) -> None:
    """Atomically replace the record (a reader sees the old or the new one, whole)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"format": 1, "files": files}, fh, indent=1, sort_keys=True)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _machine_lock(path: str, where: str):
    """An exclusive flock on ``path`` (created if needed); nothing where the file system refuses it."""
    import fcntl

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for another process that is verifying the set's checksums", where)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a file system mounted without flock support
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _todo(folder: str, entries: list[dict], cached: dict) -> list[tuple[dict, list[int]]]:
    """(entry, current stamp) of every file without a matching record."""
    out = []
    for entry in entries:
        stamp = _stamp(os.path.join(folder, entry["file"]))
        algorithm, digest = recorded_digest(entry)
        record = cached.get(entry["file"])
        if not (isinstance(record, dict) and record.get("stamp") == stamp
                and record.get("digest") == f"{algorithm}:{digest}"):
            out.append((entry, stamp))
    return out


def _hash_all(folder: str, todo: list[tuple[dict, list[int]]]) -> list[tuple[dict, list[int], bool, bool]]:
    """Hash the files of ``todo`` (up to _THREADS at once): (entry, stamp, matches, unchanged while hashed)."""
    def one(item):
        entry, stamp = item
        path = os.path.join(folder, entry["file"])
        algorithm, digest = recorded_digest(entry)
        matches = file_digest(path, algorithm) == digest
        return entry, stamp, matches, _stamp(path) == stamp

    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(todo)))) as pool:
        return list(pool.map(one, todo))


def verify_files(folder: str, manifest: dict, where: str, *, use_cache: bool = True) -> int:
    """Compare every file of a prepared folder with the digest its manifest records.

    Files recorded as verified with their current size, mtime_ns, ctime_ns and inode are trusted
    (``use_cache=False`` hashes everything); the others are hashed and, when they match, recorded.

    Args:
        folder: the prepared folder (its files' sizes were checked already).
        manifest: its manifest (``engine.data.prepared.read_manifest``).
        where: ``setting=folder`` for the message.

    Returns:
        how many files were hashed (0: every file was trusted from the record).

    Raises:
        PreparedDataError: one line naming the first file whose bytes differ from its digest (and
            how many others do).
    """
    folder = os.path.abspath(os.path.expanduser(folder))
    entries = [*manifest["shards"], manifest["documents"]]
    cache = cache_path(folder)
    if use_cache and not _todo(folder, entries, _read_cache(cache)):
        return 0
    with _machine_lock(cache + ".lock", where):
        cached = _read_cache(cache) if use_cache else {}
        todo = _todo(folder, entries, cached)  # another process may have finished meanwhile
        if not todo:
            return 0
        size = sum(stamp[0] for _, stamp in todo)
        logger.info("%s: verifying %d file(s), %.2f GB, against the manifest's checksums (once; later starts "
                    "reuse %s)", where, len(todo), size / 1e9, cache)
        started = time.perf_counter()
        results = _hash_all(folder, todo)
        bad = [entry["file"] for entry, _, matches, _ in results if not matches]
        if bad:
            more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
            raise PreparedDataError(
                f"{where}: {bad[0]}{more} does not match the checksum in its manifest (corrupted or overwritten "
                "since it was prepared); copy the file again from where the set was prepared, or prepare the "
                "folder again")
        seconds = time.perf_counter() - started
        logger.info("%s: checksums verified in %.1f s (%.2f GB/s)", where, seconds, size / 1e9 / max(seconds, 1e-9))
        for entry, stamp, _, unchanged in results:
            if unchanged:  # a file written while it was hashed is hashed again next time
                cached[entry["file"]] = {"stamp": stamp, "digest": ":".join(recorded_digest(entry))}
        try:
            _write_cache(cache, cached)
        except OSError as err:
            logger.warning("%s: cannot record the verified checksums in %s (%s); they will be hashed again at the "
                           "next start", where, cache, err)
    return len(todo)


def verify_checksums(folder: str, setting: str = "folder", *, use_cache: bool = False) -> int:
    """Compare every file of a prepared folder with the digest its manifest records.

    Args:
        use_cache: trust files recorded as verified in their current version (what a run does);
            False hashes the whole set (``prepare_data.py --verify``).

    Returns:
        how many files were hashed.

    Raises:
        PreparedDataError: as ``engine.data.prepared.open_checked``, or naming the first file that
            does not match.
    """
    manifest = open_checked(folder, setting)
    return verify_files(folder, manifest, f"{setting}={folder!r}", use_cache=use_cache)
