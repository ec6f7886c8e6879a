"""The package's layers: every import inside `dhpo_trl` points to the same layer or one below it, never up.

    0  user_errors                     one-line errors shared by every command
    1  core, scoring                   pure method; bounded scoring of model text
    2  training (and the package face) DHPOTrainer and its update engine
    3  scale_out, demo, evaluation     commands and programs built on the trainer

Imports are read from the source (relative ones resolved), so a lazy import inside a function counts too. The package
face imports its public names on first use, so that `import dhpo_trl` and the light modules below import no torch.
"""

import ast
import importlib
import json
import sys
from pathlib import Path

import processes
import pytest

import dhpo_trl

PACKAGE = Path(dhpo_trl.__file__).parent
LAYERS = {"user_errors": 0, "core": 1, "scoring": 1, "training": 2, "__init__": 2, "__main__": 3,
          "scale_out": 3, "demo": 3, "evaluation": 3}  # fmt: skip


def part(module: str) -> str:
    """`dhpo_trl.training.batching` -> `training`; `dhpo_trl` -> `__init__`."""
    pieces = module.split(".")
    assert pieces[0] == "dhpo_trl", module
    return pieces[1] if len(pieces) > 1 else "__init__"


def imported_modules(path: Path) -> list[str]:
    """Absolute `dhpo_trl...` names that one source file imports."""
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(relative.parts[:-1])  # the package this file lives in
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "dhpo_trl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "dhpo_trl":
                continue
            for alias in node.names:  # `from .. import x`: x may itself be a module or a package
                full = f"{module}.{alias.name}"
                found.append(full if is_module(full) else module)
    return found


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_file_lies_in_a_known_layer():
    assert len(SOURCES) > 30
    unknown = [str(path) for path in SOURCES if part(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
               not in LAYERS]  # fmt: skip
    assert unknown == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(path.relative_to(PACKAGE)) for path in SOURCES])
def test_no_import_points_up(path):
    importer = part(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    upward = [module for module in imported_modules(path) if LAYERS[part(module)] > LAYERS[importer]]
    assert upward == [], f"{path.relative_to(PACKAGE)} (layer {LAYERS[importer]}) imports a higher layer"


def test_the_resolver_sees_relative_imports(tmp_path):
    """The check above can fail: a training module importing a command module is found."""
    training = PACKAGE / "training" / "trainer.py"
    assert "dhpo_trl.core.config" in imported_modules(training)
    assert "dhpo_trl.training.batching" in imported_modules(training)
    fake = PACKAGE / "training" / "_layout_probe.py"
    try:
        fake.write_text("def f():\n    from ..scale_out import cli\n    from ..demo.tiny import build_tiny_qwen3\n")
        assert imported_modules(fake) == ["dhpo_trl.scale_out.cli", "dhpo_trl.demo.tiny"]
    finally:
        fake.unlink()


def test_public_names_come_from_the_package():
    from dhpo_trl.core.config import DHPOConfig
    from dhpo_trl.core.losses import dhpo_per_token_loss, gmpo_per_token_loss
    from dhpo_trl.scoring.rewards import math_verify_reward
    from dhpo_trl.training.trainer import DHPOTrainer

    assert (dhpo_trl.DHPOConfig, dhpo_trl.DHPOTrainer, dhpo_trl.math_verify_reward) == (
        DHPOConfig, DHPOTrainer, math_verify_reward)
    assert (dhpo_trl.dhpo_per_token_loss, dhpo_trl.gmpo_per_token_loss) == (dhpo_per_token_loss, gmpo_per_token_loss)
    assert set(dhpo_trl.__all__) >= {"DHPOConfig", "DHPOTrainer", "math_verify_reward", "dhpo_per_token_loss"}


def test_the_trainer_only_wires_and_training_functions_stay_short():
    """The trainer wires pure modules (at most 300 lines); no function of `training/` runs past 60 lines."""
    assert len((PACKAGE / "training" / "trainer.py").read_text().splitlines()) <= 300
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((PACKAGE / "training").glob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60]
    assert long == []


def test_the_lazily_imported_public_names_lie_no_higher_than_the_package_face():
    """The package face names its modules as strings (imported on first use), which the source check cannot read."""
    modules = [importlib.util.resolve_name(module, "dhpo_trl") for module in dhpo_trl._PUBLIC.values()]
    assert all(is_module(module) for module in modules), modules
    assert [module for module in modules if LAYERS[part(module)] > LAYERS["__init__"]] == []
    assert set(dhpo_trl.__all__) == set(dhpo_trl._PUBLIC) | {"__version__"}


def test_each_public_name_is_imported_on_first_use_and_kept(monkeypatch):
    for name in dhpo_trl._PUBLIC:
        monkeypatch.delitem(vars(dhpo_trl), name, raising=False)  # as in a fresh interpreter; restored after the test
    assert set(dir(dhpo_trl)) >= set(dhpo_trl.__all__)
    from dhpo_trl import DHPOTrainer

    assert DHPOTrainer is importlib.import_module("dhpo_trl.training.trainer").DHPOTrainer
    for name, module in dhpo_trl._PUBLIC.items():
        value = getattr(dhpo_trl, name)
        assert value is getattr(importlib.import_module(module, "dhpo_trl"), name)
        assert vars(dhpo_trl)[name] is value  # kept in the globals: later lookups do not reach `__getattr__`


def test_a_name_the_package_does_not_have_is_an_attribute_error():
    assert not hasattr(dhpo_trl, "DHPOTrainers")
    assert getattr(dhpo_trl, "__wrapped__", None) is None  # what `inspect` and `doctest` probe
    with pytest.raises(AttributeError) as missing:
        dhpo_trl.training_loss  # noqa: B018
    assert (missing.value.name, missing.value.obj) == ("training_loss", dhpo_trl)
    with pytest.raises(ImportError):
        from dhpo_trl import DHPOTrainers  # noqa: F401


HEAVY = ("torch", "transformers", "trl", "accelerate", "datasets")
PROBE = """
import json, sys
import {modules}
light = sorted(name for name in {heavy!r} if name in sys.modules)
dhpo_trl.dhpo_per_token_loss  # a public name, imported on first use: torch and nothing else heavy
print(json.dumps([light, sorted(name for name in {heavy!r} if name in sys.modules)]))
"""


def test_the_package_and_a_cell_pool_import_no_heavy_library():
    """A fresh interpreter that imports the package and what a cell pool's workers import as they start (they
    unpickle the pool's initializer, `cell_pool.report_pid`) has no torch, TRL or transformers in `sys.modules`; a
    public name used next brings in torch, so the probe sees an import when there is one."""
    modules = "dhpo_trl, dhpo_trl.demo.cell_pool, dhpo_trl.demo.stops, dhpo_trl.user_errors"
    result = processes.run([sys.executable, "-c", PROBE.format(modules=modules, heavy=HEAVY)], timeout=120,
                           cwd=PACKAGE.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], ["torch"]]


def test_training_stopped_is_one_class_in_a_standard_library_module():
    """The class `cell_pool` raises is the one the studies catch (`from dhpo_trl.demo.embedded import ...`), defined
    in a module that imports only the standard library."""
    from dhpo_trl.demo import cell_pool, embedded, stops

    assert embedded.TrainingStopped is stops.TrainingStopped is cell_pool.TrainingStopped
    source = ast.parse((PACKAGE / "demo" / "stops.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(source) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module.split(".")[0] for node in ast.walk(source)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}  # fmt: skip
    relative = [node.module for node in ast.walk(source) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == [] and imported <= set(sys.stdlib_module_names) | {"__future__"}, (relative, imported)
