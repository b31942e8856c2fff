"""dvc.yaml is the contract: every stage lists every local module it imports and its outs.

A module missing from a stage's deps means `dvc repro` would keep a stale
result after that module changed; this test finds such gaps by following
imports through the project's own packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from tuneloop.pipeline import stage_order

ROOT = Path(__file__).resolve().parents[1]
LOCAL_PACKAGES = ("tuneloop", "stages")
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def module_file(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return None


def local_imports(start: Path) -> set[Path]:
    """Every project module reachable by imports from ``start``, package __init__s included."""
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if not name.startswith(LOCAL_PACKAGES):
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the package __init__s run too
                    found = module_file(".".join(parts[:i]))
                    if found is not None:
                        todo.append(found)
    return seen


def runs_code(path: Path) -> bool:
    """True unless the module is a docstring alone (a package __init__ that imports nothing)."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def render(value: str) -> str:
    """Resolve ``${paths.x}`` the way DVC does from params.yaml."""
    while "${" in value:
        start = value.index("${")
        end = value.index("}", start)
        node = PARAMS
        for part in value[start + 2 : end].split("."):
            node = node[part]
        value = value[:start] + str(node) + value[end + 1 :]
    return value


@pytest.mark.parametrize("stage", sorted(DVC["stages"]))
def test_stage_lists_every_local_module_it_imports(stage: str) -> None:
    spec = DVC["stages"][stage]
    assert spec["cmd"] == f"python -m stages.{stage}"
    deps = {render(dep) for dep in spec["deps"]}
    # A package __init__ that is a docstring alone changes nothing a stage computes; one that
    # runs code (tuneloop's own sets environment variables) is a dep like any module.
    needed = {
        p.relative_to(ROOT).as_posix()
        for p in local_imports(ROOT / "stages" / f"{stage}.py")
        if p.name != "__init__.py" or runs_code(p)
    }
    missing = sorted(needed - deps)
    assert not missing, f"dvc.yaml stage {stage!r} lacks deps {missing}"


@pytest.mark.parametrize("stage", sorted(DVC["stages"]))
def test_stage_param_groups_exist(stage: str) -> None:
    for key in DVC["stages"][stage]["params"]:
        node = PARAMS
        for part in key.split("."):
            assert part in node, f"{stage}: param {key!r} is not in params.yaml"
            node = node[part]


def test_stages_are_listed_in_an_order_they_can_run() -> None:
    # The flows and tests run the stages in dvc.yaml's order; it is checked against DVC's
    # graph of deps and outs.
    order = stage_order(ROOT)
    assert order == tuple(DVC["stages"])
    assert order[0] == "base" and order[-1] == "evaluate"
