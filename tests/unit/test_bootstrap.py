"""scripts/bootstrap.sh is safe to start twice: a second command waits for the first one's set-up
instead of removing its half-built .venv, and a set-up killed half-way is redone by the next command.

The real bootstrap.sh runs in a scratch copy of the repo's layout with stand-in interpreters: the
"system" Python makes a .venv whose Python is this test's interpreter except for ``-m pip``, which
records the call and sleeps as long as the test says (a real install takes minutes). So what is
checked is bootstrap.sh's own logic: the lock, the completion marker, the messages.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.training_utils import REPO

_SYSTEM_PYTHON = """#!/usr/bin/env bash
# Stand-in for a system Python without the dependencies: "-m venv DIR" makes DIR/bin/python.
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  dir="${@: -1}"
  mkdir -p "$dir/bin"
  cp "$(dirname "$0")/venv-python" "$dir/bin/python"
  exit 0
fi
exec REAL "$@"
"""
_VENV_PYTHON = """#!/usr/bin/env bash
# Stand-in for .venv's Python: "-m pip ..." is recorded, takes PIP_SECONDS and then marks the packages
# installed; until then the dependency check (a script on stdin) finds none. The rest is real Python.
here=$(dirname "$0")
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$PIP_LOG"
  sleep "${PIP_SECONDS:-0}"
  touch "$here/packages-installed"
  exit 0
fi
if [ "$1" = "-" ] && [ ! -f "$here/packages-installed" ]; then
  exit 1
fi
exec REAL "$@"
"""


@pytest.fixture
def scratch(tmp_path):
    """A folder laid out like the repo (scripts/bootstrap.sh) and the stand-in interpreters."""
    os.makedirs(tmp_path / "repo" / "scripts")
    shutil.copy(os.path.join(REPO, "scripts", "bootstrap.sh"), tmp_path / "repo" / "scripts" / "bootstrap.sh")
    os.makedirs(tmp_path / "bin")
    for name, text in (("python", _SYSTEM_PYTHON), ("venv-python", _VENV_PYTHON)):
        path = tmp_path / "bin" / name
        path.write_text(text.replace("REAL", sys.executable))
        path.chmod(0o755)
    return tmp_path


def _start(scratch, pip_seconds: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUADRA_PYTHON")}
    env.update(PYTHON=str(scratch / "bin" / "python"), QUADRA_FRESH_ENV="1", PIP_LOG=str(scratch / "pip.log"),
               PIP_SECONDS=str(pip_seconds))
    return subprocess.Popen(["bash", "-c", 'set -euo pipefail; source scripts/bootstrap.sh; echo "ready $QUADRA_PYTHON"'],
                            cwd=scratch / "repo", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _pip_calls(scratch) -> list[str]:
    path = scratch / "pip.log"
    return path.read_text().splitlines() if path.exists() else []


def _wait_for_pip(scratch, calls: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_pip_calls(scratch)) < calls:
        assert time.monotonic() < deadline, "the set-up never reached pip"
        time.sleep(0.05)


def test_a_second_command_waits_for_the_first_set_up(scratch):
    first = _start(scratch, pip_seconds=3)
    _wait_for_pip(scratch, 1)  # the first one is installing into its .venv
    second = _start(scratch, pip_seconds=0)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    venv_python = str(scratch / "repo" / ".venv" / "bin" / "python")
    assert first.returncode == 0 and out1.strip() == f"ready {venv_python}", err1
    assert second.returncode == 0 and out2.strip() == f"ready {venv_python}", err2
    assert "quadra: another command is setting up .venv (pid" in err2 and "waiting for it" in err2, err2
    assert "creating .venv" not in err2, err2  # it used the first one's .venv, and built nothing
    assert [c for c in _pip_calls(scratch) if "install -e" in c] == [f"-m pip install -e {scratch / 'repo'}[dev]"]
    assert (scratch / "repo" / ".venv" / ".quadra-setup-complete").is_file()


def test_a_set_up_killed_half_way_is_done_again(scratch):
    killed = _start(scratch, pip_seconds=60)
    _wait_for_pip(scratch, 1)
    os.killpg(killed.pid, signal.SIGKILL)  # the whole command, pip included, as a closed terminal would
    killed.communicate(timeout=30)
    assert (scratch / "repo" / ".venv" / "bin" / "python").exists()  # half-built: a Python, no packages
    assert not (scratch / "repo" / ".venv" / ".quadra-setup-complete").exists()
    again = _start(scratch, pip_seconds=0)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0 and out.startswith("ready "), err
    assert "quadra: .venv is incomplete (its set-up was interrupted or failed): building it again" in err, err
    assert len([c for c in _pip_calls(scratch) if "install -e" in c]) == 2
    assert (scratch / "repo" / ".venv" / ".quadra-setup-complete").is_file()
    again = _start(scratch, pip_seconds=0)  # and once complete, the next command only uses it
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0 and err == "" and len(_pip_calls(scratch)) == 2, err
