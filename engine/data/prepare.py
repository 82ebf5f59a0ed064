"""Writing prepared data sets (the layout of engine/data/prepared.py): tokenize once, in parallel.

``prepare`` reads documents with Hugging Face ``datasets`` (engine/data/sources.py), tokenizes them
with ``Dataset.map(num_proc=N)`` into [BOS] + tokens + [EOS] per document (the policy of
engine/data/packing.py), and writes the shards, the document offsets and the manifest.
``write_prepared_folder`` does the writing for any source of token chunks (the benchmark writes
synthetic corpora with it). Everything is written into a hidden temporary folder beside the output
and renamed to the output only when complete, so an interrupted preparation never looks like a
prepared set; a complete output is left alone. The output is a pure function of the documents and
the tokenizer: preparing twice gives byte-identical files.
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable

import numpy as np

from engine.data.checksums import DIGEST, new_hasher
from engine.data.prepared import (DOCUMENTS, FORMAT, MANIFEST, PreparedDataError, is_prepared, read_manifest,
                                  tokenizer_identity)

DEFAULT_SHARD_TOKENS = 1 << 30  # 2 GiB per shard with uint16 tokens
_TOKENIZERS: dict = {}  # per worker process: path -> Tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids [0, vocab_size): uint16 up to 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)})
    return buf.getvalue()


class _NpyWriter:
    """Writes one 1-D .npy file of known length from chunks, hashing the bytes as they go (the
    manifest's digest, engine/data/checksums.py)."""

    def __init__(self, path: str, dtype: np.dtype, length: int):
        self.path, self.dtype, self.length, self.written = path, dtype, length, 0
        self._fh = open(path, "wb")
        self._hash = new_hasher(DIGEST)
        self._put(_npy_header(dtype, length))

    def _put(self, data) -> None:
        self._fh.write(data)
        self._hash.update(data)

    def write(self, array: np.ndarray) -> None:
        self._put(np.ascontiguousarray(array, dtype=self.dtype).view(np.uint8))  # its buffer, not a copy
        self.written += len(array)

    def close(self) -> dict:
        self._fh.close()
        if self.written != self.length:
            raise RuntimeError(f"{self.path}: wrote {self.written} of {self.length} elements")
        return {"file": os.path.basename(self.path), "bytes": os.path.getsize(self.path),
                DIGEST: self._hash.hexdigest()}


def _write_shards(folder: str, dtype: np.dtype, total: int, chunks: Iterable[np.ndarray], shard_tokens: int,
                  log: Callable[[str], None]) -> list[dict]:
    """Cut the token stream into shards of ``shard_tokens`` tokens (the last one shorter)."""
    sizes = [min(shard_tokens, total - start) for start in range(0, total, shard_tokens)]
    shards, writer, started, last_report, done = [], None, time.perf_counter(), 0.0, 0
    for chunk in chunks:
        while len(chunk):
            if writer is None:
                index = len(shards)
                writer = _NpyWriter(os.path.join(folder, f"tokens-{index:05d}.npy"), dtype, sizes[index])
            take = min(writer.length - writer.written, len(chunk))
            writer.write(chunk[:take])
            chunk, done = chunk[take:], done + take
            if writer.written == writer.length:
                shards.append({**writer.close(), "tokens": writer.length})
                writer = None
        elapsed = time.perf_counter() - started
        if elapsed - last_report > 5:
            last_report = elapsed
            log(f"written {done:,} / {total:,} tokens ({done / elapsed:,.0f} tokens/s)")
    if writer is not None or len(shards) != len(sizes):
        raise RuntimeError(f"the token chunks held {done} tokens, not the announced {total}")
    return shards


def write_prepared_folder(output: str, *, identity: dict, total_tokens: int, token_chunks: Iterable[np.ndarray],
                          num_documents: int, document_lengths: Iterable[np.ndarray], sources: list[dict],
                          shard_tokens: int = DEFAULT_SHARD_TOKENS, log: Callable[[str], None] = print) -> dict:
    """Write a prepared folder atomically (temporary folder, then rename).

    Args:
        output: the folder to create (must not exist).
        identity: ``engine.data.prepared.tokenizer_identity`` of the tokenizer that made the tokens.
        total_tokens: T, tokens in ``token_chunks`` (BOS/EOS included).
        token_chunks: 1-D integer arrays, the packed stream in order.
        num_documents, document_lengths: D, and 1-D arrays of the documents' token counts (sum T).
        sources: what the tokens were made from, recorded in the manifest.
        shard_tokens: tokens per shard file.

    Returns:
        the manifest.

    Raises:
        PreparedDataError: no tokens, or another process completed ``output`` first.
    """
    if total_tokens <= 0:
        raise PreparedDataError(f"{sources}: no tokens to write; the input holds no documents")
    dtype = token_dtype(identity["vocab_size"])
    output = os.path.abspath(os.path.expanduser(output))
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = scratch_folder(output, "tmp", log)
    try:
        shards = _write_shards(tmp, dtype, total_tokens, token_chunks, shard_tokens, log)
        docs = _NpyWriter(os.path.join(tmp, DOCUMENTS), np.dtype(np.int64), num_documents + 1)
        offset = 0
        docs.write(np.zeros(1, np.int64))
        for lengths in document_lengths:
            ends = offset + np.cumsum(lengths, dtype=np.int64)
            docs.write(ends)
            offset = int(ends[-1]) if len(ends) else offset
        documents = docs.close()
        if offset != total_tokens:
            raise RuntimeError(f"document lengths sum to {offset}, not {total_tokens} tokens")
        manifest = {"format": FORMAT, "tokenizer": identity, "dtype": dtype.name, "num_tokens": total_tokens,
                    "num_documents": num_documents, "sources": sources, "shard_tokens": shard_tokens,
                    "shards": shards, "documents": documents}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; the output gets the usual mode
        try:
            os.rename(tmp, output)
        except OSError:
            if is_prepared(output):
                log(f"{output} was completed by another preparation meanwhile; keeping that one")
                shutil.rmtree(tmp, ignore_errors=True)
                return read_manifest(output, "output")
            raise
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def scratch_folder(output: str, kind: str, log: Callable[[str], None] = print) -> str:
    """A new private folder ``.<output name>.<kind>-<host>-<pid>-<random>`` beside ``output``.

    Named after this host and process so that leftovers of a preparation that could not clean up
    (killed with SIGKILL, a machine that went down) are recognised: before creating the folder,
    those of this host whose process no longer exists are removed (other hosts' and live ones are
    never touched). Returns the folder's absolute path.
    """
    parent, name = os.path.dirname(output), os.path.basename(output)
    host = socket.gethostname().replace("-", "_")
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.{kind}-{glob.escape(host)}-*")):
        pid = os.path.basename(stale)[len(f".{name}.{kind}-{host}-"):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
            log(f"removed {stale}, left by an interrupted preparation (process {pid} is gone)")
    return tempfile.mkdtemp(prefix=f".{name}.{kind}-{host}-{os.getpid()}-", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _input_name(path: str) -> str:
    """The name an input is recorded and compared by: a local path as an absolute path (older
    manifests kept it as given), a hub dataset name as it is."""
    full = os.path.expanduser(path)
    return os.path.abspath(full) if os.path.exists(full) else path


def _tokenize(batch: dict, indices: list[int], *, tokenizer_path: str, text_column: str, eos: bool) -> dict:
    """``Dataset.map`` function (one worker process): {"ids": [[BOS] + ids (+ [EOS]) per text]}."""
    from engine.data.tokenizer import Tokenizer

    tok = _TOKENIZERS.get(tokenizer_path)
    if tok is None:
        tok = _TOKENIZERS[tokenizer_path] = Tokenizer(tokenizer_path)
    texts = batch[text_column]
    for row, text in zip(indices, texts):
        if not isinstance(text, str):
            raise ValueError(f"--text_column={text_column!r}: row {row} holds {type(text).__name__}, not a "
                             "string; clean the data or choose another column")
    # One encoder thread per worker: --num_proc is the one parallelism knob.
    return {"ids": tok.encode_batch(texts, bos=True, eos=eos, num_threads=1)}


def _existing(output: str, identity: dict, sources: list[dict], log) -> dict | None:
    """The manifest of a complete ``output`` made from the same input and tokenizer, else None;
    refuses an output that holds something else."""
    if is_prepared(output):
        manifest = read_manifest(output, "output")
        same = len(manifest["sources"]) == len(sources) and all(
            {**m, "path": ""} == {**s, "path": ""} and _input_name(m["path"]) == _input_name(s["path"])
            for m, s in zip(manifest["sources"], sources))
        if manifest["tokenizer"]["sha256"] != identity["sha256"] or not same:
            raise PreparedDataError(
                f"output {output!r} is a prepared set of other data or another tokenizer "
                f"({manifest['sources']}, tokenizer {manifest['tokenizer']['path']}); choose another output folder")
        log(f"{output} is already prepared ({manifest['num_tokens']:,} tokens, {manifest['num_documents']:,} "
            "documents); nothing to do")
        return manifest
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise PreparedDataError(f"output {output!r} exists and is not a prepared set; choose a new folder")
    return None


def prepare(source: str, output: str, tokenizer_path: str, *, text_column: str = "text", split: str = "train",
            num_proc: int = 1, shard_tokens: int = DEFAULT_SHARD_TOKENS, log: Callable[[str], None] = print) -> dict:
    """Tokenize ``source`` once into the prepared folder ``output`` (nothing to do if complete).

    Args:
        source: a local file/folder or hub dataset name (engine/data/sources.py).
        output: the prepared folder.
        tokenizer_path: a SentencePiece model or tokenizer.json (engine/data/tokenizer.py).
        text_column, split: as ``data.text_column`` / ``data.split``.
        num_proc: processes converting the input into the datasets cache (one per input file,
            ``load_dataset``) and tokenizing it (``datasets.Dataset.map``).
        shard_tokens: tokens per shard file.

    Returns:
        the manifest.

    Raises:
        PreparedDataError, FileNotFoundError, ValueError: bad input, tokenizer without BOS/EOS,
            an output that holds something else.
    """
    import datasets
    import pyarrow.compute as pc

    from engine.data.sources import load_documents
    from engine.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    tok._check_specials(True, True)  # packing wraps documents in BOS/EOS: refuse a tokenizer without them
    identity = tokenizer_identity(tok)
    sources = [{"path": _input_name(source), "split": split, "text_column": text_column}]
    output = os.path.abspath(os.path.expanduser(output))
    done = _existing(output, identity, sources, log)
    if done is not None:
        return done
    ds = load_documents(source, text_column=text_column, split=split, setting="input",
                        column_setting="--text_column", num_proc=num_proc)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    cache = scratch_folder(output, "cache", log)
    try:
        started = time.perf_counter()
        ids = datasets.List(datasets.Value(token_dtype(tok.vocab_size).name))
        mapped = ds.map(_tokenize, batched=True, batch_size=1000, with_indices=True,
                        num_proc=num_proc if num_proc > 1 else None, remove_columns=ds.column_names,
                        features=datasets.Features({"ids": ids}),
                        fn_kwargs={"tokenizer_path": tok.path, "text_column": text_column,
                                   "eos": tok.eos_id != tok.bos_id},
                        cache_file_name=os.path.join(cache, "ids.arrow"), load_from_cache_file=False,
                        desc=f"tokenizing ({num_proc} processes)")
        column = mapped.data.column("ids")
        lengths = [pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
                   for chunk in column.chunks]
        total = int(sum(int(x.sum()) for x in lengths))
        seconds = time.perf_counter() - started
        log(f"tokenized {len(mapped):,} documents into {total:,} tokens in {seconds:.1f} s "
            f"({total / max(seconds, 1e-9):,.0f} tokens/s with {num_proc} processes)")
        chunks = (chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks)
        manifest = write_prepared_folder(output, identity=identity, total_tokens=total, token_chunks=chunks,
                                         num_documents=len(mapped), document_lengths=lengths, sources=sources,
                                         shard_tokens=shard_tokens, log=log)
        del mapped, column
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    log(f"prepared {output}: {manifest['num_tokens']:,} tokens ({manifest['dtype']}), "
        f"{manifest['num_documents']:,} documents, {len(manifest['shards'])} shard(s) in "
        f"{time.perf_counter() - started:.1f} s")
    return manifest
