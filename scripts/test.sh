#!/usr/bin/env bash
# Runs the test suite (the command CI calls), with the 20 slowest tests listed at the end. Extra
# arguments go to pytest: -k fsdp, or -m "not slow" for the fast tier (no multi-process training);
# --durations alone lists the 20 slowest too, --durations=N the N slowest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1
args=("$@")
for i in "${!args[@]}"; do
  # pytest's --durations needs a number: a bare one (the documented way to ask for the listing) gets 20.
  next=${args[$((i + 1))]:-}
  if [ "${args[$i]}" = "--durations" ] && ! [[ $next =~ ^[0-9]+$ ]]; then args[$i]="--durations=20"; fi
done
exec "$QUADRA_PYTHON" -m pytest -q --durations=20 ${args[@]+"${args[@]}"}
