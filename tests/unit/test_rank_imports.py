"""What a rank imports when it starts (the trainer, engine/train/trainer.py, and what its import runs):
not torch.distributed.pipelining, which only a run with pipeline stages uses (engine/train/runner.py's
PipelineRunner imports it): 0.5 s of CPU in every rank that ./run_train.sh or a parity sweep starts.
Read statically, like tests/unit/test_preflight_imports.py."""

from __future__ import annotations

import os

from tests.unit import test_preflight_imports as reading

RANK_ENTRY = "engine.train.trainer"
PIPELINE_ONLY = ("torch.distributed.pipelining", "parallelisms.pipeline")


def import_time_modules(entry: str) -> dict[str, str]:
    """{module: "path:line" of the first import that reaches it} for every module that importing
    ``entry`` runs: the import-time imports (not those inside functions) of ``entry``, of every repo
    module they reach (parent packages too), and the third-party modules they name (not followed)."""
    reached: dict[str, str] = {}
    todo, seen = [entry], set()
    while todo:
        module = todo.pop()
        if module in seen or reading._module_file(module) is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for node in reading._import_statements(reading._parse(module).body, into_functions=False):
            for target, _ in reading._targets(node, module):
                where = f"{os.path.relpath(reading._module_file(module), reading.REPO)}:{node.lineno}"
                reached.setdefault(target, where)
                if reading._module_file(target) is not None:
                    todo.append(target)
    return reached


def _pipeline_only(reached: dict[str, str]) -> list[str]:
    return sorted(f"{where} imports {module}" for module, where in reached.items()
                  if any(module == name or module.startswith(name + ".") for name in PIPELINE_ONLY))


def test_a_rank_imports_no_pipelining_at_start_up():
    found = _pipeline_only(import_time_modules(RANK_ENTRY))
    assert not found, ("a rank without pipeline parallel must not import torch.distributed.pipelining "
                       "(import it where the pipeline is built):\n" + "\n".join(found))


def test_rank_import_check_catches(tmp_path, monkeypatch):
    """A module-level import two modules down is found; one inside a function is not."""
    package = tmp_path / "engine_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "trainer.py").write_text("import os\nfrom engine_probe.runner import Runner\n")
    (package / "runner.py").write_text("from torch.distributed.pipelining import PipelineStage\n\n"
                                       "class Runner:\n    def build(self):\n        import parallelisms.pipeline\n")
    monkeypatch.setattr(reading, "REPO", str(tmp_path))
    found = _pipeline_only(import_time_modules("engine_probe.trainer"))
    assert found == ["engine_probe/runner.py:1 imports torch.distributed.pipelining"], found
