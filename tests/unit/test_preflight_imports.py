"""The pre-flight imports no torch, whichever feature the config turns on: read statically, so that a
check behind a feature flag cannot hide a torch import (engine/docs/architecture.md, "Torch-free")."""

from __future__ import annotations

import ast
import os
import sys

from tests.unit.test_architecture import PACKAGES
from tests.training_utils import REPO

# The pre-flight's imports, read statically: every import in the modules the launcher runs before the
# ranks start (each of their functions runs there, whichever feature the config turns on: the config's
# loading and validate(), then check_setup), then what each imported module runs at import time, and
# the body of each imported function, transitively.
PREFLIGHT_ENTRIES = ("engine.config.loading", "engine.config.validation", "engine.setup.preflight")
HEAVY = ("torch", "numpy", "datasets", "transformers", "safetensors", "tensorboard")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(body: list[ast.stmt], into_functions: bool):
    """Import nodes that running ``body`` executes: conditional and class bodies included, ``if
    TYPE_CHECKING:`` blocks left out, function bodies only with ``into_functions``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if into_functions:
                yield from _import_statements(node.body, into_functions)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_statements(node.orelse, into_functions)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _import_statements(getattr(node, field, []) or [], into_functions)


def _module_file(module: str) -> str | None:
    path = os.path.join(REPO, *module.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _parse(module: str) -> ast.Module:
    with open(_module_file(module), encoding="utf-8") as fh:
        return ast.parse(fh.read())


def _targets(node: ast.stmt, module: str):
    """(module, function or None) that an import statement of ``module`` runs; third-party modules too."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing package
        package = module.split(".") if _module_file(module).endswith("__init__.py") else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append((sub, None) if _module_file(sub) else (base, alias.name))
    return out


def preflight_heavy_imports(entry: str) -> list[str]:
    """``"path:line imports X (via ...)"`` for every import of a :data:`HEAVY` package the pre-flight can
    run: all imports of ``entry`` (functions included), the import-time imports of every repo module
    reached (parent packages too), and the bodies of the functions imported by name."""
    found, seen = [], set()
    todo = [(entry, None, True, entry)]
    while todo:
        module, function, into_functions, via = todo.pop()
        if (module, function) in seen or _module_file(module) is None:
            continue
        seen.add((module, function))
        tree = _parse(module)
        body = tree.body
        if function is not None:
            defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
            if not defs:  # a class or a constant: its module's import-time imports are already followed
                continue
            body, into_functions = defs[0].body, True
        parts = module.split(".")
        todo += [(".".join(parts[:i]), None, False, via) for i in range(1, len(parts))]
        for node in _import_statements(body, into_functions):
            for target, name in _targets(node, module):
                where = f"{os.path.relpath(_module_file(module), REPO)}:{node.lineno}"
                if target.split(".")[0] in HEAVY:
                    found.append(f"{where} imports {target} (reached via {via})")
                elif target.split(".")[0] in PACKAGES:
                    todo.append((target, None, False, via if via != entry else f"{where}"))
                    if name is not None:
                        todo.append((target, name, True, via if via != entry else f"{where}"))
    return sorted(set(found))


def test_the_preflight_imports_no_torch_whatever_the_config_turns_on():
    """Static, so every branch counts: a check behind a feature flag (``[document_mask]``, prepared
    data, ``initial_load_path``, pipeline plans) cannot hide a torch import from a config that
    leaves it off (the runtime check in tests/unit/test_preflight.py sees one config's path only)."""
    found = [line for entry in PREFLIGHT_ENTRIES for line in preflight_heavy_imports(entry)]
    assert not found, "the pre-flight must import no torch (engine/docs/running.md: 'the checks import no torch'):\n" + "\n".join(found)


def test_preflight_import_check_catches(tmp_path, monkeypatch):
    """The checker follows a function-level import into another module's function, and skips
    ``if TYPE_CHECKING:`` blocks."""
    package = tmp_path / "engine_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "entry.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\n"
        "def check(cfg):\n    if cfg.feature:\n        from engine_probe.rules import rule\n        rule()\n")
    (package / "rules.py").write_text("def rule():\n    import numpy\n\ndef unused():\n    import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("engine_probe",))
    found = preflight_heavy_imports("engine_probe.entry")
    assert found == ["engine_probe/rules.py:2 imports numpy (reached via engine_probe/entry.py:7)"], found
