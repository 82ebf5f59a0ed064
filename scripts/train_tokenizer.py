"""Train a lossless BPE tokenizer (SentencePiece, or a Hugging Face tokenizer.json) on any dataset the
data loader reads.

Example (this made the bundled assets/tokenizer/shakespeare.model):

    python scripts/train_tokenizer.py --data_path assets/data/shakespeare/train.jsonl \
        --vocab_size 4096 --output assets/tokenizer/shakespeare

With ``--format hf`` it writes OUTPUT/tokenizer.json and OUTPUT/tokenizer_config.json instead (a
byte-level BPE of the `tokenizers` library, GPT-2 / Llama-3 style: lossless by construction,
digits split into single pieces; <pad>=0, bos=1 <|begin_of_text|>, eos=2 <|end_of_text|>), which
`model.tokenizer_path = "OUTPUT/tokenizer.json"` and transformers' AutoTokenizer both read. It
trains on the first --input_sentence_size chunks (no sampling).

Every string round-trips exactly (decode(encode(s)) == s, newlines, tabs, repeated spaces and any
Unicode included): no normalization (rule "identity"), no whitespace folding, no dummy prefix,
byte fallback for characters outside the vocabulary, digits split into single pieces.
Special ids: pad=0, bos=1 (<s>), eos=2 (</s>), unk=3 (never produced thanks to byte fallback).
Algorithm: byte-pair encoding (Sennrich et al. 2016, arXiv:1508.07909) as implemented by
SentencePiece (Kudo & Richardson 2018, arXiv:1808.06226).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Iterator

# Allow `python scripts/train_tokenizer.py` from the repo root without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's

import sentencepiece as spm  # noqa: E402  (after the re-run: a bare Python lacks it)

from engine.data.sources import iter_text_batches, load_documents  # noqa: E402

SPECIAL_IDS = {"pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3}


def iter_training_sentences(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Cut documents into training "sentences" of at most `max_chars` characters.

    Chunks are whole lines with their newline kept, so the trainer sees (and can learn pieces
    for) newlines; SentencePiece skips sentences longer than max_sentence_length bytes, hence
    the bound (over-long lines are cut).
    """
    for text in texts:
        chunk = ""
        for line in text.splitlines(keepends=True):
            while len(line) > max_chars:
                if chunk:
                    yield chunk
                    chunk = ""
                yield line[:max_chars]
                line = line[max_chars:]
            if len(chunk) + len(line) > max_chars and chunk:
                yield chunk
                chunk = ""
            chunk += line
        if chunk:
            yield chunk


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_path", required=True,
                   help="local file/folder (jsonl, json, txt, parquet) or hub dataset name")
    p.add_argument("--text_column", default="text", help="column holding the document text")
    p.add_argument("--split", default="train", help="split name for hub datasets")
    p.add_argument("--streaming", action="store_true", help="stream the dataset (large hub datasets)")
    p.add_argument("--max_documents", type=int, default=-1, help="read at most N documents (-1: all)")
    p.add_argument("--vocab_size", type=int, default=4096, help="number of pieces incl. specials and 256 bytes")
    p.add_argument("--output", required=True,
                   help="output prefix: writes PREFIX.model and PREFIX.vocab "
                        "(--format hf: a folder, gets tokenizer.json + tokenizer_config.json)")
    p.add_argument("--format", choices=("sentencepiece", "hf"), default="sentencepiece",
                   help="sentencepiece (.model) or hf (a Hugging Face tokenizer.json)")
    p.add_argument("--input_sentence_size", type=int, default=200_000,
                   help="sample at most this many training sentences (line chunks)")
    p.add_argument("--max_sentence_chars", type=int, default=2000, help="characters per training sentence")
    p.add_argument("--seed", type=int, default=0, help="seed of SentencePiece's sentence sampling")
    p.add_argument("--num_threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.vocab_size < 300:
        p.error(f"--vocab_size={args.vocab_size}: need room for 4 specials + 256 byte pieces + merges (>= 300)")
    return args


def main(argv: list[str] | None = None) -> str:
    """Train and write the model; returns the path of PREFIX.model."""
    args = parse_args(argv)
    ds = load_documents(args.data_path, text_column=args.text_column, split=args.split,
                        streaming=args.streaming, setting="--data_path", column_setting="--text_column")

    def texts() -> Iterator[str]:
        n = 0
        for batch in iter_text_batches(ds, args.text_column, column_setting="--text_column"):
            for text in batch:
                if 0 <= args.max_documents <= n:
                    return
                n += 1
                yield text

    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    if args.format == "hf":
        path = _train_hf(args, iter_training_sentences(texts(), args.max_sentence_chars))
        print(f"wrote {path} (vocab {args.vocab_size}, {time.perf_counter() - start:.1f} s)")
        return path
    spm.set_random_generator_seed(args.seed)  # reproducible sentence sampling
    try:
        _train(args, iter_training_sentences(texts(), args.max_sentence_chars))
    except RuntimeError as err:
        if "Vocabulary size too high" in str(err):
            raise ValueError(f"--vocab_size={args.vocab_size} is more than this corpus supports "
                             f"({err}); lower --vocab_size or train on more data") from err
        raise
    path = args.output + ".model"
    print(f"wrote {path} (vocab {args.vocab_size}, {time.perf_counter() - start:.1f} s)")
    return path


HF_SPECIALS = {"pad_token": "<pad>", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


def _train_hf(args: argparse.Namespace, sentences: Iterator[str]) -> str:
    """Byte-level BPE with the `tokenizers` library -> OUTPUT/tokenizer.json (+ tokenizer_config.json)."""
    import itertools
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=list(HF_SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(itertools.islice(sentences, args.input_sentence_size), trainer=trainer)
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(args.output, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({**HF_SPECIALS, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                   "clean_up_tokenization_spaces": False}, fh, indent=2)
    return path


def _train(args: argparse.Namespace, sentences: Iterator[str]) -> None:
    """Run SentencePiece BPE training with the lossless options of the module docstring."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_prefix=args.output,
        model_type="bpe",
        vocab_size=args.vocab_size,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=4 * args.max_sentence_chars + 16,  # bytes: UTF-8 is <= 4 per char
        num_threads=args.num_threads,
        minloglevel=2,
        **SPECIAL_IDS,
    )


if __name__ == "__main__":
    main()
