"""A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) behind engine/data/tokenizer.py.

The special tokens come from the tokenizer's own config: ``bos_token`` / ``eos_token`` / ``pad_token``
of the ``tokenizer_config.json`` beside the file (else of ``special_tokens_map.json``), given as a
string or as ``{"content": ...}``, looked up in the vocabulary. Texts are encoded without the
file's post-processor (``add_special_tokens=False``; Llama-3's would prepend its BOS itself), so the
data pipeline adds BOS/EOS the same way for every tokenizer.
"""

from __future__ import annotations

import json
import os

_FIX = ("set --model.tokenizer_path to a Hugging Face tokenizer.json (with its tokenizer_config.json beside it) "
        "or a SentencePiece .model file")


def _special(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizerFile:
    """Text <-> ids through a ``tokenizer.json``.

    Attributes:
        vocab_size: ids are in [0, vocab_size) (added tokens included).
        bos_id, eos_id, pad_id: ids of the config's bos/eos/pad tokens, -1 where it names none.

    Raises:
        ValueError: the file is not a readable tokenizer.json, or its config names a special token
            that is not in the vocabulary.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # noqa: BLE001 - the library raises plain Exception subclasses
            raise ValueError(f"model.tokenizer_path={path!r} is not a readable tokenizer.json ({err}); "
                             f"{_FIX}") from None
        config = {}
        folder = os.path.dirname(os.path.abspath(path))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            file = os.path.join(folder, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as fh:
                    config = json.load(fh)
                self.config_file = file
                break
        else:
            self.config_file = None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        keys = ("bos_token", "eos_token", "pad_token")
        self.bos_id, self.eos_id, self.pad_id = (self._id(config, key) for key in keys)

    def _id(self, config: dict, key: str) -> int:
        token = _special(config, key)
        if token is None:
            return -1
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"model.tokenizer_path={self.path!r}: {self.config_file} names {key} {token!r}, which "
                             f"is not in the tokenizer's vocabulary; {_FIX}")
        return token_id

    def missing_special_fix(self) -> str:
        """What to do when BOS or EOS is missing."""
        return ("give the tokenizer a tokenizer_config.json with bos_token and eos_token beside "
                f"{os.path.basename(self.path)} (e.g. the one scripts/train_tokenizer.py --format hf writes)")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, without special tokens (threads: the library's own pool)."""
        return [encoding.ids for encoding in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
