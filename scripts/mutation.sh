#!/usr/bin/env bash
# Mutation testing (mutmut, configured in pyproject.toml's [tool.mutmut]) of the modules whose rules a
# one-line slip would bend without a crash, each against the fast tests that cover it. Outside CI:
# minutes per module. Each module runs in its own scratch copy of the tree (mutmut writes mutants/
# beside the code), and the table at the end gives killed / survived per module; the survivors of
# each are listed in OUT/<module>.survived (`mutmut show NAME` in OUT/<module>/ prints the change).
#   ./scripts/mutation.sh                              # every module of the table below
#   ./scripts/mutation.sh engine/parity/noise.py       # chosen modules (must be in the table)
#   MUTATION_INTEGRATION=1 ./scripts/mutation.sh models/common/moe.py   # then each survivor against INTEGRATION's tests
# A survivor of code that runs only in forked ranks (expert parallel's dispatch, tensor-parallel loss, Muon's gathers)
# is out of reach of the in-process tests mutmut maps; with MUTATION_INTEGRATION=1 each survivor of a module that has an
# INTEGRATION row is applied to the scratch tree (mutmut apply) and that row's multi-process tests run against it:
# killed ones are counted, the rest listed in OUT/<module>.integration-survived. Minutes per survivor.
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
# the one-process tests of two integration files, named once for the rows that share them
FUSED_LOSS_FAST="tests/integration/test_fused_loss.py::test_bf16_matches_unfused_to_bf16_rounding
  tests/integration/test_fused_loss.py::test_evaluation_computes_no_gradients
  tests/integration/test_fused_loss.py::test_fused_equals_unfused_loss_and_gradients
  tests/integration/test_fused_loss.py::test_refuses_a_chunk_size_below_one
  tests/integration/test_fused_loss.py::test_split_backward_inputs_then_weights
  tests/integration/test_fused_loss.py::test_tied_embeddings_get_both_gradients
  tests/integration/test_fused_loss.py::test_vocab_parallel_equals_one_process
  tests/integration/test_fused_loss.py::test_z_loss_fused_equals_unfused_in_value_and_gradients"
MUON_FAST="tests/integration/test_muon.py::test_a_bad_or_unmatched_rule_is_refused_in_one_line
  tests/integration/test_muon.py::test_bad_muon_and_z_loss_settings_are_refused_in_one_line
  tests/integration/test_muon.py::test_lr_multiplier_is_seen_in_the_applied_update
  tests/integration/test_muon.py::test_muon_step_is_torch_muon_plus_adamw_bitwise
  tests/integration/test_muon.py::test_param_group_rules_take_counts_and_log_them_once
  tests/integration/test_muon.py::test_planner_counts_muon_gathers_and_broadcasts_per_mesh_dim
  tests/integration/test_muon.py::test_planner_optimizer_bytes_are_the_real_state
  tests/integration/test_muon.py::test_the_docs_parameter_group_example_passes_the_preflight_as_written
  tests/integration/test_muon.py::test_unmatched_rule_is_refused_by_the_preflight_and_the_config"
