"""The house rules of engine/docs/architecture.md, checked on the source (ast) and by importing.

- engine/ knows no model family: no module under engine/ imports a family package
  (``models.<family>``) or holds a family's name (or a Hugging Face model type a family reads) as a
  string constant; it reaches families only through models/registry.py.
"""

from __future__ import annotations

import ast
import os

import pytest

from tests.training_utils import REPO

ENGINE = os.path.join(REPO, "engine")
MODELS = os.path.join(REPO, "models")


def _python_files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return sorted(out)


def _family_packages() -> set[str]:
    """The model families' packages: the folders of models/ that are packages."""
    return {n for n in os.listdir(MODELS) if os.path.isfile(os.path.join(MODELS, n, "__init__.py"))}


def _family_words() -> set[str]:
    """Registered family names and the Hugging Face model types their adapters read."""
    import models  # noqa: F401
    from models.registry import get_model_spec, list_model_names, load_ref

    words = set(list_model_names())
    for name in list_model_names():
        adapter = get_model_spec(name).hf_adapter
        if adapter is not None:
            words.update(load_ref(adapter).model_types)
    return words


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` (``from a import b`` gives "a" and "a.b")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def family_violations(path: str, families: set[str], words: set[str]) -> list[str]:
    """Lines of ``path`` that import a family package or name a family in a string constant."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    rel = os.path.relpath(path, REPO)
    bad = {}
    for line, module in imported_modules(tree):
        parts = module.split(".")
        if parts[0] == "models" and len(parts) > 1 and parts[1] in families:
            bad.setdefault(line, module)  # one report per import statement
    out = [f"{rel}:{line} imports {module}" for line, module in sorted(bad.items())]
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if text in words or any(text.startswith(f"models.{f}") for f in families):
                out.append(f"{rel}:{node.lineno} names model family {text!r}")
    return out


def test_engine_knows_no_model_family():
    families, words = _family_packages(), _family_words()
    assert {"llama", "moe"} <= families and {"llama", "moe", "mixtral"} <= words
    found = [v for path in _python_files(ENGINE) for v in family_violations(path, families, words)]
    assert not found, "engine/ must reach model families only through models/registry.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from models.llama.args import LlamaModelArgs\n", "imports models.llama.args"),
    ("import models.moe\n", "imports models.moe"),
    ("from models import llama\n", "imports models.llama"),
    ("if cfg.model.name == 'moe':\n    pass\n", "names model family 'moe'"),
    ("ref = 'models.llama.model:Transformer'\n", "names model family"),
])
def test_family_check_catches(tmp_path, source, expected):
    """The checker itself finds each kind of violation (and a docstring mention is allowed)."""
    path = tmp_path / "x.py"
    path.write_text('"""Mentions llama in prose."""\n' + source)
    found = family_violations(str(path), _family_packages(), _family_words())
    assert len(found) == 1 and expected in found[0], found
