"""Streaming data (engine/data/streaming.py): windows tokenized on the fly, and a resume that seeks
through the datasets iterable's own state instead of re-tokenizing the stream up to the position."""

import io
import json
import os

import pytest
import torch

import engine.data.streaming as streaming
from tests.prepared_utils import make_docs, reference_stream, write_jsonl

S = 8
pytestmark = pytest.mark.usefixtures("private_datasets_cache")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    """Two jsonl files (two shards of the streaming dataset) of 40 documents, and their packed stream."""
    folder = tmp_path_factory.mktemp("stream")
    docs = make_docs(40)
    write_jsonl(folder / "part0.jsonl", docs[:23])
    write_jsonl(folder / "part1.jsonl", docs[23:])
    lengths = [len(tok.encode(d, True, True)) for d in docs]
    starts = [sum(lengths[:i]) for i in range(len(docs))]  # each document's first token
    return str(folder), reference_stream(tok, docs), starts


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(streaming, "STREAM_BATCH_DOCS", 3)  # a mark every 3 documents: resumes seek


def stream_loader(tok, path, **kw):
    from tests.prepared_utils import loader

    return loader(tok, path, streaming=True, shuffle=True, **kw)  # (shuffle does not apply to streaming)


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def counting_documents(monkeypatch, tok) -> list[int]:
    """Documents the tokenizer is given, one entry per call."""
    counts, encode = [], tok.encode_batch

    def encode_batch(texts, *args, **kwargs):
        counts.append(len(texts))
        return encode(texts, *args, **kwargs)

    monkeypatch.setattr(tok, "encode_batch", encode_batch)
    return counts


def test_windows_equal_the_packed_stream(tok, corpus, small_batches):
    path, stream, _ = corpus
    n = (len(stream) - 1) // S
    ld = stream_loader(tok, path, L=3)
    got = torch.cat([ld.next_batch()[0] for _ in range(n)])  # 3 epochs
    want = torch.stack([stream[(q % n) * S: (q % n) * S + S] for q in range(3 * n)])
    assert torch.equal(got, want)


def test_resume_seeks_and_continues_bitwise(tok, corpus, small_batches, monkeypatch):
    path, stream, doc_starts = corpus
    n = (len(stream) - 1) // S
    kw = dict(L=2, G=8, dp=2, r=1)
    straight = stream_loader(tok, path, **kw)
    expected = [straight.next_batch() for _ in range(2 * (2 * n // 8 + 3))]
    assert len(straight.source._marks) <= 4  # the notes of the batches since the step began, not of the run
    counts = counting_documents(monkeypatch, tok)
    got, ld, notes = [], stream_loader(tok, path, **kw), []
    for cut in (3, 8, 14, 2 * (n // 8 + 1) + 1):  # mid-step, step boundaries (the second file), next epoch
        while len(got) < cut:
            got.append(ld.next_batch())
        state = roundtrip(ld.state_dict())
        notes.append(json.loads(state["stream"]))
        ld = stream_loader(tok, path, **kw)
        del counts[:]
        ld.load_state_dict(state)
        got.append(ld.next_batch())
        # Seeking: the batch holding the position and those up to this rank's windows, not the epoch so far.
        assert sum(counts) <= 3 * 3, (cut, counts)
    while len(got) < len(expected):
        got.append(ld.next_batch())
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert [note["epoch"] for note in notes] == [0, 0, 0, 1]
    positions = [note["position"] for note in notes]
    assert any(note["skip"] > 0 and note["token"] > 0 for note in notes)  # dropped tokens of a later batch
    assert any((p % n) * S not in doc_starts for p in positions)  # a window starting inside a document
    assert any(note["token"] > doc_starts[23] for note in notes)  # a batch of the second file


def test_a_state_without_the_stream_note_reads_the_epoch_again(tok, corpus, small_batches, monkeypatch):
    path, _, _ = corpus
    kw = dict(L=2, G=8, dp=2, r=0)
    ld = stream_loader(tok, path, **kw)
    for _ in range(6):
        ld.next_batch()
    state = roundtrip(ld.state_dict())
    want = ld.next_batch()
    del state["stream"]  # a checkpoint saved before the note existed
    counts = counting_documents(monkeypatch, tok)
    old = stream_loader(tok, path, **kw)
    old.load_state_dict(state)
    got = old.next_batch()
    assert torch.equal(got[0], want[0]) and sum(counts) > 3 * 3


def _stream_runs(folder: str, corpus: str) -> dict:
    """4 steps straight, and 4 steps stopped after step 2 and resumed (checkpoints through DCP), with
    one document per streaming batch."""
    from tests.checkpoint_utils import train_run
    from tests.training_utils import base_args

    streaming.STREAM_BATCH_DOCS = 1  # this forked test worker only

    def argv(name, steps):
        return base_args(os.path.join(folder, name), {"data.path": corpus, "data.streaming": "true",
                                                       "training.steps": steps, "checkpoint.enable": "true",
                                                       "checkpoint.interval": 2})

    straight = train_run(argv("straight", 4))
    first, second = train_run(argv("stopped", 2)), train_run(argv("stopped", 4))
    return {"straight": straight["losses"], "resumed": {**first["losses"], **second["losses"]},
            "start": (second["start_step"], second["start_position"])}


def test_a_training_resume_on_streaming_data_is_bitwise(tmp_path):
    from tests.checkpoint_utils import read_checkpoint, write_tiny_corpus
    from engine.testing.processes import run_distributed

    corpus = write_tiny_corpus(str(tmp_path))  # 6 documents of ~150 tokens: step 2 ends inside the fourth
    (runs,) = run_distributed(_stream_runs, 1, str(tmp_path), corpus, torchrun_env=False)
    assert runs["start"] == (2, 16) and runs["resumed"] == runs["straight"]
    saved = read_checkpoint(str(tmp_path / "stopped" / "checkpoint" / "step-2"), str(tmp_path / "flat.pt"))
    note = json.loads(saved["dataloader.stream"])
    assert note["position"] == 16 and note["token"] > 0 and note["dataset"] is not None  # it seeks
