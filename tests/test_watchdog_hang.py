"""A real hang on CPU: two gloo ranks under torchrun, one with a batch fewer.

Rank 1 reaches the epoch-end barrier (inside its "checkpoint" section) while
rank 0 waits in the gradient all-reduce of its extra batch; gloo's timeout is
300 s, so nothing ends it but the watchdog. On this machine there is no GPU, so
the watchdog runs on the heartbeat alone (``--heartbeat-only`` keeps it so on a
GPU node too). The balanced job must run to its end untouched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tuneloop.telemetry.actions import find_py_spy
from tuneloop.telemetry.heartbeat import read_heartbeats
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE, watch_main

DDP_HANG = Path(__file__).parent / "fixtures" / "ddp_hang.py"
DEADLOCK_AFTER_S = 10.0
ENDED_WITHIN_S = DEADLOCK_AFTER_S + 15.0


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(DDP_HANG),
        *args,
    ]


def _watch(out: Path, *job_args: str) -> int:
    return watch_main(
        [
            "--heartbeat-only",
            "--deadlock-after",
            str(DEADLOCK_AFTER_S),
            "--kill-grace",
            "5",
            "--out-dir",
            str(out),
            "--",
            *_torchrun(*job_args),
        ]
    )


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A local SQLite tracking store (created once: its schema takes seconds)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    experiment = MlflowClient(uri).create_experiment("watchdog", (root / "artifacts").as_uri())
    return uri, experiment


@pytest.fixture
def mlflow_run(mlflow_store: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh run, handed to the watchdog the way a flow would: through the environment."""
    from mlflow.tracking import MlflowClient

    uri, experiment = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    return client, run_id


@pytest.fixture(autouse=True)
def _small_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ranks on two cores: one thread each, or they trip over each other.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_hang_is_caught_stacks_dumped_run_failed(tmp_path: Path, mlflow_run: Any) -> None:
    client, run_id = mlflow_run

    out = tmp_path / "watch"
    code = _watch(out, "--imbalanced")

    assert code == WATCHDOG_EXIT_CODE
    records = read_heartbeats(out / "heartbeat.json")
    assert [r.rank for r in records] == [0, 1]
    # Rank 1 finished its 11 batches and went on to the epoch-end save; rank 0 did not.
    assert records[1].section == "checkpoint" and records[0].section is None
    manifest = json.loads((out / "watch.json").read_text())
    last_sign_of_life = max(r.time for r in records)
    assert manifest["job_ended_at"] - last_sign_of_life <= ENDED_WITHIN_S
    assert not any(psutil.pid_exists(r.pid) for r in records), "a rank outlived the watchdog"

    if find_py_spy() is not None:
        stacks = (out / "stacks.txt").read_text()
        assert stacks.count("=== pid") == 3  # torchrun and both ranks
        assert "backward" in stacks and "barrier" in stacks  # where each rank waits
    else:  # the ranks registered faulthandler: their stacks went to the job's stderr
        assert (
            "faulthandler signal"
            in json.loads((out / "watch.json").read_text())["actions"]["stacks"]
        )

    assert manifest["alarm"]["kind"] == "deadlock"
    assert manifest["actions"]["mlflow"] == "done"

    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "no training step" in run.data.tags["tuneloop.watchdog.reason"]
    logged = {a.path for a in client.list_artifacts(run_id, "watchdog")}
    assert {
        "watchdog/reason.txt",
        "watchdog/timeline.tsv",
        "watchdog/stacks.txt",
        "watchdog/accounting.json",
    } <= logged


def test_balanced_job_runs_to_the_end_untouched(tmp_path: Path, mlflow_run: Any) -> None:
    client, run_id = mlflow_run
    out = tmp_path / "watch"
    checkpoint = tmp_path / "model.pt"
    code = _watch(out, "--checkpoint", str(checkpoint))
    assert code == 0
    assert checkpoint.exists()
    assert not (out / "stacks.txt").exists()
    manifest = json.loads((out / "watch.json").read_text())
    assert manifest["alarm"] is None and manifest["exit_code"] == 0
    # Leaving the checkpoint section forces a write, so both ranks show their last step.
    assert {r.step for r in read_heartbeats(out / "heartbeat.json")} == {12}
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # the job's own business, not the watchdog's
    assert "gpu_hours.compute" in run.data.metrics
