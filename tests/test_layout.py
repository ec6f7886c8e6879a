"""The package's layers: every import inside `dhpo_trl` points to the same layer or one below it, never up.

    0  user_errors                     one-line errors shared by every command
    1  core, scoring                   pure method; bounded scoring of model text
    2  training (and the package face) DHPOTrainer and its update engine
    3  scale_out, demo, evaluation     commands and programs built on the trainer

Imports are read from the source (relative ones resolved), so a lazy import inside a function counts too.
"""

import ast
from pathlib import Path

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
