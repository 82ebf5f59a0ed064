#!/usr/bin/env bash
# Sourced by run_train.sh and scripts/test.sh: sets QUADRA_PYTHON to a Python that has Quadra's
# dependencies. Order: $PYTHON (or python3) if it already has them; else the repo's .venv; else
# create .venv and install into it. The venv sees system site-packages, so an existing torch
# install (CPU or CUDA) is used as is; torch==2.13.0 is installed only when no torch is found.
_quadra_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_quadra_has_deps() {
  # find_spec locates the packages without importing them (importing torch alone takes seconds).
  "$1" - <<'PY' >/dev/null 2>&1
import sys
from importlib.util import find_spec
assert sys.version_info >= (3, 10)
needed = ["torch", "sentencepiece", "datasets", "tensorboard", "pytest"]
if sys.version_info < (3, 11):
    needed.append("tomli")
missing = [name for name in needed if find_spec(name) is None]
sys.exit(1 if missing else 0)
PY
}
QUADRA_PYTHON=${PYTHON:-python3}
if ! _quadra_has_deps "$QUADRA_PYTHON"; then
  QUADRA_PYTHON="$_quadra_root/.venv/bin/python"
  if ! { [ -x "$QUADRA_PYTHON" ] && _quadra_has_deps "$QUADRA_PYTHON"; }; then
    _log="$_quadra_root/.venv-setup.log"
    exec 3>&2  # the terminal, while the install's own output goes to the log
    echo "quadra: first run: creating .venv and installing dependencies (pip install -e \".[dev]\"; log: .venv-setup.log)" >&2
    {
      "${PYTHON:-python3}" -m venv --system-site-packages "$_quadra_root/.venv" &&
      if "$QUADRA_PYTHON" -c "import torch" 2>/dev/null; then
        echo "quadra: using the torch already installed" >&3
      else
        echo "quadra: installing torch==2.13.0" >&3
        "$QUADRA_PYTHON" -m pip install "torch==2.13.0"
      fi &&
      "$QUADRA_PYTHON" -m pip install -e "$_quadra_root[dev]"
    } >"$_log" 2>&1 || { tail -n 30 "$_log" >&2; echo "quadra: dependency set-up failed (see .venv-setup.log)" >&2; exit 1; }
  fi
fi
export QUADRA_PYTHON
export PYTHONPATH="$_quadra_root${PYTHONPATH:+:$PYTHONPATH}"
