"""The data stages start fast and log their MLflow run after the work.

ingest, clean, pack and preflight import no torch, transformers or MLflow before their work
starts (seconds of start-up each; preflight imports torch once it probes the machine);
``logged_after`` then logs the run as ``stage_run`` would, a failed one included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import ROOT, write_params
from tuneloop.params import load_params
from tuneloop.stage import logged_after, write_metrics

# The whole suite (`make test`): the data stages imported in subprocesses; MLflow runs
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["ingest", "clean", "pack", "preflight"])
def test_data_stage_imports_nothing_heavy(stage: str) -> None:
    code = (
        f"import sys, stages.{stage}; "
        "print(','.join(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules))"
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def runs(folder: Path) -> list:  # type: ignore[type-arg]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    return client.search_runs([experiment.experiment_id])


def test_logged_after_logs_the_work_and_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    params = load_params()
    with logged_after("clean", params):
        write_metrics(params, "clean", {"train": 7, "removed": {"near_duplicate": 2}})
    with pytest.raises(SystemExit, match="nothing left"), logged_after("pack", params):
        write_metrics(params, "pack", {"bins": 0})
        raise SystemExit("nothing left")
    by_stage = {run.data.tags["tuneloop.stage"]: run for run in runs(tmp_path)}
    clean, pack = by_stage["clean"], by_stage["pack"]
    assert clean.info.status == "FINISHED" and pack.info.status == "FAILED"
    assert clean.data.metrics["train"] == 7
    assert clean.data.metrics["removed.near_duplicate"] == 2
    assert pack.data.metrics["bins"] == 0
    assert {"git.commit", "params.hash"} <= set(clean.data.tags)
    assert clean.data.params["clean.near_dup_threshold"] == "0.9"
    assert "stage_seconds" in clean.data.metrics
    assert json.loads((tmp_path / "metrics" / "clean.json").read_text())["train"] == 7
