"""Tokenizer wrapper and scripts/train_tokenizer.py: lossless round trips, special ids, errors."""

import io
import json
import math
import random

import pytest
import sentencepiece as spm

from engine.data.tokenizer import Tokenizer
from scripts.train_tokenizer import iter_training_sentences, main as train_tokenizer_main

BUNDLED = "assets/tokenizer/shakespeare.model"

TRICKY = [
    "",
    "\n",
    " ",
    "hello world",
    "  leading spaces and   repeated   spaces  ",
    "line one\nline two\n\n\nafter blank lines\n",
    "\ttab\t\tindented\t",
    "windows\r\nline end",
    "emoji 😀🎉 and ZWJ 👩‍👩‍👧",
    "ünïcödé, 中文, العربية, ελληνικά",
    "digits 1234567890 and 3.14159",
    "KING LEAR.\n  Blow, winds, and crack your cheeks! rage! blow!\n",
    "nul \x00 and bell \x07",
]


# Corpora written by these tests go to a private datasets cache (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("private_datasets_cache")


def test_bundled_special_ids_and_vocab(tok):
    assert 2000 <= tok.vocab_size <= 8000
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_exact(tok, text):
    ids = tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bos_eos_and_batch_matches_single(tok):
    text = "To be, or not to be:\nthat is the question."
    plain = tok.encode(text, bos=False, eos=False)
    assert tok.encode(text, bos=True, eos=True) == [tok.bos_id] + plain + [tok.eos_id]
    assert tok.encode(text, bos=True, eos=False) == [tok.bos_id] + plain
    batch = tok.encode_batch(TRICKY, bos=True, eos=True)
    assert batch == [tok.encode(t, bos=True, eos=True) for t in TRICKY]
    assert tok.encode_batch([], bos=True, eos=True) == []
    # Specials decode to nothing, so decode(encode(.., bos, eos)) is still exact.
    assert tok.decode(batch[4]) == TRICKY[4]


def test_newlines_are_compact(tok):
    # The trainer saw whole lines with their newline, so "\n\n" is one piece, not byte fallback.
    assert len(tok.encode("\n\n", bos=False, eos=False)) == 1


def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer(str(missing))
    msg = str(err.value)
    assert "model.tokenizer_path" in msg and str(missing) in msg and "train_tokenizer.py" in msg


def test_unreadable_file_error(tmp_path):
    bad = tmp_path / "garbage.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ValueError, match="model.tokenizer_path"):
        Tokenizer(str(bad))


def test_llama2_style_model_without_pad(tmp_path):
    # Llama-2's tokenizer.model: unk=0, bos=1, eos=2, no pad. Build one with those ids.
    buf = io.BytesIO()
    sentences = [f"word{i} and more words {i * 7}" for i in range(300)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, model_type="bpe", vocab_size=300,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    path = tmp_path / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    tok = Tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, -1, 300)
    ids = tok.encode("word3 and more", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    # Llama-2 models add a dummy prefix space; the text itself still comes back.
    assert tok.decode(ids) == "word3 and more"


def test_training_sentences_keep_newlines_and_bound_length():
    docs = ["a\nbb\n\nccc", "x" * 25 + "\nyy"]
    chunks = list(iter_training_sentences(docs, max_chars=10))
    assert all(len(c) <= 10 for c in chunks)
    assert "".join(chunks) == "".join(docs)  # nothing lost
    assert chunks[0] == "a\nbb\n\nccc"


def test_train_tokenizer_script_makes_lossless_model(tmp_path, capsys):
    rng = random.Random(0)
    words = ["thou", "art", "the", "king", "of", "Denmark", "good", "night", "sweet", "prince"]
    corpus = tmp_path / "tiny.jsonl"
    with open(corpus, "w") as f:
        for i in range(200):
            lines = [" ".join(rng.choice(words) for _ in range(8)) + rng.choice([".", ",", "!"])
                     for _ in range(5)]
            f.write(json.dumps({"body": "\n".join(lines) + f"\n\tAct {i}\n"}) + "\n")
    out = tmp_path / "tok" / "tiny"
    path = train_tokenizer_main([
        "--data_path", str(corpus), "--text_column", "body", "--vocab_size", "350",
        "--output", str(out), "--num_threads", "1",
    ])
    assert path == str(out) + ".model"
    assert "wrote" in capsys.readouterr().out
    tok = Tokenizer(path)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (350, 0, 1, 2)
    for text in TRICKY + ["thou art the king of Denmark,\n\tgood night!"]:
        assert tok.decode(tok.encode(text, bos=True, eos=True)) == text
    # Merges were learned from the corpus: a frequent word is one piece.
    assert len(tok.encode("Denmark", bos=False, eos=False)) == 1


def test_train_tokenizer_script_errors(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="--vocab_size=4096 is more than this corpus supports"):
        train_tokenizer_main(["--data_path", str(corpus), "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match=r"--text_column='body'.*available columns: \['text'\]"):
        train_tokenizer_main(["--data_path", str(corpus), "--text_column", "body",
                              "--output", str(tmp_path / "x")])


def _train_with_tokenizer(argv):
    from engine.config import load_config
    from engine.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    try:
        inputs, _ = trainer.dataloader.next_batch()
        vocab, largest_id = trainer.tokenizer.vocab_size, int(inputs.max())
        history = trainer.train()
    finally:
        trainer.close()
    return vocab, largest_id, [(h["loss"], h["grad_norm"]) for h in history]


def test_a_trained_tokenizer_trains_the_model_across_processes(tmp_path):
    """scripts/train_tokenizer.py on the bundled corpus, then FSDP over 2 ranks with that tokenizer:
    the data is its ids (the flavor's 4096 embedding rows hold its 512) and both ranks agree."""
    from engine.testing.processes import run_distributed
    from tests.training_utils import SMALL_CORPUS, base_args

    path = train_tokenizer_main(["--data_path", SMALL_CORPUS, "--vocab_size", "512",
                                 "--output", str(tmp_path / "tok" / "small"), "--num_threads", "1"])
    argv = base_args(str(tmp_path / "run"), {"model.tokenizer_path": path, "parallelism.dp_shard": 2,
                                             "training.local_batch_size": 4, "training.steps": 3})
    ranks = run_distributed(_train_with_tokenizer, 2, argv)
    assert ranks[0][2] == ranks[1][2]  # the same global loss and norm on both ranks
    for vocab, largest_id, history in ranks:
        assert vocab == 512 and 256 < largest_id < 512, (vocab, largest_id)
        assert all(math.isfinite(loss) and loss > math.log(512) for loss, _ in history), history
