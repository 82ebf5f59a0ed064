"""Prepared data sets: preparation, memory-mapped windows, O(1) shuffle, mixtures, resume.

Every order is compared with a plain reference computed here: the packed stream from the
tokenizer, the Feistel permutation written out with Python integers, and the mixture schedule
simulated position by position (engine/data/order.py documents both). The refusals are in
tests/integration/test_data_prepared_safety.py.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.data import build_validation_dataloader
from engine.data.prepare import prepare
from engine.data.prepared import is_prepared
from tests.prepared_utils import (REPO, S, by_position, cfg, loader, quiet, run_prepare_main, sets,  # noqa: F401
                                  write_jsonl)

pytestmark = pytest.mark.usefixtures("private_datasets_cache")


# ---------------------------------------------------------------- references


def ref_permutation(n: int, seed: int, stream: int, epoch: int) -> list[int]:
    """engine/data/order.py's permutation, with Python integers."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, full = (1 << half) - 1, (1 << 64) - 1
    digest = hashlib.sha512(f"quadra-window-order:{seed}:{stream}:{epoch}".encode()).digest()
    keys = [int.from_bytes(digest[8 * j: 8 * j + 8], "little") for j in range(6)]

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & full
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & full
        return x ^ (x >> 31)

    def feistel(x):
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (mix(right ^ key) & mask)
        return (left << half) | right

    out = []
    for i in range(n):
        x = feistel(i)
        while x >= n:
            x = feistel(x)
        out.append(x)
    return out


