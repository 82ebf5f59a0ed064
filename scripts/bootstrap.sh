#!/usr/bin/env bash
# Sourced by run_train.sh and scripts/test.sh: sets QUADRA_PYTHON to a Python that has Quadra's
# dependencies. Order: $PYTHON (or python3) if it already has them; else the repo's .venv; else
# create .venv and install into it (pip install -e ".[dev]", torch==2.13.0 first when needed).
# The new .venv sees the system's site-packages only when the system Python already has torch (an
# existing CUDA build is reused as is); otherwise it is isolated and gets everything from pip.
# QUADRA_FRESH_ENV=1 (what .ci/run sets) ignores the running Python's packages and builds an
# isolated .venv the way a machine without any dependency does.
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
_quadra_base=${PYTHON:-python3}
QUADRA_PYTHON=$_quadra_base
if [ -n "${QUADRA_FRESH_ENV:-}" ] || ! _quadra_has_deps "$QUADRA_PYTHON"; then
  QUADRA_PYTHON="$_quadra_root/.venv/bin/python"
  if ! { [ -x "$QUADRA_PYTHON" ] && _quadra_has_deps "$QUADRA_PYTHON"; }; then
    _log="$_quadra_root/.venv-setup.log"
    _site=()
    if [ -z "${QUADRA_FRESH_ENV:-}" ] && "$_quadra_base" -c "import torch" >/dev/null 2>&1; then
      _site=(--system-site-packages)
    fi
    exec 3>&2  # the terminal, while the install's own output goes to the log
    echo "quadra: first run: creating .venv and installing dependencies (pip install -e \".[dev]\"; log: .venv-setup.log)" >&2
    {
      rm -rf "$_quadra_root/.venv" &&
      "$_quadra_base" -m venv "${_site[@]}" "$_quadra_root/.venv" &&
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
