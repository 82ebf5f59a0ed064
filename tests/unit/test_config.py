"""Tests for engine/config/loading.py: defaults, TOML + CLI precedence, strict keys, TOML out (validate(): tests/unit/test_config_validation.py)."""

import dataclasses
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

from engine.config import (
    CONFIG_KEYS,
    ConfigError,
    JobConfig,
    config_to_dict,
    config_to_toml,
    load_config,
    resolve_dump_folder,
)

REPO = Path(__file__).resolve().parents[2]

# Pinned on purpose: adding or removing a config key must update this list in the same change.
PINNED_KEYS = """
job.config_file job.dump_folder job.description job.device job.print_config job.dry_run job.dry_run_gpu
model.name model.flavor model.args_path model.tokenizer_path model.vocab_size model.tie_embeddings
data.path data.text_column data.split data.streaming data.shuffle data.mixture data.sequence_order_seed
validation.enable validation.path validation.freq validation.steps
eval.enable eval.tasks eval.freq eval.limit
training.steps training.local_batch_size training.global_batch_size training.seq_len
training.max_norm training.seed training.deterministic training.mixed_precision_param
training.mixed_precision_reduce training.gc_freq training.stop_after_step
step_health.on_nonfinite step_health.loss_spike_sigma step_health.grad_norm_spike_sigma step_health.window
step_health.max_consecutive_skips
optimizer.name optimizer.lr optimizer.beta1 optimizer.beta2 optimizer.eps optimizer.weight_decay
optimizer.implementation optimizer.muon_lr optimizer.muon_momentum optimizer.muon_nesterov optimizer.muon_ns_steps
optimizer.muon_ns_coefficients optimizer.muon_adjust_lr optimizer.muon_ns_dtype optimizer.param_groups
lr_scheduler.warmup_steps lr_scheduler.decay_type lr_scheduler.decay_ratio lr_scheduler.min_lr
parallelism.dp_replicate parallelism.dp_shard parallelism.cp parallelism.cp_rotate_method
parallelism.cp_load_balance parallelism.tp parallelism.pp
parallelism.pp_schedule parallelism.pp_microbatch_size parallelism.pp_stages_per_rank
parallelism.pp_layers_per_stage parallelism.pp_split_points parallelism.pp_input_weight
parallelism.pp_output_weight
parallelism.ep parallelism.fsdp_reshard_after_forward parallelism.grad_sync_each_microbatch
parallelism.sequence_parallel
parallelism.loss_parallel parallelism.async_tp
comm.backend comm.init_timeout_seconds comm.hang_timeout_seconds
checkpoint.enable checkpoint.folder checkpoint.interval checkpoint.keep_latest_k checkpoint.async_mode
checkpoint.load_step checkpoint.initial_load_path checkpoint.initial_load_model_only
checkpoint.initial_load_lr checkpoint.initial_load_data
metrics.log_freq metrics.enable_tensorboard metrics.save_tb_folder metrics.peak_tflops
metrics.log_all_ranks metrics.time_attribution
metrics.enable_wandb metrics.wandb_project metrics.wandb_entity metrics.wandb_run_name metrics.wandb_tags
activation_checkpoint.mode activation_checkpoint.selective_ac_option
compile.enable compile.backend
float8.enable float8.recipe float8.filter_fqns float8.fsdp_all_gather
loss.z_loss_weight loss.chunk_tokens
loss.mtp_weight
profiling.enable profiling.start_step profiling.num_steps profiling.traces_folder profiling.memory_snapshot
document_mask.enable document_mask.restart_positions
record.step record.folder
fault_tolerance.enable fault_tolerance.group_size fault_tolerance.replica_id fault_tolerance.min_replica_size
fault_tolerance.lighthouse fault_tolerance.quorum_timeout_seconds
""".split()


