"""Optional extras in tests: skip where one is not installed, fail where it must be.

The extras (pyproject.toml: float8 -> torchao, ft -> torchft, wandb -> wandb; lm-eval in dev) are
installed by ``pip install -e ".[dev]"``, which scripts/bootstrap.sh and CI run. A developer's own
Python may lack one: its tests then skip with the install command as the reason. Under CI
(``QUADRA_FRESH_ENV=1``, set by .ci/run) a missing extra is an error instead, so its tests cannot be
skipped silently where they are meant to run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = {
    "torchao": 'pip install -e ".[float8]"',
    "torchft": 'pip install -e ".[ft]"',
    "wandb": 'pip install -e ".[wandb]"',
    "lm_eval": 'pip install -e ".[dev]"',
}


def require_extra(module: str) -> ModuleType:
    """Import an optional extra for a test, or skip it with the install command.

    Returns the imported module. Raises ``pytest.skip.Exception`` when the module is missing on a
    developer's machine, and ``pytest.fail`` when it is missing under ``QUADRA_FRESH_ENV=1`` (CI
    installs every extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        fix = INSTALL.get(module, f"pip install {module}")
        if os.environ.get("QUADRA_FRESH_ENV"):
            pytest.fail(f"{module} must be installed under CI ({fix}): {err}")
        pytest.skip(f"optional extra {module} is not installed ({fix})")
