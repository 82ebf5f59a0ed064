"""The scripts of scripts/ run under the project's environment whichever Python starts them
(scripts/project_env.py): here a Python started without its site-packages (no torch, as on a fresh
machine) still plans a layout and refuses bad input in one line."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.training_utils import REPO


def _plan(*args: str) -> subprocess.CompletedProcess:
    # PYTHON: this interpreter (which has the dependencies) is the one scripts/bootstrap.sh hands back,
    # as for ./run_train.sh. Without it bootstrap.sh falls back to the repo's .venv and, on a clone
    # that has none yet, builds one with pip in the middle of the test (98 s; CI builds .venv before
    # the tests and sets QUADRA_FRESH_ENV=1, so there .venv is used either way).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    # -S: no site-packages, so torch is not importable and the script must re-run itself.
    return subprocess.run([sys.executable, "-S", os.path.join(REPO, "scripts", "plan.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_plan_runs_from_a_python_without_the_dependencies():
    run = _plan("--flavor", "8B", "--gpus", "8", "--seq_len", "8192", "--global_batch_size", "32")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "decision matrix: row 2" in run.stdout, run.stdout[-2000:]


def test_plan_json_to_a_missing_folder_is_refused_before_the_search():
    run = _plan("--flavor", "8B", "--gpus", "8", "--json", "/nonexistent/plan.json")
    assert run.returncode == 2 and run.stdout == "", run.stdout[-2000:]
    assert run.stderr.strip().splitlines() == [
        "plan error: --json /nonexistent/plan.json: folder /nonexistent does not exist or is not writable; "
        "create it or choose another path"], run.stderr
