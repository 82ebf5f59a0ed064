#!/usr/bin/env bash
# Sourced by run_train.sh and scripts/test.sh: sets QUADRA_PYTHON to a Python that has Quadra's
# dependencies. Order: $PYTHON (or python3) if it already has them; else the repo's .venv when its
# set-up ran to the end; else (re)create .venv and install into it (pip install -e ".[dev]",
# torch==2.13.0 first when needed).
# The new .venv sees the system's site-packages only when the system Python already has torch (an
# existing CUDA build is reused as is); otherwise it is isolated and gets everything from pip.
# QUADRA_FRESH_ENV=1 (what .ci/run sets) ignores the running Python's packages and builds an
# isolated .venv the way a machine without any dependency does.
# Safe to start twice: the set-up holds an exclusive lock on .venv.lock (flock(2), released by the
# kernel when its holder exits or is killed), so a second command waits for the first one's .venv
# instead of removing it; .venv/.quadra-setup-complete is written last, so a set-up that was
# interrupted half-way is found incomplete by the next command, which builds .venv again.
_quadra_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_quadra_has_deps() {
  # find_spec locates the packages without importing them (importing torch alone takes seconds).
  "$1" - <<'PY' >/dev/null 2>&1
import sys
from importlib.util import find_spec
assert sys.version_info >= (3, 10)
needed = ["torch", "sentencepiece", "tokenizers", "safetensors", "datasets", "tensorboard", "pytest", "transformers"]
if sys.version_info < (3, 11):
    needed.append("tomli")
missing = [name for name in needed if find_spec(name) is None]
sys.exit(1 if missing else 0)
PY
}
_quadra_venv_ready() {  # .venv's set-up ran to its end and its Python has the dependencies
  [ -f "$_quadra_root/.venv/.quadra-setup-complete" ] && [ -x "$QUADRA_PYTHON" ] && _quadra_has_deps "$QUADRA_PYTHON"
}
_quadra_build_venv() {
  local log="$_quadra_root/.venv-setup.log" site=()
  if [ -z "${QUADRA_FRESH_ENV:-}" ] && "$_quadra_base" -c "import torch" >/dev/null 2>&1; then
    site=(--system-site-packages)
  fi
  if [ -e "$_quadra_root/.venv" ]; then
    echo "quadra: .venv is incomplete (its set-up was interrupted or failed): building it again" >&2
  fi
  exec 3>&2  # the terminal, while the install's own output goes to the log
  echo "quadra: first run: creating .venv and installing dependencies (pip install -e \".[dev]\"; log: .venv-setup.log)" >&2
  {
    rm -rf "$_quadra_root/.venv" &&
    "$_quadra_base" -m venv "${site[@]}" "$_quadra_root/.venv" &&
    if "$QUADRA_PYTHON" -c "import torch" 2>/dev/null; then
      echo "quadra: using the torch already installed" >&3
    else
      echo "quadra: installing torch==2.13.0" >&3
      "$QUADRA_PYTHON" -m pip install "torch==2.13.0"
    fi &&
    "$QUADRA_PYTHON" -m pip install -e "$_quadra_root[dev]" &&
    date -u +"set up %Y-%m-%dT%H:%M:%SZ" >"$_quadra_root/.venv/.quadra-setup-complete"
  } >"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "quadra: dependency set-up failed (see .venv-setup.log)" >&2; exit 1; }
  exec 3>&-
}
_quadra_base=${PYTHON:-python3}
QUADRA_PYTHON=$_quadra_base
if [ -n "${QUADRA_FRESH_ENV:-}" ] || ! _quadra_has_deps "$QUADRA_PYTHON"; then
  QUADRA_PYTHON="$_quadra_root/.venv/bin/python"
  if ! _quadra_venv_ready; then
    exec 9>>"$_quadra_root/.venv.lock"
    # flock through Python's fcntl (on every POSIX Python; util-linux's flock(1) is not on macOS): the
    # lock belongs to fd 9's open file, which this shell keeps, so it outlives the Python that took it.
    if ! "$_quadra_base" -c "import fcntl; fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)" 2>/dev/null; then
      echo "quadra: another command is setting up .venv ($(cat "$_quadra_root/.venv.lock" 2>/dev/null)); waiting for it" >&2
      "$_quadra_base" -c "import fcntl; fcntl.flock(9, fcntl.LOCK_EX)"
    fi
    echo "pid $$ on $(hostname 2>/dev/null || echo this host)" >"$_quadra_root/.venv.lock"
    _quadra_venv_ready || _quadra_build_venv  # the one we waited for may have built it
    exec 9>&-
  fi
fi
export QUADRA_PYTHON
export PYTHONPATH="$_quadra_root${PYTHONPATH:+:$PYTHONPATH}"
