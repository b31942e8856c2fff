"""The ``tasks:`` group: each task's view of the params, and what a wrong one says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import task_entry
from tuneloop.cli import main
from tuneloop.params import PER_TASK_PATHS, ParamsError, load_params, parse_params

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

TASKS = {
    "support": task_entry("support"),
    "copy": {
        **task_entry("copy", "copy_demo"),
        "public_model": "product-copy",
        "gate": {"min_gain": 0.1, "max_broken_fixes": 0},
        "train": {"lora_r": 8, "learning_rate": 2.0e-4},
    },
}


def shipped() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(Path("params.yaml").read_text())
    return data


def with_tasks(tasks: Any) -> dict[str, Any]:
    return {**shipped(), "tasks": tasks}


def test_a_project_of_one_task_lists_it_in_the_projects_folders() -> None:
    params = load_params()
    assert params.task_names() == ("support",) and params.task is None
    support = params.the_task()
    assert support.task == "support" and support == params.for_task("support")
    # Its folder is the project's root, its model and suites tracking's and evaluate's.
    assert support.paths == params.paths
    assert support.tracking == params.tracking and support.evaluate == params.evaluate
    # One router: no /tasks/<task> prefix.
    assert support.release.routers == params.release.routers
    assert params.public_model("support") == "support"
    with pytest.raises(ParamsError, match=r"no task 'copy'.*\['support'\]"):
        params.for_task("copy")


def test_each_task_sees_its_model_suites_overrides_and_folders() -> None:
    params = parse_params(with_tasks(TASKS))
    assert params.task_names() == ("support", "copy")
    copy, support = params.for_task("copy"), params.for_task("support")
    assert copy.tracking.registered_model == "tuneloop-copy"
    assert copy.evaluate.suites == ("copy_demo",)
    assert (copy.gate.min_gain, copy.gate.max_broken_fixes) == (0.1, 0)
    assert copy.train.lora_r == 8 and copy.train.learning_rate == 2.0e-4
    # What the task did not override is the shared value.
    assert support.gate == params.gate and support.train == params.train
    assert copy.gate.max_forgetting == params.gate.max_forgetting
    assert copy.evaluate.general_suites == params.evaluate.general_suites
    assert copy.task == "copy" and params.task is None
    with pytest.raises(ParamsError, match=r"lists tasks \['support', 'copy'\]: give --task"):
        params.the_task()
    for key in PER_TASK_PATHS:
        own = Path("tasks/copy") / getattr(params.paths, key)
        assert getattr(copy.paths, key) == own, key
        assert copy.project_path(key) == getattr(params.paths, key)
    assert copy.paths.clean != support.paths.clean
    for shared in ("incoming", "pool", "base_model", "downloads", "eval_suites"):
        assert getattr(copy.paths, shared) == getattr(params.paths, shared), shared
    # Its regression suite's items lie in its folder (the suite's loader reads them there).
    assert copy.paths.fixed_badcases == Path("tasks/copy/data/fixed_badcases")
    # Its release, rollback and status reach its own router on each replica.
    assert copy.release.routers == tuple(
        f"{url.rstrip('/')}/tasks/copy" for url in params.release.routers
    )
    assert params.public_model("copy") == "product-copy"
    assert params.public_model("support") == "support"


def test_a_params_file_from_before_tasks_is_shown_the_new_shape() -> None:
    data = shipped()
    del data["tasks"]
    with pytest.raises(ParamsError, match=r"tasks: required key is missing \(list each task"):
        parse_params(data)
    for old, new in (
        (
            {"tasks": {}},
            "no tasks: list each task with its folder: `tasks: {support: {folder: .}}`",
        ),
        ({"paths": {**data["paths"], "task_folders": "tasks"}}, "tasks.<task>.folder"),
        ({"schedule": {**data["schedule"], "task_models": "both"}}, "`records: all`"),
    ):
        with pytest.raises(ParamsError) as raised:
            parse_params({**shipped(), **old})
        assert new in str(raised.value), str(raised.value)


def test_the_command_line_says_what_is_wrong_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = shipped()
    del data["tasks"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("tuneloop status: ") and "{support: {folder: .}}" in said, said
    assert "Traceback" not in said and len(said.splitlines()) <= 3, said


def test_an_absolute_path_of_a_task_is_its_own_subfolder() -> None:
    data = with_tasks(TASKS)
    data["paths"] = {**data["paths"], "checkpoints": "/scratch/ckpt"}
    copy = parse_params(data).for_task("copy")
    assert copy.paths.checkpoints == Path("/scratch/ckpt/copy")
    assert copy.project_path("checkpoints") == Path("/scratch/ckpt")


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        (None, "no tasks: list each task with its folder"),
        ({"Support": TASKS["support"]}, "name 'Support' must match"),
        ({"support": {"suites": ["support_demo"]}}, "tasks.support.folder: required key"),
        ({"support": {**TASKS["support"], "folder": "../x"}}, "must be a folder inside"),
        (
            {"support": TASKS["support"], "copy": {**TASKS["copy"], "folder": "tasks/support"}},
            "share folder 'tasks/support'",
        ),
        (
            {"support": TASKS["support"], "copy": {**TASKS["copy"], "registered_model": None}},
            "share registered_model 'tuneloop-support'",
        ),
        ({"support": {**TASKS["support"], "suites": []}}, "tasks.support.suites"),
        ({"support": {**TASKS["support"], "owner": "me"}}, "tasks.support.owner: unknown key"),
        (
            {
                "support": TASKS["support"],
                "copy": {**TASKS["copy"], "registered_model": "tuneloop-support"},
            },
            "share registered_model 'tuneloop-support'",
        ),
        (
            {"support": TASKS["support"], "copy": {**TASKS["copy"], "public_model": "support"}},
            "share public_model 'support'",
        ),
        ({"copy": {**TASKS["copy"], "gate": {"min_gian": 0.1}}}, "tasks.copy.gate: min_gian"),
        ({"copy": {**TASKS["copy"], "train": {"lora_r": -1}}}, "tasks.copy.train: lora_r"),
    ],
)
def test_a_wrong_task_is_refused_naming_it(tasks: Any, message: str) -> None:
    with pytest.raises(ParamsError) as raised:
        parse_params(with_tasks(tasks))
    assert message in str(raised.value), str(raised.value)


def test_a_task_on_every_tasks_records_is_judged_on_their_suites() -> None:
    def data(suites: list[str]) -> dict[str, Any]:
        everyone = {"folder": "tasks/all", "registered_model": "tuneloop-all", "suites": suites}
        return with_tasks({**TASKS, "all": {**everyone, "records": "all"}})

    with pytest.raises(ParamsError, match=r"task all trains on every .* lack \['copy_demo'\]"):
        parse_params(data(["support_demo"]))
    params = parse_params(data(["support_demo", "copy_demo"]))
    assert params.tasks["all"].records == "all" and params.tasks["copy"].records == "own"
    assert params.for_task("all").tracking.registered_model == "tuneloop-all"