def write_toml(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_toml(tmp_path: Path, text: str, *extra: str) -> JobConfig:
    return load_config(["--job.config_file", write_toml(tmp_path, text), *extra])


def raises_config_error(argv: list[str], *fragments: str) -> str:
    """Assert load_config(argv) raises ConfigError whose message contains every fragment."""
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return str(info.value)


# ---------------------------------------------------------------- defaults and keys


def test_pinned_key_set():
    assert list(CONFIG_KEYS) == PINNED_KEYS


def test_defaults_match_spec_and_validate():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 100 and cfg.training.local_batch_size == 8
    assert cfg.training.global_batch_size == -1 and cfg.training.seq_len == 256
    assert cfg.optimizer.lr == 8e-4 and cfg.optimizer.implementation == "auto"
    assert cfg.lr_scheduler.decay_type == "linear" and cfg.lr_scheduler.min_lr == 0.0
    assert cfg.parallelism.dp_shard == -1 and cfg.parallelism.tp == 1
    assert cfg.activation_checkpoint.selective_ac_option == "op"
    assert cfg.job.print_config is True and cfg.checkpoint.enable is False
    assert cfg.model.tokenizer_path == "assets/tokenizer/shakespeare.model"
    cfg.validate()


def test_every_field_has_doc_and_supported_type():
    cfg = JobConfig()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.metadata["doc"], f"{section.name}.{f.name} has no doc"
            assert f.type in (str, int, float, bool, list[str]), f"{section.name}.{f.name}: {f.type}"
            for choice in f.metadata.get("choices", ()):
                assert isinstance(choice, f.type)
            if "choices" in f.metadata:
                assert f.default in f.metadata["choices"]


# ---------------------------------------------------------------- TOML and CLI


def test_toml_values_loaded_and_others_default(tmp_path):
    cfg = load_toml(tmp_path, '[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n')
    assert cfg.training.steps == 7 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int -> float
    assert cfg.training.local_batch_size == 8
    assert cfg.job.config_file.endswith("run.toml")


def test_precedence_cli_over_toml_over_default(tmp_path):
    toml = '[training]\nsteps = 7\nseq_len = 64\n'
    cfg = load_toml(tmp_path, toml, "--training.steps", "9")
    assert cfg.training.steps == 9            # CLI beats TOML
    assert cfg.training.seq_len == 64         # TOML beats default
    assert cfg.training.local_batch_size == 8  # default
    # The order of arguments does not matter: the file is read before overrides are applied.
    path = write_toml(tmp_path, toml, "other.toml")
    cfg = load_config(["--training.steps=11", "--job.config_file", path])
    assert cfg.training.steps == 11 and cfg.training.seq_len == 64


@pytest.mark.parametrize("argv", [
    ["--training.seq_len", "128", "--optimizer.lr", "3e-4", "--job.description", "a b"],
    ["--training.seq_len=128", "--optimizer.lr=3e-4", "--job.description=a b"],
])
def test_both_override_forms(argv):
    cfg = load_config(argv)
    assert cfg.training.seq_len == 128 and cfg.optimizer.lr == 3e-4
    assert cfg.job.description == "a b"


def test_cli_negative_numbers_empty_string_and_last_wins():
    cfg = load_config(["--parallelism.dp_shard", "-1", "--job.dump_folder=",
                       "--training.steps", "1", "--training.steps", "2"])
    assert cfg.parallelism.dp_shard == -1 and cfg.job.dump_folder == "" and cfg.training.steps == 2


@pytest.mark.parametrize("word,expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False),
])
def test_bool_words(word, expected):
    assert load_config(["--compile.enable", word]).compile.enable is expected
    assert load_config([f"--compile.enable={word}"]).compile.enable is expected


def test_bare_bool_flag_means_true():
    cfg = load_config(["--compile.enable", "--training.deterministic"])
    assert cfg.compile.enable is True and cfg.training.deterministic is True


def test_selective_ac_option_accepts_toml_int(tmp_path):
    cfg = load_toml(tmp_path, "[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 2\n")
    assert cfg.activation_checkpoint.selective_ac_option == "2"
    cfg.validate()


# ---------------------------------------------------------------- load-time errors


def test_unknown_section_suggests(tmp_path):
    path = write_toml(tmp_path, "[trainig]\nsteps = 10\n")
    raises_config_error(["--job.config_file", path], "'trainig'", "did you mean 'training'?", path)
    raises_config_error(["--trainig.steps", "3"], "did you mean 'training'?")


