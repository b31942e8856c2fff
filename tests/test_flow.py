"""The retrain flow end to end on a tiny project copy: wiring, lineage, and DVC caching."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.helpers import ROOT, TASK, dvc_name, flow_runs, ran
from tuneloop.orchestration.flow_results import TasksRun
from tuneloop.pipeline import SHARED_STAGES, stage_order

# The whole suite (`make test`): the retrain flow under dvc (the tiny project)
pytestmark = pytest.mark.slow

# The one task's pipeline, as DVC names its stages (train@support).
STAGES = tuple(dvc_name(stage) for stage in stage_order(ROOT))
# The one stage DVC runs on every repro: it reads the tasks' champions from the registry.
CHAMPIONS = "champions"
# "Running stage 'init@support':"
RAN = r"Running stage '([\w@]+)'"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def only_champions_run_again(status: str) -> bool:
    """`dvc status` of a workspace where nothing changed: `champions` is always changed (it
    reads the registry, which DVC cannot see), every other stage is up to date."""
    changed = [line for line in status.splitlines() if line and not line[0].isspace()]
    return changed == [f"{CHAMPIONS}:"] and "always changed" in status


def dvc(repo: Path, *args: str, stderr: bool = False) -> str:
    """DVC's output; with ``stderr``, the stages' log lines (on stderr) after it."""
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
    return result.stdout + (result.stderr if stderr else "")


@pytest.fixture(scope="module")
def flow_result(tiny_project: tuple[Path, TasksRun]) -> tuple[Path, TasksRun]:
    """The session's tiny project, which the retrain flow built (``conftest.tiny_project``)."""
    repo, result = tiny_project
    assert list(result.tasks) == [TASK] and result.failed == [], result
    return repo, result


def lock_tags(entry: dict[str, Any]) -> dict[str, str]:
    """The ``dvc.dep.*``/``dvc.out.*`` tags a stage run must carry for a dvc.lock entry."""
    # normpath: the one task's folder is the root, ./metrics/... in dvc.lock.
    return {f"dvc.dep.{os.path.normpath(d['path'])}": d["md5"] for d in entry["deps"]} | {
        f"dvc.out.{os.path.normpath(o['path'])}": o["md5"] for o in entry.get("outs", [])
    }


def dvc_tags(run: Run) -> dict[str, str]:
    return {k: v for k, v in run.data.tags.items() if k.startswith(("dvc.dep.", "dvc.out."))}


def test_flow_returns_counts_losses_and_scores(flow_result: tuple[Path, TasksRun]) -> None:
    _, done = flow_result
    result = ran(done)
    assert result.data.accepted > 0 and result.data.train > 0
    assert result.train.steps == 30
    assert set(result.eval) == {"base", "candidate", "candidate-fp8"}
    assert isinstance(result.decision.passed, bool)


def test_retrain_run_holds_the_shared_stages_and_the_tasks_run_of_its_stages(
    flow_result: tuple[Path, TasksRun],
) -> None:
    repo, result = flow_result
    parent, children = flow_runs(repo)
    assert parent.info.run_id == result.mlflow_run_id
    assert sorted(children) == sorted(STAGES)
    # The one task's run, named after it, in the retrain run; its stages in it.
    task_run = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").get_run(ran(result).mlflow_run_id)
    assert task_run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert (task_run.info.run_name, task_run.data.tags["task"]) == (TASK, TASK)
    for stage, run in children.items():
        below = parent if stage in SHARED_STAGES else task_run
        assert run.data.tags["mlflow.parentRunId"] == below.info.run_id, stage
    # The report of every task, for one task too, on the retrain run.
    assert f"| {TASK} | ran |" in result.report_text
    assert Path(result.report).read_text() == result.report_text
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
        assert dvc_tags(run) == lock_tags(lock[stage]), stage
        data = {
            os.path.normpath(d["path"]): d["md5"]
            for d in lock[stage]["deps"]
            if not d["path"].endswith(".py")
        }
        assert {i.dataset.name: i.dataset.digest for i in run.inputs.dataset_inputs} == data
        # champions, a registry lookup, writes no metrics file (its files are each task's).
        assert run.data.metrics or stage == CHAMPIONS, f"{stage} logged no metrics"
    assert "loss" in children[dvc_name("train")].data.metrics


def test_dvc_is_up_to_date_after_the_flow(flow_result: tuple[Path, dict[str, Any]]) -> None:
    repo, _ = flow_result
    # `champions` looks at the registry on every repro (DVC cannot see an alias move); it finds
    # the same champion, so its out is unchanged and nothing after it runs, init included.
    assert only_champions_run_again(dvc(repo, "status"))
    store = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiments = [e.experiment_id for e in store.search_experiments()]
    before = len(store.search_runs(experiments, max_results=10_000))
    out = dvc(repo, "repro", stderr=True)
    assert re.findall(RAN, out) == [CHAMPIONS]
    assert f"Stage '{dvc_name('init')}' didn't change, skipping" in out
    # The no-op is a registry lookup, which logs no MLflow run.
    assert f"champions: {TASK}: none" in out
    assert len(store.search_runs(experiments, max_results=10_000)) == before


