"""Run a script of scripts/ in the project's Python environment, whichever Python started it.

``./scripts/plan.py`` or ``python scripts/convert_checkpoint.py`` on a fresh machine starts the
system Python, which lacks torch and the other dependencies. :func:`use_project_python` then asks
scripts/bootstrap.sh (the same set-up as ``./run_train.sh``: the running Python if it has the
dependencies, else the repo's ``.venv``, created on first use) for the right interpreter and re-runs
the script under it with the same arguments. Standard library only: it runs before anything else is
importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The packages every script needs (pyproject.toml's dependencies that the scripts import).
NEEDED = ("torch", "sentencepiece", "tokenizers", "safetensors")


def use_project_python() -> None:
    """Return if the running Python has the dependencies; else re-exec the script under the Python
    scripts/bootstrap.sh selects (creating ``.venv`` on first use, about a minute from the pip cache).

    Raises:
        SystemExit: status 1 with bootstrap.sh's message when no environment can be set up.
    """
    if all(find_spec(name) is not None for name in NEEDED):
        return
    if os.environ.get("QUADRA_REEXEC"):  # already re-run once: the environment still lacks them
        missing = [name for name in NEEDED if find_spec(name) is None]
        sys.exit(f"quadra: {sys.executable} lacks {', '.join(missing)}; remove .venv and run ./run_train.sh "
                 "--help once to rebuild it")
    result = subprocess.run(["bash", "-c", 'source scripts/bootstrap.sh >&2 && printf %s "$QUADRA_PYTHON"'],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0 or not result.stdout:
        sys.exit(result.returncode or 1)
    os.environ["QUADRA_REEXEC"] = "1"
    os.execv(result.stdout, [result.stdout, os.path.abspath(sys.argv[0]), *sys.argv[1:]])
