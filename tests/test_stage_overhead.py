"""A stage costs only its work: what replaces MLflow's import in a stage process is checked here.

The data stages log over an MLflow server's REST API (``tuneloop.tracking.rest``),
``champions`` and ``init`` read the champion without MLflow (``tuneloop.tracking.aliases``),
``init`` logs a run only when the start changed, and a stage started outside the project's
environment says how to fix it. How long any of it takes is ``benchmarks/stage_overhead.py``'s
business, not a test's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import ROOT, write_params
from tuneloop import stage
from tuneloop.io import read_model
from tuneloop.params import load_params
from tuneloop.tracking import aliases, init_from, registry, runs, server

# The whole suite (`make test`): a local MLflow server, stages as processes
pytestmark = pytest.mark.slow

NAME = "tuneloop-support"  # params.yaml's tracking.registered_model


def test_a_stage_outside_the_project_environment_says_to_activate_it() -> None:
    # -S: no site-packages, as the system's Python that `.venv/bin/dvc repro` reaches through
    # PATH when the environment is not activated (DVC runs `$SHELL -c "python -m ..."`).
    done = subprocess.run(
        [sys.executable, "-S", "-m", "stages.init"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"DVC_STAGE": "init"},
    )
    assert done.returncode == 1
    assert "stage init:" in done.stderr and "source .venv/bin/activate" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def project(tmp_path: Path) -> Iterator[MlflowClient]:
    """An empty project folder with tiny params, its SQLite store as the tracking URI."""
    write_params(tmp_path, {"train": {"init_from": "base"}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with contextlib.chdir(tmp_path), runs.use_tracking_uri(uri):
        yield MlflowClient(uri)


def register(client: MlflowClient, tags: dict[str, str], run_id: str | None = None) -> str:
    if not client.search_registered_models(f"name = '{NAME}'"):
        client.create_registered_model(NAME)
    version = client.create_model_version(NAME, Path.cwd().as_uri(), run_id=run_id, tags=tags)
    return str(version.version)


def test_the_champion_read_without_mlflow_is_the_registrys(project: MlflowClient) -> None:
    experiment = project.create_experiment("tuneloop")  # creates the store
    assert aliases.champion(NAME) is None  # no registered model yet
    base = register(project, {init_from.TAG_BASE_MODEL: "builtin:tiny", init_from.TAG_BATCHES: ""})
    run = project.create_run(experiment)
    trained = register(project, {init_from.TAG_BATCHES: "b1,b2"}, run.info.run_id)
    untagged = register(project, {})  # registered before the batches tag existed
    assert aliases.champion(NAME) is None  # no alias yet
    for version in (base, trained, untagged):
        project.set_registered_model_alias(NAME, registry.CHAMPION, version)
        assert aliases.champion(NAME) == registry.serving_champion(NAME, project)
    project.set_registered_model_alias(NAME, registry.CHAMPION, trained)
    assert aliases.champion(NAME) == init_from.Champion(trained, run.info.run_id, ("b1", "b2"))
    # What `tuneloop status` shows, read the same way.
    project.set_registered_model_alias(NAME, "challenger", untagged)
    assert aliases.aliases(NAME) == {"champion": trained, "challenger": untagged}
    assert aliases.aliases("no-such-model") == {}
    assert aliases.version_tags(NAME, trained) == project.get_model_version(NAME, trained).tags
    with pytest.raises(ValueError, match="a model version is a number"):
        aliases.version_tags(NAME, "1 OR 1=1")


def mlflow_runs(folder: Path) -> int:
    with sqlite3.connect(folder / "mlflow.db") as db:
        return int(db.execute("SELECT count(*) FROM runs").fetchone()[0])


def test_init_logs_a_run_only_when_the_start_changes(project: MlflowClient) -> None:
    from stages import init

    params = load_params()
    written = [params.paths.init / init_from.INIT_FILE, stage.metrics_path(params, "init")]
    init.main()  # the first time: base (no store to read yet), recorded and logged
    assert mlflow_runs(Path.cwd()) == 1
    before = [path.stat().st_mtime_ns for path in written]
    init.main()  # nothing moved: no run, nothing written
    assert mlflow_runs(Path.cwd()) == 1
    assert [path.stat().st_mtime_ns for path in written] == before

    # The serving champion moved (training still starts from the base: init_from base):
    # metrics/init.json names it, so the stage runs and logs again, once.
    version = register(project, {init_from.TAG_BASE_MODEL: "builtin:tiny"})
    project.set_registered_model_alias(NAME, registry.CHAMPION, version)
    init.main()
    assert mlflow_runs(Path.cwd()) == 2
    assert json.loads(written[1].read_text())["champion"] == {"version": version, "batches": []}
    init.main()
    assert mlflow_runs(Path.cwd()) == 2


def test_champions_records_each_tasks_champion_and_logs_no_run(project: MlflowClient) -> None:
    from stages import champions

    tasks = {
        name: {"folder": f"tasks/{name}", "registered_model": f"tuneloop-{name}"}
        for name in ("support", "orders")
    }
    write_params(Path.cwd(), {"tasks": tasks})
    folder = Path("metrics") / init_from.CHAMPIONS_DIR
    champions.main()  # nothing registered yet
    recorded = {t: (folder / f"{t}.json").read_bytes() for t in tasks}
    none = init_from.TaskChampion(model="tuneloop-orders", version=None, run_id=None, batches=())
    assert read_model(folder / "orders.json", init_from.TaskChampion) == none

    # orders' champion moves: its file changes (init@orders reruns), support's does not.
    experiment = project.create_experiment("tuneloop")
    run = project.create_run(experiment)
    project.create_registered_model("tuneloop-orders")
    version = project.create_model_version(
        "tuneloop-orders",
        Path.cwd().as_uri(),
        run_id=run.info.run_id,
        tags={init_from.TAG_BATCHES: "b1"},
    ).version
    project.set_registered_model_alias("tuneloop-orders", registry.CHAMPION, str(version))
    champions.main()
    assert (folder / "support.json").read_bytes() == recorded["support"]
    moved = read_model(folder / "orders.json", init_from.TaskChampion)
    assert moved == none.model_copy(
        update={"version": str(version), "run_id": run.info.run_id, "batches": ("b1",)}
    )
    assert mlflow_runs(Path.cwd()) == 1  # the test's own: the lookup logs none


def test_a_data_stage_logs_its_run_over_rest(tmp_path: Path) -> None:
    write_params(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The server the flows start over the project's store (tuneloop.tracking.server).
    with (
        contextlib.chdir(tmp_path),
        runs.use_tracking_uri(store),
        server.local_server(tmp_path, tmp_path / "logs") as url,
    ):
        assert url.startswith("http://127.0.0.1:") and runs.tracking_uri() == url
        params = load_params()
        with stage.logged_after("pack", params) as deferred:
            stage.write_metrics(params, "pack", {"bins": 3, "rank": {"tokens": 1.5}})
            deferred.log_dict({"checks": ["ok"]}, "pack/report.json")
            deferred.log_text("| ok |", "pack/report.md")
            deferred.set_tags({"pack.note": "yes"})
        with pytest.raises(SystemExit), stage.logged_after("clean", params):
            raise SystemExit("clean: refused")

        client = MlflowClient(url)
        experiment = client.get_experiment_by_name(params.tracking.experiment)
        assert experiment is not None
        found = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
        assert found["clean"].info.status == "FAILED"
        run = found["pack"]
        assert run.info.status == "FINISHED"
        assert run.data.metrics["bins"] == 3 and run.data.metrics["rank.tokens"] == 1.5
        assert "stage_seconds" in run.data.metrics
        assert run.data.params == runs.flat_params(params, "pack")
        expected = runs.lineage_tags("pack", params) | {"pack.note": "yes"}
        assert expected.items() <= run.data.tags.items()
        report = client.download_artifacts(run.info.run_id, "pack/report.json", str(tmp_path))
        assert json.loads(Path(report).read_text()) == {"checks": ["ok"]}
        text = client.download_artifacts(run.info.run_id, "pack/report.md", str(tmp_path))
        assert Path(text).read_text() == "| ok |"

        # The champion read over REST, as the init stage reads it against a server. (Registered
        # in the store itself: the server accepts a version's source only from a logged model.)
        assert aliases.champion(NAME) is None
        local = MlflowClient(store)
        version = register(local, {init_from.TAG_BATCHES: "b1"}, run.info.run_id)
        local.set_registered_model_alias(NAME, registry.CHAMPION, version)
        assert aliases.champion(NAME) == init_from.Champion(version, run.info.run_id, ("b1",))
        assert aliases.aliases(NAME) == {"champion": version}
        assert aliases.aliases("no-such-model") == {}
        assert aliases.version_tags(NAME, version) == local.get_model_version(NAME, version).tags
    assert runs.tracking_uri() != url  # the block's end stopped the server and restored the URI
    # The server kept the artifacts as plain files, so the store alone serves them now (a plain
    # `dvc repro` after the demo tracks without the server).
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    after = MlflowClient(store).download_artifacts(run.info.run_id, "pack/report.md", str(tmp_path))
    assert Path(after).read_text() == "| ok |"