def test_dvc_repro_after_the_flow_logs_to_the_store_without_its_server(
    flow_result: tuple[Path, TasksRun],
) -> None:
    # The flow tracked through its own local MLflow server, now stopped. A plain `dvc repro`
    # afterwards (a changed param, no server) opens the same store directly: the experiment
    # the server created must not name its artifacts by a scheme only a server resolves.
    repo, _ = flow_result
    changed = ["params.yaml", "dvc.lock", "reports/preflight.json", "reports/preflight.md"]
    changed.append("metrics/preflight.json")
    saved = {name: (repo / name).read_bytes() for name in changed}
    data = yaml.safe_load(saved["params.yaml"])
    data["preflight"]["roundtrip_samples"] = data["preflight"]["roundtrip_samples"] // 2
    (repo / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert "MLFLOW_TRACKING_URI" not in os.environ
    started = int(time.time() * 1000)
    try:
        out = dvc(repo, "repro", dvc_name("preflight"), stderr=True)
    finally:
        for name, content in saved.items():  # the session's project is shared
            (repo / name).write_bytes(content)
    assert re.findall(RAN, out) == [CHAMPIONS, dvc_name("preflight")], out
    store = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = store.get_experiment_by_name("tuneloop")
    assert experiment is not None
    (run,) = store.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`tuneloop.stage` = '{dvc_name('preflight')}' and "
        f"attributes.start_time >= {started}",
    )
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("file:"), run.info.artifact_uri
    logged = {a.path for a in store.list_artifacts(run.info.run_id, "preflight")}
    assert "preflight/preflight.md" in logged, logged
    assert only_champions_run_again(dvc(repo, "status"))


def test_a_second_run_finds_every_stage_cached(
    flow_result: tuple[Path, TasksRun],
) -> None:
    from flows.retrain import retrain

    repo, done = flow_result
    first = ran(done)
    # What a retrain killed with its worker leaves: its run RUNNING, its flow run gone.
    store = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = store.get_experiment_by_name("tuneloop")
    assert experiment is not None
    orphan = store.create_run(
        experiment.experiment_id,
        tags={"tuneloop.pipeline": "retrain", "prefect.flow_run_id": str(uuid.uuid4())},
    ).info.run_id
    # On the schedule too: the task's champion is none, so there is something to learn.
    again = retrain(repo=repo)
    second = ran(again)
    assert second.eval == first.eval
    assert store.get_run(orphan).info.status == "KILLED"
    assert "tuneloop.killed_reason" in store.get_run(orphan).data.tags
    # Registered by the first run (when its gate passed): not announced, nor released, again.
    assert second.registration is not None and first.registration is not None
    assert second.registration.registered == first.registration.registered
    assert not second.registration.created
    # Below the retrain run: the shared stages' runs and the task's, which holds its stages'.
    below = {again.mlflow_run_id, second.mlflow_run_id}
    latest = [
        r
        for r in store.search_runs([experiment.experiment_id], max_results=10_000)
        if r.data.tags.get("mlflow.parentRunId") in below and r.info.run_id != second.mlflow_run_id
    ]
    assert len(latest) == len(STAGES)
    # `champions` always runs (DVC cannot see the registry's champion move); it logs no run
    # of its own and the flow records its lineage. It finds the same champion, so every
    # stage after it, init included, is cached.
    cached = {r.data.tags["tuneloop.stage"]: r.data.tags["dvc.cached"] for r in latest}
    assert cached == dict.fromkeys(STAGES, "true") | {CHAMPIONS: "false"}
    assert all(r.data.metrics for r in latest if r.data.tags["tuneloop.stage"] != CHAMPIONS)
    # A stage DVC found up to date did not run; the flow recorded its lineage instead.
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    for run in latest:
        assert dvc_tags(run) == lock_tags(lock[run.data.tags["tuneloop.stage"]])
        # base, champions and task_names read no data (a model shape, the registry, params).
        stage = run.data.tags["tuneloop.stage"]
        assert run.inputs.dataset_inputs or stage in {"base", CHAMPIONS, "task_names"}