def test_unknown_key_suggests(tmp_path):
    path = write_toml(tmp_path, "[training]\nstpes = 10\n")
    raises_config_error(["--job.config_file", path],
                        "unknown key 'training.stpes'", "did you mean 'training.steps'?")
    raises_config_error(["--training.stpes", "3"], "did you mean 'training.steps'?")
    # A key that lives in another section points there.
    raises_config_error(["--training.lr", "1"], "did you mean 'optimizer.lr'?")


def test_top_level_key_outside_section(tmp_path):
    path = write_toml(tmp_path, "seq_len = 10\n")
    raises_config_error(["--job.config_file", path], "'seq_len'", "[training]", "Fix")


@pytest.mark.parametrize("toml,fragments", [
    ('[training]\nsteps = "10"\n', ("training.steps", '"10"', "int")),
    ("[training]\nsteps = true\n", ("training.steps", "true", "bool", "int")),   # no bool as int
    ("[training]\nsteps = 10.0\n", ("training.steps", "10.0", "int")),
    ("[compile]\nenable = 1\n", ("compile.enable", "1", "bool")),
    ("[optimizer]\nlr = true\n", ("optimizer.lr", "float")),
    ("[optimizer]\nlr = nan\n", ("optimizer.lr", "nan", "finite")),
    ("[job]\ndescription = 5\n", ("job.description", "5", "str")),
    ("[training]\nsteps = [1]\n", ("training.steps", "list", "int")),
])
def test_wrong_type_in_toml(tmp_path, toml, fragments):
    raises_config_error(["--job.config_file", write_toml(tmp_path, toml)], *fragments, "Fix")


@pytest.mark.parametrize("argv,fragments", [
    (["--training.steps", "ten"], ("training.steps", "'ten'", "int")),
    (["--training.steps=1.5"], ("training.steps", "'1.5'", "int")),
    (["--optimizer.lr", "fast"], ("optimizer.lr", "'fast'", "float")),
    (["--optimizer.lr", "inf"], ("optimizer.lr", "'inf'", "float")),
    (["--compile.enable", "maybe"], ("compile.enable", "'maybe'", "bool", "true/false")),
])
def test_wrong_type_on_cli(argv, fragments):
    raises_config_error(argv, *fragments, "Fix")


@pytest.mark.parametrize("key,value,allowed", [
    ("lr_scheduler.decay_type", "cos", "constant|linear|cosine|wsd"),
    ("training.mixed_precision_param", "float16", "float32|bfloat16"),
    ("training.mixed_precision_reduce", "fp8", "float32|bfloat16"),
    ("optimizer.implementation", "apex", "auto|fused|foreach|for-loop"),
    ("parallelism.fsdp_reshard_after_forward", "sometimes", "default|always|never"),
    ("comm.backend", "mpi", "auto|nccl|gloo"),
    ("activation_checkpoint.mode", "partial", "none|full|selective"),
    ("job.device", "tpu", "auto|cpu|cuda"),
    ("compile.backend", "foo", "inductor|aot_eager|eager"),
])
def test_enum_value_not_allowed(tmp_path, key, value, allowed):
    raises_config_error([f"--{key}", value], key, value, allowed)
    section, name = key.split(".")
    path = write_toml(tmp_path, f'[{section}]\n{name} = "{value}"\n')
    raises_config_error(["--job.config_file", path], key, value, allowed)


def test_missing_toml_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    raises_config_error(["--job.config_file", path], "job.config_file", path, "not found", "Fix")


def test_unparsable_toml_file(tmp_path):
    path = write_toml(tmp_path, "[training\nsteps = 1\n")
    raises_config_error(["--job.config_file", path], path, "not valid TOML", "line 1")


@pytest.mark.parametrize("argv,fragment", [
    (["steps"], "'steps'"),
    (["--steps", "3"], "'--steps'"),
    (["-x"], "'-x'"),
    (["--.steps=3"], "'--.steps=3'"),
])
def test_malformed_cli_argument(argv, fragment):
    raises_config_error(argv, fragment, "--section.key", "Fix")


