#!/usr/bin/env bash
# One-shot GPU check (scripts/gpu_check.py): one table on stdout, JSON in $OUT/gpu_check.json when
# $OUT is set (or --json PATH). Arguments go to the Python script: --quick, --dry-cpu, --only ROWS...
#   bash scripts/gpu_check.sh                   # one GPU, about 2 minutes on an H200, hard limit GPU_CHECK_TIMEOUT
#   QUADRA_PYTHON=.venv/bin/python bash scripts/gpu_check.sh --dry-cpu    # no GPU: tiny shapes on the CPU
# The Python used: $QUADRA_PYTHON, else python3 (the GPU machine's python3 holds its CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${QUADRA_PYTHON:-python3}
LIMIT=${GPU_CHECK_TIMEOUT:-470}           # seconds, whole run; the rows share LIMIT - 20
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
json=""
prev=""
for arg in "$@"; do                        # where the JSON goes, to report a killed run's rows
  [ "$prev" = "--json" ] && json=$arg
  case $arg in --json=*) json=${arg#--json=} ;; esac
  prev=$arg
done
[ -z "$json" ] && [ -n "${OUT:-}" ] && json=$OUT/gpu_check.json
timeout -k 15 "$LIMIT" "$PY" scripts/gpu_check.py --budget $((LIMIT - 20)) "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_check: stopped after ${LIMIT}s (exit $rc)"
  # SIGKILL (137): the script could not print its table; the rows it finished are in the JSON.
  [ "$rc" -eq 137 ] && [ -n "$json" ] && [ -f "$json" ] && "$PY" scripts/gpu_check.py --report "$json"
fi
exit "$rc"
