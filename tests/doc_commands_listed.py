"""The markdown pages' shell commands that tests/integration/test_doc_commands.py does not run, each with the reason it
cannot run as written on a 2-core CPU in under a minute and, where one exists, the test that runs the same
thing shorter. Keys are tests/doc_blocks.py's ``command_key`` (comments dropped, lines joined). Times
marked "here" were measured on the 2-core CPU this table was written on, shared with other jobs.
"""

from __future__ import annotations

# The kinds of reason a listed command may have.
REASONS = {
    "gpu": "needs GPUs",
    "nodes": "needs several machines",
    "network": "downloads from the Hugging Face hub",
    "user": "reads the user's own files (a checkpoint, a run, a config, a task) that the repo does not have",
    "trains": "trains for minutes here; the named test runs the same flags shorter",
    "minutes": "a script or benchmark that takes over a minute",
    "after": "needs the output of a command listed here",
    "suite": "runs the test suite",
}

_100_STEPS = "100 steps of the debug model (its config's; 3 to 4 minutes on 2 CPU processes, README)"
_CP_TEST = "tests/integration/test_context_parallel.py::test_context_parallel_parity_with_one_process"
_PP_TEST = "tests/integration/test_pipeline.py::test_pipeline_parity_with_one_process"
_DSV3 = "CONFIG_FILE=train_configs/debug_deepseek_v3.toml"
_DEFECTS = ("tp_unreduced:layers.0.attention.wo,cp_rope_offset:layers.1.attention,ep_drop:layers.2.feed_forward."
            "experts,dp_grad_scale:layers.1.attention.wq.weight")
_TINY_PARITY = ("--model.flavor debugmodel_tiny --job.device cpu --data.path assets/data/shakespeare/validation.jsonl "
                "--training.seq_len 32 --training.local_batch_size 8 --training.global_batch_size 8 "
                "--training.max_norm 0.65 --optimizer.lr 0.03 --optimizer.eps 1e-4 --lr_scheduler.warmup_steps 2")
_CTX = "CONFIG_FILE=train_configs/debug_model.toml NGPU=1 ./run_train.sh "
_CTX_TEST = "tests/integration/test_long_context.py::test_context_extension_resumes_weights_and_optimizer_at_twice_the_length"
_HF_TEST = "tests/integration/test_hf_interop.py::test_converted_checkpoint_trains_under_fsdp_and_tp_and_exports"
_F8 = "PYTHONPATH=. python scripts/benchmarks/float8_loss.py --steps 100 --out /tmp/f8loss "
_F8_RUN = ("trains", "100 steps of the float8 benchmark's model (float8 casts are slow on a CPU): minutes; "
           "shorter: tests/integration/test_float8.py::test_one_process_equals_a_plain_torchao_loop")


def _seed(name: str, path: str, *extra: str) -> str:
    """engine/docs/hugging-face.md's continue-pretraining command from an imported checkpoint under outputs/<path>."""
    return " ".join([f"./run_train.sh --checkpoint.initial_load_path outputs/{path}/seed --model.args_path "
                     f"outputs/{path}/seed", *([f"--model.name {name}"] if name else []),
                     f"--model.tokenizer_path outputs/{path}/seed/tokenizer.json --job.dump_folder outputs/{path}/run",
                     *extra])


LISTED: dict[str, tuple[str, str]] = {
    "./run_train.sh": ("trains", _100_STEPS + "; shorter: tests/integration/test_run_train.py::test_debug_model_trains_and_logs"),
    "./scripts/test.sh": ("suite", "the whole suite, this file included: about 15 minutes on 2 cores"),
    "./run_train.sh --training.steps 20 --optimizer.lr 1e-3": (
        "trains", "20 steps and a validation on 2 processes: 99 s here; shorter: "
                  "tests/integration/test_run_train.py::test_debug_model_trains_and_logs"),
    "NGPU=4 ./run_train.sh --parallelism.dp_shard 2 --parallelism.dp_replicate 2": (
        "trains", _100_STEPS + " on 4 processes; shorter (hsdp2x2): "
                  "tests/integration/test_data_parallel.py::test_parity_with_one_process"),
    "NGPU=4 ./run_train.sh --parallelism.tp 2 --parallelism.dp_shard 2": (
        "trains", _100_STEPS + " on 4 processes; shorter: tests/integration/test_tensor_parallel.py::test_parity_with_one_process"),
    "NGPU=2 ./run_train.sh --parallelism.pp 2 --parallelism.pp_schedule GPipe": (
        "trains", _100_STEPS + "; shorter: " + _PP_TEST),
    "NGPU=2 ./run_train.sh --parallelism.cp 2": (
        "trains", _100_STEPS + "; shorter: " + _CP_TEST),
    "NGPU=8 ./run_train.sh --parallelism.pp 2 --parallelism.tp 2 --parallelism.dp_shard 2": (
        "trains", _100_STEPS + " on 8 processes; shorter: " + _PP_TEST),
    "NGPU=16 ./run_train.sh --parallelism.pp 2 --parallelism.dp_shard 2 --parallelism.cp 2 --parallelism.tp 2": (
        "trains", _100_STEPS + " on 16 processes; shorter (4-D): " + _CP_TEST),
    "NGPU=1 ./run_train.sh --parallelism.dp_shard 1": (
        "trains", _100_STEPS + " on one; shorter: "
                  "tests/integration/test_reference_loop.py::test_engine_equals_a_plain_pytorch_loop"),
    "CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh": ("gpu", "Llama 3 8B on 8 GPUs"),
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NGPU=8 ./run_train.sh": (
        "nodes", "node0 of two 8-GPU nodes; two nodes on one machine: "
                 "tests/integration/test_launch.py::test_two_nodes_on_one_machine_train_like_one_node"),
    "NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 NGPU=8 ./run_train.sh": (
        "nodes", "node1 of two 8-GPU nodes; tests/integration/test_launch.py::test_two_nodes_on_one_machine_train_like_one_node"),
    "scripts/stress.sh -n 20 -t 1800 -- bash -c 'CONFIG_FILE=train_configs/debug_moe.toml ./run_train.sh "
    "--job.dump_folder /tmp/stress/$STRESS_RUN --training.steps 10 --parallelism.dp_replicate 1 --parallelism.tp 2'": (
        "minutes", "20 runs of a 10-step tp2 training under glibc's heap checks, for up to 1800 s"),
    "grep -E '\"kind\": \"(attempt|goodput)\"' /tmp/rec/run/metrics.jsonl": (
        "after", "reads the ledger of engine/docs/metrics.md's 12-step restart run in /tmp/rec/run, described but not given; "
                 "the ledger: tests/integration/test_recovery.py::test_a_killed_rank_then_a_hang_are_restarted_and_the_run_ends_"
                 "as_if_never_stopped"),
    "NGPU=2 MAX_RESTARTS=1 QUADRA_TEST_FAULT=kill:0:4:1,rejoin:0:8:0 ./run_train.sh --model.flavor debugmodel_tiny "
    "--training.steps 12 --metrics.log_freq 1 --validation.enable false --fault_tolerance.enable true "
    "--fault_tolerance.group_size 2": (
        "trains", "12 steps in 2 torchft groups with a kill and a restart: 47 s of wall in engine/docs/fault-tolerance.md's run, past "
                  "this file's budget; tests/integration/test_fault_tolerance.py::test_a_killed_group_heals_from_the_live_one_"
                  "which_never_stops"),
    "PYTHONPATH=. python scripts/benchmarks/muon_lr.py --out /tmp/muon_lr": (
        "minutes", "7 runs of 100 steps; the defaults it measured: tests/unit/test_muon_lr.py::test_the_measured_defaults"),
    "PYTHONPATH=. python scripts/benchmarks/muon_lr.py --out /tmp/muon_lr --report": (
        "after", "reports the 7 runs of the line above"),
    "PYTHONPATH=. python scripts/benchmarks/muon_lr.py --flavor debugmodel --seq-len 256 --steps 60 "
    "--runs \"AdamW 8e-4,Muon 2e-2\" --out /tmp/muon_lr_dm": (
        "minutes", "2 runs of 60 steps of the debug model in one process"),
    "./run_train.sh --data.path outputs/data/shakespeare --job.dump_folder outputs/prepared_run": (
        "trains", _100_STEPS + "; shorter, on a prepared folder: "
                  "tests/integration/test_data_prepared.py::test_exact_resume_under_fsdp2_and_after_a_dp_change"),
    "./scripts/prepare_data.py HuggingFaceFW/fineweb-edu outputs/data/fineweb --split train "
    "--tokenizer path/to/tokenizer.json --num_proc 16": ("network", "FineWeb-Edu from the hub, and a user's tokenizer"),
    "./run_train.sh --document_mask.enable true --training.steps 20 --job.dump_folder outputs/document_mask": (
        "trains", "20 steps and a validation on 2 processes, as the 20-step line of engine/docs/running.md (99 s here); shorter: "
                  "tests/integration/test_document_mask_parity.py::test_document_mask_parity_with_one_process"),
    _DSV3 + " NGPU=4 ./run_train.sh --parallelism.ep 2 --parallelism.tp 2": (
        "trains", "100 steps of the DeepSeek-V3 debug model on 4 processes; shorter: "
                  "tests/integration/test_deepseek_v3_parallel.py::test_deepseek_v3_fp64_parity_with_one_process"),
    "WANDB_MODE=offline ./run_train.sh --job.dump_folder outputs/debug_eval --eval.enable true "
    "--eval.tasks outputs/eval/shakespeare_cloze.jsonl --eval.freq 50 --metrics.enable_wandb true": (
        "trains", "100 steps and two evaluations of 200 questions: 1293 s in engine/docs/evaluation.md's run; shorter: "
                  "tests/integration/test_downstream.py::test_a_layout_scores_like_one_process"),
    "python scripts/eval_task.py --include_path my_tasks --task my_arc --output outputs/eval/my_arc.jsonl": (
        "user", "the user's task yaml and ARC-Easy file (not bundled); the conversion: tests/integration/test_lm_eval_oracle.py::"
                "test_lm_eval_scores_the_exported_checkpoint_like_the_in_loop_evaluation"),
    "./run_train.sh --training.steps 20 --step_health.on_nonfinite skip --step_health.loss_spike_sigma 6 "
    "--step_health.grad_norm_spike_sigma 6": (
        "trains", "20 steps and a validation on 2 processes, as the 20-step line of engine/docs/running.md (99 s here); shorter: "
                  "tests/unit/test_step_health.py::test_skip_records_reach_metrics_jsonl_and_tensorboard"),
    "./scripts/parity.py --replay outputs/my_run --step 3 --layouts fsdp2": (
        "user", "replays the user's run outputs/my_run; tests/integration/test_parity.py::test_replay_resumes_the_newest_"
                "checkpoint_before_the_step"),
    _F8 + "--only float32": _F8_RUN,
    _F8 + "--only \"float8 tensorwise\"": _F8_RUN,
    _F8 + "--only \"float8 rowwise\"": _F8_RUN,
    _F8 + "--report": ("after", "reports the three float8_loss.py runs above"),
    _CTX + "--training.steps 10 --job.dump_folder outputs/ctx_short --validation.enable false": (
        "trains", f"10 steps of the debug model, 39 s here; shorter: {_CTX_TEST}"),
    _CTX + "--training.seq_len 512 --training.steps 10 --job.dump_folder outputs/ctx_long --validation.enable false "
    "--checkpoint.initial_load_path outputs/ctx_short/checkpoint/step-10 --checkpoint.initial_load_model_only false "
    "--checkpoint.initial_load_lr restart": (
        "trains", f"10 steps at seq_len 512 from the line above's checkpoint, 126 s here; shorter: {_CTX_TEST}"),
    "python scripts/convert_checkpoint.py to-torch outputs/debug_model/checkpoint/step-100 model.pt": (
        "after", "the quick start's step-100 checkpoint (3 to 4 minutes); the commands: "
                 "tests/unit/test_checkpoint_tools.py::test_command_line_scripts"),
    "python scripts/convert_checkpoint.py from-torch model.pt weights_dcp": (
        "after", "model.pt of the line above; tests/unit/test_checkpoint_tools.py::test_command_line_scripts"),
    "python scripts/convert_checkpoint.py from-hf path/to/Llama-3.2-1B outputs/llama32/seed": (
        "user", "the user's Llama-3.2-1B download; tests/integration/test_hf_interop.py::test_command_line"),
    _seed("", "llama32"): ("after", f"the import above, then 1000 steps of a 1B model; {_HF_TEST}"),
    "python scripts/convert_checkpoint.py to-hf outputs/llama32/run/checkpoint/step-1000 hf_out": (
        "after", f"step 1000 of the run above; {_HF_TEST}"),
    "python scripts/convert_checkpoint.py from-hf path/to/Qwen3-0.6B outputs/qwen3/seed": (
        "user", "the user's Qwen3-0.6B download; "
                "tests/unit/test_qwen3_convert.py::test_from_hf_then_to_hf_is_bitwise_and_gives_transformers_logits"),
    _seed("qwen3", "qwen3"): ("after", f"the import above, then a 0.6B model's training; {_HF_TEST}"),
    "python scripts/convert_checkpoint.py from-hf path/to/Qwen3-30B-A3B outputs/qwen3moe/seed": (
        "user", "the user's Qwen3-30B-A3B download; "
                "tests/unit/test_qwen3_convert.py::test_from_hf_then_to_hf_is_bitwise_and_gives_transformers_logits"),
    _seed("qwen3_moe", "qwen3moe", "--parallelism.ep 8"): ("gpu", "a 30B MoE under ep 8: 8 GPUs"),
    "python scripts/convert_checkpoint.py to-hf outputs/qwen3/run/checkpoint/step-1000 qwen3_out --dtype bfloat16": (
        "after", "step 1000 of the Qwen3 run above; "
                 "tests/unit/test_qwen3_convert.py::test_from_hf_then_to_hf_is_bitwise_and_gives_transformers_logits"),
    "python scripts/convert_checkpoint.py from-hf path/to/Moonlight-16B-A3B outputs/dsv3/seed": (
        "user", "the user's Moonlight-16B-A3B download; tests/integration/test_deepseek_v3_hf_training.py::"
                "test_converted_deepseek_v3_trains_under_ep_tp_and_ep_x_fsdp_and_exports"),
    _seed("deepseek_v3", "dsv3", "--parallelism.ep 8"): ("gpu", "a 16B MoE under ep 8: 8 GPUs"),
    "python scripts/convert_checkpoint.py to-hf outputs/dsv3/run/checkpoint/step-1000 dsv3_out --dtype bfloat16": (
        "after", "step 1000 of the DeepSeek-V3 run above; tests/integration/test_deepseek_v3_hf_training.py::"
                 "test_converted_deepseek_v3_trains_under_ep_tp_and_ep_x_fsdp_and_exports"),
    "./scripts/parity.py": (
        "minutes", "27 layouts, 29 runs of 5 steps: 1200 s in engine/docs/parity.md's run; "
                   "tests/integration/test_parity.py::test_parity_sweep_passes_and_reports"),
    "./scripts/parity.py --config my.toml --layouts \"fsdp2,tp2,pp2:1F1B,cp2,tp2xpp2\" --steps 5": (
        "user", "the user's my.toml; tests/integration/test_parity.py::test_parity_sweep_passes_and_reports"),
    "./scripts/parity.py --precision fp64 --json parity.json": (
        "minutes", "27 layouts of the debug model in float64 (the tiny model's took 1967 s); "
                   "tests/integration/test_parity.py::test_float64_sweep_matches_to_1e12"),
    "./scripts/parity.py --layouts tp2,cp2 --locate": (
        "minutes", "a 25 s reference (idle machine, engine/docs/parity.md) and 2 layouts of the debug model, each recorded again; "
                   "tests/integration/test_parity_locate.py::test_locate_names_the_module_of_a_defect_in_one_layout"),
    "./scripts/parity.py --layouts fsdp2,tp2,fsdp2xtp2 --float8.enable true": (
        "minutes", "the reference, its twins and 3 float8 layouts: 69 + 87 + 85 s of layouts in engine/docs/parity.md's run; "
                   "tests/integration/test_parity_noise.py::test_float8_layout_passes_against_the_noise_floor"),
    "./scripts/parity.py --precision fp64 " + _TINY_PARITY: (
        "minutes", "27 layouts in float64: 1967 s in engine/docs/parity.md's run; "
                   "tests/integration/test_parity.py::test_float64_sweep_matches_to_1e12"),
    f"PYTHONPATH=tests/parity_defects QUADRA_TEST_DEFECT={_DEFECTS} ./scripts/parity.py --locate --layouts "
    "tp2,cp2,ep2,fsdp2 --steps 1 --keep_max_norm --model.name moe " + _TINY_PARITY: (
        "minutes", "a reference and 4 layouts, each located: 54 s in engine/docs/parity.md's run, more on a busy machine (this "
                   "file's budget is 90 s); tests/integration/test_parity_locate.py::test_locate_names_the_module_of_a_defect_in_"
                   "one_layout"),
}

# TOML blocks another test loads as written, by their sorted dotted keys.
TOML_ELSEWHERE = {
    "optimizer.name optimizer.param_groups": (
        "tests/integration/test_muon.py::test_the_docs_parameter_group_example_passes_the_preflight_as_written runs the "
        "pre-flight on it (every rule must match a parameter of debug_moe.toml)"),
}
