"""Every shell command of the project's markdown pages (README.md, docs/**/*.md, engine/docs/*.md; parsed by
tests/doc_blocks.py) runs here as written, or is listed with the reason it cannot run on a 2-core CPU in
under a minute (issue #48: "every README command block that can run on a CPU in under a minute runs as
written in a test"). A command in neither table fails, and so does a table entry no page has any more.

A command of RUN runs with ``bash -c`` byte for byte as its page writes it, in a scratch folder that
looks like the repo (symlinks to its code, configs and assets), so its ``outputs/...`` land in a temporary
folder; its check asserts what the page says it prints. The TOML blocks are config fragments: each loads
with the config loader as written (tests/integration/test_muon.py checks the param_groups one against the pre-flight).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from tests.doc_blocks import REPO, all_blocks, commands
from tests.doc_commands_listed import LISTED, REASONS, TOML_ELSEWHERE

# What a RUN command's scratch folder holds of the repo (symlinks): what the commands read or run.
SCRATCH_LINKS = ("engine", "models", "parallelisms", "train_configs", "scripts", "assets", "tests",
                 "run_train.sh", "pyproject.toml")
# Variables the harness may carry that would change a command (its page sets the ones it needs).
UNSET = ("NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CONFIG_FILE", "MAX_RESTARTS", "LOG_RANKS",
         "RDZV_ID", "RDZV_CONF", "PYTHONPATH", "WANDB_MODE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHON")


@dataclasses.dataclass(frozen=True)
class Run:
    """How a command that runs here is judged: ``check(output, scratch)`` asserts what its page says it
    prints or writes (``output`` is stdout + stderr), ``status`` its exit status, ``after`` a command of
    RUN that must have run first in the same scratch folder, ``slow`` over 5 s here."""

    check: Callable[[str, str], None]
    status: int = 0
    after: str | None = None
    slow: bool = False  # over 5 s on a busy 2-core machine (a dry run imports torch and builds the real plan)


def _help(out: str, scratch: str) -> None:
    from engine.config import CONFIG_KEYS

    missing = [key for key in CONFIG_KEYS if f"--{key}  (" not in out]
    assert not missing, f"--help should list every key; missing {missing}"


def _dry_run(*wanted: str, fits: list[str] | None = None) -> Callable[[str, str], None]:
    """A dry run's check: the lines its page quotes, and the totals of its 'fits' verdicts in order."""

    def check(out: str, scratch: str) -> None:
        for text in wanted:
            assert text in out, (text, out[-3000:])
        if fits is not None:
            assert re.findall(r"dry run: fits: ([\d.]+) GiB per rank", out) == fits, out[-3000:]
    return check


def _plan(out: str, scratch: str) -> None:
    with open(os.path.join(scratch, "plan.json"), encoding="utf-8") as f:
        layouts = json.load(f)["layouts"]
    assert f"wrote {len(layouts)} layouts to plan.json" in out and "decision matrix: row" in out, out[-3000:]
    # engine/docs/choosing-a-layout.md's description of the JSON, per layout.
    keys = {"degrees", "memory_bytes_per_rank", "comm_bytes_per_step_per_rank", "bubble", "step_time_s", "mfu", "fits"}
    memory = {"params", "grads", "optimizer", "activations", "transient", "reduction", "peak_nonstate", "total"}
    assert layouts and all(keys <= set(layout) and memory <= set(layout["memory_bytes_per_rank"])
                           for layout in layouts), layouts[0]