def test_a_sweep_runs_as_dvc_experiments_side_by_side_in_mlflow(
    flow_result: tuple[Path, TasksRun],
) -> None:
    from flows.experiment import ExperimentFailed, experiment

    repo, _ = flow_result
    before = {name: (repo / name).read_text() for name in ("params.yaml", "dvc.lock")}
    # A training change (every stage from preflight on runs again) and a what-if on the gate
    # (only evaluate runs again): each experiment runs only what its set changes.
    sets = [{"train.learning_rate": 1e-2, "train.lora_r": 8}, {"gate.max_forgetting": 0.5}]
    reran = [
        {dvc_name(s) for s in ("preflight", "train", "merge", "export", "evaluate")},
        {dvc_name("evaluate")},
    ]
    result = experiment(sets=sets, repo=repo, prefix="sweep")

    assert list(result.experiments) == ["sweep-1", "sweep-2"]
    for done, settings in zip(result.experiments.values(), sets, strict=True):
        assert done.error is None and done.rev, done
        assert done.settings == settings
        assert (done.scores["eval_loss"] or 0) > 0
    # Queued experiments ran in temporary copies: the workspace is as it was.
    assert {name: (repo / name).read_text() for name in before} == before
    assert only_champions_run_again(dvc(repo, "status"))
    shown = {
        exp["name"]: exp["revs"][0]["data"]
        for baseline in json.loads(dvc(repo, "exp", "show", "--json"))
        for exp in baseline.get("experiments") or []
    }
    ran = shown["sweep-1"]["params"]["params.yaml"]["data"]
    assert (ran["train"]["learning_rate"], ran["train"]["lora_r"]) == (1e-2, 8)
    assert shown["sweep-2"]["params"]["params.yaml"]["data"]["gate"]["max_forgetting"] == 0.5
    assert "data" in shown["sweep-2"]["metrics"]["metrics/evaluate.json"]

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    parent = client.get_run(result.mlflow_run_id)
    experiment_id = parent.info.experiment_id

    def children(run_id: str) -> dict[str, Run]:
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'"
        )
        return {r.info.run_name: r for r in found}

    exps = children(parent.info.run_id)
    assert set(exps) == {"sweep-1", "sweep-2"}
    for (name, run), settings, stages_set in zip(sorted(exps.items()), sets, reran, strict=True):
        assert run.info.status == "FINISHED"
        assert run.data.params == {key: str(value) for key, value in settings.items()}
        assert run.data.tags["dvc.exp.rev"] == result.experiments[name].rev
        assert {"train.eval_loss", "evaluate.candidate.support_demo.accuracy"} <= set(
            run.data.metrics
        )
        # Its stage runs hang below it; only the stages the set changes ran again.
        stages = children(run.info.run_id)
        # (init is not among them: the champion did not move, so it logged no run.)
        assert set(stages) == stages_set, name
        assert {r.data.tags["dvc.exp.name"] for r in stages.values()} == {name}
        # Each ran in the experiment's temporary copy and recorded that copy's versions.
        lock = yaml.safe_load(git(repo, "show", f"{run.data.tags['dvc.exp.rev']}:dvc.lock"))
        for stage, stage_run in stages.items():
            assert dvc_tags(stage_run) == lock_tags(lock["stages"][stage]), (name, stage)
    # The sweep logged through the flow's local MLflow server, whose artifacts are plain files
    # under mlartifacts/ (not mlflow-artifacts:/..., which only a server resolves), so the
    # store still works without the server.
    uri = parent.info.artifact_uri
    assert uri.startswith((repo / "mlartifacts").resolve().as_uri() + "/"), uri
    logged = Path(urllib.request.url2pathname(urllib.parse.urlsplit(uri).path)) / "experiment"
    artifacts = {f"experiment/{path.name}" for path in logged.iterdir()}
    assert artifacts == {"experiment/comparison.md", "experiment/experiment-comparison.png"}

    # Names are the experiments' handles in DVC: a second sweep may not reuse them.
    with pytest.raises(ExperimentFailed, match=r"\['sweep-1'\] exist already"):
        experiment(sets=sets[:1], repo=repo, prefix="sweep")


def test_changing_the_learning_rate_reruns_train_and_after_only(
    flow_result: tuple[Path, TasksRun],
) -> None:
    # What `dvc repro` would run, not a run: the sweep above ran the stages after train for real
    # in its experiments, and the session's project is shared, so params.yaml is put back.
    repo, _ = flow_result
    path = repo / "params.yaml"
    before = path.read_text()
    data = yaml.safe_load(before)
    data["train"]["learning_rate"] = data["train"]["learning_rate"] / 2
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        # `dvc status` names the stages whose own inputs changed (preflight checks the
        # learning rate too, the model card that evaluate writes quotes it); nothing before
        # them.
        assert set(yaml.safe_load(dvc(repo, "status", "--json"))) == {CHAMPIONS} | {
            dvc_name(s) for s in ("preflight", "train", "evaluate")
        }
        out = dvc(repo, "repro", "--dry")
    finally:
        path.write_text(before)
    # A dry run lists the stages whose own inputs changed; merge and export follow once train
    # has written a new adapter, as each experiment of the sweep above ran them.
    ran = {line.split("'")[1] for line in out.splitlines() if "Running stage" in line}
    assert ran == {CHAMPIONS} | {dvc_name(s) for s in ("preflight", "train", "evaluate")}
    assert only_champions_run_again(dvc(repo, "status"))
