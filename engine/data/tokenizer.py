"""Tokenizer wrapper used by the data loader and the tools: SentencePiece or Hugging Face files.

`model.tokenizer_path` may be
- any SentencePiece model: the bundled BPE model (assets/tokenizer/shakespeare.model, made by
  scripts/train_tokenizer.py) or a Llama-2 style `tokenizer.model` (bos=1, eos=2, no pad);
  Kudo & Richardson, "SentencePiece ...", EMNLP 2018 (arXiv:1808.06226);
- a Hugging Face `tokenizer.json` (e.g. Llama-3's BPE, or one from `scripts/train_tokenizer.py
  --format hf`), read with the `tokenizers` library; BOS/EOS/PAD come from the tokenizer_config.json
  beside it (engine/data/hf_tokenizer.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

_FIX = ("set --model.tokenizer_path to a SentencePiece .model file or a Hugging Face tokenizer.json, or make one "
        "with scripts/train_tokenizer.py")


def require_bos(bos_id: int) -> None:
    """Refuse ``[document_mask]`` for a tokenizer without a BOS token.

    Packing begins every document with BOS (engine/data/packing.py), so document boundaries are
    found at BOS tokens (models/common/document_mask.py); without one there is nothing to mask at. Torch-
    free: the launcher's pre-flight calls it before any rank starts.

    Args:
        bos_id: the tokenizer's BOS id, -1 when it defines none.

    Raises:
        ValueError: ``bos_id`` < 0, in one line naming the settings and the fix.
    """
    if bos_id < 0:
        raise ValueError("document_mask.enable / restart_positions need a tokenizer with a BOS token "
                         "(packing begins each document with it); use such a tokenizer or set both to false")


class Tokenizer:
    """Text <-> token ids (units: tokens) through a SentencePiece model or a Hugging Face tokenizer.json.

    Args:
        path: the SentencePiece model file, or a file ending in ``.json`` read as a Hugging Face
            tokenizer (config key `model.tokenizer_path`).

    Attributes:
        vocab_size: number of pieces, i.e. valid ids are [0, vocab_size).
        bos_id, eos_id: begin/end-of-sequence ids (-1 when the model defines none).
        pad_id: padding id, -1 when the model defines none (Llama-2 has none).

    Raises:
        FileNotFoundError: `path` does not exist or is not a file.
        ValueError: the file is not a readable SentencePiece model / tokenizer.json.
    """

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"model.tokenizer_path={self.path!r}: no such file; {_FIX}"
            )
        self._hf = None
        if self.path.endswith(".json"):
            from engine.data.hf_tokenizer import HFTokenizerFile

            self._hf = HFTokenizerFile(self.path)
            self.vocab_size = self._hf.vocab_size
            self.bos_id, self.eos_id, self.pad_id = self._hf.bos_id, self._hf.eos_id, self._hf.pad_id
            return
        # Imported here, not at the top: modules that import the trainer (and so this file) stay
        # importable where sentencepiece is not installed, e.g. a GPU check on synthetic tokens.
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as err:
            raise ValueError(
                f"model.tokenizer_path={self.path!r} is not a readable SentencePiece model "
                f"({err}); {_FIX}"
            ) from err
        self.vocab_size: int = self._sp.get_piece_size()
        # SentencePiece reports -1 for a disabled special id, which is the convention we expose.
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()

    def _check_specials(self, bos: bool, eos: bool) -> None:
        # Asking for a special token the model lacks would silently drop it: refuse instead.
        for wanted, tok_id, name in ((bos, self.bos_id, "bos"), (eos, self.eos_id, "eos")):
            if wanted and tok_id < 0:
                fix = (self._hf.missing_special_fix() if self._hf is not None else
                       f"use a tokenizer with {name}_id set (e.g. one from scripts/train_tokenizer.py)")
                raise ValueError(
                    f"model.tokenizer_path={self.path!r} defines no {name} token ({name}_id=-1) but "
                    f"{name}=True was requested; {fix}"
                )

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`, optionally wrapped as [bos] + ids + [eos].

        Raises:
            TypeError: `text` is not a str.
            ValueError: bos/eos requested but the model defines no such token.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}")
        self._check_specials(bos, eos)
        if self._hf is not None:
            return self._wrap(self._hf.encode_batch([text])[0], bos, eos)
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def encode_batch(
        self, texts: Sequence[str], bos: bool, eos: bool, num_threads: int = -1
    ) -> list[list[int]]:
        """Token ids of each text (SentencePiece's threaded batch encode).

        Args:
            texts: the documents.
            bos, eos: wrap each result as [bos] + ids + [eos].
            num_threads: SentencePiece encoder threads; -1 uses all cores (a tokenizer.json uses
                the `tokenizers` library's own thread pool).

        Returns:
            one id list per text, in order.
        """
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"Tokenizer.encode_batch expects str items, item {i} is {type(text).__name__}"
                )
        self._check_specials(bos, eos)
        if not texts:
            return []
        if self._hf is not None:
            return [self._wrap(ids, bos, eos) for ids in self._hf.encode_batch(texts)]
        return self._sp.encode(texts, add_bos=bos, add_eos=eos, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; accepts a list of ints or a 1-D integer tensor/array.

        Special ids (bos/eos/pad) decode to the empty string.
        """
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids])
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )
