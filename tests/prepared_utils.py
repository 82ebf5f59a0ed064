"""Helpers of the prepared-data tests (tests/integration/test_data_prepared*.py): small corpora, two prepared
sets shared by a test module, loaders over them, and copies of a set to damage."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.data import build_dataloader
from engine.data.prepare import prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 8


def make_docs(n: int, tag: str = "Doc") -> list[str]:
    return [f"{tag} {i}: " + "word " * (i % 7 + 1) + ("\nthe end.\n" if i % 2 else "") for i in range(n)]


def write_jsonl(path, docs) -> str:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


def quiet(_line: str) -> None:
    pass


def reference_stream(tok, docs) -> torch.Tensor:
    return torch.tensor([t for d in docs for t in [tok.bos_id, *tok.encode(d, False, False), tok.eos_id]])


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tok):
    """Two prepared sets: 'a' (the corpus of tests/unit/test_data.py) and 'b' (other documents)."""
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name, docs in (("a", make_docs(24)), ("b", make_docs(9, "Other text"))):
        raw = write_jsonl(root / f"{name}.jsonl", docs)
        out[name] = SimpleNamespace(raw=raw, docs=docs, folder=str(root / name), stream=reference_stream(tok, docs))
        prepare(raw, out[name].folder, tok.path, num_proc=1, log=quiet)
    return out


def cfg(path, **kw):
    return SimpleNamespace(**{**dict(path=path, text_column="text", split="train", streaming=False, shuffle=False,
                                     mixture=[]), **kw})


def loader(tok, path, *, L=1, G=-1, dp=1, r=0, seed=0, infinite=True, **kw):
    return build_dataloader(cfg(path, **kw), tok, seq_len=S, local_batch_size=L, global_batch_size=G,
                            dp_rank=r, dp_degree=dp, seed=seed, infinite=infinite)


def by_position(ld, n) -> torch.Tensor:
    return torch.cat([ld.next_batch()[0] for _ in range(n)])


def load_prepare_script():
    """scripts/prepare_data.py as a module (its ``main(argv)`` returns the exit status)."""
    spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(REPO, "scripts", "prepare_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_prepare_main(argv: list[str]) -> int:
    """scripts/prepare_data.py's ``main(argv)`` in this process; the SIGINT/SIGTERM handlers it
    installs are replaced by this process's own again afterwards (a later Ctrl-C or SIGTERM must reach
    pytest, not a handler of a finished preparation)."""
    import signal

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return load_prepare_script().main(argv)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def copy_set(sets, tmp_path, name="copy") -> str:
    """A copy of set 'a' (without the verification record of the original) to damage."""
    folder = str(tmp_path / name)
    shutil.copytree(sets["a"].folder, folder, ignore=shutil.ignore_patterns(".quadra-verified*"))
    return folder


def flip_last_byte(path: str) -> None:
    """Corrupt a file in place, keeping its size."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def setup_check(folder, tmp_path, *extra):
    """The launcher's pre-flight (engine/setup/preflight.py) of a run on ``folder``."""
    from engine.config import load_config
    from engine.setup.preflight import check_setup

    config = load_config(["--data.path", folder, "--job.dump_folder", str(tmp_path / "run"), *extra])
    config.validate()
    return check_setup(config, 1, "cpu")
