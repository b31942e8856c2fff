"""Two tasks on one base through the whole pipeline: dvc.yaml's per-task stages, run by the
retrain flow, each task's data, folders, gate and registered model its own; a change to one
task reruns that task's stages alone."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.helpers import copy_project, write_params
from tuneloop.demo import domain
from tuneloop.judge.decision import Decision
from tuneloop.orchestration.flow_results import PipelineRun, TaskFailed, TasksRun, TaskUnchanged
from tuneloop.params import ParamsError, load_params

# The whole suite (`make test`): two tasks' pipelines under the retrain flow, dvc repro
pytestmark = pytest.mark.slow

TASKS: dict[str, dict[str, Any]] = {
    "support": {
        "folder": "tasks/support",
        "registered_model": "tuneloop-support",
        "suites": ["support_demo"],
    },
    # A task whose run preflight refuses (a learning rate that diverges): it fails alone.
    "broken": {
        "folder": "tasks/broken",
        "registered_model": "tuneloop-broken",
        "suites": ["support_demo"],
        "train": {"learning_rate": 0.5},
    },
    # A second task on the same base, with its own data, model and LoRA.
    "orders": {
        "folder": "tasks/orders",
        "registered_model": "tuneloop-orders",
        "suites": ["support_demo"],
        "train": {"lora_r": 4},
    },
    # One adapter on every task's records, judged beside each task's own.
    "all": {
        "folder": "tasks/all",
        "registered_model": "tuneloop-all",
        "suites": ["support_demo"],
        "records": "all",
    },
}


def dvc(repo: Path, *args: str) -> str:
    bin_dir = Path(sys.executable).parent
    # dvc.yaml's `python -m stages.x` must find this environment's python.
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(bin_dir / "dvc"), *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"dvc {' '.join(args)}: {done.stderr[-3000:]}"
    return done.stdout


# Three pipelines in one test module: what each task does is the code path, not the skill.
SMALL: dict[str, dict[str, Any]] = {
    "train": {"max_steps": 10},
    "evaluate": {"limit": 12, "general_limit": 24},
}


def changed_stages(repo: Path) -> set[str]:
    """The tasks' stages ``dvc status`` names as changed (not the shared ones, among them
    champions, which is always changed: it reads the registry, which DVC cannot see)."""
    status = json.loads(dvc(repo, "status", "--json"))
    return {stage for stage in status if "@" in stage}


@pytest.fixture(scope="module")
def two_tasks(
    tmp_path_factory: pytest.TempPathFactory, prefect_harness: None
) -> tuple[Path, TasksRun]:
    from flows.retrain import TasksFailed, retrain

    repo = copy_project(tmp_path_factory.mktemp("two-tasks"))
    write_params(repo, {"tasks": TASKS, **SMALL})
    subprocess.run(["git", "commit", "-qam", "two tasks"], cwd=repo, check=True)
    params = load_params(repo / "params.yaml")
    incoming = repo / params.paths.incoming
    # Each task's month in its own folder, from a seed of its own; broken's smaller.
    domain.seed_month(incoming / "support", params.demo)
    domain.seed_month(incoming / "orders", params.demo.model_copy(update={"seed": 7}))
    small = {"seed": 9, "n_support": 80, "n_badcases": 8}
    domain.seed_month(incoming / "broken", params.demo.model_copy(update=small))
    state = retrain(repo=repo, return_state=True)
    # The broken task fails: once the others ran, the flow run ends Failed, naming it.
    assert state.is_failed(), state
    failed = state.result(raise_on_failure=False)
    assert isinstance(failed, TasksFailed), failed
    assert "task broken: stage 'preflight@broken' failed" in str(failed), failed
    assert failed.result.report in str(failed), failed
    return repo, failed.result


def test_each_task_runs_its_own_pipeline_and_registers_its_own_model(
    two_tasks: tuple[Path, TasksRun],
) -> None:
    repo, result = two_tasks
    # The task between them failed in preflight, and the next task still ran.
    assert result.failed == ["broken"]
    broken = result.tasks["broken"]
    assert isinstance(broken, TaskFailed) and "preflight@broken" in broken.error
    assert not (repo / "tasks/broken/models/adapter").exists()
    # In MLflow its run failed, and the retrain's with it; the other tasks' runs finished.
    store = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    retrain_run = store.get_run(result.mlflow_run_id)
    assert retrain_run.info.status == "FAILED"
    found = store.search_runs(
        [retrain_run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'",
    )
    status = {r.data.tags["task"]: r.info.status for r in found if "task" in r.data.tags}
    assert status == dict.fromkeys(TASKS, "FINISHED") | {"broken": "FAILED"}, status
    for task in ("support", "orders"):
        outcome = result.tasks[task]
        assert isinstance(outcome, PipelineRun), outcome
        folder = repo / "tasks" / task
        # Its own adapter, trained on its own records, judged by its own gate.
        assert (folder / "models/adapter/adapter_config.json").exists()
        assert json.loads((folder / "models/adapter/adapter_config.json").read_text())["r"] == (
            4 if task == "orders" else load_params(repo / "params.yaml").train.lora_r
        )
        decision = Decision.read(folder / "metrics/decision.json")
        assert decision.passed is outcome.decision.passed
        assert outcome.registration is not None
        assert outcome.registration.name == TASKS[task]["registered_model"]
        # Its records only: clean saw the pool batches of its own folder.
        clean = json.loads((folder / "metrics/clean.json").read_text())
        assert clean["batches"] and all(b.endswith(f"_{task}") for b in clean["batches"])
    # The interference report: a row per task, each adapter new, nothing moved unrun.
    report = Path(result.report).read_text()
    assert result.report_text == report  # the month's own, kept when the file is rewritten
    assert "| broken | failed |" in report and "Moved without running: none." in report
    for task in ("support", "orders"):
        assert f"| {task} | ran | none -> " in report
    # The month on the results branch: the lock, each task's metrics, the report.
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", result.results.branch],
        cwd=repo, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for path in ("dvc.lock", "reports/tasks.md", "tasks/orders/metrics/decision.json"):
        assert path in listed, path
    # The single adapter trained on every task's records (copies in its own folder), judged
    # and registered as its own model, then set beside each task's adapter that ran.
    single = result.tasks["all"]
    assert isinstance(single, PipelineRun) and single.registration is not None, single
    assert single.registration.name == "tuneloop-all"
    clean = json.loads((repo / "tasks/all/metrics/clean.json").read_text())
    assert {b.rsplit("_", 1)[1] for b in clean["batches"]} == {"all"}
    accepted = json.loads((repo / "metrics/ingest.json").read_text())["accepted_by_task"]
    assert clean["records_in"] == sum(accepted[t] for t in ("support", "orders", "broken"))
    compared = {(row.task, row.suite, row.metric): row for row in result.compared or []}
    assert {task for task, _, _ in compared} == {"support", "orders"}
    row = compared[("orders", "support_demo", "accuracy")]
    orders = json.loads((repo / "tasks/orders/metrics/evaluate.json").read_text())
    mine = json.loads((repo / "tasks/all/metrics/evaluate.json").read_text())
    assert row.value == pytest.approx(orders["candidate"]["support_demo"]["accuracy"])
    assert row.reference_value == pytest.approx(mine["candidate"]["support_demo"]["accuracy"])
    assert row.items == SMALL["evaluate"]["limit"]
    assert row.better in ("adapter", "single", "no settled difference")
    assert "One adapter on every task's data (tuneloop-all): ran, gate " in report
    assert "registered as v1" in report and "| orders | support_demo/accuracy |" in report


@pytest.fixture(scope="module")
def orders_month_2(two_tasks: tuple[Path, TasksRun]) -> tuple[set[str], set[str]]:
    """New records for orders alone, ingested; the stages DVC saw changed before and after."""
    repo, _ = two_tasks
    before = changed_stages(repo)
    params = load_params(repo / "params.yaml")
    domain.seed_month(
        repo / params.paths.incoming / "orders",
        params.demo.model_copy(update={"seed": 8, "n_support": 40, "n_badcases": 4}),
        month=2,
    )
    dvc(repo, "repro", "--single-item", "ingest")
    return before, changed_stages(repo)


def test_a_change_to_one_task_reruns_only_that_tasks_stages(
    two_tasks: tuple[Path, TasksRun], orders_month_2: tuple[set[str], set[str]]
) -> None:
    repo, _ = two_tasks
    before, changed = orders_month_2
    # What ran is up to date; the broken task's refused stage and those after it are not.
    assert {s for s in before if not s.endswith("@broken")} == set()
    # New records for orders alone: after ingest, only orders' stages see new data.
    assert changed, "the new records changed nothing"
    # (and the task on every task's records, which holds a copy of them).
    assert all(stage.endswith(("@orders", "@broken", "@all")) for stage in changed), changed
    assert not any(stage.endswith("@support") for stage in changed), changed
    assert {"clean@orders", "clean@all"} <= changed
    # A param of one task: that task's stages, none of the other's.
    support = {**TASKS["support"], "gate": {"min_gain": 0.5}}
    write_params(repo, {"tasks": {**TASKS, "support": support}, **SMALL})
    changed = changed_stages(repo)
    support = {stage for stage in changed if stage.endswith("@support")}
    assert support and "train@support" in support
    # Nor ingest, which reads the tasks' names alone: through task_names' file, which a
    # task's own settings leave as it was.
    status = set(json.loads(dvc(repo, "status", "--json")))
    assert "task_names" in status and "ingest" not in status, sorted(status)


def test_one_task_is_run_by_hand_and_the_others_stay_as_they_were(
    two_tasks: tuple[Path, TasksRun],
    orders_month_2: tuple[set[str], set[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flows.retrain import retrain
    from tuneloop.cli import main

    repo, _ = two_tasks
    locked = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    with pytest.raises(ParamsError, match=r"not there: \['nope'\]"):
        retrain(repo=repo, tasks=["nope"])
    # orders has new records (orders_month_2): its month reruns, support's does not. By
    # hand, as an operator runs it: `tuneloop retrain --task orders`.
    capsys.readouterr()
    assert main(["retrain", "--repo", str(repo), "--task", "orders", "--json"]) == 0
    summary, _, dumped = capsys.readouterr().out.partition("\n{\n")
    result = json.loads("{\n" + dumped)
    assert set(result["tasks"]) == {"orders"} and result["failed"] == []
    # The summary: the task that ran, its gate, and the report's row of the one that did not.
    assert "--- task orders" in summary and "\ngate   " in summary, summary
    assert "--- task support" not in summary and "| support | not run |" in summary, summary
    # By hand, the tasks named: the single adapter is the scheduled month's comparison.
    assert result["compared"] is None
    after = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    for stage in ("clean", "train", "evaluate"):
        assert after[f"{stage}@support"] == locked[f"{stage}@support"], stage
    assert after["clean@orders"] != locked["clean@orders"]
    # The report says so: support did not run, and its adapter and champion did not move.
    report = Path(result["report"]).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| support |"))
    assert "| not run |" in row and "(untouched)" in row, row
    assert "Moved without running: none." in report
    # Its scores: those of its last evaluation, which dvc.lock ties to the adapter it has.
    judged = json.loads((repo / "tasks/support/metrics/evaluate.json").read_text())
    accuracy = judged["candidate"]["support_demo"]["accuracy"]
    assert f"last judged (this adapter): support_demo/accuracy {accuracy:.3f}" in row, row


def test_on_the_schedule_a_task_whose_champion_trained_on_all_its_records_keeps_it(
    two_tasks: tuple[Path, TasksRun],
) -> None:
    from mlflow.tracking import MlflowClient

    from flows.retrain import nothing_new
    from tuneloop.judge import tasks_report
    from tuneloop.tracking import registry, runs

    repo, result = two_tasks
    params = load_params(repo / "params.yaml")
    support = params.for_task("support")
    # As the flow reads them: in the project (its paths are relative), from its store.
    with contextlib.chdir(repo), runs.use_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}"):
        # No champion yet (the test registered no base): there is something new to learn.
        assert nothing_new(support) is None
        # Support's candidate released: its champion trained on every support batch there is.
        support_run = result.tasks["support"]
        assert isinstance(support_run, PipelineRun) and support_run.registration is not None
        version = support_run.registration.version
        name = support.tracking.registered_model
        MlflowClient().set_registered_model_alias(name, registry.CHAMPION, str(version))
        said = nothing_new(support)
        assert said == (
            f"no new records since {name} v{version}: it trained on all 1 pool batch(es) "
            "of the task"
        )
        # Orders has records its champion (the base) never saw.
        assert nothing_new(params.for_task("orders")) is None
        # The report's row for a task left alone, and it did not count as moved.
        state = tasks_report.states(repo, params)
        assert said is not None
        text = tasks_report.report(params, state, state, {"support": TaskUnchanged(reason=said)})
    row = next(line for line in text.splitlines() if line.startswith("| support |"))
    assert "| nothing new | " in row and said in row and "(untouched)" in row, row
    assert "Moved without running: none." in text
