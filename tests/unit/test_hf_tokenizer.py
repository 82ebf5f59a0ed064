"""Hugging Face tokenizer.json as model.tokenizer_path: a BPE made by scripts/train_tokenizer.py
--format hf encodes the bundled corpus losslessly, takes BOS/EOS from its own config, packs one
separator per document boundary when BOS is EOS, and trains the debug model."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from engine.data.packing import pack_documents
from engine.data.tokenizer import Tokenizer
from scripts.train_tokenizer import main as train_tokenizer_main
from tests.training_utils import SMALL_CORPUS, base_args


pytestmark = pytest.mark.usefixtures("private_datasets_cache")


def _documents(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hf_tok"))
    path = train_tokenizer_main(["--data_path", SMALL_CORPUS, "--vocab_size", "512", "--output", out, "--format", "hf"])
    assert path == os.path.join(out, "tokenizer.json")
    return path


def test_encodes_the_bundled_corpus_losslessly(tokenizer_json):
    tok = Tokenizer(tokenizer_json)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (512, 0, 1, 2)
    docs = _documents(SMALL_CORPUS)  # the bundled validation split (the train split: 5 MB, 15 s here)
    ids = tok.encode_batch(docs, bos=True, eos=True)
    assert all(x[0] == 1 and x[-1] == 2 and 2 not in x[1:-1] for x in ids)
    assert [tok.decode(x) for x in ids] == docs  # specials decode to nothing
    assert tok.encode(docs[0], bos=False, eos=False) == ids[0][1:-1]
    assert max(max(x) for x in ids) < 512


def test_one_separator_per_document_when_bos_is_eos(tokenizer_json, tmp_path):
    tok = Tokenizer(tokenizer_json)
    docs = _documents(SMALL_CORPUS)[:3]
    plain = [tok.encode(d, bos=False, eos=False) for d in docs]
    assert pack_documents([docs], tok).tolist() == sum(([1] + ids + [2] for ids in plain), [])
    shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|end_of_text|>",
                                                                "eos_token": {"content": "<|end_of_text|>"}}))
    same = Tokenizer(str(tmp_path / "tokenizer.json"))
    assert same.bos_id == same.eos_id == 2
    stream = pack_documents([docs], same).tolist()
    assert stream == sum(([2] + ids for ids in plain), []) and stream.count(2) == len(docs)


def test_special_tokens_come_from_the_tokenizer_config(tokenizer_json, tmp_path):
    shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
    bare = Tokenizer(str(tmp_path / "tokenizer.json"))  # no config beside it: no BOS/EOS
    assert (bare.bos_id, bare.eos_id) == (-1, -1)
    with pytest.raises(ValueError, match="defines no bos token.*tokenizer_config.json with bos_token"):
        pack_documents([["text"]], bare)
    # Llama-3's tokenizer.json prepends its BOS itself (a post-processor): the pipeline adds it once.
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.processors import TemplateProcessing

    raw = RawTokenizer.from_file(tokenizer_json)
    raw.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)])
    raw.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json"), tmp_path)
    plain = Tokenizer(tokenizer_json).encode("To be", bos=False, eos=False)
    assert Tokenizer(str(tmp_path / "tokenizer.json")).encode("To be", bos=True, eos=True) == [1] + plain + [2]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(ValueError, match="names bos_token '<s>', which is not in the tokenizer's vocabulary"):
        Tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a readable tokenizer.json"):
        Tokenizer(str(tmp_path / "bad.json"))


def test_preflight_refuses_a_tokenizer_larger_than_the_model(tokenizer_json, tmp_path):
    from engine.config import load_config
    from engine.setup.preflight import check_setup

    cfg = load_config(base_args(str(tmp_path), {"model.tokenizer_path": tokenizer_json, "model.vocab_size": "300",
                                                "model.flavor": "debugmodel"}))
    with pytest.raises(ValueError, match="has 512 tokens but model llama/debugmodel has vocab_size 300"):
        check_setup(cfg, 1, "cpu", check_data=False)


def test_trains_the_debug_model(tokenizer_json, tmp_path):
    from engine.testing.processes import run_distributed
    from tests.integration.test_tokenizer import _train_with_tokenizer

    argv = base_args(str(tmp_path / "run"), {"model.tokenizer_path": tokenizer_json, "training.steps": 2})
    ((vocab, largest_id, history),) = run_distributed(_train_with_tokenizer, 1, argv, torchrun_env=False)
    assert vocab == 512 and 256 < largest_id < 512, (vocab, largest_id)
    assert len(history) == 2 and all(math.isfinite(loss) and loss > math.log(512) for loss, _ in history), history
