"""The house rules of engine/docs/architecture.md ("House rules"), checked on the source (ast) and by
importing, so that one test says when a change breaks one:

- engine/ knows no model family: no module under engine/ imports a family package
  (``models.<family>``) or holds a family's name (or a Hugging Face model type a family reads) as a
  string constant; it reaches families only through models/registry.py;
- models/ and parallelisms/ never import engine/;
- engine/'s packages form layers (:data:`ENGINE_LAYERS`: which package may import which), so no
  import runs back up, and no engine modules import each other in a circle;
- files under ~400 lines, functions under ~80 and lines within pyproject.toml's line-length: in
  tests/unit/test_house_sizes.py;
- the torch-free list (:data:`TORCH_FREE`): what the launcher's pre-flight, the planner and the
  config tools import must import without torch, checked in a subprocess whose import system
  refuses ``torch``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.training_utils import REPO

PACKAGES = ("engine", "models", "parallelisms")

# Modules that must import without torch (engine/docs/architecture.md, "Torch-free"): the launcher,
# its pre-flight and everything that reaches (config, batch arithmetic, tokenizer, data checks,
# checkpoint markers, model registry, flavors, checks, layout rules), the planner (scripts/plan.py
# re-runs itself only when it needs torch) and each family's torch-free half.
TORCH_FREE = (
    "engine.config", "engine.config.loading", "engine.config.schema", "engine.config.schema_scale",
    "engine.config.schema_observe", "engine.config.toml_format", "engine.config.value_checks",
    "engine.config.validation", "engine.config.fingerprint", "engine.config.__main__", "engine.config.reference",
    "engine.launch", "engine.launch.launcher", "engine.launch.dry_run", "engine.setup", "engine.setup.preflight",
    "engine.planner", "engine.planner.activations", "engine.planner.comm", "engine.planner.estimate",
    "engine.observe.hardware", "engine.planner.layout", "engine.planner.memory", "engine.planner.params",
    "engine.planner.real_plan", "engine.planner.reduction", "engine.planner.report", "engine.planner.schedule",
    "engine.planner.search",
    "engine.data.batch_sizes", "engine.data.tokenizer", "engine.data.prepared", "engine.data.sources",
    "engine.checkpoint.files", "engine.convert", "engine.convert.hf_adapter", "engine.observe",
    "models", "models.registry", "models.resolve", "models.common", "models.common.planning",
    "models.common.hf",
    "models.common.args", "models.common.moe_args", "models.common.checks", "models.common.shapes",
    "models.common.moe_shapes", "models.common.specs",
    "parallelisms.checks", "parallelisms.parallel_dims", "parallelisms.pipeline_plan", "parallelisms.float8_checks",
    "engine.planner.float8",
)
FAMILY_TORCH_FREE = ("args", "flavors", "checks", "planning", "hf")  # of each models/<family>/, when present

ENGINE = os.path.join(REPO, "engine")
MODELS = os.path.join(REPO, "models")


def python_files(folder: str) -> list[str]:
    """The ``.py`` files under ``folder``, recursively, as sorted paths."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names if n.endswith(".py")]
    return sorted(out)


def _family_packages() -> set[str]:
    """The model families' packages: the folders of models/ that are packages."""
    return {n for n in os.listdir(MODELS)
            if n != "common" and os.path.isfile(os.path.join(MODELS, n, "__init__.py"))}


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
    found = [v for path in python_files(ENGINE) for v in family_violations(path, families, words)]
    assert not found, "engine/ must reach model families only through models/registry.py:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from models.llama.flavors import llama3_flavors\n", "imports models.llama.flavors"),
    ("import models.moe\n", "imports models.moe"),
    ("from models import llama\n", "imports models.llama"),
    ("if cfg.model.name == 'moe':\n    pass\n", "names model family 'moe'"),
    ("ref = 'models.llama.hf:LLAMA_HF_ADAPTER'\n", "names model family"),
])
def test_family_check_catches(tmp_path, source, expected):
    """The checker itself finds each kind of violation (and a docstring mention is allowed)."""
    path = tmp_path / "x.py"
    path.write_text('"""Mentions llama in prose."""\n' + source)
    found = family_violations(str(path), _family_packages(), _family_words())
    assert len(found) == 1 and expected in found[0], found


