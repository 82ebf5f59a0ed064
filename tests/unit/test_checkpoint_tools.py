"""Checkpoint building blocks and tools: the folder protocol, state-dict keys, signals, LR restore,
export to one file and back, seed checkpoints, and the two command-line scripts."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

from engine.checkpoint import files
from engine.checkpoint.state import (
    _restore, _strip, changed_settings, optimizer_settings, reapply_lr, restore_optimizer_settings,
)
from engine.train.signals import StopRequest
from engine.testing.processes import run_distributed
from tests.training_utils import REPO, base_args


# ---------------------------------------------------------------- the folder protocol
def _fake_checkpoint(folder: str, name: str, marker: bool = True) -> str:
    path = os.path.join(folder, name)
    os.makedirs(path)
    open(os.path.join(path, files.DCP_METADATA), "w").close()
    if marker:
        files.write_marker(path, {"step": 0})
    return path


def test_scan_prune_and_partial_folders(tmp_path, caplog):
    folder = str(tmp_path)
    for step in (2, 4, 10):
        _fake_checkpoint(folder, f"step-{step}")
    _fake_checkpoint(folder, "step-12.tmp")           # a crashed save
    _fake_checkpoint(folder, "step-14", marker=False)  # damaged after its save, or not ours
    (tmp_path / "notes.txt").write_text("ignored")
    found = files.scan(folder)
    assert sorted(found.complete) == [2, 4, 10] and found.latest == 10
    assert list(map(os.path.basename, found.partial)) == ["step-12.tmp"]
    assert list(found.incomplete) == [14]
    assert files.incomplete_reason(found.incomplete[14]) == "quadra.json is missing or not valid JSON"
    files.remove_partial(found)
    assert "step-12.tmp" in caplog.text and "step-14" not in caplog.text  # the loader reports it
    assert not os.path.exists(os.path.join(folder, "step-12.tmp")) and os.path.exists(os.path.join(folder, "step-14"))
    assert files.prune(folder, 0) == [] and files.prune(folder, 1, keep_step=2) == [4]
    assert files.prune(folder, 2) == [] and sorted(files.scan(folder).complete) == [2, 10]
    assert files.prune(folder, 1) == [2] and sorted(files.scan(folder).complete) == [10]


def test_finish_renames_and_replaces(tmp_path):
    folder = str(tmp_path)
    old = _fake_checkpoint(folder, "step-5")
    (tmp_path / "step-5" / "old").write_text("x")
    tmp = _fake_checkpoint(folder, "step-5.tmp")
    files.finish(tmp, old)
    assert sorted(os.listdir(folder)) == ["step-5"] and not os.path.exists(os.path.join(old, "old"))
    assert files.is_complete(old) and files.read_marker(old)["format"] == files.FORMAT_VERSION


def test_check_writable(tmp_path):
    assert files.check_writable(str(tmp_path / "a" / "b")) is None
    (tmp_path / "file").write_text("x")
    assert "NotADirectoryError" in files.check_writable(str(tmp_path / "file" / "sub"))
    # the pre-flight's probe (keep=False) removes what it created, and only that
    assert files.check_writable(str(tmp_path / "c" / "d" / "e"), keep=False) is None
    assert not (tmp_path / "c").exists() and (tmp_path / "a" / "b").is_dir()
    assert files.check_writable(str(tmp_path / "a" / "b" / "x"), keep=False) is None
    assert sorted(os.listdir(tmp_path / "a" / "b")) == []


# ---------------------------------------------------------------- state dict keys, LR, signals
def test_part_index_is_stripped_and_restored():
    model = {"0.layers.0.w": 1, "1.layers.3.w": 2, "1.norm.weight": 3}
    stripped, back = _strip(model, depth=0)
    assert stripped == {"layers.0.w": 1, "layers.3.w": 2, "norm.weight": 3} and _restore(stripped, back) == model
    optim = {"state.1.layers.3.w.exp_avg": 4, "param_groups.0.layers.0.w.lr": 5}
    stripped, back = _strip(optim, depth=1)
    assert stripped == {"state.layers.3.w.exp_avg": 4, "param_groups.layers.0.w.lr": 5}
    with pytest.raises(RuntimeError, match="share the state key 'layers.0.w'"):
        _strip({"0.layers.0.w": 1, "1.layers.0.w": 2}, depth=0)


def test_reapply_lr_matches_the_scheduler_and_takes_a_new_schedule():
    from engine.config.schema import LRSchedulerSection
    from engine.train.lr_scheduler import build_lr_scheduler

    def scheduler(steps):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return build_lr_scheduler(optimizer, LRSchedulerSection(warmup_steps=2, decay_type="cosine"), steps)

    saved = scheduler(10)
    for _ in range(4):
        saved.optimizer.step()
        saved.step()
    same, longer = scheduler(10), scheduler(20)
    for restored in (same, longer):
        restored.load_state_dict(saved.state_dict())
        reapply_lr(restored)
    assert same.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
    assert same.get_last_lr() == saved.get_last_lr()
    assert longer.get_last_lr()[0] > saved.get_last_lr()[0]  # the longer cosine decays more slowly


def test_config_settings_win_over_the_checkpoint():
    """On resume the optimizer's hyperparameters are this run's; the diff of the configs is logged."""
    from engine.config import JobConfig, config_to_toml

    param = torch.nn.Parameter(torch.zeros(2))
    now = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    settings = optimizer_settings([now])
    saved = torch.optim.AdamW([param], lr=5e-4, betas=(0.8, 0.9), weight_decay=0.0)
    now.load_state_dict(saved.state_dict())  # what loading a checkpoint does to the groups
    assert now.param_groups[0]["betas"] == (0.8, 0.9)
    restore_optimizer_settings([now], settings)
    assert (now.param_groups[0]["lr"], now.param_groups[0]["betas"]) == (1e-3, (0.9, 0.99))
    old, new = JobConfig(), JobConfig()
    new.optimizer.lr, new.parallelism.dp_shard = 1e-4, 2
    assert changed_settings(config_to_toml(old), config_to_toml(new)) == [
        "optimizer.lr: 0.0008 -> 0.0001", "parallelism.dp_shard: -1 -> 2"]


def test_stop_request_records_sigterm_and_sigusr1():
    previous = signal.getsignal(signal.SIGUSR1)
    request = StopRequest(torch.device("cpu"), distributed=False)
    try:
        assert request.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.agreed() == "SIGUSR1"
    finally:
        request.restore()
    assert signal.getsignal(signal.SIGUSR1) == previous


# ---------------------------------------------------------------- export, import, seed
def _export_round_trip(folder: str) -> dict:
    """Train 2 steps; export step-2; compare with the live model; import; a new run starts from it."""
    from engine.convert.tools import export_model_weights, import_model_weights, save_seed_checkpoint
    from engine.config import load_config
    from engine.train.trainer import Trainer

    def trainer_in(name: str, **overrides) -> Trainer:
        cfg = load_config(base_args(os.path.join(folder, name), {"checkpoint.enable": "true", **overrides}))
        cfg.validate()
        return Trainer(cfg)

    out = {}
    trainer = trainer_in("run", **{"checkpoint.interval": 2})
    trainer.train(2)
    live = {k: v.clone() for k, v in trainer.model_parts[0].state_dict().items()}
    trainer.close()
    step2 = os.path.join(folder, "run", "checkpoint", "step-2")
    # Other data (here: another seq_len) makes the saved window position meaningless: the run
    # resumes model, optimizer and step, warns, and reads the new data from its first window.
    other_data = trainer_in("run", **{"training.seq_len": 16})
    out["other_data"] = (other_data.step, other_data.dataloader.state_dict()["position"])
    other_data.close()
    pt, pt16 = os.path.join(folder, "model.pt"), os.path.join(folder, "model_bf16.pt")
    out["count"] = export_model_weights(step2, pt)
    export_model_weights(step2, pt16, dtype="bfloat16")
    exported = torch.load(pt, weights_only=True)
    out["export_equals_live"] = exported.keys() == live.keys() and all(torch.equal(exported[k], live[k]) for k in live)
    out["bf16"] = {v.dtype for v in torch.load(pt16, weights_only=True).values()} == {torch.bfloat16}

    imported = import_model_weights(pt, os.path.join(folder, "imported"))
    try:
        import_model_weights(pt, imported)
    except ValueError as error:  # never overwrites
        out["refuses_existing"] = "already exists" in str(error)
    fresh = trainer_in("from_import", **{"checkpoint.initial_load_path": imported})
    state = fresh.model_parts[0].state_dict()
    out["import_equals_live"] = all(torch.equal(state[k], live[k]) for k in live) and fresh.step == 0
    fresh.close()

    seed_cfg = load_config(base_args(os.path.join(folder, "seeded"), {"checkpoint.enable": "true"}))
    seed = save_seed_checkpoint(seed_cfg)
    export_model_weights(seed, os.path.join(folder, "seed.pt"))
    seeded = trainer_in("seeded")  # resumes from its step-0: the seed's weights, step 0
    state = seeded.model_parts[0].state_dict()
    seed_weights = torch.load(os.path.join(folder, "seed.pt"), weights_only=True)
    out["seed_loaded"] = all(torch.equal(state[k], seed_weights[k]) for k in seed_weights) and seeded.step == 0
    seeded.close()
    return out


def test_export_import_and_seed_round_trip(tmp_path):
    (out,) = run_distributed(_export_round_trip, 1, str(tmp_path), torchrun_env=False)
    assert out == {"other_data": (2, 0), "count": 57, "export_equals_live": True, "bf16": True,
                   "refuses_existing": True, "import_equals_live": True, "seed_loaded": True}


def test_command_line_scripts(tmp_path, capsys):
    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=240)

    run_folder = str(tmp_path / "run")
    seeded = run("seed_checkpoint.py", *base_args(run_folder, {"checkpoint.enable": "true"}))
    assert seeded.returncode == 0 and "step-0" in seeded.stdout, seeded.stderr
    step0 = os.path.join(run_folder, "checkpoint", "step-0")
    pt = str(tmp_path / "model.pt")
    exported = run("convert_checkpoint.py", "to-torch", step0, pt)
    assert exported.returncode == 0 and "wrote 57 tensors" in exported.stdout, exported.stderr
    assert set(torch.load(pt, weights_only=True)) >= {"tok_embeddings.weight", "layers.5.feed_forward.w2.weight"}
    # Refusals, in this process (a subprocess would import torch again): one line, exit status 2.
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(REPO, "scripts",
                                                                                    "convert_checkpoint.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["to-torch", step0, pt]) == 2  # never overwrites
    assert capsys.readouterr().err == f"error: {pt!r} already exists; choose a new output file or remove it\n"
    not_pt = str(tmp_path / "notes.jsonl")
    with open(not_pt, "w") as file:
        file.write('{"a": 1}\n')
    assert script.main(["from-torch", not_pt, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cannot read it" in err, err
    # from-torch records no model: to-hf of it says what to do instead.
    dcp_dir = str(tmp_path / "from_torch")
    assert script.main(["from-torch", pt, dcp_dir]) == 0
    capsys.readouterr()
    assert script.main(["to-hf", dcp_dir, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "export one of that run's checkpoints" in err, err
    # The seed's manifest (written by write_model_only) catches a shard damaged since: one line.
    os.truncate(os.path.join(step0, "__0_0.distcp"), 1000)
    assert script.main(["to-torch", step0, str(tmp_path / "damaged.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {step0!r} is damaged: __0_0.distcp has 1000 bytes, the manifest says "), err
    assert len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "damaged.pt")
