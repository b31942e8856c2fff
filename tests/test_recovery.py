"""MLflow runs a killed flow left RUNNING are closed at the pipeline's next start.

Real flow runs on the session's Prefect test server (one crashed, one still running), real
MLflow runs in a SQLite store: only runs of the same pipeline whose flow run is over or
unknown are closed, with their running children.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tuneloop.tracking import recovery, runs
from tuneloop.training import checkpoints
from tuneloop.training.run import name_continued_run

# The whole suite (`make test`): the Prefect test server
pytestmark = pytest.mark.slow


def flow_run_in(state: Any) -> str:
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="recovery-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        created = client.create_flow_run(probe)
        client.set_flow_run_state(created.id, state, force=True)
    return str(created.id)


def test_runs_of_a_dead_flow_run_are_killed_with_the_reason(
    prefect_harness: None, tmp_path: Path
) -> None:
    from prefect.states import Crashed, Running

    crashed, running = flow_run_in(Crashed()), flow_run_in(Running())
    unknown, current = str(uuid.uuid4()), str(uuid.uuid4())
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("tuneloop", artifact_location=tmp_path.as_uri())

    def run(pipeline: str | None, flow_run: str, parent: str | None = None, stage: str = "") -> str:
        tags = {runs.TAG_FLOW_RUN: flow_run}
        if pipeline:
            tags[runs.TAG_PIPELINE] = pipeline
        if parent:
            tags |= {runs.TAG_PARENT: parent, runs.TAG_STAGE: stage}
        return client.create_run(experiment, run_name=stage or pipeline, tags=tags).info.run_id

    killed = run("retrain", crashed)
    finished_stage = run(None, crashed, killed, "ingest")
    client.set_terminated(finished_stage, status="FINISHED")
    hung_stage = run(None, crashed, killed, "train")
    lost = run("retrain", unknown)
    alive = run("retrain", running)
    alive_stage = run(None, running, alive, "train")
    other_pipeline = run("experiment", crashed)
    done = run("retrain", crashed)
    client.set_terminated(done, status="FINISHED")

    said = recovery.close_killed_runs(experiment, "retrain", current, client=client)

    def status(run_id: str) -> str:
        return client.get_run(run_id).info.status

    assert len(said) == 2
    for run_id in (killed, hung_stage):
        assert status(run_id) == "KILLED"
        reason = client.get_run(run_id).data.tags[runs.TAG_KILLED]
        assert reason == (
            f"its Prefect flow run {crashed} is CRASHED; closed when retrain flow run "
            f"{current} started"
        )
    assert status(lost) == "KILLED"
    assert "is unknown to the Prefect server" in client.get_run(lost).data.tags[runs.TAG_KILLED]
    assert status(finished_stage) == status(done) == "FINISHED"
    # A flow run still going keeps its runs; so does another pipeline until it starts again.
    assert status(alive) == status(alive_stage) == status(other_pipeline) == "RUNNING"
    assert recovery.close_killed_runs(experiment, "retrain", current, client=client) == []


@pytest.mark.parametrize("resumed", [True, False])
def test_a_resumed_train_run_names_the_run_it_continues(tmp_path: Path, resumed: bool) -> None:
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        record = checkpoints.RunRecord("fingerprint", "hash", "killed-run-id")
        prep = checkpoints.Preparation(resumed, record, "resuming" if resumed else "fresh")
        # An explicit experiment of this store: an earlier test's active experiment (set
        # process-wide by mlflow.set_experiment) does not exist here.
        experiment = MlflowClient().create_experiment("resume", artifact_location=tmp_path.as_uri())
        with mlflow.start_run(experiment_id=experiment) as run:
            name_continued_run(prep, run.info.run_id)
        tags = MlflowClient().get_run(run.info.run_id).data.tags
    finally:
        mlflow.set_tracking_uri(previous)
    assert tags.get(runs.TAG_RESUMES) == ("killed-run-id" if resumed else None)