# module -> the fast tests that cover it (pytest arguments): tests/unit files, and the one-process tests of a
# tests/integration file by node id (its multi-process ones would run for every mutant)
declare -A TESTS=(
  [engine/parity/noise.py]="tests/unit/test_noise_floor.py"
  [engine/parity/compare.py]="tests/unit/test_parity_compare.py tests/unit/test_noise_floor.py
    tests/integration/test_parity.py::test_a_non_finite_logged_value_reads_as_nan_and_fails
    tests/integration/test_parity.py::test_a_step_1_difference_of_5e_5_fails_both_comparators
    tests/integration/test_parity.py::test_auto_layouts_fit_the_budget_and_cover_every_parallelism
    tests/integration/test_parity.py::test_bad_input_is_one_line
    tests/integration/test_parity.py::test_bad_layout_names_are_refused_in_one_line
    tests/integration/test_parity.py::test_float64_mode_refuses_what_it_cannot_do
    tests/integration/test_parity.py::test_history_differences_name_the_first_step_over_tolerance
    tests/integration/test_parity.py::test_layout_names_give_the_degrees
    tests/integration/test_parity.py::test_parameter_differences_and_clipping"
  [engine/train/loss.py]="tests/unit/test_deepseek_v3_mtp.py tests/unit/test_loss_rules.py $FUSED_LOSS_FAST"
  [models/common/linear_cross_entropy.py]="tests/unit/test_fused_loss_rules.py $FUSED_LOSS_FAST"
  [models/common/rope.py]="tests/unit/test_rope_rules.py tests/unit/test_model.py
    tests/integration/test_long_context.py::test_past_max_seq_len_is_planned_with_one_warning_and_recorded"
  [models/deepseek_v3/yarn.py]="tests/unit/test_rope_rules.py tests/unit/test_deepseek_v3.py"
  [models/common/moe.py]="tests/unit/test_moe_routing_rules.py tests/unit/test_moe.py"
  [engine/config/param_groups.py]="tests/unit/test_optimizer.py tests/unit/test_param_groups_rules.py $MUON_FAST"
  [engine/train/muon.py]="tests/unit/test_muon_rules.py $MUON_FAST"
  [engine/observe/goodput.py]="tests/unit/test_goodput_rules.py tests/unit/test_recovery_units.py
    tests/unit/test_published_hparams.py::test_goodput_ledger_over_three_attempts_equals_a_hand_count"
  [engine/observe/hang.py]="tests/unit/test_hang_rules.py tests/unit/test_recovery_units.py"
  [engine/launch/failures.py]="tests/unit/test_failure_rules.py tests/unit/test_recovery_units.py"
  [engine/launch/launcher.py]="tests/unit/test_launcher_rules.py tests/unit/test_launcher_launch_rules.py
    tests/unit/test_recovery_units.py"
  [engine/launch/environment.py]="tests/unit/test_launcher_rules.py tests/unit/test_launcher_launch_rules.py
    tests/unit/test_recovery_units.py"
  [engine/launch/replica_groups.py]="tests/unit/test_replica_groups_rules.py"
  [engine/train/downstream.py]="tests/unit/test_downstream_rules.py
    tests/integration/test_downstream.py::test_evaluation_time_is_evaluation_in_the_ledger_not_step_time
    tests/integration/test_downstream.py::test_windows_are_left_truncated_as_lm_eval_does"
  # (test_wandb.py's launches run ./run_train.sh, which in mutmut's copy of the tree sets up a .venv without
  # mutmut, where the mutated module cannot be imported: only its in-process tests)
  [engine/observe/sinks.py]="tests/unit/test_sinks_rules.py
    tests/integration/test_wandb.py::test_the_job_run_id_is_the_checkpoints_else_the_run_folders_else_a_fresh_one
    tests/integration/test_wandb.py::test_the_sink_rewinds_only_a_run_it_wrote_and_continues_where_the_server_refuses
    tests/integration/test_wandb.py::test_the_preflight_refuses_wandb_only_without_credentials"
)
# module -> the multi-process tests its survivors are run against with MUTATION_INTEGRATION=1 (no ./run_train.sh
# launches: in the scratch tree they would set up a .venv of their own)
declare -A INTEGRATION=(
  [models/common/moe.py]="tests/integration/test_expert_parallel.py"
  [models/common/linear_cross_entropy.py]="tests/integration/test_tensor_parallel.py"
  [engine/train/muon.py]="tests/integration/test_muon_parallel.py"
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
                 f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"])
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
  if [ "${MUTATION_INTEGRATION:-0}" = 1 ] && [ -n "${INTEGRATION[$module]:-}" ]; then
    # each survivor applied to the scratch tree's copy of the module, then the multi-process tests; the copy restored
    mapfile -t survivors < <(awk -F': ' '$2 == "survived" {gsub(/ /, "", $1); print $1}' "$out/$name.survived")
    cp "$work/$module" "$work/$module.unmutated"
    left=()
    # the control: on the unmutated tree the tests must pass, or every survivor would count as killed
    if ! (cd "$work" && OMP_NUM_THREADS=1 "$QUADRA_PYTHON" -m pytest -x -q -p no:cacheprovider ${INTEGRATION[$module]} \
          >"$work/integration-control.log" 2>&1); then
      echo "mutation: ${INTEGRATION[$module]} fails on the unmutated tree ($work/integration-control.log)" >&2; exit 1
    fi
    for mutant in "${survivors[@]}"; do
      (cd "$work" && "$mutmut" apply "$mutant" >/dev/null 2>&1)
      if (cd "$work" && OMP_NUM_THREADS=1 "$QUADRA_PYTHON" -m pytest -x -q -p no:cacheprovider ${INTEGRATION[$module]} \
          >"$work/integration.log" 2>&1); then
        left+=("$mutant")
      fi
      cp "$work/$module.unmutated" "$work/$module"
    done
    printf '%s\n' ${left[@]+"${left[@]}"} >"$out/$name.integration-survived"
    echo "=== $module: ${#survivors[@]} survivors against ${INTEGRATION[$module]}:" \
         "$(( ${#survivors[@]} - ${#left[@]} )) killed, ${#left[@]} left ($out/$name.integration-survived)"
  fi
  rows+=("$module $stats $(( $(date +%s) - start ))")
done
printf '\n%-34s %7s %9s %6s %6s %6s\n' module killed survived total other seconds
for row in "${rows[@]}"; do printf '%-34s %7s %9s %6s %6s %6s\n' $row; done
echo "survivors (one per line; \`mutmut show NAME\` in the module's folder prints the change):"
for module in "${modules[@]}"; do name=${module//\//.}; echo "  $out/${name%.py}.survived"; done