def _prepared(out: str, scratch: str) -> None:
    with open(os.path.join(scratch, "outputs", "data", "shakespeare", "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    printed = re.search(r"prepared \S+: ([\d,]+) tokens \(uint16\), ([\d,]+) documents", out)
    assert printed, out[-3000:]
    numbers = [int(n.replace(",", "")) for n in printed.groups()]
    assert numbers == [manifest["num_tokens"], manifest["num_documents"]], (numbers, manifest)
    # "the bundled 1.46M-token train.jsonl" (engine/docs/data.md)
    assert round(manifest["num_tokens"] / 1e6, 2) == 1.46, manifest["num_tokens"]


def _verified(out: str, scratch: str) -> None:
    assert re.search(r"outputs/data/shakespeare: every file \(\d+\) matches its manifest", out), out


def _cloze(out: str, scratch: str) -> None:
    with open(os.path.join(scratch, "outputs", "eval", "shakespeare_cloze.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert "wrote 200 examples of 4 choices" in out and len(rows) == 200, out
    assert all(len(row["choices"]) == 4 for row in rows), rows[0]  # its next 4 words and 3 spans from elsewhere


def _seed(out: str, scratch: str) -> None:
    assert "wrote seed checkpoint outputs/debug_model/checkpoint/step-0" in out, out[-3000:]
    assert os.path.isdir(os.path.join(scratch, "outputs", "debug_model", "checkpoint", "step-0"))


PREPARE = ("./scripts/prepare_data.py assets/data/shakespeare/train.jsonl outputs/data/shakespeare "
           "--tokenizer assets/tokenizer/shakespeare.model --num_proc 2")
DSV3_671B = ("CONFIG_FILE=train_configs/debug_deepseek_v3.toml NGPU=8 NNODES=64 ./run_train.sh --dry_run "
             "--model.flavor 671B --training.seq_len 4096 ")

# The commands that run here, keyed as tests/doc_blocks.py's command_key writes them, in page order.
RUN = {
    "./run_train.sh --help": Run(_help),
    # engine/docs/choosing-a-layout.md's table of the presets' planned rows: llama3_405b totals 24.7 GiB per rank.
    "CONFIG_FILE=train_configs/llama3_405b.toml NGPU=8 NNODES=64 ./run_train.sh --dry_run": Run(_dry_run(
        "512 ranks", "planner formulas vs real plan (rank 0): equal", "dry run: fits: 24.7 GiB per rank"), slow=True),
    PREPARE: Run(_prepared, slow=True),
    "./scripts/prepare_data.py --verify outputs/data/shakespeare": Run(_verified, after=PREPARE, slow=True),
    DSV3_671B + "--training.local_batch_size 4 --training.global_batch_size 256 --parallelism.tp 8 "
    "--parallelism.ep 8 --activation_checkpoint.mode full --validation.enable false": Run(_dry_run(
        "planner formulas vs real plan (rank 0): equal", fits=["47.5"]), slow=True),
    DSV3_671B + "--training.global_batch_size 1024 --training.local_batch_size 32 --parallelism.pp 16 "
    "--parallelism.dp_shard 32 --parallelism.ep 16 --activation_checkpoint.mode full --validation.enable false":
        Run(_dry_run("planner formulas vs real plan (rank 480): equal", fits=["57.6"]), slow=True),
    "python scripts/make_cloze_task.py --data_path assets/data/shakespeare/validation.jsonl "
    "--output outputs/eval/shakespeare_cloze.jsonl --examples 200": Run(_cloze),
    # Its page's table: FSDP x CP 8x1 33.1 GiB, then 36.8 for cp 2, 4 and 8, each exiting 0; the warning at cp 8.
    "for cp in 1 2 4 8; do CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./run_train.sh --dry_run "
    "--parallelism.cp $cp --training.seq_len $((32768 * cp)) --activation_checkpoint.mode full "
    "--job.dry_run_gpu H100-80GB; done": Run(_dry_run(
        "is past the max_seq_len 131072", fits=["33.1", "36.8", "36.8", "36.8"]), slow=True),
    "./scripts/plan.py --model llama --flavor 70B --gpus 64 --gpus_per_node 8 --gpu H100-80GB --seq_len 8192 "
    "--global_batch_size 512 --json plan.json": Run(_plan, slow=True),
    "CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./run_train.sh --dry_run --training.local_batch_size 2 "
    "--training.global_batch_size 16 --compile.enable false": Run(_dry_run(fits=["51.4"]), slow=True),
    "python scripts/seed_checkpoint.py --job.config_file train_configs/debug_model.toml": Run(_seed, slow=True),
}


def _doc_commands():
    """Every command of every page, in page order."""
    return [command for block in all_blocks() for command in commands(block)]


def test_every_doc_command_runs_here_or_is_listed_with_its_reason():
    """The tables cover the pages exactly: no command in neither or both, no entry that no page has, every
    reason of a known kind, every test it names exists, and no command uses ``[--option]`` notation
    (it does not run as written)."""
    found = _doc_commands()
    keys = {command.key for command in found}
    where = {command.key: f"{command.page}:{command.line}" for command in found}
    unclassified = sorted(f"{where[key]}: {key}" for key in keys - set(RUN) - set(LISTED))
    assert not unclassified, "doc commands in neither RUN nor LISTED (run them here or list the reason):\n" + \
        "\n".join(unclassified)
    assert not set(RUN) & set(LISTED), sorted(set(RUN) & set(LISTED))
    stale = sorted((set(RUN) | set(LISTED)) - keys)
    assert not stale, "table entries that no page has any more:\n" + "\n".join(stale)
    for key, (kind, reason) in LISTED.items():
        assert kind in REASONS and reason, (key, kind)
    for key, run in RUN.items():
        assert run.after is None or run.after in RUN, key
    names = [reason for _, reason in LISTED.values()] + list(TOML_ELSEWHERE.values())
    for name in sorted({m for text in names for m in re.findall(r"tests/\S+?\.py::\w+", text)}):
        path, test = name.split("::")
        located = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, "tests"))
                   for f in files if f == os.path.basename(path)]
        assert any(re.search(rf"^def {test}\(", open(p, encoding="utf-8").read(), re.M) for p in located), \
            f"{name} (named in a reason) does not exist"
    bracketed = [f"{where[key]}: {key}" for key in keys if re.search(r"(^|\s)\[-", key)]
    assert not bracketed, "optional [--flag] notation does not run as written:\n" + "\n".join(bracketed)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder that looks like the repo to the commands, its environment, and the results run so far."""
    root = str(tmp_path_factory.mktemp("doc_commands"))
    for name in SCRATCH_LINKS:
        os.symlink(os.path.join(REPO, name), os.path.join(root, name))
    shims = os.path.join(root, ".bin")  # `python` in a command is the harness's Python, a venv's included
    os.makedirs(shims)
    for name in ("python", "python3"):
        with open(os.path.join(shims, name), "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        os.chmod(os.path.join(shims, name), 0o755)
    env = {k: v for k, v in os.environ.items() if k not in UNSET and not k.startswith("QUADRA_")}
    env.update(OMP_NUM_THREADS="1", PATH=shims + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable)
    return root, env, {}


def _run(key: str, scratch) -> str:
    root, env, done = scratch
    if key in done:
        return done[key]
    run = RUN[key]
    if run.after is not None:
        _run(run.after, scratch)
    texts = [command.text for command in _doc_commands() if command.key == key]
    assert texts, f"no page has {key!r} any more"
    result = subprocess.run(["bash", "-c", texts[0]], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == run.status, f"exit {result.returncode}, expected {run.status}:\n{output[-4000:]}"
    run.check(output, root)
    done[key] = output
    return output


@pytest.mark.parametrize("key", [pytest.param(key, id=key[:60])
                                 for key, run in RUN.items()])
def test_doc_command_runs_as_written(key, scratch):
    """The command, byte for byte as its page writes it, exits as the page says and prints what it says."""
    _run(key, scratch)


def _toml_blocks(elsewhere: bool | None = None):
    """The TOML blocks: all, or those TOML_ELSEWHERE lists (True) or not (False)."""
    found = [block for block in all_blocks() if block.lang == "toml"]
    return [block for block in found if elsewhere is None or (_toml_name(block) in TOML_ELSEWHERE) == elsewhere]


def _toml_name(block) -> str:
    return " ".join(sorted(_dotted(tomllib.loads(block.text))))


def _dotted(table: dict) -> dict:
    return {f"{section}.{key}": value for section, keys in table.items() for key, value in keys.items()}


@pytest.mark.parametrize("block", _toml_blocks(elsewhere=False), ids=lambda block: f"{block.page}:{block.line}")
def test_doc_toml_block_loads_as_written(block, tmp_path):
    """A TOML block is a config fragment: the loader takes it as written and every value lands where the
    block puts it; a ``# CLI: --key value`` comment gives the same value from the command line."""
    from engine.config import config_to_dict, load_config

    values = _dotted(tomllib.loads(block.text))
    fragment = tmp_path / "fragment.toml"
    fragment.write_text(block.text)
    cfg = load_config(["--job.config_file", str(fragment)])
    cfg.validate()
    loaded = _dotted(config_to_dict(cfg))
    assert {key: loaded[key] for key in values} == values
    for flag, text in re.findall(r"#\s*CLI:\s*--(\S+)\s+(\S+)", block.text):
        assert _dotted(config_to_dict(load_config([f"--{flag}", text])))[flag] == values[flag], flag


def test_toml_blocks_checked_elsewhere_are_still_in_the_pages():
    """TOML_ELSEWHERE names blocks by their keys; an entry whose block is gone is stale."""
    present = {_toml_name(block) for block in _toml_blocks()}
    assert set(TOML_ELSEWHERE) <= present, sorted(set(TOML_ELSEWHERE) - present)


@pytest.mark.parametrize("block", [block for block in all_blocks() if block.lang in ("yaml", "yml")],
                         ids=lambda block: f"{block.page}:{block.line}")
def test_doc_yaml_block_parses(block):
    """A YAML block (an lm-evaluation-harness task) is YAML that reads as a mapping."""
    import yaml  # PyYAML: a dependency of datasets and transformers

    assert isinstance(yaml.safe_load(block.text), dict)
