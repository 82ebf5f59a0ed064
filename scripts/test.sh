#!/usr/bin/env bash
# Runs the test suite (the command CI calls), with the 15 slowest tests listed at the end. Extra
# arguments go to pytest: -k fsdp, or -m "not slow" for the fast tier (no multi-process training).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1
exec "$QUADRA_PYTHON" -m pytest -q --durations=15 "$@"
