"""A real hang on CPU: two gloo ranks under torchrun, one with a batch fewer.

Rank 1 reaches the epoch-end barrier (inside its "checkpoint" section) while
rank 0 waits in the gradient all-reduce of its extra batch; gloo's timeout is
300 s, so nothing ends it but the watchdog. On this machine there is no GPU, so
the watchdog runs on the heartbeat alone (``--heartbeat-only`` keeps it so on a
GPU node too). The balanced job must run to its end untouched.

A rank that leaves the job's session (``setsid()``) must not outlive the job,
whether the watchdog ends it or its root exits on its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tuneloop.cli.host import watch_main
from tuneloop.telemetry.actions import find_py_spy
from tuneloop.telemetry.heartbeat import read_heartbeats
from tuneloop.telemetry.watch import WATCHDOG_EXIT_CODE

# The whole suite (`make test`): torchrun ranks that hang
pytestmark = pytest.mark.slow

DDP_HANG = Path(__file__).parent / "fixtures" / "ddp_hang.py"
SETSID_RANK = Path(__file__).parent / "fixtures" / "setsid_rank.py"
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
    # Ended, if not yet reaped: a rank SIGKILLed with its torchrun is reparented, and a
    # container's first process may never reap it.
    assert all(_gone(r.pid) for r in records), "a rank outlived the watchdog"

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
        "watchdog/trace.csv",
        "watchdog/timeline.png",
    } <= logged
    assert run.data.tags["tuneloop.watchdog.calibration_source"] == "none"  # heartbeat only


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


def _gone(pid: int) -> bool:
    """No such process, or one that has finished and only waits for its reaper."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def rank_pid_file(tmp_path: Path) -> Iterator[Path]:
    """Where the setsid rank writes its pid; a rank the test left running is ended after it."""
    pid_file = tmp_path / "rank.pid"
    yield pid_file
    if pid_file.exists() and not _gone(pid := int(pid_file.read_text())):
        os.kill(pid, signal.SIGKILL)


def _watch_setsid_job(out: Path, *job_args: str) -> int:
    return watch_main(
        [
            "--heartbeat-only",
            "--hz",
            "4",
            "--deadlock-after",
            "2",
            "--kill-grace",
            "1",
            "--out-dir",
            str(out),
            "--",
            sys.executable,
            str(SETSID_RANK),
            *job_args,
        ]
    )


def test_a_setsid_rank_is_ended_with_the_hung_job(tmp_path: Path, rank_pid_file: Path) -> None:
    # Orphaned at once and stripped of the job's token: only its heartbeat shows it.
    out = tmp_path / "watch"
    code = _watch_setsid_job(out, "hang", str(rank_pid_file), "--scrub", "--beat")

    assert code == WATCHDOG_EXIT_CODE
    rank_pid = int(rank_pid_file.read_text())
    assert _gone(rank_pid), "the setsid rank outlived the watchdog"
    manifest = json.loads((out / "watch.json").read_text())
    assert str(rank_pid) in manifest["actions"]["end_job"]
    assert "leftovers" not in manifest["actions"]  # nothing was left for the final sweep


@pytest.mark.parametrize(
    "how_seen",
    [["--scrub", "--beat"], []],
    ids=["heartbeat-without-token", "token-without-heartbeat"],
)
def test_a_setsid_rank_is_ended_when_the_root_exits(
    tmp_path: Path, rank_pid_file: Path, how_seen: list[str]
) -> None:
    out = tmp_path / "watch"
    started = time.monotonic()
    code = _watch_setsid_job(out, "exit", str(rank_pid_file), *how_seen)

    assert code == 0  # the command's own code: ending its leftovers is not a failure
    rank_pid = int(rank_pid_file.read_text())
    assert _gone(rank_pid), "the setsid rank outlived its root"
    manifest = json.loads((out / "watch.json").read_text())
    assert manifest["alarm"] is None
    assert str(rank_pid) in manifest["actions"]["leftovers"]
    assert time.monotonic() - started < 60  # the rank sleeps 600 s: it did not end by itself
