#!/usr/bin/env bash
# Mutation testing (mutmut, configured in pyproject.toml's [tool.mutmut]) of the modules whose rules a
# one-line slip would bend without a crash, each against the fast tests that cover it. Outside CI:
# minutes per module. Each module runs in its own scratch copy of the tree (mutmut writes mutants/
# beside the code), and the table at the end gives killed / survived per module; the survivors of
# each are listed in OUT/<module>.survived (`mutmut show NAME` in OUT/<module>/ prints the change).
#   ./scripts/mutation.sh                              # every module of the table below
#   ./scripts/mutation.sh engine/parity/noise.py       # chosen modules (must be in the table)
# OUT: $MUTATION_OUT or /tmp/quadra-mutation. Needs mutmut (installed into the project's Python when
# missing, as a mutation tool made for this; not a runtime or CI dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
root=$(pwd)
out=${MUTATION_OUT:-/tmp/quadra-mutation}
mkdir -p "$out"
"$QUADRA_PYTHON" -c "import mutmut" 2>/dev/null || "$QUADRA_PYTHON" -m pip install -q "mutmut>=3.3"
mutmut=$(dirname "$QUADRA_PYTHON")/mutmut
# module -> the fast tests that cover it (pytest arguments; "-m not slow" is added)
declare -A TESTS=(
  [engine/parity/noise.py]="tests/test_noise_floor.py"
  [engine/parity/compare.py]="tests/test_parity_compare.py tests/test_parity.py tests/test_noise_floor.py"
  [engine/train/loss.py]="tests/test_fused_loss.py tests/test_deepseek_v3_mtp.py tests/test_loss_rules.py"
  [models/common/linear_cross_entropy.py]="tests/test_fused_loss.py tests/test_fused_loss_rules.py"
  [models/common/rope.py]="tests/test_rope_rules.py tests/test_model.py tests/test_long_context.py"
  [models/deepseek_v3/yarn.py]="tests/test_rope_rules.py tests/test_deepseek_v3.py"
  [models/common/moe.py]="tests/test_moe_routing_rules.py tests/test_moe.py"
  [engine/config/param_groups.py]="tests/test_muon.py tests/test_optimizer.py tests/test_param_groups_rules.py"
  [engine/train/muon.py]="tests/test_muon_rules.py tests/test_muon.py"
  [engine/observe/goodput.py]="tests/test_goodput_rules.py tests/test_recovery_units.py
    tests/test_published_hparams.py::test_goodput_ledger_over_three_attempts_equals_a_hand_count"
  [engine/observe/hang.py]="tests/test_hang_rules.py tests/test_recovery_units.py"
  [engine/launch/failures.py]="tests/test_failure_rules.py tests/test_recovery_units.py tests/test_launch.py"
  [engine/launch/launcher.py]="tests/test_launcher_rules.py tests/test_launcher_launch_rules.py
    tests/test_recovery_units.py tests/test_launch.py"
  [engine/launch/environment.py]="tests/test_launcher_rules.py tests/test_launcher_launch_rules.py
    tests/test_recovery_units.py tests/test_launch.py"
  [engine/launch/replica_groups.py]="tests/test_replica_groups_rules.py tests/test_fault_tolerance.py"
  [engine/train/downstream.py]="tests/test_downstream_rules.py tests/test_downstream.py"
  # (test_wandb.py's launches run ./run_train.sh, which in mutmut's copy of the tree sets up a .venv without
  # mutmut, where the mutated module cannot be imported: only its in-process tests)
  [engine/observe/sinks.py]="tests/test_sinks_rules.py
    tests/test_wandb.py::test_the_job_run_id_is_the_checkpoints_else_the_run_folders_else_a_fresh_one
    tests/test_wandb.py::test_the_sink_rewinds_only_a_run_it_wrote_and_continues_where_the_server_refuses
    tests/test_wandb.py::test_the_preflight_refuses_wandb_only_without_credentials"
)
modules=("$@")
if [ ${#modules[@]} -eq 0 ]; then
  mapfile -t modules < <(printf '%s\n' "${!TESTS[@]}" | sort)
fi
rows=()
for module in "${modules[@]}"; do
  if [ -z "${TESTS[$module]:-}" ]; then
    echo "mutation: $module is not in scripts/mutation.sh's table (one of: ${!TESTS[*]})" >&2; exit 2
  fi
  name=${module//\//.}; name=${name%.py}
  work="$out/$name"
  rm -rf "$work"; mkdir -p "$work"
  # the tree as git sees it (tracked and untracked-not-ignored files), not .venv or outputs
  git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$work"
  "$QUADRA_PYTHON" - "$work/pyproject.toml" "$module" ${TESTS[$module]} <<'PY'
import json, sys
path, module, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
text = open(path).read()
lines = "".join([f"only_mutate = {json.dumps([module])}\n",
                 f"pytest_add_cli_args_test_selection = {json.dumps(tests + ['-m', 'not slow'])}\n"])
if "[tool.mutmut]\n" not in text:
    sys.exit("mutation: pyproject.toml has no [tool.mutmut] table")
open(path, "w").write(text.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + lines, 1))  # inside the table
PY
  echo "=== $module: ${TESTS[$module]} ==="
  start=$(date +%s)
  # QUADRA_TEST_TIMEOUT=0: tests/conftest.py's watchdog needs a real stderr, which mutmut captures
  (cd "$work" && QUADRA_TEST_TIMEOUT=0 OMP_NUM_THREADS=1 "$mutmut" run --max-children 2 >"$work/run.log" 2>&1) || true
  (cd "$work" && "$mutmut" export-cicd-stats >/dev/null 2>&1 && "$mutmut" results >"$out/$name.survived" 2>&1) || true
  stats=$("$QUADRA_PYTHON" -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['killed'], s['survived'], s['total'], s['no_tests'] + s['timeout'] + s['suspicious'] + s['segfault'])" \
          "$work/mutants/mutmut-cicd-stats.json" 2>/dev/null || echo "? ? ? ?")
  rows+=("$module $stats $(( $(date +%s) - start ))")
done
printf '\n%-34s %7s %9s %6s %6s %6s\n' module killed survived total other seconds
for row in "${rows[@]}"; do printf '%-34s %7s %9s %6s %6s %6s\n' $row; done
echo "survivors (one per line; \`mutmut show NAME\` in the module's folder prints the change):"
for module in "${modules[@]}"; do name=${module//\//.}; echo "  $out/${name%.py}.survived"; done
