"""The retrain flow end to end on a tiny project copy: wiring, lineage, and DVC caching."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.conftest import copy_project
from tuneloop import demo
from tuneloop.params import load_params

STAGES = ["base", "ingest", "clean", "pack", "preflight", "train", "merge", "export", "evaluate"]


def dvc(repo: Path, *args: str) -> str:
    # dvc.yaml runs `python -m stages.<name>`: this environment's python must come first.
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return result.stdout


@pytest.fixture(scope="module")
def flow_result(
    tmp_path_factory: pytest.TempPathFactory, prefect_harness: None
) -> Iterator[tuple[Path, dict[str, Any]]]:
    from flows.retrain import retrain

    repo = copy_project(tmp_path_factory.mktemp("repo"))
    params = load_params(repo / "params.yaml")
    demo.seed_incoming(
        repo / params.paths.incoming,
        params.demo.seed,
        params.demo.n_support,
        params.demo.n_badcases,
    )
    yield repo, retrain(repo=repo)


def runs(repo: Path) -> tuple[Run, dict[str, Run]]:
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tuneloop")
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    parent = parents[0]
    children = {
        r.data.tags["tuneloop.stage"]: r
        for r in found
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    return parent, children


def test_flow_returns_counts_losses_and_scores(flow_result: tuple[Path, dict[str, Any]]) -> None:
    _, result = flow_result
    assert result["data"]["accepted"] > 0 and result["data"]["train"] > 0
    assert result["train"]["steps"] == 30
    assert set(result["eval"]) == {"base", "candidate", "candidate-fp8"}
    assert isinstance(result["decision"]["passed"], bool)


def test_parent_run_has_one_child_per_stage_with_lineage(
    flow_result: tuple[Path, dict[str, Any]],
) -> None:
    repo, result = flow_result
    parent, children = runs(repo)
    assert parent.info.run_id == result["mlflow_run_id"]
    assert sorted(children) == sorted(STAGES)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert flow_run_id
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    for stage, run in children.items():
        tags = run.data.tags
        assert run.info.status == "FINISHED", stage
        assert tags["git.commit"] == commit
        assert tags["git.dirty"] in {"true", "false"}
        assert len(tags["params.hash"]) == 16
        assert tags["prefect.flow_run_id"] == flow_run_id
        for out in lock[stage].get("outs", []):
            assert tags[f"dvc.out.{out['path']}"] == out["md5"], (stage, out["path"])
        for dep in lock[stage]["deps"]:
            assert tags[f"dvc.dep.{dep['path']}"] == dep["md5"], (stage, dep["path"])
        assert run.data.metrics, f"{stage} logged no metrics"
    assert "loss" in children["train"].data.metrics


def test_dvc_is_up_to_date_after_the_flow(flow_result: tuple[Path, dict[str, Any]]) -> None:
    repo, _ = flow_result
    assert "up to date" in dvc(repo, "status")
    out = dvc(repo, "repro")
    assert "Data and pipelines are up to date" in out


def test_a_second_run_finds_every_stage_cached(
    flow_result: tuple[Path, dict[str, Any]],
) -> None:
    from flows.retrain import retrain

    repo, first = flow_result
    second = retrain(repo=repo)
    assert second["eval"] == first["eval"]
    parent, _ = runs(repo)
    latest = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{second['mlflow_run_id']}'",
    )
    assert len(latest) == len(STAGES)
    assert {r.data.tags["dvc.cached"] for r in latest} == {"true"}
    assert all(r.data.metrics for r in latest)


def test_changing_the_learning_rate_reruns_train_and_after_only(
    flow_result: tuple[Path, dict[str, Any]],
) -> None:
    # Last in this module: it retrains the project with another learning rate.
    repo, _ = flow_result
    path = repo / "params.yaml"
    data = yaml.safe_load(path.read_text())
    data["train"]["learning_rate"] = data["train"]["learning_rate"] / 2
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    # `dvc status` names the stages whose own inputs changed (preflight checks the
    # learning rate too); nothing before them.
    assert set(yaml.safe_load(dvc(repo, "status", "--json"))) == {"preflight", "train"}
    ran = {
        line.split("'")[1] for line in dvc(repo, "repro").splitlines() if "Running stage" in line
    }
    assert ran == {"preflight", "train", "merge", "export", "evaluate"}