@pytest.mark.parametrize("argv", [["--training.steps"], ["--training.steps", "--compile.enable"]])
def test_missing_cli_value(argv):
    raises_config_error(argv, "--training.steps", "missing its value", "int", "Fix")


# ---------------------------------------------------------------- help, run folder, TOML out


def test_help_lists_every_key(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            load_config(["--training.steps", "1", flag])
        assert info.value.code == 0
        out = capsys.readouterr().out
        for key in CONFIG_KEYS:
            assert f"--{key}  (" in out, key
    # A value given on the command line (or in the TOML file) is shown next to the default.
    assert "--training.steps  (int, default: 100, set: 1)  optimizer steps to train" in out
    assert '--lr_scheduler.decay_type  (str, default: "linear")' in out
    assert "--compile.enable  (bool, default: false)" in out


def test_help_shows_config_file_values(capsys):
    with pytest.raises(SystemExit):
        load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--help"])
    out = capsys.readouterr().out
    assert '--lr_scheduler.decay_type  (str, default: "linear", set: "cosine")' in out


def test_run_folder(tmp_path):
    assert resolve_dump_folder(JobConfig()) == str(Path("outputs") / "default")
    cfg = load_toml(tmp_path, "[training]\nsteps = 3\n")
    assert cfg.run_folder == str(Path("outputs") / "run")
    cfg = load_toml(tmp_path, '[job]\ndump_folder = "/tmp/x"\n')
    assert cfg.run_folder == "/tmp/x" == resolve_dump_folder(cfg)


def test_toml_round_trip(tmp_path):
    cfg = load_config(["--job.description", 'quote " backslash \\ tab \t newline \n del \x7f é',
                       "--optimizer.lr", "1.2345678901234567e-4", "--optimizer.eps", "1e-300",
                       "--compile.enable", "--parallelism.dp_shard", "-1"])
    text = config_to_toml(cfg)
    assert tomllib.loads(text) == config_to_dict(cfg)
    assert set(f"{s}.{k}" for s, t in tomllib.loads(text).items() for k in t) == set(CONFIG_KEYS)
    # Through a file and load_config as well (config_file is replaced by the path read).
    path = write_toml(tmp_path, text)
    again = load_config(["--job.config_file", path])
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    plain = config_to_dict(JobConfig())
    assert list(plain) == [f.name for f in dataclasses.fields(JobConfig)]
    assert all(isinstance(v, (str, int, float, bool, list)) for t in plain.values() for v in t.values())


# ---------------------------------------------------------------- shipped configs


def test_list_field_from_toml_and_cli(tmp_path):
    path = write_toml(tmp_path, '[parallelism]\npp_split_points = ["layers.2", "layers.4"]\n')
    assert load_config(["--job.config_file", path]).parallelism.pp_split_points == ["layers.2", "layers.4"]
    cli = load_config(["--job.config_file", path, "--parallelism.pp_split_points", "layers.3"])
    assert cli.parallelism.pp_split_points == ["layers.3"]
    with pytest.raises(ConfigError, match="parallelism.pp_split_points"):
        load_config(["--job.config_file", write_toml(tmp_path, "[parallelism]\npp_split_points = [3]\n", "bad.toml")])
    assert JobConfig().parallelism.pp_split_points is not JobConfig().parallelism.pp_split_points


@pytest.mark.parametrize("text, want", [
    ("output,router.gate", ["output", "router.gate"]),
    ('["output", "router.gate"]', ["output", "router.gate"]),  # the form --help shows
    ("[]", []),
    ("['layers.1']", ["layers.1"]),
])
def test_a_list_on_the_command_line_is_comma_separated_or_a_toml_array(text, want):
    assert load_config(["--float8.filter_fqns", text]).float8.filter_fqns == want


@pytest.mark.parametrize("text", ['["output", 3]', '["output"', "[output]"])
def test_a_bad_array_on_the_command_line_is_one_line(text):
    raises_config_error(["--float8.filter_fqns", text], "float8.filter_fqns", "from the command line")
