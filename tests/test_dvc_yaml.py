"""dvc.yaml is the contract: each stage written once, listing every local module it imports.

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
STAGES = list(DVC["stages"])
# Each task's stages: a ``foreach`` over params.yaml's tasks.
PER_TASK = [name for name, spec in DVC["stages"].items() if "foreach" in spec]


def body(stage: str) -> dict[str, Any]:
    """A stage's definition: a task's stage is its ``foreach`` group's ``do``."""
    spec: dict[str, Any] = DVC["stages"][stage]
    return spec.get("do", spec)


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


def render(value: str, folder: str = "tasks/orders", key: str = "orders") -> str:
    """Resolve ``${paths.x}`` the way DVC does from params.yaml (a task's ``${item.folder}``
    and ``${key}`` as given)."""
    value = value.replace("${item.folder}", folder).replace("${key}", key)
    while "${" in value:
        start = value.index("${")
        end = value.index("}", start)
        node = PARAMS
        for part in value[start + 2 : end].split("."):
            node = node[part]
        value = value[:start] + str(node) + value[end + 1 :]
    return value


@pytest.mark.parametrize("stage", STAGES)
def test_stage_lists_every_local_module_it_imports(stage: str) -> None:
    spec = body(stage)
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


def test_each_stage_is_written_once_and_a_tasks_once_for_every_task() -> None:
    commands = [body(stage)["cmd"] for stage in STAGES]
    assert len(set(commands)) == len(commands)
    for stage in STAGES:
        task = "" if stage in SHARED_STAGES else " --task ${key}"
        assert body(stage)["cmd"] == f"python -m stages.{stage}{task}"
    assert [s for s in STAGES if s not in PER_TASK] == list(SHARED_STAGES)
    assert all(DVC["stages"][s]["foreach"] == "${tasks}" for s in PER_TASK)
    assert task_stages("orders", ROOT) == tuple(f"{name}@orders" for name in PER_TASK)


@pytest.mark.parametrize("stage", STAGES)
def test_stage_param_groups_exist(stage: str) -> None:
    for key in body(stage)["params"]:
        node = PARAMS
        for part in key.replace("${key}", next(iter(PARAMS["tasks"]))).split("."):
            assert part in node, f"{stage}: param {key!r} is not in params.yaml"
            node = node[part]
    if stage in PER_TASK:
        # Its task's own settings (overrides, registered model, folder), no other task's.
        assert "tasks.${key}" in body(stage)["params"]
        assert "tasks" not in body(stage)["params"]


def test_stages_are_listed_in_an_order_they_can_run() -> None:
    # The flows and tests run the stages in dvc.yaml's order; it is checked against DVC's
    # graph of deps and outs.
    order = stage_order(ROOT)
    assert order == tuple(STAGES)
    assert order[: len(SHARED_STAGES)] == SHARED_STAGES and order[-1] == "evaluate"


# The project's metrics a task stage may read: its own task's file among them (its champion,
# stage champions). Not ingest's numbers, though the cards read them: they change with any
# task's records.
SHARED_METRICS = ("champions/${key}.json",)


def paths_of(spec: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for f in fields for e in spec.get(f, [])]


@pytest.mark.parametrize("stage", PER_TASK)
def test_a_task_stage_reads_and_writes_its_own_folder(stage: str) -> None:
    # Every path a task writes lies under its folder, so two tasks never share an out, and
    # what it reads of what a task writes is its own task's: a change to one task's data
    # reruns that task's stages alone.
    spec = body(stage)
    for path in paths_of(spec, ("outs", "metrics")):
        assert path.startswith("${item.folder}/"), f"{stage} writes {path} outside its folder"
    for path in paths_of(spec, ("deps",)):
        found = re.match(r"\$\{paths\.(\w+)\}(/.*)?$", path)
        if found is None:
            continue
        key, rest = found.group(1), (found.group(2) or "").lstrip("/")
        assert key not in PER_TASK_PATHS or rest in SHARED_METRICS, (
            f"{stage} reads {path}, not its task's: write ${{item.folder}}/{path}"
        )
        assert key != "pool" or rest == "records/${key}", f"{stage} reads every task's records"


def test_tasks_in_their_folders_write_nothing_a_shared_stage_writes() -> None:
    # DVC refuses an out inside another's: a task at the project's root writes beside the
    # shared stages, and one in tasks/<task> apart from them.
    shared = {render(p) for s in SHARED_STAGES for p in paths_of(body(s), ("outs", "metrics"))}
    for folder in (".", "tasks/orders"):
        for stage in PER_TASK:
            for path in paths_of(body(stage), ("outs", "metrics")):
                ours = Path(render(path, folder))
                assert not any(
                    ours.is_relative_to(p) or Path(p).is_relative_to(ours) for p in shared
                )
