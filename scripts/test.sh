#!/usr/bin/env bash
# Runs the test suite (the command CI calls), with the 20 slowest tests listed at the end. Extra
# arguments go to pytest: -k fsdp, or tests/unit for the fast tier (no multi-process training);
# --durations alone lists the 20 slowest too, --durations=N the N slowest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# The cores this process may use; GNU nproc reports OMP_NUM_THREADS instead where it is set.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1
args=("$@")
for i in "${!args[@]}"; do
  # pytest's --durations needs a number: a bare one (the documented way to ask for the listing) gets 20.
  next=${args[$((i + 1))]:-}
  if [ "${args[$i]}" = "--durations" ] && ! [[ $next =~ ^[0-9]+$ ]]; then args[$i]="--durations=20"; fi
done
# Two pytest workers (pytest-xdist, in the dev extra), each taking whole test files: most tests run
# one single-threaded process and would leave the second core idle, and a file's module fixtures (a
# batch of layouts trained in one set of ranks) must run once, not once per worker. Files go out in
# tests/conftest.py's order (tests/integration first), not xdist's default (most tests first). -n 0: one process.
workers=()
if [ "$cores" -ge 2 ]; then
  if "$QUADRA_PYTHON" -c "import xdist" 2>/dev/null; then
    workers=(-n 2 --dist loadfile --no-loadscope-reorder)
  else
    echo "quadra: pytest-xdist is not installed: the tests run on one core (pip install -e \".[dev]\")" >&2
  fi
fi
exec "$QUADRA_PYTHON" -m pytest -q --durations=20 ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"}
