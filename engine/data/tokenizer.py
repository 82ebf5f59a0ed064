"""SentencePiece tokenizer wrapper used by the data loader and the generation tools.

Any SentencePiece model works: the bundled BPE model (assets/tokenizer/shakespeare.model, made by
scripts/train_tokenizer.py) or a Llama-2 style `tokenizer.model` (bos=1, eos=2, no pad).
Reference: Kudo & Richardson, "SentencePiece: A simple and language independent subword tokenizer
and detokenizer for Neural Text Processing", EMNLP 2018 (arXiv:1808.06226).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

_FIX = "set --model.tokenizer_path to a SentencePiece .model file, or make one with scripts/train_tokenizer.py"


class Tokenizer:
    """Text <-> token ids (units: tokens) through a SentencePiece model.

    Args:
        path: the SentencePiece model file (config key `model.tokenizer_path`).

    Attributes:
        vocab_size: number of pieces, i.e. valid ids are [0, vocab_size).
        bos_id, eos_id: begin/end-of-sequence ids (-1 when the model defines none).
        pad_id: padding id, -1 when the model defines none (Llama-2 has none).

    Raises:
        FileNotFoundError: `path` does not exist or is not a file.
        ValueError: the file is not a readable SentencePiece model.
    """

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"model.tokenizer_path={self.path!r}: no such file; {_FIX}"
            )
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
                raise ValueError(
                    f"model.tokenizer_path={self.path!r} defines no {name} token ({name}_id=-1) but "
                    f"{name}=True was requested; use a tokenizer with {name}_id set (e.g. one from "
                    "scripts/train_tokenizer.py)"
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
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def encode_batch(
        self, texts: Sequence[str], bos: bool, eos: bool, num_threads: int = -1
    ) -> list[list[int]]:
        """Token ids of each text (SentencePiece's threaded batch encode).

        Args:
            texts: the documents.
            bos, eos: wrap each result as [bos] + ids + [eos].
            num_threads: encoder threads; -1 lets SentencePiece use all cores.

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
        return self._sp.encode(texts, add_bos=bos, add_eos=eos, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; accepts a list of ints or a 1-D integer tensor/array.

        Special ids (bos/eos/pad) decode to the empty string.
        """
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )
