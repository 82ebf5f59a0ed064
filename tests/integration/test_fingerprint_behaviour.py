"""The classes of engine/config/fingerprint.py, checked by what each key does to a short run.

Every key of ``KEY_CLASS`` gets the check of the class it is in *now*, so moving a key to another
class fails here (tests/training_utils.py's tiny model, 3 steps, tests/fingerprint_runs.py):

- ``convergence``: another value trains another model: the losses or grad norms of the common
  steps, or the final parameters, differ beyond the float32 tolerance of engine/parity/compare.py
  (or, for a key of the data, the tokens of the first steps differ, shown by the loader alone);
- ``numerics``: another value changes only the rounding: within the float32 tolerance, not bitwise;
- ``execution``: another value is the same run: bitwise equal (losses, grad norms, parameters), or,
  for the layouts of :data:`LAYOUT` (they sum the same terms in another order), equal within 1e-12
  in the float64 reference mode. The execution keys of one family change together in one run: the
  run proves the family neutral, which is what the class claims; when it differs, each key is run
  alone to name the culprit.

A key that no run can exercise here is in :data:`UNEXERCISED` with the reason and the class the
reason was written for: moving it, or adding a key with neither a :data:`SPECS` entry nor a reason,
fails :func:`test_every_key_is_checked_or_has_a_reason`.

Execution and numerics are told apart by purpose, not always by behaviour: a layout (microbatches,
parallel degrees) and a kernel (the fused loss, foreach Adam) both move float32 runs within the
tolerance and both agree in float64. :data:`LAYOUT` records which keys are layouts; a numerics key
moved to execution fails because its float32 run is not bitwise, a layout moved to numerics because
it is listed there.
"""

from __future__ import annotations

import json
import os

import pytest

from engine.config.fingerprint import CONVERGENCE, EXECUTION, KEY_CLASS, NUMERICS
from tests.fingerprint_runs import (FILES_FOLDER, RUN_FOLDER, SOURCE_FOLDER, Lab, Spec, changed_run, files_folder,
                                    group_runs, reference_run)
from tests.training_utils import LR, REPO, SMALL_CORPUS

pytestmark = pytest.mark.usefixtures("private_datasets_cache")

F = FILES_FOLDER
# dp 2 x 2 sequences x 2 microbatches = the global batch of 8
FSDP = {"parallelism.dp_shard": 2, "training.local_batch_size": 2}
TP, CP, PP = {"parallelism.tp": 2}, {"parallelism.cp": 2}, {"parallelism.pp": 2}
CKPT = {"checkpoint.enable": True}
FLOAT64 = {"training.mixed_precision_param": "float64", "training.mixed_precision_reduce": "float64"}
SPIKE_WINDOW = {"step_health.window": 2}  # spikes are judged from step 3 on (2 accepted steps)

MUON = {"optimizer.name": "Muon"}  # the context the Muon keys act in
EVAL = {"eval.enable": True, "eval.tasks": [f"t={F}/task.jsonl"], "eval.freq": 2, "eval.limit": 2}
SPECS: dict[str, Spec] = {
    # convergence: the model
    "model.name": Spec({"model.name": "moe"}),
    "model.flavor": Spec({"model.flavor": "debugmodel"}),
    "model.args_path": Spec({"model.args_path": f"{F}/two_layers.json"}),
    "model.tokenizer_path": Spec({"model.tokenizer_path": f"{F}/tokenizer.json"}, loader=True),
    "model.vocab_size": Spec({"model.vocab_size": 4608}),
    "model.tie_embeddings": Spec({"model.tie_embeddings": True}),
    # convergence: the data and the tokens per step
    "data.path": Spec({"data.path": f"{F}/other.jsonl"}, loader=True),
    "data.text_column": Spec({"data.text_column": "other"}, {"data.path": f"{F}/two_columns.jsonl"}, loader=True),
    "data.streaming": Spec({"data.streaming": True}, loader=True),
    "data.shuffle": Spec({"data.shuffle": False}, loader=True),
    "data.mixture": Spec({"data.mixture": [f"{F}/set_a:0.5", f"{F}/set_b:0.5"]}, loader=True),
    "training.global_batch_size": Spec({"training.global_batch_size": 4}, {"training.local_batch_size": 4},
                                       loader=True),
    "training.seq_len": Spec({"training.seq_len": 8}, loader=True),
    "training.seed": Spec({"training.seed": 1}, loader=True),
    # convergence: the updates
    "training.steps": Spec({"training.steps": 6}),  # the same 3 steps trained, the decay over 6
    "training.max_norm": Spec({"training.max_norm": 0.5}),  # clips every step (norms 0.76-0.80)
    "optimizer.name": Spec({"optimizer.name": "Adam"}),
    "optimizer.lr": Spec({"optimizer.lr": 2 * LR}),
    "optimizer.beta1": Spec({"optimizer.beta1": 0.5}),
    "optimizer.beta2": Spec({"optimizer.beta2": 0.5}),
    "optimizer.eps": Spec({"optimizer.eps": 1e-6}),
    "optimizer.weight_decay": Spec({"optimizer.weight_decay": 0.0}),
    "optimizer.muon_lr": Spec({"optimizer.muon_lr": 2 * LR}, MUON),
    "optimizer.muon_momentum": Spec({"optimizer.muon_momentum": 0.5}, MUON),
    "optimizer.muon_nesterov": Spec({"optimizer.muon_nesterov": False}, MUON),
    "optimizer.muon_ns_steps": Spec({"optimizer.muon_ns_steps": 3}, MUON),
    "optimizer.muon_ns_coefficients": Spec({"optimizer.muon_ns_coefficients": "3.0,-3.0,1.0"}, MUON),
    "optimizer.muon_adjust_lr": Spec({"optimizer.muon_adjust_lr": "original"}, MUON),
    "optimizer.param_groups": Spec({"optimizer.param_groups": ["*norm* lr_mult=0.5"]}),
    "loss.z_loss_weight": Spec({"loss.z_loss_weight": 0.01}),
    "lr_scheduler.warmup_steps": Spec({"lr_scheduler.warmup_steps": 2}),
    "lr_scheduler.decay_type": Spec({"lr_scheduler.decay_type": "constant"}),
    "lr_scheduler.decay_ratio": Spec({"lr_scheduler.decay_ratio": 0.67}, {"lr_scheduler.decay_type": "wsd"}),
    "lr_scheduler.min_lr": Spec({"lr_scheduler.min_lr": 0.0}),
    "checkpoint.initial_load_path": Spec({"checkpoint.initial_load_path": f"{SOURCE_FOLDER}/checkpoint/step-2"},
                                         {**CKPT, "checkpoint.interval": 1}),
    "checkpoint.initial_load_model_only": Spec(
        {"checkpoint.initial_load_model_only": False},
        {**CKPT, "checkpoint.interval": 1, "checkpoint.initial_load_path": f"{SOURCE_FOLDER}/checkpoint/step-2"}),
    # a full load of step-2 that restarts the schedule at step 0, or reads from the first window
    "checkpoint.initial_load_lr": Spec(
        {"checkpoint.initial_load_lr": "restart"},
        {**CKPT, "checkpoint.interval": 1, "checkpoint.initial_load_path": f"{SOURCE_FOLDER}/checkpoint/step-2",
         "checkpoint.initial_load_model_only": False}),
    "checkpoint.initial_load_data": Spec(
        {"checkpoint.initial_load_data": "restart"},
        {**CKPT, "checkpoint.interval": 1, "checkpoint.initial_load_path": f"{SOURCE_FOLDER}/checkpoint/step-2",
         "checkpoint.initial_load_model_only": False}),
    "step_health.on_nonfinite": Spec({"step_health.on_nonfinite": "skip"}, inject={2: "nan_grad"}),
    "step_health.loss_spike_sigma": Spec({"step_health.loss_spike_sigma": 3.0}, SPIKE_WINDOW, inject={3: "loss_spike"}),
    "step_health.grad_norm_spike_sigma": Spec({"step_health.grad_norm_spike_sigma": 3.0}, SPIKE_WINDOW,
                                              inject={3: "grad_spike"}),
    "step_health.window": Spec({"step_health.window": 8}, {**SPIKE_WINDOW, "step_health.loss_spike_sigma": 3.0},
                               inject={3: "loss_spike"}),
    # documents of ~25 tokens: every window holds boundaries (the small corpus's run for thousands)
    "document_mask.enable": Spec({"document_mask.enable": True}, {"data.path": f"{F}/other.jsonl"}),
    "document_mask.restart_positions": Spec({"document_mask.restart_positions": True},
                                            {"data.path": f"{F}/other.jsonl"}),
    # the reference trains the same MTP modules at weight 0 (main loss only)
    "loss.mtp_weight": Spec({"loss.mtp_weight": 0.3}, {"model.name": "deepseek_v3", "model.flavor": "debugmodel_mtp"}),
    # numerics
    # float64 needs both keys (engine/config/validation.py); an fp32 run is within the fp32 tolerance of it.
    # bfloat16 is not checked: the parity tools define no bf16 tolerance, and on 2 processes a bf16
    # reduction keeps losses and grad norms within 1e-4 but moves parameters by 3e-2 at these lr and eps.
    "training.mixed_precision_param": Spec(FLOAT64),
    "training.mixed_precision_reduce": Spec(FLOAT64),
    "optimizer.implementation": Spec({"optimizer.implementation": "foreach"}),  # auto: fused on the CPU
    "loss.chunk_tokens": Spec({"loss.chunk_tokens": 0}),
    # the same step's sums over sequences in another order: the noise floor's perturbation (engine/parity/noise.py)
    "data.sequence_order_seed": Spec({"data.sequence_order_seed": 1}),
    # float32 against float64 Newton-Schulz: the default bfloat16 iteration rounds beyond the fp32
    # tolerance (engine/docs/optimizers.md), as bfloat16 mixed precision does.
    "optimizer.muon_ns_dtype": Spec({"optimizer.muon_ns_dtype": "float64"}, {**MUON, "optimizer.muon_ns_dtype": "float32"}),
    # execution, one process
    "job.config_file": Spec({"job.config_file": f"{F}/description.toml"}),
    "job.dump_folder": Spec({"job.dump_folder": f"{RUN_FOLDER}/elsewhere"}),
    "job.description": Spec({"job.description": "another description"}),
    "job.print_config": Spec({"job.print_config": True}),
    "validation.enable": Spec({"validation.enable": True}),
    "validation.path": Spec({"validation.enable": True, "validation.path": f"{F}/other.jsonl"}),
    "validation.freq": Spec({"validation.enable": True, "validation.freq": 1}),
    "validation.steps": Spec({"validation.enable": True, "validation.steps": 2}),
    # evaluating the tasks after steps changes no step (the model's train mode and RNG stay as they were)
    **{f"eval.{key}": Spec(EVAL) for key in ("enable", "tasks", "freq", "limit")},
    "training.local_batch_size": Spec({"training.local_batch_size": 4}),  # 2 microbatches per step
    "training.gc_freq": Spec({"training.gc_freq": 1}),
    "training.stop_after_step": Spec({"training.stop_after_step": 2}, family="stop"),
    "comm.init_timeout_seconds": Spec({"comm.init_timeout_seconds": 30}),  # one process: no collective
    "comm.hang_timeout_seconds": Spec({"comm.hang_timeout_seconds": 0}),  # the watchdog off
    "step_health.max_consecutive_skips": Spec({"step_health.max_consecutive_skips": 1}),
    "checkpoint.enable": Spec(CKPT),
    "checkpoint.folder": Spec({**CKPT, "checkpoint.folder": "elsewhere"}),
    "checkpoint.interval": Spec({**CKPT, "checkpoint.interval": 1}),
    "checkpoint.keep_latest_k": Spec({**CKPT, "checkpoint.interval": 1, "checkpoint.keep_latest_k": 1}),
    "checkpoint.async_mode": Spec({**CKPT, "checkpoint.async_mode": "async"}),
    # resumes step 2 of the checkpoint source (the default run with a checkpoint per step), trains step 3
    "checkpoint.load_step": Spec({**CKPT, "checkpoint.load_step": 2}, resume=3, family="resume"),
    "metrics.log_freq": Spec({"metrics.log_freq": 2}),
    "metrics.enable_tensorboard": Spec({"metrics.enable_tensorboard": True}),
    "metrics.save_tb_folder": Spec({"metrics.enable_tensorboard": True, "metrics.save_tb_folder": "tb2"}),
    "metrics.peak_tflops": Spec({"metrics.peak_tflops": 100.0}),
    "metrics.log_all_ranks": Spec({"metrics.log_all_ranks": True}),
    "metrics.time_attribution": Spec({"metrics.time_attribution": True}),
    "activation_checkpoint.mode": Spec({"activation_checkpoint.mode": "full"}),
    "activation_checkpoint.selective_ac_option": Spec({"activation_checkpoint.mode": "selective",
                                                       "activation_checkpoint.selective_ac_option": "2"},
                                                      family="selective"),
    "profiling.enable": Spec({"profiling.enable": True}),
    "profiling.start_step": Spec({"profiling.enable": True, "profiling.start_step": 2}),
    "profiling.num_steps": Spec({"profiling.enable": True, "profiling.num_steps": 2}),
    "profiling.traces_folder": Spec({"profiling.enable": True, "profiling.traces_folder": "traces2"}),
    "record.step": Spec({"record.step": 1}),
    "record.folder": Spec({"record.step": 1, "record.folder": "record2"}),
    # execution, two processes
    "parallelism.dp_shard": Spec(FSDP, world_size=2, family="fsdp"),
    "parallelism.fsdp_reshard_after_forward": Spec({**FSDP, "parallelism.fsdp_reshard_after_forward": "never"},
                                                   world_size=2, family="fsdp"),
    "parallelism.grad_sync_each_microbatch": Spec({**FSDP, "parallelism.grad_sync_each_microbatch": False},
                                                  world_size=2, family="fsdp"),
    "parallelism.dp_replicate": Spec({"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1,
                                      "training.local_batch_size": 4}, world_size=2,
                                     family="ddp"),
    "parallelism.tp": Spec(TP, world_size=2, family="tp"),
    "parallelism.sequence_parallel": Spec({**TP, "parallelism.sequence_parallel": False}, world_size=2, family="tp"),
    # vocabulary-parallel cross entropy acts on the unfused loss only
    "parallelism.loss_parallel": Spec({**TP, "loss.chunk_tokens": 0, "parallelism.loss_parallel": False},
                                      world_size=2, family="tp"),
    "parallelism.cp": Spec(CP, world_size=2, family="cp"),
    "parallelism.cp_rotate_method": Spec({**CP, "parallelism.cp_rotate_method": "allgather"}, world_size=2,
                                         family="cp"),
    "parallelism.cp_load_balance": Spec({**CP, "parallelism.cp_load_balance": False}, world_size=2, family="cp"),
    # 6 layers on 2 stages: the split depends on output_weight - input_weight (3 layers each by default);
    # 3 and 5 move it alone (to 2 and 5 layers first) and together (4)
    "parallelism.pp": Spec(PP, world_size=2, family="pp"),
    "parallelism.pp_schedule": Spec({**PP, "parallelism.pp_schedule": "GPipe"}, world_size=2, family="pp"),
    "parallelism.pp_microbatch_size": Spec({**PP, "parallelism.pp_microbatch_size": 2}, world_size=2, family="pp"),
    "parallelism.pp_input_weight": Spec({**PP, "parallelism.pp_input_weight": 3.0}, world_size=2, family="pp"),
    "parallelism.pp_output_weight": Spec({**PP, "parallelism.pp_output_weight": 5.0}, world_size=2, family="pp"),
    "parallelism.pp_split_points": Spec({**PP, "parallelism.pp_split_points": ["layers.1"]}, world_size=2,
                                        family="pp_split"),
    "parallelism.pp_stages_per_rank": Spec({**PP, "parallelism.pp_schedule": "Interleaved1F1B",
                                            "parallelism.pp_stages_per_rank": 3}, world_size=2, family="pp_stages"),
    "parallelism.pp_layers_per_stage": Spec({**PP, "parallelism.pp_schedule": "Interleaved1F1B",
                                             "parallelism.pp_layers_per_stage": 1}, world_size=2, family="pp_layers"),
    "parallelism.ep": Spec({**FSDP, "parallelism.ep": 2}, {"model.name": "moe"}, world_size=2, family="ep"),
}

