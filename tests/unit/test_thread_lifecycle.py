"""The threads a rank starts end with its run (issue #54: a heap corruption at an unknown writer).

A thread still running when the interpreter shuts down runs numpy/torch code while the main thread tears
down modules and, at ``exit()``, C++ static objects: a daemon thread is only stopped once it next asks
for the GIL. The data read-ahead thread (engine/data/readahead.py) kept reading ahead past the last step,
since nothing closed the training data loader: ``Trainer.close`` now does, on every exit path.
"""

from __future__ import annotations

import os
import threading
import time

from engine.config import load_config
from engine.data.prepare import prepare
from engine.train.trainer import Trainer
from tests.checkpoint_utils import write_tiny_corpus
from tests.training_utils import FLAVOR, REPO

THREAD_PREFIX = "quadra-"  # every thread Quadra starts is named so (hang watchdog, read-ahead, checkpoint hashing)


def _quadra_threads(wait_s: float, before: frozenset = frozenset()) -> list[str]:
    """Names of live Quadra threads not in ``before`` (threads of other tests in this pytest process),
    after up to ``wait_s`` for those told to stop (they poll)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t not in before)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_close_ends_every_thread_of_a_run_with_read_ahead_and_async_saves(tmp_path):
    """Prepared data (read-ahead on), async checkpoints (the hashing thread), the hang watchdog: after
    ``Trainer.close`` none of them is left (2 s for the watchdog's poll)."""
    corpus = write_tiny_corpus(str(tmp_path))
    tokenizer = os.path.join(REPO, "assets", "tokenizer", "shakespeare.model")
    prepare(corpus, str(tmp_path / "prepared"), tokenizer, num_proc=1, log=lambda line: None)
    cfg = load_config(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                       "--data.path", str(tmp_path / "prepared"), "--job.dump_folder", str(tmp_path / "run"),
                       "--model.flavor", FLAVOR, "--training.steps", "3", "--training.seq_len", "32",
                       "--training.local_batch_size", "2", "--training.global_batch_size", "2",
                       "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                       "--parallelism.dp_shard", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                       "--checkpoint.async_mode", "async", "--comm.hang_timeout_seconds", "60",
                       "--job.device", "cpu", "--job.print_config", "false"])
    cfg.validate()
    before = frozenset(threading.enumerate())  # a test run before this one in the same process may leave its own
    trainer = Trainer(cfg)
    try:
        trainer.train()
        assert "quadra-data-read-ahead" in _quadra_threads(0, before)  # the thread this test is about ran
    finally:
        trainer.close()
    assert _quadra_threads(2.0, before) == []
