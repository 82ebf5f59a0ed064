#!/usr/bin/env python3
"""Tokenize a corpus once into a prepared folder that training memory-maps (engine/data/prepared.py).

    ./scripts/prepare_data.py INPUT OUTPUT --tokenizer path/to/tokenizer [--num_proc 16]
    ./run_train.sh --data.path OUTPUT
    ./scripts/prepare_data.py --verify OUTPUT       # hash every file again, compare with the manifest

INPUT is what ``data.path`` accepts: a local .jsonl/.json/.txt/.parquet file or a folder of them,
or a Hugging Face hub dataset name (read with ``datasets``, --split). Documents are tokenized by
``--num_proc`` processes into [BOS] + tokens + [EOS] each (the packing of engine/data/packing.py)
and written as memory-mappable .npy shards of the smallest unsigned dtype holding the vocabulary,
with the document offsets and a manifest (tokenizer identity and hash, BOS/EOS policy, counts,
sources, per-file sizes and xxh3-128 digests). The output appears only when complete (written to a hidden
temporary folder beside it, then renamed); an existing complete output is left alone. Preparing
the same input with the same tokenizer twice gives byte-identical files.

Bad input: one line, exit 2. Ctrl-C or SIGTERM: one line, exit 130 / 143, nothing left behind.
Runs in one process plus the tokenizer processes (no torchrun).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Allow `python scripts/prepare_data.py` from the repo root without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks the dependencies: re-run under .venv's


_MAIN_PID = os.getpid()
_STOPPED: list[int] = []  # the signal that interrupted the preparation


def _on_stop_signal(signum, frame):
    """SIGINT/SIGTERM: the main process unwinds (its ``finally`` blocks remove the temporary
    folders) and reports in one line; a forked tokenizer worker leaves quietly, since the main
    process reports and tears the pool down."""
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)
    _STOPPED.append(signum)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", nargs="?", help="local file/folder or hub dataset name (as data.path)")
    parser.add_argument("output", help="the prepared folder to create (or, with --verify, to check)")
    parser.add_argument("--tokenizer", default="assets/tokenizer/shakespeare.model",
                        help="SentencePiece .model or Hugging Face tokenizer.json; the run's model.tokenizer_path "
                             "must be the same file (default: %(default)s)")
    parser.add_argument("--text_column", default="text", help="column holding the text (default: %(default)s)")
    parser.add_argument("--split", default="train", help="split of a hub dataset (default: %(default)s)")
    parser.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 1)),
                        help="processes converting (one per input file) and tokenizing the input (default: the "
                             "CPU count, %(default)s)")
    parser.add_argument("--shard_tokens", type=int, default=None,
                        help="tokens per shard file (default 2**30: 2 GiB with uint16 tokens)")
    parser.add_argument("--verify", action="store_true",
                        help="only check OUTPUT: every file's size and digest against its manifest (training "
                             "hashes each file once and trusts an unchanged file afterwards; this hashes all)")
    args = parser.parse_args(argv)
    from engine.data.prepared import PreparedDataError

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_stop_signal)
    try:
        if args.verify:
            return _verify(args.output)
        if not args.input:
            raise PreparedDataError("INPUT is missing: prepare_data.py INPUT OUTPUT --tokenizer PATH (see --help)")
        if args.num_proc < 1 or (args.shard_tokens is not None and args.shard_tokens < 1):
            raise PreparedDataError("--num_proc and --shard_tokens must be >= 1")
        from engine.data.prepare import DEFAULT_SHARD_TOKENS, prepare

        if args.num_proc > 1:
            # datasets' worker pools (the `multiprocess` library) start by spawn here, as datasets does on
            # macOS, not fork: a child forked from this process after Arrow's thread pool has run may
            # inherit its locks held and never start (fork(2) copies only the calling thread); a run
            # with --num_proc 2 was seen to hang so. This script has a main guard, which spawn needs.
            import multiprocess

            multiprocess.set_start_method("spawn", force=True)
        prepare(args.input, args.output, args.tokenizer, text_column=args.text_column, split=args.split,
                num_proc=args.num_proc, shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
                log=lambda line: print(line, flush=True))
    except (PreparedDataError, FileNotFoundError, ValueError) as error:
        print(f"prepare_data error: {error}", file=sys.stderr)
        return 2
    except BaseException:
        if not _STOPPED:
            raise
        # datasets' worker pool turns the interrupt into a chained TimeoutError: report the signal.
        name = signal.Signals(_STOPPED[0]).name
        print(f"prepare_data: stopped by {name}; {args.output} was not written and the temporary files are "
              "removed; the same command starts the preparation again", file=sys.stderr)
        return 128 + _STOPPED[0]
    return 0


def _verify(folder: str) -> int:
    """Hash every file (a mismatch raises PreparedDataError, exit 2) and record the result for runs."""
    from engine.data.checksums import verify_checksums

    count = verify_checksums(folder)
    print(f"{folder}: every file ({count}) matches its manifest (size and checksum)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