# Execution keys that lay the same sums out in another order: float32 runs differ by rounding, float64
# runs agree to 1e-12 (a kernel choice does too; that one is numerics, see the module docstring).
LAYOUT = {"training.local_batch_size", *(key for key in KEY_CLASS if key.startswith("parallelism."))}

# {key: (the class the reason was written for, why no run here exercises it)}
UNEXERCISED = {
    "job.device": (NUMERICS, "another device than the CPU needs CUDA"),
    "job.dry_run": (EXECUTION, "trains nothing: the launcher builds the model on the meta device, prints the plan "
                               "and exits (tests/unit/test_dry_run.py)"),
    "job.dry_run_gpu": (EXECUTION, "read by the dry run only (it names the GPU the plan is checked against)"),
    "data.split": (CONVERGENCE, "read for Hugging Face hub datasets only (local files are one split); the "
                                "tests have no network"),
    "training.deterministic": (NUMERICS, "chooses deterministic CUDA kernels: the CPU kernels are deterministic "
                                         "already, so a CPU run is bitwise the default one"),
    "comm.backend": (EXECUTION, "auto is gloo on the CPU already; nccl needs CUDA"),
    "parallelism.async_tp": (EXECUTION, "needs CUDA and compile (refused without them)"),
    "profiling.memory_snapshot": (EXECUTION, "CUDA allocator snapshots: on the CPU it warns and records nothing"),
    "compile.enable": (NUMERICS, "inductor's C++ build of the blocks costs ~30 s on 2 cores; "
                                 "tests/integration/test_ac_compile.py::test_compile_parity holds it to the fp32 tolerance"),
    "compile.backend": (NUMERICS, "acts with compile.enable only (see compile.enable)"),
    **{f"metrics.{key}": (EXECUTION, "Weights & Biases starts a service process per run (~4 s); "
                                     "tests/integration/test_wandb.py checks the offline run against metrics.jsonl")
       for key in ("enable_wandb", "wandb_project", "wandb_entity", "wandb_run_name", "wandb_tags")},
    **{f"fault_tolerance.{key}": (EXECUTION, "torchft replica groups need a lighthouse and one launch per group: "
                                             "tests/integration/test_fault_tolerance.py checks 2 groups x fsdp2 against HSDP 2x2")
       for key in ("enable", "group_size", "replica_id", "min_replica_size", "lighthouse", "quorum_timeout_seconds")},
    # float8 rounds like a narrower dtype: beyond the fp32 tolerance, as bfloat16 (unchecked above).
    "float8.enable": (NUMERICS, "float8 matmuls round beyond the fp32 tolerance (as bfloat16 does, which is not "
                                "checked either); tests/integration/test_float8.py holds every layout to one float8 process"),
    "float8.recipe": (NUMERICS, "acts with float8.enable only (see float8.enable)"),
    "float8.filter_fqns": (NUMERICS, "acts with float8.enable only (see float8.enable)"),
    "float8.fsdp_all_gather": (EXECUTION, "acts with float8.enable only, whose runs are not within the fp32 "
                                          "tolerance of the reference; tests/integration/test_float8.py holds fsdp2 with and "
                                          "without it to the same one-process float8 run"),
}

