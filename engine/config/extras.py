"""Optional extras a config can ask for (pyproject.toml's float8, ft, wandb), checked without importing them.

``importlib.util.find_spec`` locates a package without running it (torch-free, so the launcher's
pre-flight can call it before any rank starts).
"""

from __future__ import annotations

from importlib.util import find_spec


def missing_extra(key: str, module: str, extra: str) -> str | None:
    """The pre-flight line for a setting that needs an optional package which is not installed.

    Args:
        key: the setting that asks for it, e.g. "fault_tolerance.enable".
        module: the import name, e.g. "torchft".
        extra: the pyproject extra that installs it, e.g. "ft".

    Returns:
        one line naming the setting, the package and the install command, or None when it is installed.
    """
    if find_spec(module) is not None:
        return None
    return f'{key} = true: needs {module}, which is not installed; install it with pip install -e ".[{extra}]"'
