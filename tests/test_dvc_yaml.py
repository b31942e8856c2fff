"""dvc.yaml is the contract: every stage lists every local module it imports and its outs.

A module missing from a stage's deps means `dvc repro` would keep a stale
result after that module changed; this test finds such gaps by following
imports through the project's own packages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tuneloop.params import PER_TASK_PATHS
from tuneloop.pipeline import SHARED_STAGES, stage_order, task_stages

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
LOCAL_PACKAGES = ("tuneloop", "stages")
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
# The project's own stages; each task's are generated from them (``task_stage``).
OWN = [name for name, spec in DVC["stages"].items() if "foreach" not in spec]


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


@pytest.mark.parametrize("stage", sorted(OWN))
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


@pytest.mark.parametrize("stage", sorted(OWN))
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
    assert order == tuple(OWN)
    assert order[0] == "base" and order[-1] == "evaluate"


# What the shared stages write in paths.metrics.
SHARED_METRICS = ("ingest.json", "base.json")
# Not a dep of a task's stage: ingest's numbers (every task's, for the cards) change with any
# task's records; the task's own records (<pool>/records/<task>) are its dep.
DROPPED_DEPS = ("${paths.metrics}/ingest.json",)
# A task's own: tasks.<task>.registered_model.
DROPPED_PARAMS = ("tracking.registered_model",)


def task_path(path: str) -> str:
    """A path of the project's stage as the task's stage reads or writes it."""
    found = re.fullmatch(r"\$\{paths\.(\w+)\}(/.*)?", path)
    if not found:
        return path
    key, rest = found.group(1), found.group(2) or ""
    if key == "metrics" and rest.lstrip("/") in SHARED_METRICS:
        return path
    if key in PER_TASK_PATHS:
        return f"${{paths.task_folders}}/${{key}}/{path}"
    if key == "pool":
        return f"${{paths.pool}}/records/${{key}}{rest}"
    return path


def _entry(entry: Any) -> Any:
    if isinstance(entry, str):
        return task_path(entry)
    return {task_path(k): v for k, v in entry.items()}


def task_stage(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``foreach`` group of a project's stage: the same command, code deps and param
    groups, with the task's folders, records and params."""
    body: dict[str, Any] = {}
    for field, value in spec.items():
        if field == "cmd":
            body[field] = f"{value} --task ${{key}}"
        elif field == "deps":
            body[field] = [_entry(e) for e in value if e not in DROPPED_DEPS]
        elif field in ("outs", "metrics"):
            body[field] = [_entry(e) for e in value]
        elif field == "params":
            kept = [p for p in value if p not in DROPPED_PARAMS]
            body[field] = [*kept, "paths.task_folders", "tasks.${key}"]
        else:
            body[field] = value
    return {"foreach": "${tasks}", "do": body}


def test_each_task_stage_is_its_project_stage_with_the_tasks_paths() -> None:
    # One dvc.yaml holds both; were they written apart, a dep added to one would be missed
    # in the other.
    groups = [name for name in DVC["stages"] if name not in OWN]
    assert groups == [f"task-{name}" for name in OWN if name not in SHARED_STAGES]
    for name in groups:
        assert DVC["stages"][name] == task_stage(DVC["stages"][name.removeprefix("task-")])
    assert task_stages("copy", ROOT) == tuple(f"{name}@copy" for name in groups)


def test_task_stages_write_nothing_a_project_stage_writes() -> None:
    # DVC refuses an out inside another's, so a task's folders lie apart (paths.task_folders).
    project = {
        render(next(iter(o)) if isinstance(o, dict) else o)
        for spec in DVC["stages"].values()
        if "foreach" not in spec
        for o in [*spec.get("outs", []), *spec.get("metrics", [])]
    }
    for key in PER_TASK_PATHS:
        ours = Path(PARAMS["paths"]["task_folders"], "copy", PARAMS["paths"][key])
        assert not any(ours.is_relative_to(p) or Path(p).is_relative_to(ours) for p in project)
