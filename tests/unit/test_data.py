"""Data reading, packing, dp sharding, resumption and validation loaders (small tmp corpora)."""

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import datasets
import pytest
import torch

from engine.data import build_dataloader, build_validation_dataloader, resolve_batch_sizes
from engine.data.packing import pack_documents
from engine.data.sources import load_documents, looks_like_local_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S = 8  # seq_len of most tests: small, so a few documents give dozens of windows


# Corpora written by these tests go to a private datasets cache (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("private_datasets_cache")


def make_docs(n: int) -> list[str]:
    return [f"Doc {i}: " + "word " * (i % 7 + 1) + ("\nthe end.\n" if i % 2 else "") for i in range(n)]


def write_jsonl(path, docs, column="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({column: d, "id": 0}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "train.jsonl", make_docs(24))


def cfg(path, **kw):
    base = dict(path=path, text_column="text", split="train", streaming=False, shuffle=False)
    return SimpleNamespace(**{**base, **kw})


def loader(tok, path, *, L=1, G=-1, dp=1, r=0, seed=0, seq_len=S, infinite=True, **kw):
    return build_dataloader(cfg(path, **kw), tok, seq_len=seq_len, local_batch_size=L,
                            global_batch_size=G, dp_rank=r, dp_degree=dp, seed=seed, infinite=infinite)


def reference_stream(tok, docs):
    return torch.tensor([t for d in docs for t in [tok.bos_id, *tok.encode(d, False, False), tok.eos_id]])


def step_windows(loaders, A):
    """One optimizer step over all dp ranks: inputs concatenated in rank, microbatch order."""
    return torch.cat([ld.next_batch()[0] for ld in loaders for _ in range(A)])


def by_position(tok, path, n, **kw):
    """inputs of global positions 0..n-1 (dp=1, L=1: one window per call)."""
    ld = loader(tok, path, **kw)
    return torch.cat([ld.next_batch()[0] for _ in range(n)])


# ---------------------------------------------------------------- packing


def test_packing_windows_cover_stream(tok, corpus):
    docs = make_docs(24)
    ref = reference_stream(tok, docs)
    stream = pack_documents([docs[:10], docs[10:]], tok)
    assert stream.dtype == torch.int32 and torch.equal(stream.long(), ref)
    # Every document starts with BOS right after the previous one's EOS.
    bos_at = (ref == tok.bos_id).nonzero().flatten()
    assert len(bos_at) == len(docs) and bos_at[0] == 0
    assert (ref[bos_at[1:] - 1] == tok.eos_id).all()

    ld = loader(tok, corpus, L=2, infinite=False)
    batches = list(ld)
    n_windows = (len(ref) - 1) // S
    assert len(batches) == n_windows // 2
    for k, (inputs, labels) in enumerate(batches):
        assert inputs.shape == labels.shape == (2, S) and inputs.dtype == torch.int64
        for j in range(2):
            w = k * 2 + j
            assert torch.equal(inputs[j], ref[w * S : w * S + S])
            assert torch.equal(labels[j], ref[w * S + 1 : w * S + S + 1])  # inputs shifted by one


def test_batch_size_validation():
    assert resolve_batch_sizes(4, -1, 2) == (8, 1)
    assert resolve_batch_sizes(2, 16, 2) == (16, 4)
    for G in (12, 0, -2):
        with pytest.raises(ValueError, match="training.global_batch_size.*local_batch_size.*dp degree"):
            resolve_batch_sizes(4, G, 2)


# ---------------------------------------------------------------- sharding and layout


@pytest.mark.parametrize("shuffle", [False, True])
def test_layout_independence_and_disjoint_shards(tok, corpus, shuffle):
    ref = loader(tok, corpus, L=8, G=8, shuffle=shuffle)
    layouts = [(2, 4), (2, 2), (4, 1), (1, 2)]  # (dp, L); A = 8 // (dp * L)
    groups = [[loader(tok, corpus, L=L, G=8, dp=dp, r=r, shuffle=shuffle) for r in range(dp)]
              for dp, L in layouts]
    for _ in range(6):  # crosses an epoch boundary (24 docs give < 48 windows)
        expected = ref.next_batch()[0]
        for (dp, L), group in zip(layouts, groups):
            assert group[0].grad_accum_steps == 8 // (dp * L)
            assert torch.equal(step_windows(group, 8 // (dp * L)), expected)
    # Disjoint: within a step (one epoch, shuffle off) the ranks' windows are distinct positions.
    fresh = [loader(tok, corpus, L=2, G=4, dp=2, r=r) for r in range(2)]
    w0, w1 = fresh[0].next_batch()[0], fresh[1].next_batch()[0]
    assert torch.equal(torch.cat([w0, w1]), by_position(tok, corpus, 4))


def test_shuffle_determinism_and_per_epoch_permutation(tok, corpus):
    n = loader(tok, corpus).source.windows_per_epoch
    a = by_position(tok, corpus, 2 * n, shuffle=True, seed=3)
    b = by_position(tok, corpus, 2 * n, shuffle=True, seed=3)
    c = by_position(tok, corpus, n, shuffle=True, seed=4)
    plain = by_position(tok, corpus, n)
    assert torch.equal(a, b)
    assert not torch.equal(a[:n], c) and not torch.equal(a[:n], plain)
    assert not torch.equal(a[:n], a[n:])  # each epoch has its own order
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(a[:n]) == key(plain) == key(a[n:])  # ... of every window exactly once


# ---------------------------------------------------------------- resumption


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_twice_and_across_epochs(tok, corpus, caplog, streaming):
    kw = dict(L=2, G=8, dp=2, r=1, shuffle=True, streaming=streaming)
    n = loader(tok, corpus).source.windows_per_epoch
    steps = 3 * n // 8 + 2  # about three epochs
    straight = loader(tok, corpus, **kw)
    expected = [straight.next_batch() for _ in range(steps * 2)]
    assert straight.epoch >= 2
    got, ld = [], loader(tok, corpus, **kw)
    with caplog.at_level(logging.INFO, logger="quadra.data"):
        # Resume mid-step (microbatch 1), at a step boundary, then after the data re-looped.
        for cut in (3, 6, 2 * (2 * n // 8 + 1)):
            while len(got) < cut:
                got.append(ld.next_batch())
            state = roundtrip(ld.state_dict())
            ld = loader(tok, corpus, **kw)
            ld.load_state_dict(state)
        assert ld.epoch == 2
        while len(got) < len(expected):
            got.append(ld.next_batch())
    assert ld.epoch == straight.epoch
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    epoch_logs = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage()]
    assert sum("epoch 1 begins" in m for m in epoch_logs) == 1


@pytest.mark.parametrize("new_dp, new_L, new_G", [(4, 1, 8), (1, 4, 8), (2, 1, 4)])
def test_resume_with_another_dp_degree(tok, corpus, new_dp, new_L, new_G):
    old = [loader(tok, corpus, L=2, G=8, dp=2, r=r, shuffle=True) for r in range(2)]
    for _ in range(3):
        step_windows(old, 2)
    state = roundtrip(old[0].state_dict())
    assert state == old[1].state_dict()  # the same on every rank
    new = [loader(tok, corpus, L=new_L, G=new_G, dp=new_dp, r=r, shuffle=True) for r in range(new_dp)]
    for ld in new:
        ld.load_state_dict(state)
    A = new_G // (new_dp * new_L)
    consumed = torch.cat([step_windows(new, A) for _ in range(16 // new_G)])
    assert torch.equal(consumed, by_position(tok, corpus, 24 + 16, shuffle=True)[24:])


def test_resume_mid_step_needs_same_layout(tok, corpus):
    ld = loader(tok, corpus, L=2, G=8, dp=2)
    ld.next_batch()
    other = loader(tok, corpus, L=4, G=8, dp=2)
    with pytest.raises(ValueError, match="middle of a step"):
        other.load_state_dict(ld.state_dict())
    with pytest.raises(ValueError, match="seq_len"):
        loader(tok, corpus, L=2, G=8, dp=2, seq_len=S + 1).load_state_dict(ld.state_dict())


# ---------------------------------------------------------------- streaming


def test_streaming_equals_map_style_without_shuffle(tok, corpus):
    n = loader(tok, corpus).source.windows_per_epoch
    assert torch.equal(by_position(tok, corpus, 2 * n + 3, streaming=True),
                       by_position(tok, corpus, 2 * n + 3))
    group = [loader(tok, corpus, L=2, G=8, dp=2, r=r, streaming=True) for r in range(2)]
    ref = loader(tok, corpus, L=8, G=8)
    for _ in range(4):
        assert torch.equal(step_windows(group, 2), ref.next_batch()[0])
    # Not infinite: both ranks stop after the same (last full) step.
    finite = [loader(tok, corpus, L=2, G=8, dp=2, r=r, streaming=True, infinite=False) for r in range(2)]
    assert len(list(finite[0])) == len(list(finite[1])) == 2 * (n // 8)


# ---------------------------------------------------------------- validation


def val_cfg(path, steps=-1):
    return SimpleNamespace(enable=True, path=path, freq=10, steps=steps)


@pytest.mark.parametrize("streaming", [False, True])
def test_validation_equal_counts_and_sharding(tok, corpus, streaming):
    n = loader(tok, corpus).source.windows_per_epoch
    ref = by_position(tok, corpus, n)
    for steps, dp in [(-1, 3), (2, 2), (-1, 1)]:
        per_rank = []
        for r in range(dp):
            vl = build_validation_dataloader(val_cfg(corpus, steps), cfg(corpus, streaming=streaming), tok,
                                             seq_len=S, local_batch_size=2, dp_rank=r, dp_degree=dp)
            per_rank.append([x for x, _ in vl])
            assert len(list(vl)) == len(per_rank[-1])  # iterating again restarts
        counts = {len(b) for b in per_rank}
        expect = n // (2 * dp) if steps < 0 else steps
        assert counts == {expect}
        for k in range(expect):
            assert torch.equal(torch.cat([b[k] for b in per_rank]), ref[k * 2 * dp : (k + 1) * 2 * dp])
    with pytest.raises(ValueError, match="validation.steps"):
        build_validation_dataloader(val_cfg(corpus, 0), cfg(corpus), tok, seq_len=S,
                                    local_batch_size=2, dp_rank=0, dp_degree=1)


def test_validation_steps_beyond_the_split_are_announced(tok, corpus, caplog):
    available = loader(tok, corpus).source.windows_per_epoch // 2
    for steps, rank, warned in [(available, 0, False), (available + 1, 0, True), (available + 1, 1, False)]:
        caplog.clear()
        vl = build_validation_dataloader(val_cfg(corpus, steps), cfg(corpus), tok, seq_len=S, local_batch_size=1,
                                         dp_rank=rank, dp_degree=2)
        assert len(list(vl)) == available
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(said) == warned, said  # once per run: rank 0 only
        if warned:
            assert said[0].startswith(f"validation.steps={available + 1} but validation.path=") and \
                f"holds {available} global batches" in said[0]


# ---------------------------------------------------------------- reading


def test_folder_txt_and_parquet_sources(tok, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = make_docs(6)
    write_jsonl(folder / "b.jsonl", docs[3:])
    write_jsonl(folder / "a.jsonl", docs[:3])  # sorted by name: a before b
    (folder / "notes.md").write_text("ignored: not a data file type")
    ds = load_documents(str(folder))
    assert list(ds["text"]) == docs
    txt = tmp_path / "book.txt"
    txt.write_text("Line one.\n\nLine three.\n")
    assert list(load_documents(str(txt))["text"]) == ["Line one.\n\nLine three.\n"]  # one document
    pq = tmp_path / "c.parquet"
    datasets.Dataset.from_dict({"content": docs}).to_parquet(str(pq))
    assert list(load_documents(str(pq), text_column="content")["content"]) == docs
    (folder / "c.txt").write_text("mixed")
    with pytest.raises(ValueError, match="mixes file types"):
        load_documents(str(folder))


def test_local_paths_and_hub_names_are_told_apart(tmp_path):
    assert not looks_like_local_path("roneneldan/TinyStories")
    for path in ("corpus.jsonl", "data/shard.parquet", "./corpus", "/abs/folder", str(tmp_path)):
        assert looks_like_local_path(path)


def test_concurrent_loads_of_one_file(tmp_path):
    # Two processes preparing the same file in the same (cold) cache must both succeed.
    path = write_jsonl(tmp_path / "shared.jsonl", make_docs(500))
    code = textwrap.dedent(f"""
        import datasets
        datasets.config.HF_DATASETS_CACHE = {str(tmp_path / "cache")!r}
        from engine.data.sources import load_documents, looks_like_local_path
        print(len(load_documents({path!r})))
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip().splitlines()[-1] == "500"


# ---------------------------------------------------------------- errors


def test_error_messages(tok, tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="data.path=.*does not exist"):
        loader(tok, str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="data.path"):
        loader(tok, str(tmp_path / "missing_dir") + "/")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for streaming in (False, True):
        with pytest.raises(ValueError, match="data.path=.*empty"):
            loader(tok, str(empty), streaming=streaming)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n")
    with pytest.raises(ValueError, match="data.path=.*no rows"):
        loader(tok, str(blank))
    other = write_jsonl(tmp_path / "other.jsonl", ["x"], column="body")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"data.text_column='text'.*available columns: \['body', 'id'\]"):
            loader(tok, other, streaming=streaming)
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": "ok"}\n{"text": null}\n')
    with pytest.raises(ValueError, match="data.text_column='text': row 1 holds NoneType"):
        loader(tok, str(nulls))
    short = write_jsonl(tmp_path / "short.jsonl", ["hi"])
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"fewer than training.seq_len \+ 1 = 65"):
            loader(tok, short, seq_len=64, streaming=streaming)
    n_tokens = len(tok.encode("hi", bos=True, eos=True))
    with pytest.raises(ValueError, match=f"has {n_tokens} tokens"):  # names the token count
        loader(tok, short, seq_len=64)
    with pytest.raises(ValueError, match="training.global_batch_size=6"):
        loader(tok, corpus, L=4, G=6)
    with pytest.raises(ValueError, match="validation.path=.*fewer than"):
        build_validation_dataloader(val_cfg(short), cfg(corpus), tok, seq_len=64,
                                    local_batch_size=1, dp_rank=0, dp_degree=1)


def test_sequence_order_seed_reorders_each_microbatch_and_nothing_else(tok, corpus):
    """data.sequence_order_seed (engine/parity/noise.py's reordered twin): every microbatch holds the
    same sequences, labels still the inputs shifted by one, in one fixed non-identity order."""
    from engine.data.order import sequence_permutation

    plain, reordered = loader(tok, corpus, L=4, G=8), loader(tok, corpus, L=4, G=8, sequence_order_seed=1)
    order = sequence_permutation(4, 1)
    assert order != [0, 1, 2, 3] and sorted(order) == [0, 1, 2, 3]
    for _ in range(4):
        (x, y), (rx, ry) = plain.next_batch(), reordered.next_batch()
        assert torch.equal(rx, x[order]) and torch.equal(ry, y[order])
    assert reordered.state_dict() == plain.state_dict()  # the data position is the same
    assert sequence_permutation(2, 5) == [1, 0]  # two sequences: never the identity
    with pytest.raises(ValueError, match="seed >= 1"):
        sequence_permutation(4, 0)