def ref_window(stream: torch.Tensor, q: int, *, shuffle: bool, seed: int = 0, index: int = 0) -> torch.Tensor:
    """Inputs of position q of one set: window order[q % n] of epoch q // n."""
    n = (len(stream) - 1) // S
    w = ref_permutation(n, seed, index, q // n)[q % n] if shuffle else q % n
    return stream[w * S: w * S + S]


def ref_mixture_sources(counts: list[int], positions: int) -> list[int]:
    """Smooth weighted round robin, simulated one position at a time."""
    credit, out = [0] * len(counts), []
    for _ in range(positions):
        credit = [c + k for c, k in zip(credit, counts)]
        best = max(range(len(counts)), key=lambda i: (credit[i], -i))
        credit[best] -= sum(counts)
        out.append(best)
    return out


# ---------------------------------------------------------------- preparing


def _run_script(argv: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a script with its worker processes in a session of their own. Past ``timeout`` every process
    of the session (the script, datasets' pool workers and manager) dumps its Python stack (SIGABRT
    under PYTHONFAULTHANDLER) and is killed, and the test fails with the stacks: a stuck pool worker
    (one hung a fast-tier run) can neither hang the test nor outlive it holding the output pipes."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1", **env}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        pytest.fail(f"{' '.join(argv[:1])} ran over {timeout:.0f} s; the stacks of its processes:\n{err[-8000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_prepare_twice_is_byte_identical_and_a_complete_folder_is_left_alone(sets, tok, tmp_path, capsys):
    a = sets["a"]
    parts = tmp_path / "in"  # a folder of 3 files: 2 processes convert it to Arrow and tokenize it
    os.makedirs(parts)
    for i, (start, end) in enumerate([(0, 10), (10, 17), (17, len(a.docs))]):
        write_jsonl(parts / f"part{i}.jsonl", a.docs[start:end])
    out = _run_script([os.path.join(REPO, "scripts", "prepare_data.py"), str(parts), str(tmp_path / "again"),
                       "--tokenizer", tok.path, "--num_proc", "2", "--shard_tokens", "100"],
                      {"HF_DATASETS_CACHE": str(parts / ".cache")})  # (hidden: not an input)
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout
    shard = dict(num_proc=1, log=quiet, shard_tokens=100)
    prepare(str(parts), str(tmp_path / "new" / "once"), tok.path, **shard)  # the parent folder is created
    shutil.move(str(tmp_path / "new" / "once"), str(tmp_path / "once"))
    os.rmdir(tmp_path / "new")
    files = sorted(os.listdir(tmp_path / "once"))
    assert len([f for f in files if f.startswith("tokens-")]) == -(-len(a.stream) // 100)  # shards of 100
    for name in files:  # 2 processes vs 1: the same bytes, manifest included
        assert (tmp_path / "once" / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    stamp = os.stat(tmp_path / "once" / "manifest.json").st_mtime_ns
    assert run_prepare_main([str(parts), str(tmp_path / "once"), "--tokenizer", tok.path]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert os.stat(tmp_path / "once" / "manifest.json").st_mtime_ns == stamp
    tokens = np.concatenate([np.load(tmp_path / "once" / f) for f in files if f.startswith("tokens-")])
    assert tokens.dtype == np.uint16 and np.array_equal(tokens, a.stream.numpy())
    offsets = np.load(tmp_path / "once" / "documents.npy")
    assert np.array_equal(np.diff(offsets), [len(tok.encode(d, True, True)) for d in a.docs])
    assert sorted(os.listdir(tmp_path)) == ["again", "in", "once"]  # no temporary folder left


def test_an_interrupted_preparation_leaves_no_output(sets, tok, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("engine.data.prepare._write_shards", fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(sets["a"].raw, str(tmp_path / "out"), tok.path, log=quiet)
    assert os.listdir(tmp_path) == [] and not is_prepared(str(tmp_path / "out"))


# ---------------------------------------------------------------- windows and orders


def test_windows_equal_the_raw_packing_and_the_reference(sets, tok):
    a = sets["a"]
    n = (len(a.stream) - 1) // S
    prepared, raw = loader(tok, a.folder, L=4), loader(tok, a.raw, L=4)
    assert prepared.source.windows_per_epoch == raw.source.windows_per_epoch == n
    for _ in range(2 * n // 4 + 3):  # past the second epoch boundary
        (x, y), (rx, ry) = prepared.next_batch(), raw.next_batch()
        assert torch.equal(x, rx) and torch.equal(y, ry)
    want = torch.stack([ref_window(a.stream, q, shuffle=False) for q in range(n)])
    assert torch.equal(by_position(loader(tok, a.folder), n), want)


def test_shuffle_is_the_documented_permutation_of_every_epoch(sets, tok):
    a = sets["a"]
    n = (len(a.stream) - 1) // S
    for seed in (0, 5):
        got = by_position(loader(tok, a.folder, shuffle=True, seed=seed), 2 * n + 3)
        want = torch.stack([ref_window(a.stream, q, shuffle=True, seed=seed) for q in range(2 * n + 3)])
        assert torch.equal(got, want)
    orders = [ref_permutation(n, 0, 0, e) for e in range(2)] + [ref_permutation(n, 5, 0, 0)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[0] != orders[1] and orders[0] != orders[2] and orders[0] != list(range(n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_mixture_order_and_tokens_per_set(sets, tok, shuffle):
    a, b = sets["a"], sets["b"]
    mixture = [f"{a.folder}:0.75", f"{b.folder}:0.25"]
    P = 64  # b (fewer windows) wraps several times
    got = by_position(loader(tok, "unused", mixture=mixture, shuffle=shuffle), P)
    sources = ref_mixture_sources([3, 1], P)
    seen = [0, 0]
    for p, s in enumerate(sources):
        want = ref_window([a, b][s].stream, seen[s], shuffle=shuffle, index=s)
        assert torch.equal(got[p], want), p
        seen[s] += 1
    ld = loader(tok, "unused", L=2, G=8, mixture=mixture)
    for _ in range(4 * 4):  # 4 steps of 8 windows: 24 of a, 8 of b
        ld.next_batch()
    assert ld.log_metrics() == {"data_tokens_a": 24 * S, "data_tokens_b": 8 * S}
    assert len(ld.state_dict()["data"]) > 0


def test_layout_independence_of_mixtures(sets, tok):
    mixture = [f"{sets['a'].folder}:0.6", f"{sets['b'].folder}:0.4"]
    ref = loader(tok, "unused", L=8, G=8, mixture=mixture, shuffle=True)
    group = [loader(tok, "unused", L=2, G=8, dp=2, r=r, mixture=mixture, shuffle=True) for r in range(2)]
    for _ in range(6):
        assert torch.equal(torch.cat([g.next_batch()[0] for g in group for _ in range(2)]), ref.next_batch()[0])


# ---------------------------------------------------------------- resumption


@pytest.mark.parametrize("kind", ["prepared", "mixture"])
def test_resume_mid_step_across_epochs_and_on_another_dp(sets, tok, kind):
    kw = {"mixture": [f"{sets['a'].folder}:0.7", f"{sets['b'].folder}:0.3"]} if kind == "mixture" else {}
    path = sets["a"].folder
    n = (len(sets["a"].stream) - 1) // S
    straight = loader(tok, path, L=2, G=8, dp=2, r=1, shuffle=True, **kw)
    expected = [straight.next_batch()[0] for _ in range(2 * (3 * n // 8 + 2))]
    got, ld = [], loader(tok, path, L=2, G=8, dp=2, r=1, shuffle=True, **kw)
    for cut in (3, 6, 2 * (2 * n // 8 + 1)):  # mid-step, step boundary, after two epochs
        while len(got) < cut:
            got.append(ld.next_batch()[0])
        state = ld.state_dict()
        ld = loader(tok, path, L=2, G=8, dp=2, r=1, shuffle=True, **kw)
        ld.load_state_dict(state)
    while len(got) < len(expected):
        got.append(ld.next_batch()[0])
    assert all(torch.equal(x, y) for x, y in zip(got, expected))
    # Another dp degree from a step-boundary state: the global sequence continues exactly.
    reference = by_position(loader(tok, path, shuffle=True, **kw), 40)
    state = loader(tok, path, L=2, G=8, dp=2, shuffle=True, **kw)
    for _ in range(3 * 2):
        state.next_batch()
    new = [loader(tok, path, L=1, G=8, dp=4, r=r, shuffle=True, **kw) for r in range(4)]
    for ld in new:
        ld.load_state_dict(state.state_dict())
    steps = [torch.cat([ld.next_batch()[0] for ld in new for _ in range(2)]) for _ in range(2)]
    assert torch.equal(torch.cat(steps), reference[24:40])


def test_validation_reads_a_prepared_folder(sets, tok):
    a = sets["a"]
    made = [build_validation_dataloader(SimpleNamespace(enable=True, path=path, freq=1, steps=-1), cfg(a.raw), tok,
                                        seq_len=S, local_batch_size=2, dp_rank=0, dp_degree=1)
            for path in (a.folder, a.raw)]
    prepared, raw = ([x for x, _ in vl] for vl in made)
    assert len(prepared) == len(raw) == ((len(a.stream) - 1) // S) // 2
    assert all(torch.equal(x, y) for x, y in zip(prepared, raw))


# ---------------------------------------------------------------- training (2 gloo processes)


def _fsdp_runs(folder: str, mixture: list[str]) -> dict:
    """In each of 2 ranks (FSDP2, 2 microbatches of 2): 6 steps straight, and 6 steps stopped
    after steps 2 and 4 and resumed from their checkpoints each time."""
    from tests.checkpoint_utils import train_run
    from tests.training_utils import base_args

    def argv(name):
        return base_args(f"{folder}/{name}", {"data.mixture": ",".join(mixture), "training.steps": 6,
                                              "checkpoint.enable": "true", "checkpoint.interval": 2,
                                              "parallelism.dp_shard": 2, "training.local_batch_size": 2})

    straight = train_run(argv("straight"))
    parts = [train_run(argv("stopped"), 2), train_run(argv("stopped"), 2), train_run(argv("stopped"))]
    return {"straight": straight, "parts": parts}


def _single_from_step4(folder: str, mixture: list[str]) -> dict:
    from tests.checkpoint_utils import train_run
    from tests.training_utils import base_args

    return train_run(base_args(folder, {"data.mixture": ",".join(mixture), "training.steps": 6,
                                        "checkpoint.enable": "true", "checkpoint.interval": 2}))


def _last_record(run_folder: str) -> dict:
    with open(os.path.join(run_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"train"' in line][-1]


def test_exact_resume_under_fsdp2_and_after_a_dp_change(sets, tok, tmp_path):
    from tests.checkpoint_utils import assert_losses_close, copy_checkpoint, write_tiny_corpus
    from engine.testing.processes import run_distributed

    # 28 windows of 33 tokens at 3/4 of 8 per step: its first epoch ends in step 5, after the second resume.
    tiny = str(tmp_path / "tiny")
    prepare(write_tiny_corpus(str(tmp_path)), tiny, tok.path, log=quiet)
    mixture = [f"{tiny}:0.75", f"{sets['b'].folder}:0.25"]
    ranks = run_distributed(_fsdp_runs, 2, str(tmp_path), mixture, timeout=400)
    for rank in ranks:
        straight, parts = rank["straight"], rank["parts"]
        assert [p["start_step"] for p in parts] == [0, 2, 4]
        resumed = {**parts[0]["losses"], **parts[1]["losses"], **parts[2]["losses"]}
        assert resumed == straight["losses"] and sorted(resumed) == list(range(1, 7))  # bitwise
    last = _last_record(str(tmp_path / "straight"))
    assert last["data_tokens_tiny"] + last["data_tokens_b"] == 6 * 8 * 32 and last["data_tokens_b"] == 6 * 2 * 32
    resumed_last = _last_record(str(tmp_path / "stopped"))
    assert resumed_last["step"] == 6 and all(resumed_last[k] == last[k] for k in ("data_tokens_tiny", "data_tokens_b"))
    # dp 2 -> 1 from the step-4 checkpoint: the same windows, so the losses agree to fp32 reduction order.
    copy_checkpoint(str(tmp_path / "stopped"), str(tmp_path / "single"), 4)
    (single,) = run_distributed(_single_from_step4, 1, str(tmp_path / "single"), mixture, torchrun_env=False)
    assert single["start_step"] == 4
    assert_losses_close(single["losses"], {s: ranks[0]["straight"]["losses"][s] for s in (5, 6)}, rel=1e-5)