CHECKED = sorted(key for key in KEY_CLASS if key in SPECS and key not in UNEXERCISED)


def precision_of(key: str) -> str:
    return "float64" if key in LAYOUT else "float32"


def _groups() -> dict:
    """{execution key: the run of its family} for the classes of fingerprint.py as they are now."""
    return group_runs(SPECS, [key for key in CHECKED if KEY_CLASS[key] == EXECUTION], precision_of)


def _runs_of(key: str, groups: dict) -> list:
    """What the check of ``key``'s class trains."""
    spec, kind = SPECS[key], KEY_CLASS[key]
    if kind == EXECUTION:
        return [groups[key], reference_run(spec, precision_of(key))]
    if kind == CONVERGENCE and spec.loader:
        return []
    return [changed_run(spec, "float32"), reference_run(spec, "float32")]


def _write_files(folder: str) -> None:
    """The corpora, config file, model record, tokenizer and prepared sets the specs name (@files)."""
    import dataclasses

    from engine.data.prepare import prepare
    from models.registry import get_model_args
    from models.resolve import model_record
    from scripts.train_tokenizer import main as train_tokenizer_main

    os.makedirs(folder)
    docs = [f"Document {i} of another corpus: " + " ".join(f"word{(i * j) % 97}" for j in range(12)) for i in range(100)]
    with open(os.path.join(folder, "other.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    with open(os.path.join(folder, "two_columns.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": doc, "other": doc.upper()}) + "\n" for doc in docs)
    with open(os.path.join(folder, "task.jsonl"), "w") as f:  # [eval]: 3 questions of 2 choices
        f.writelines(json.dumps({"context": f"Document {i} of", "choices": ["another corpus", "word7"], "gold": 0}) + "\n"
                     for i in range(3))
    with open(os.path.join(folder, "description.toml"), "w") as f:
        f.write('[job]\ndescription = "from a config file"\n')
    args = dataclasses.replace(get_model_args("llama", "debugmodel_tiny"), n_layers=2)
    with open(os.path.join(folder, "two_layers.json"), "w") as f:
        json.dump(model_record("llama", args), f)
    train_tokenizer_main(["--data_path", SMALL_CORPUS, "--vocab_size", "512", "--output", folder, "--format", "hf"])
    tokenizer = os.path.join(REPO, "assets", "tokenizer", "shakespeare.model")
    prepare(os.path.join(folder, "other.jsonl"), os.path.join(folder, "set_a"), tokenizer, log=lambda _: None)
    prepare(SMALL_CORPUS, os.path.join(folder, "set_b"), tokenizer, log=lambda _: None)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fingerprint"))
    _write_files(files_folder(root))
    return Lab(root)


def _train_tier(lab: Lab, slow: bool) -> None:
    """Train every run of the keys of one tier (one process / two processes) at once."""
    groups = _groups()
    lab.train([run for key in CHECKED if (SPECS[key].world_size > 1) == slow for run in _runs_of(key, groups)])


def _check_execution(lab: Lab, key: str) -> None:
    spec, precision = SPECS[key], precision_of(key)
    reference, group = reference_run(spec, precision), _groups()[key]
    ok = (lambda d: d.bitwise) if precision == "float32" else (lambda d: d.within)
    if ok(lab.difference(group, reference, precision)):
        return
    # The family differs: run the key alone (test_execution_families_are_neutral names the family).
    alone = changed_run(spec, precision)
    diff = lab.difference(alone, reference, precision)
    want = "bitwise" if precision == "float32" else "within 1e-12 in float64"
    assert ok(diff), f"{key}: {spec.change} is not the same run ({want} expected): {diff.detail}"


def _check_numerics(lab: Lab, key: str) -> None:
    assert key not in LAYOUT, f"{key} is a layout (LAYOUT: the same sums in another order): execution, not numerics"
    spec = SPECS[key]
    diff = lab.difference(changed_run(spec, "float32"), reference_run(spec, "float32"), "float32")
    assert diff.within, f"{key}: {spec.change} trains another model, not another rounding: {diff.detail}"
    assert not diff.bitwise, f"{key}: {spec.change} leaves the run bitwise the same: not numerics"


def _check_convergence(lab: Lab, key: str) -> None:
    spec = SPECS[key]
    changed, reference = changed_run(spec, "float32"), reference_run(spec, "float32")
    if spec.loader:
        mine, theirs = lab.tokens(changed), lab.tokens(reference)
        assert any(a.shape != b.shape or not a.equal(b) for a, b in zip(mine, theirs)), \
            f"{key}: {spec.change} trains the same tokens in the same order in the first steps"
        return
    diff = lab.difference(changed, reference, "float32")
    assert not diff.within, f"{key}: {spec.change} trains the same model (float32 tolerance): {diff.detail}"


@pytest.mark.parametrize("key", CHECKED)
def test_key_behaves_as_its_class(key, lab):
    _train_tier(lab, SPECS[key].world_size > 1)
    {CONVERGENCE: _check_convergence, NUMERICS: _check_numerics, EXECUTION: _check_execution}[KEY_CLASS[key]](lab, key)


def _families() -> dict[str, tuple]:
    groups = _groups()
    out: dict[str, tuple] = {}
    for key, run in groups.items():
        label = f"{SPECS[key].family}-{run.world_size}-{precision_of(key)}"
        out.setdefault(label, (run, key, []))[2].append(key)
    return out


@pytest.mark.parametrize("label", list(_families()))
def test_execution_families_are_neutral(label, lab):
    """The keys of a family changed together are the same run (each alone is checked above)."""
    run, first, keys = _families()[label]
    spec, precision = SPECS[first], precision_of(first)
    _train_tier(lab, run.world_size > 1)
    diff = lab.difference(run, reference_run(spec, precision), precision)
    assert (diff.bitwise if precision == "float32" else diff.within), f"{keys} changed together: {diff.detail}"


def test_every_key_is_checked_or_has_a_reason():
    """A key moved out of the class its reason for no run was written for, or a new key with neither a
    spec nor a reason, fails here; the keys no run exercises are printed with their reasons."""
    problems = []
    for key, kind in KEY_CLASS.items():
        if key in UNEXERCISED and UNEXERCISED[key][0] != kind:
            problems.append(f"{key} is {kind} now, but the reason no run checks it was written for "
                            f"{UNEXERCISED[key][0]} ({UNEXERCISED[key][1]}): exercise it or give a reason for {kind}")
        elif key not in UNEXERCISED and key not in SPECS:
            problems.append(f"{key} ({kind}) has no behavioural check (SPECS) and no reason (UNEXERCISED)")
    assert not problems, "\n".join(problems)
    assert not set(SPECS) & set(UNEXERCISED), set(SPECS) & set(UNEXERCISED)
    assert set(SPECS) | set(UNEXERCISED) <= set(KEY_CLASS), (set(SPECS) | set(UNEXERCISED)) - set(KEY_CLASS)
    print("\nkeys no run exercises:\n" + "\n".join(f"  {key} ({kind}): {reason}"
                                                   for key, (kind, reason) in sorted(UNEXERCISED.items())))
