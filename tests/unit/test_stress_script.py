"""scripts/stress.sh (outside the suite's runs, a tool for heap-corruption hunts): a bad
mode is refused in one line, and each heap-check mode turns a 1-byte heap overflow in a child process
into a counted failing run with its checker's line, the way the hunt relies on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.training_utils import REPO

STRESS = os.path.join(REPO, "scripts", "stress.sh")
# a library that writes one byte past a 20-byte block, by a plain store (glibc's checks see it at free) and
# by memset (AddressSanitizer sees it in the intercepted call), as a library's copy past its buffer would
OVERFLOW_C = """#include <stdlib.h>
#include <string.h>
int overflow(void){char *p = malloc(20); p[20] = 65; memset(p, 65, 21); free(p); return 0;}
"""


def _stress(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", STRESS, "-o", str(tmp_path / "logs"), *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_an_unknown_mode_is_refused_in_one_line(tmp_path):
    run = _stress(tmp_path, "-m", "bogus", "true")
    assert run.returncode == 2 and run.stderr.splitlines()[0] == "stress.sh: -m bogus: MODE must be check, plain or asan"


@pytest.mark.parametrize("mode", ["check", "asan"])
def test_a_heap_overflow_is_a_counted_failing_run(tmp_path, mode):
    if not shutil.which("gcc"):
        pytest.skip("no gcc here to build the overflowing library (and stress.sh's own probe needs it too)")
    (tmp_path / "ov.c").write_text(OVERFLOW_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(tmp_path / "libov.so"), str(tmp_path / "ov.c")],
                   check=True)
    code = f"import ctypes; ctypes.CDLL({str(tmp_path / 'libov.so')!r}).overflow()"
    run = _stress(tmp_path, "-m", mode, "-n", "2", "-t", "100", "--", sys.executable, "-c", code)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("heap checks: active"), run.stdout
    assert "run 1: killed by signal SIGABRT" in run.stdout and "run 2: killed by signal SIGABRT" in run.stdout
    summary = run.stdout.split("stress summary:")[1]
    assert "2        killed by signal SIGABRT" in summary
    if mode == "asan":
        assert "AddressSanitizer: heap-buffer-overflow" in summary, summary
    assert len(os.listdir(tmp_path / "logs")) == 2  # both failing runs' logs kept


def test_asan_mode_runs_torch_which_throws_and_catches_cpp_exceptions(tmp_path):
    """Under the preloaded sanitizer a C++ exception inside torch (an op refusing its shapes) reaches
    Python as a RuntimeError; without libstdc++ preloaded beside libasan it aborted every rank
    ("CHECK failed: ... real___cxa_throw") before step 1."""
    if not shutil.which("gcc"):
        pytest.skip("no gcc here: -m asan finds AddressSanitizer's runtime through it")
    code = ("import torch\ntry:\n    torch.ones(2) + torch.ones(3)\nexcept RuntimeError:\n    print('caught')\n")
    run = _stress(tmp_path, "-m", "asan", "-n", "1", "-t", "100", "-k", "--", sys.executable, "-c", code)
    assert run.returncode == 0 and "run 1: exit 0" in run.stdout, run.stdout + run.stderr
    assert "caught" in (tmp_path / "logs" / "run-1.log").read_text()
