"""The ``data`` case of scripts/benchmark.py: start-up, memory, resume and throughput of prepared data.

Synthetic prepared corpora (random uint16 tokens, 1000-token documents, written by
engine/data/prepare.py's ``write_prepared_folder`` with the bundled tokenizer's identity) of 10^7 and
10^9 tokens (2 GB on disk; deleted afterwards). Each start-up sample runs in a fresh process
(``python -m scripts.benchmarks.data MEASURE_JSON``): after the imports and the tokenizer (the
"empty run"), it builds the training loader, loads a state at the given global window position and
takes the first batch; it reports that time, the resident memory it added (VmRSS, /proc), and the
loader's tokens/s over the next batches (read-ahead on). Samples of the sizes and positions are
interleaved by round; medians are reported. The page cache is warm (the corpus was just written):
a cold first batch adds the latency of reading the few pages of one batch.

The optional ``data_prepare`` case times ``prepare`` (scripts/prepare_data.py) of the bundled corpus
repeated into one jsonl, with 1 and 2 tokenizer processes side by side (``measure_prepare``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "shakespeare.model")
RAW_CORPUS = os.path.join(REPO, "assets", "data", "shakespeare", "train.jsonl")


def write_synthetic(folder: str, n_tokens: int, chunk: int = 10_000_000) -> float:
    """A prepared folder of ``n_tokens`` random tokens below the bundled vocabulary; returns seconds."""
    import numpy as np

    from engine.data.prepare import write_prepared_folder
    from engine.data.prepared import tokenizer_identity
    from engine.data.tokenizer import Tokenizer

    identity = tokenizer_identity(Tokenizer(TOKENIZER))
    rng = np.random.default_rng(0)
    doc = 1000
    started = time.perf_counter()

    def tokens():
        for start in range(0, n_tokens, chunk):
            yield rng.integers(0, identity["vocab_size"], size=min(chunk, n_tokens - start), dtype=np.uint16)

    def lengths():
        full, rest = divmod(n_tokens, doc)
        for start in range(0, full, chunk // doc):
            yield np.full(min(chunk // doc, full - start), doc, np.int64)
        if rest:
            yield np.array([rest], np.int64)

    write_prepared_folder(folder, identity=identity, total_tokens=n_tokens, token_chunks=tokens(),
                          num_documents=-(-n_tokens // doc), document_lengths=lengths(),
                          sources=[{"path": f"synthetic:{n_tokens}"}], log=lambda line: None)
    return time.perf_counter() - started


def verify_once(folder: str) -> dict:
    """Hash every file of a prepared folder as a run's first start does (engine/data/checksums.py),
    whatever its record says: {"seconds", "bytes", "gb_per_s"} (the record is written too)."""
    from engine.data.checksums import verify_checksums
    from engine.data.prepared import read_manifest

    manifest = read_manifest(folder)
    size = sum(entry["bytes"] for entry in [*manifest["shards"], manifest["documents"]])
    started = time.perf_counter()
    verify_checksums(folder, use_cache=False)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": size, "gb_per_s": size / 1e9 / seconds}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(spec: dict) -> dict:
    """In a fresh process: first-batch seconds and added RSS of the loader of ``spec["path"]`` at
    ``spec["position"]``, then the loader's tokens/s over ``spec["seconds"]``."""
    from types import SimpleNamespace

    from engine.data import build_dataloader
    from engine.data.tokenizer import Tokenizer

    tok = Tokenizer(TOKENIZER)
    seq_len, local = spec["seq_len"], spec["local_batch_size"]
    cfg = SimpleNamespace(path=spec["path"], text_column="text", split="train", streaming=spec.get("streaming", False),
                          shuffle=True, mixture=[])
    empty = _rss_bytes()
    started = time.perf_counter()
    loader = build_dataloader(cfg, tok, seq_len=seq_len, local_batch_size=local, global_batch_size=-1,
                              dp_rank=0, dp_degree=1, seed=0)
    if spec["position"]:
        loader.load_state_dict({**loader.state_dict(), "position": spec["position"]})
    loader.next_batch()
    first = time.perf_counter() - started
    added = _rss_bytes() - empty
    batches, started = 0, time.perf_counter()
    while time.perf_counter() - started < spec["seconds"]:
        loader.next_batch()
        batches += 1
    rate = batches * local * seq_len / (time.perf_counter() - started)
    loader.close()
    return {"first_batch_s": first, "rss_added_bytes": added, "loader_tokens_per_s": rate}


def repeated_corpus(path: str, repeats: int) -> str:
    """The bundled train.jsonl written ``repeats`` times into one jsonl (1.46M tokens each time)."""
    with open(RAW_CORPUS, "rb") as src:
        text = src.read()
    with open(path, "wb") as out:
        for _ in range(repeats):
            out.write(text)
    return path


def measure_prepare(spec: dict) -> dict:
    """In a fresh process (with its own, empty datasets cache): engine/data/prepare.py's ``prepare``
    of ``spec["input"]`` with ``spec["num_proc"]`` processes, Arrow conversion of the input included.
    Returns its seconds, tokens/s, and the CPU seconds of this process and of its worker processes."""
    import resource
    import shutil

    from engine.data.prepare import prepare

    started = time.perf_counter()
    manifest = prepare(spec["input"], spec["output"], TOKENIZER, num_proc=spec["num_proc"], log=lambda line: None)
    seconds = time.perf_counter() - started
    shutil.rmtree(spec["output"])
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": seconds, "tokens_per_s": manifest["num_tokens"] / seconds,
            "cpu_main_s": me.ru_utime + me.ru_stime, "cpu_workers_s": workers.ru_utime + workers.ru_stime}


def measure_in_fresh_process(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **spec.get("env", {})}
    out = subprocess.run([sys.executable, "-m", "scripts.benchmarks.data", json.dumps(spec)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"data measurement {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    print(json.dumps(measure_prepare(_spec) if _spec.get("kind") == "prepare" else measure(_spec)))
