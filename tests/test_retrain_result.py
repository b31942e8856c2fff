"""What the retrain flow gives back when a task fails, whatever the number of tasks: the
error that ends the flow run Failed, naming each failed task, and the summary ``tuneloop
retrain`` still prints of the month. The flow itself: tests/test_flow.py (one task) and
tests/test_tasks_pipeline.py (several)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from tuneloop.cli import main
from tuneloop.orchestration.flow_results import TaskFailed, TasksRun, TaskUnchanged

# The fast tier: no pipeline, server or rank.
pytestmark = pytest.mark.fast

ERROR = "stage 'preflight@broken' failed (dvc repro exit 1)"


def a_month() -> TasksRun:
    return TasksRun(
        tasks={
            "support": TaskUnchanged(reason="no new records since tuneloop-support v2"),
            "broken": TaskFailed(error=ERROR),
        },
        failed=["broken"],
        report="/project/reports/tasks.md",
        report_text="| support | nothing new |\n| broken | failed |",
        mlflow_run_id="run-1",
    )


def test_the_error_names_each_failed_task_and_holds_the_month() -> None:
    from flows.retrain import TasksFailed

    failed = TasksFailed(a_month())
    assert str(failed) == (
        f"1 of 2 task(s) failed: task broken: {ERROR} "
        "(every task's outcome: /project/reports/tasks.md)"
    )
    # Prefect may keep a failed flow run's exception pickled: it comes back whole.
    again = pickle.loads(pickle.dumps(failed))
    assert isinstance(again, TasksFailed) and again.result == failed.result
    assert str(again) == str(failed)


def test_the_command_prints_the_month_then_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flows.retrain

    def retrain(**_: Any) -> TasksRun:
        raise flows.retrain.TasksFailed(a_month())

    monkeypatch.setattr(flows.retrain, "retrain", retrain)
    assert main(["retrain", "--json"]) == 1
    out, err = capsys.readouterr()
    assert "--- task support\nnot run: no new records since tuneloop-support v2" in out
    assert f"--- task broken\nFAILED: {ERROR}" in out and "| broken | failed |" in out
    assert TasksRun.model_validate_json(out[out.index("\n{") :]) == a_month()
    assert f"tuneloop retrain: 1 of 2 task(s) failed: task broken: {ERROR}" in err
