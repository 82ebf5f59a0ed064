"""scripts/gpu_check.py without a GPU: the driver keeps going past failing and overrunning rows, and
the --dry-cpu run of the rows passes where datasets, sentencepiece and tensorboard are missing
(as on the GPU machine). The compile rows are left out here (about a minute each on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import pytest

from tests.training_utils import REPO

SCRIPTS = os.path.join(REPO, "scripts")


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(SCRIPTS)
    import gpu_check

    return gpu_check


def test_a_failing_or_slow_row_does_not_stop_the_others(gpu_check, monkeypatch, tmp_path, capsys):
    from gpu_check_common import Skip

    def slow(ctx):
        time.sleep(30)

    def skip(ctx):
        raise Skip("not here")

    fake = types.ModuleType("fake_rows")
    fake.ok = lambda ctx: {"value": 1}
    fake.bad = lambda ctx: 1 / 0
    fake.slow, fake.skip = slow, skip
    monkeypatch.setitem(sys.modules, "fake_rows", fake)
    rows = tuple((name, "fake_rows", name, 1) for name in ("ok", "bad", "slow", "skip"))
    monkeypatch.setattr(gpu_check, "ROWS", rows + (("again", "fake_rows", "ok", 1),))
    monkeypatch.setattr(gpu_check, "ROW_NAMES", [r[0] for r in rows] + ["again"])
    monkeypatch.setattr(gpu_check, "DRY_SLOWDOWN", 1)
    path = tmp_path / "out" / "gpu_check.json"
    start = time.monotonic()
    assert gpu_check.main(["--dry-cpu", "--json", str(path)]) == 1
    assert time.monotonic() - start < 20, "the slow row ran past its 1 s budget"
    report = json.loads(path.read_text())
    got = [(r["name"], r["status"]) for r in report["rows"]]
    assert got == [("ok", "ok"), ("bad", "FAIL"), ("slow", "FAIL"), ("skip", "skip"), ("again", "ok")]
    reasons = {r["name"]: r["reason"] for r in report["rows"]}
    assert reasons["bad"] == "ZeroDivisionError: division by zero" and "budget" in reasons["slow"]
    assert report["complete"] is True and report["rows"][0]["numbers"] == {"value": 1}
    table = capsys.readouterr().out.split("GPU check (dry-cpu)")[-1].splitlines()
    assert len(table) == 2 + len(got) and "2 ok, 2 FAIL, 1 skip" in table[0]
    assert gpu_check.main(["--report", str(path)]) == 0
    assert "ZeroDivisionError" in capsys.readouterr().out


def test_json_goes_to_out_when_set(gpu_check, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.json_path(gpu_check.parse_args([])) == str(tmp_path / "gpu_check.json")
    assert gpu_check.json_path(gpu_check.parse_args(["--json", "x.json"])) == "x.json"
    monkeypatch.delenv("OUT")
    assert gpu_check.json_path(gpu_check.parse_args([])) is None
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "no_such_row"])


_BLOCKED_RUN = """
import importlib.abc, runpy, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"datasets", "sentencepiece", "tensorboard"}:
            raise ImportError(f"{name} is blocked: the GPU machine has no such package")
sys.meta_path.insert(0, Blocker())
import engine.train.trainer, engine.train  # the engine imports without them too
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_dry_cpu_rows_pass_without_optional_packages(tmp_path):
    path = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    env.pop("OUT", None)
    run = subprocess.run(
        # the compile rows take 15-40 s each on 2 cores; their CPU paths are the compiled parity layouts' (tests/integration/test_context_parallel.py, test_expert_parallel.py)
        [sys.executable, "-c", _BLOCKED_RUN, "--dry-cpu", "--skip", "compile_per_block,ring_kernels_compile_cp,compile_moe",
         "--no-compile",
         "--json", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["complete"] and [r["status"] for r in report["rows"]] == ["ok"] * 9, report["rows"]
    numbers = {r["name"]: r["numbers"] for r in report["rows"]}
    assert numbers["cuda_nccl_init"]["backend"] == "gloo"
    assert numbers["flash_sdpa"]["forced"].startswith("flash_attention")
    assert numbers["mfu_llama3"]["steps_timed"] == 3 and numbers["mfu_llama3"]["mfu_pct"] is not None
    assert numbers["float8_step"]["steps"] == 5 and numbers["float8_step"]["speedup"] > 0


def test_rows_rerun_in_a_fresh_process(gpu_check, monkeypatch):
    """After a row leaves the CUDA context unusable, the driver runs the rest in a child process,
    which must start its own process group (not reuse this one's torchrun variables and port)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:  # as this process's store would
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("RANK", "0")
        args = gpu_check.parse_args(["--dry-cpu"])
        ctx = gpu_check.make_ctx(args)
        rows = gpu_check._run_in_child(args, ["device", "cuda_nccl_init"], 120, ctx)
    assert [(r["name"], r["status"]) for r in rows] == [("device", "ok"), ("cuda_nccl_init", "ok")], rows
