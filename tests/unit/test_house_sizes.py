"""The house's size rules (engine/docs/architecture.md, "House rules"), checked on the source:

- files under ~400 lines and functions under ~80 (:data:`MAX_FILE_LINES`, :data:`MAX_FUNCTION_LINES`,
  with the justified exceptions listed in :data:`EXCEPTIONS`), in the packages;
- no line longer than pyproject.toml's ``[tool.ruff] line-length`` (:func:`max_line_length`, the one
  place the number lives), in the packages and scripts/, so the file cap cannot be met by widening
  lines (issue #49). tests/ are out of scope.
"""

from __future__ import annotations

import ast
import os
import sys

from tests.unit.test_architecture import PACKAGES, python_files
from tests.training_utils import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# "path" or "path::function" -> why it may exceed the limit. Empty: no exception is needed today.
EXCEPTIONS: dict[str, str] = {}

LINE_LENGTH_SCOPE = PACKAGES + ("scripts",)


def size_violations(path: str) -> list[str]:
    """``path`` over :data:`MAX_FILE_LINES` lines, and its functions over :data:`MAX_FUNCTION_LINES`."""
    rel = os.path.relpath(path, REPO)
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    out = []
    if source.count("\n") > MAX_FILE_LINES and rel not in EXCEPTIONS:
        out.append(f"{rel}: {source.count(chr(10))} lines > {MAX_FILE_LINES}")
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in EXCEPTIONS:
                out.append(f"{rel}:{node.lineno} {node.name}: {length} lines > {MAX_FUNCTION_LINES}")
    return out


def test_files_and_functions_stay_small():
    found = [v for package in PACKAGES for path in python_files(os.path.join(REPO, package))
             for v in size_violations(path)]
    assert not found, "split these (or list a justified exception in EXCEPTIONS):\n" + "\n".join(found)


def test_size_check_catches(tmp_path):
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    path = tmp_path / "big.py"
    path.write_text(long_function + "\n" * MAX_FILE_LINES)
    found = size_violations(str(path))
    assert len(found) == 2 and "lines > 400" in found[0] and "f: 81 lines > 80" in found[1], found


def max_line_length(pyproject: str = os.path.join(REPO, "pyproject.toml")) -> int:
    """The house's line cap in characters: ``[tool.ruff] line-length`` of ``pyproject``.

    Raises KeyError when the table or the key is missing."""
    with open(pyproject, "rb") as fh:
        return int(tomllib.load(fh)["tool"]["ruff"]["line-length"])


def long_lines(path: str, limit: int) -> list[str]:
    """Each line of ``path`` over ``limit`` characters (not counting its newline), as ``file:line:length``."""
    rel = os.path.relpath(path, REPO)
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    return [f"{rel}:{number}:{len(line)}" for number, line in enumerate(lines, 1) if len(line) > limit]


def test_lines_stay_within_the_line_length():
    limit = max_line_length()
    paths = [path for folder in LINE_LENGTH_SCOPE for path in python_files(os.path.join(REPO, folder))]
    found = [v for path in paths for v in long_lines(path, limit)]
    assert not found, (f"wrap these lines to {limit} characters (split the call, name a long expression, "
                       f"shorten the comment; pyproject.toml [tool.ruff] line-length):\n" + "\n".join(found))


def test_line_length_check_catches(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("[tool.ruff]\nline-length = 80\n")
    assert max_line_length(str(pyproject)) == 80
    path = tmp_path / "wide.py"
    path.write_text("x = 1\n" + "#" * 80 + "\n" + "é" * 81 + "\n" + "y = 2")
    found = long_lines(str(path), 80)
    assert len(found) == 1 and found[0].endswith("wide.py:3:81"), found