def family_import_violations(path: str, family: str | None, families: set[str]) -> list[str]:
    """Imports in ``path`` (a module of models/<family>/, or of models/common/ when ``family`` is None)
    of another family: a family stands on models/common and the registry only, and common on no
    family."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    bad = {}
    for line, module in imported_modules(tree):
        parts = module.split(".")
        if parts[0] == "models" and len(parts) > 1 and parts[1] in families and parts[1] != family:
            bad.setdefault(line, module)  # one report per import statement
    return [f"{os.path.relpath(path, REPO)}:{line} imports {module}" for line, module in sorted(bad.items())]


def test_a_family_imports_only_common_and_the_registry():
    families = _family_packages()
    assert {"llama", "moe", "qwen3", "deepseek_v3"} <= families and "common" not in families
    found = [v for path in python_files(os.path.join(MODELS, "common"))
             for v in family_import_violations(path, None, families)]
    for family in sorted(families):
        found += [v for path in python_files(os.path.join(MODELS, family))
                  for v in family_import_violations(path, family, families)]
    assert not found, ("a family imports only models.common and models.registry (and itself), never another "
                       "family; models/common imports no family:\n" + "\n".join(found))


@pytest.mark.parametrize("family, source", [
    ("qwen3", "from models.llama.flavors import llama3_flavors\n"),
    ("deepseek_v3", "import models.moe\n"),
    (None, "from models.deepseek_v3.mtp import MTPModule\n"),
])
def test_family_import_check_catches(tmp_path, family, source):
    path = tmp_path / "x.py"
    path.write_text(source + "from models.common.decoder import Transformer\nfrom models.registry import ModelSpec\n")
    assert len(family_import_violations(str(path), family, _family_packages())) == 1


# (package, package it must never import): models/ and parallelisms/ stand below engine/; what scripts/
# (benchmarks included) or engine/ share with the tests lives in engine/testing/, not in tests/.
NEVER_IMPORTS = [("models", "engine"), ("parallelisms", "engine"), ("scripts", "tests"), ("engine", "tests")]


@pytest.mark.parametrize("package, forbidden", NEVER_IMPORTS)
def test_packages_never_import_the_ones_above_them(package, forbidden):
    found = []
    for path in python_files(os.path.join(REPO, package)):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        found += [f"{os.path.relpath(path, REPO)}:{line} imports {module}"
                  for line, module in imported_modules(tree) if module.split(".")[0] == forbidden]
    assert not found, f"{package}/ must not import {forbidden}/:\n" + "\n".join(sorted(set(found)))


# engine/'s floors (engine/docs/architecture.md, "Layers"): each package may import itself and the
# packages listed, nothing else, so no import runs back up; the table itself has no circle
# (test_the_layer_table_has_no_circle), and neither have the modules (test_engine_modules_form_no_circle).
ENGINE_LAYERS: dict[str, set[str]] = {
    "data": set(),
    "observe": set(),
    "config": {"data"},
    "checkpoint": {"config"},
    "setup": {"checkpoint", "config", "data", "observe"},
    "train": {"checkpoint", "config", "data", "observe", "setup"},
    "convert": {"checkpoint", "config", "data", "setup"},
    "planner": {"config", "observe", "setup"},
    "parity": {"config", "convert", "setup"},
    "launch": {"config", "observe", "planner", "setup"},
    "testing": set(),
}


def _engine_modules(root: str) -> dict[str, str]:
    """{module name: file} of every module under ``root``/engine (a package by its ``__init__``)."""
    out = {}
    for path in python_files(os.path.join(root, "engine")):
        parts = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def engine_imports(root: str) -> dict[str, list[tuple[int, str]]]:
    """{module: [(line, engine module it imports)]}, function-level imports included."""
    modules = _engine_modules(root)
    out = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        out[module] = [(line, target) for line, target in imported_modules(tree)
                       if target in modules and target != module]
    return out


def layering_violations(root: str, layers: dict[str, set[str]]) -> list[str]:
    """``"engine/a/x.py:L: a imports b (engine.b.y)"`` for each import between engine packages that
    ``layers`` does not allow, and each package missing from ``layers``."""
    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and os.path.isdir(os.path.join(root, *parts))) else None

    files, out = _engine_modules(root), set()
    for module, targets in engine_imports(root).items():
        source = package(module)
        if source is not None and source not in layers:
            out.add(f"engine/{source}/ is not in the layer table: give it a row")
            continue
        bad = {}  # (line, package) -> the most specific module named there
        for line, target in targets:
            goal = package(target)
            if source is not None and goal not in (None, source) and goal not in layers[source]:
                bad[line, goal] = max(bad.get((line, goal), ""), target, key=len)
        where = os.path.relpath(files[module], root)
        out.update(f"{where}:{line}: {source} imports {goal} ({target})" for (line, goal), target in bad.items())
    return sorted(out)


def module_circles(root: str) -> list[list[str]]:
    """The circles among engine's modules: each strongly connected component of the import graph with
    more than one module (Tarjan 1972), the modules sorted."""
    graph = {module: {target for _, target in targets} for module, targets in engine_imports(root).items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def table_circle(layers: dict[str, set[str]]) -> list[str]:
    """Packages left over when the table is peeled from the bottom (those that import nothing
    left): empty when the allowed imports form layers, else the packages on or above a circle."""
    left = {name: set(allowed) for name, allowed in layers.items()}
    while True:
        bottom = {name for name, allowed in left.items() if not allowed & left.keys()}
        if not bottom:
            return sorted(left)
        left = {name: allowed for name, allowed in left.items() if name not in bottom}


def test_the_layer_table_has_no_circle():
    assert table_circle(ENGINE_LAYERS) == [] and set(ENGINE_LAYERS) == {
        name for name in os.listdir(ENGINE) if os.path.isfile(os.path.join(ENGINE, name, "__init__.py"))}


def test_engine_imports_follow_the_layers():
    found = layering_violations(REPO, ENGINE_LAYERS)
    assert not found, ("engine/ packages import only the packages below them (ENGINE_LAYERS, engine/docs/"
                       "architecture.md 'Layers'):\n" + "\n".join(found))


def test_engine_modules_form_no_circle():
    found = module_circles(REPO)
    assert not found, "these engine modules import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layering_check_catches(tmp_path):
    """The checkers find an import that runs back up, a package without a row, a circle of modules
    (through a function-level import) and a circle in the table."""
    for package in ("low", "high", "new"):
        (tmp_path / "engine" / package).mkdir(parents=True)
        (tmp_path / "engine" / package / "__init__.py").write_text("")
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "high" / "top.py").write_text("from engine.low.base import f\n")
    (tmp_path / "engine" / "low" / "base.py").write_text(
        "def f():\n    from engine.high import top\n    return top\n")
    (tmp_path / "engine" / "new" / "x.py").write_text("import engine.low.base\n")
    layers = {"low": set(), "high": {"low"}}
    assert layering_violations(str(tmp_path), layers) == [
        "engine/low/base.py:2: low imports high (engine.high.top)",
        "engine/new/ is not in the layer table: give it a row"]
    assert module_circles(str(tmp_path)) == [["engine.high.top", "engine.low.base"]]
    assert table_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set(), "e": {"a"}}) == ["a", "b", "c", "e"]
    assert table_circle(layers) == []


_BLOCK_TORCH = """
import importlib, sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked: this module must import without torch")
        return None

sys.meta_path.insert(0, _NoTorch())
failed = []
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except Exception as error:
        failed.append(f"{module}: {type(error).__name__}: {error}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def torch_free_modules() -> list[str]:
    """:data:`TORCH_FREE` and the torch-free half of every model family."""
    modules = list(TORCH_FREE)
    for family in sorted(_family_packages()):
        modules.append(f"models.{family}")
        modules += [f"models.{family}.{name}" for name in FAMILY_TORCH_FREE
                    if os.path.isfile(os.path.join(MODELS, family, name + ".py"))]
    return modules


def import_without_torch(modules: list[str]) -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter whose import system refuses torch."""
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH, *modules], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_torch_free_list_imports_without_torch():
    modules = torch_free_modules()
    assert "models.common.args" in modules and "models.common.moe_shapes" in modules
    result = import_without_torch(modules)
    assert result.returncode == 0, "these modules must import without torch:\n" + result.stdout + result.stderr[-2000:]


def test_torch_blocker_catches_a_torch_import():
    result = import_without_torch(["engine.train.trainer"])
    assert result.returncode == 1 and "engine.train.trainer: ImportError: torch is blocked" in result.stdout, result
