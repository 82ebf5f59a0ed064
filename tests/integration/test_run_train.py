"""End to end through ./run_train.sh (torchrun, 2 gloo ranks): a short run learns and logs; bad input
stops every rank at start-up with one clear line."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time

import pytest

from tests.training_utils import REPO


def _run(args: list[str], timeout: float = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", **env_vars)
    env.pop("CONFIG_FILE", None)
    return subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *args, "--job.device", "cpu"],  # gloo ranks even on a GPU machine
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_debug_model_trains_and_logs(tmp_path):
    """The default config learns and logs. Also: a warmup longer than the run is clamped to it with
    one warning (smoke runs work); LOG_RANKS=1 shows rank 1's output only (here every rank logs its
    steps: metrics.log_all_ranks)."""
    run = _run(
        [
            "--job.dump_folder", str(tmp_path),
            "--job.print_config", "false",
            "--training.steps", "10",
            "--lr_scheduler.warmup_steps", "12",
            "--metrics.log_freq", "1",
            "--metrics.log_all_ranks", "true",
            "--validation.freq", "10",
            "--validation.steps", "2",
        ],
        LOG_RANKS="1",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in train] == list(range(1, 11))
    # 8.82 -> 8.21 here (warming up over all 10 steps)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert len(val) == 1 and val[0]["loss"] < train[0]["loss"]
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*")), "no TensorBoard event file"
    assert (tmp_path / "config.toml").read_text().count("[parallelism]") == 1
    warnings = [line for line in run.stderr.splitlines() if "warmup" in line]
    assert warnings == ["warning: lr_scheduler.warmup_steps = 12 does not fit in training.steps = 10: warming "
                        "up over 10 steps instead"], run.stderr[-3000:]
    output = (run.stdout + run.stderr).splitlines()
    assert any(line.startswith("[rank1]") and "step: 10  loss: " in line for line in output), run.stdout[-3000:]
    assert not any(line.startswith("[rank0]") for line in output), run.stdout[-3000:]


CONFIG_ERRORS = {
    "misspelled key": (["--training.stpes", "10"], "did you mean 'training.steps'"),
    "wrong type": (["--training.steps", "ten"], "training.steps"),
    "zero lr": (["--optimizer.lr", "0"], "optimizer.lr = 0.0: must be > 0"),
    "negative steps": (["--training.steps", "-3"], "training.steps = -3: must be > 0"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_bad_config_is_refused_before_any_rank_starts(case, tmp_path):
    """run_train.sh checks the config in one process first: one line, exit 2, no torchrun."""
    args, expected = CONFIG_ERRORS[case]
    run = _run(["--job.dump_folder", str(tmp_path), *args], timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("config error: ") and expected in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]
    assert "torch.distributed" not in run.stderr and "Traceback" not in run.stderr


def test_missing_config_file_names_the_variable(tmp_path):
    env_file = str(tmp_path / "missing.toml")
    run = subprocess.run([os.path.join(REPO, "run_train.sh")], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, CONFIG_FILE=env_file), timeout=60)
    assert run.returncode == 2 and f"CONFIG_FILE={env_file} does not exist" in run.stderr


SETUP_ERRORS = {
    "degrees vs world size": (["--parallelism.dp_shard", "3"], "world_size is 2"),
    "global batch": (["--training.global_batch_size", "12"], "training.global_batch_size"),
    "missing dataset": (["--data.path", "/nonexistent/corpus.jsonl"], "data.path"),
    "tokenizer larger than model": (["--model.vocab_size", "1000"], "model.vocab_size >= 4096"),
    "unknown flavor": (["--model.flavor", "7B"], "model.flavor"),
    "unknown model": (["--model.name", "gpt"], "model.name"),
    "tp vs heads": (["--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--model.vocab_size", "4097"],
                    "parallelism.tp = 2 does not divide the vocabulary size 4097"),
    "cp vs seq_len": (["--parallelism.cp", "2", "--training.seq_len", "250"], "training.seq_len = 250"),
    "pp microbatches": (["--parallelism.pp", "2", "--parallelism.pp_microbatch_size", "3"],
                        "parallelism.pp_microbatch_size = 3"),
    "ep on a dense model": (["--parallelism.ep", "2"], "parallelism.ep = 2"),
    "unwritable checkpoint folder": (["--checkpoint.folder", "/proc/quadra"], "checkpoint.folder = '/proc/quadra'"),
}


@pytest.mark.parametrize("case", sorted(SETUP_ERRORS))
def test_bad_setup_is_refused_before_any_rank_starts(case, tmp_path):
    """Rules the config and NGPU decide: the launcher's pre-flight says it in one line, exit 2, before
    torchrun starts (with the test environment's .venv inside the repo, as on a fresh machine)."""
    args, expected = SETUP_ERRORS[case]
    start = time.monotonic()
    run = _run(["--job.dump_folder", str(tmp_path), *args], timeout=60)
    elapsed = time.monotonic() - start
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.startswith("set-up error: ") and expected in run.stderr, run.stderr[-3000:]
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stdout == "", "a rank started despite bad input"
    assert elapsed < 4, f"took {elapsed:.1f} s to refuse (the pre-flight imports no torch; ranks take longer to start)"


def test_error_only_the_ranks_can_find_is_one_line(tmp_path):
    """A hub dataset that cannot be loaded (offline): every rank finds it; the user reads it once."""
    run = _run(["--job.dump_folder", str(tmp_path), "--data.path", "nobody/no_such_dataset"], timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if not line.startswith("[rank")]
    assert len(errors) == 1 and errors[0].startswith("set-up error: data.path='nobody/no_such_dataset'"), run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr, run.stderr[-3000:]
