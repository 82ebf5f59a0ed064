#!/usr/bin/env bash
# Runs tests under two float32 summation orders that every x86 CPU offers, to show a tolerance tied
# to one CPU's rounding without that CPU: the default kernels (AVX2, AVX-512 or AMX, whichever this
# CPU has) and capped ones (ATen without vectorization, MKL's SSE4.2 path, oneDNN's SSE4.1 one: the
# KERNEL_CAP_ENV of engine/parity/noise.py). Each pass is the README's test command with the given
# pytest arguments; the default ones are the tests that compare arithmetic that is not exact.
#   ./scripts/cpu_kernels.sh                      # float8, bf16, Muon, compiled-vs-eager tests
#   ./scripts/cpu_kernels.sh tests/integration/test_float8.py # chosen tests
# Exit status: 0 when both passes pass, else 1. Outside CI (it runs the chosen tests twice).
set -uo pipefail
cd "$(dirname "$0")/.."
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/integration/test_float8.py tests/unit/test_float8_setup.py tests/integration/test_trainer.py tests/integration/test_fused_loss.py
         tests/integration/test_muon.py tests/integration/test_muon_parallel.py tests/integration/test_ac_compile.py tests/integration/test_reference_loop.py)
fi
caps=$(PYTHONPATH=. python3 -c "from engine.parity.noise import KERNEL_CAP_ENV as e; print(' '.join(f'{k}={v}' for k, v in e.items()))")
declare -A status
caches=$(mktemp -d)
trap 'rm -rf "$caches"' EXIT
for pass in default capped; do
  # inductor's cache keys miss the kernel choice: each pass compiles into its own cache
  export TORCHINDUCTOR_CACHE_DIR="$caches/$pass"
  echo "=== $pass kernels${caps:+ ($([ $pass = capped ] && echo "$caps" || echo "none set"))} ==="
  if [ $pass = capped ]; then
    env $caps ./scripts/test.sh -p no:cacheprovider "${tests[@]}"
  else
    env -u ATEN_CPU_CAPABILITY -u MKL_ENABLE_INSTRUCTIONS -u ONEDNN_MAX_CPU_ISA ./scripts/test.sh -p no:cacheprovider "${tests[@]}"
  fi
  status[$pass]=$?
done
echo "cpu_kernels: default kernels exit ${status[default]}, capped kernels exit ${status[capped]}"
[ "${status[default]}" -eq 0 ] && [ "${status[capped]}" -eq 0 ]
