#!/usr/bin/env bash
# Runs the test suite (the command CI calls). Extra arguments go to pytest, e.g. -k fsdp.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1
exec "$QUADRA_PYTHON" -m pytest -q "$@"
