"""The MLflow UI shows a pipeline run's stages and lineage tags, rendered by a real browser.

Needs Debian's `chromium` (`.ci/run` installs it); skipped where it is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import CHROMIUM, chromium, mlflow_server, write_params
from tuneloop.params import Params, load_params
from tuneloop.tracking import lineage, runs

# The whole suite (`make test`): the MLflow UI in Chromium
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium"),
]


DATASET, DIGEST = "data/pool", "0f3c6e1a9b2d4c5e8f7a6b5c4d3e2f1a.dir"


class Echo(mlflow.pyfunc.PythonModel):
    def predict(self, context: object, model_input: list[str]) -> list[str]:
        return model_input


@dataclass(frozen=True)
class UI:
    base: str  # the UI's URL
    experiment_id: str
    parent_id: str
    client: MlflowClient
    params: Params


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UI]:
    """A parent run with stage children logged the way the flow logs them, and a UI serving it.

    One store and one server for the module: each test only renders a page of it.
    """
    folder = tmp_path_factory.mktemp("mlflow-ui")
    write_params(folder)
    params = load_params(folder / "params.yaml")
    with contextlib.chdir(folder):
        experiment_id = runs.setup(params.tracking.experiment)
        uri = runs.tracking_uri()
        # A stage run under plain `dvc repro` (no flow, so no parent) with its data dep as an
        # MLflow dataset input, logged the way every stage logs it.
        support = params.the_task()  # the stages of the project's one task: clean@support
        with runs.stage_run("clean", support) as clean:
            md5s = lineage.StageMd5s(deps={DATASET: DIGEST}, outs={}, remote="s3://team/dvc")
            MlflowClient().log_inputs(
                clean.info.run_id, datasets=runs.dataset_inputs("clean", md5s)
            )
        with mlflow.start_run(run_name="retrain-ui-test", experiment_id=experiment_id) as parent:
            mlflow.set_tags({"git.commit": "0123abcd", "prefect.flow_run_id": "flow-ui-test"})
            for stage, view in (("ingest", params), ("train", support)):
                with runs.stage_run(stage, view):
                    mlflow.log_metric("records", 42)
            # A registered version with the alias the flow sets (the real registration, with
            # its pyfunc wrapper around a merged model, is test_registry's; this page only
            # renders).
            model = mlflow.pyfunc.log_model(name="model", python_model=Echo(), pip_requirements=[])
        version = mlflow.register_model(model.model_uri, params.tracking.registered_model)
        client = MlflowClient(uri)
        client.set_registered_model_alias(
            params.tracking.registered_model, "challenger", version.version
        )
    with mlflow_server(uri) as base:
        yield UI(base, experiment_id, parent.info.run_id, client, params)


def test_experiment_page_lists_the_pipeline_run(ui: UI, tmp_path: Path) -> None:
    page = f"{ui.base}/#/experiments/{ui.experiment_id}/runs"
    dom = chromium(page, tmp_path / "profile", "--dump-dom")
    # The stage runs are folded under their parent in the runs table.
    assert "retrain-ui-test" in dom, "the pipeline run is not rendered on the experiment page"
    shot = tmp_path / "experiment.png"
    chromium(
        page,
        tmp_path / "profile2",
        f"--screenshot={shot}",
        "--window-size=1400,900",
    )
    assert shot.stat().st_size > 10_000
    ui.client.log_artifact(ui.parent_id, str(shot), "ui")
    artifacts = [a.path for a in ui.client.list_artifacts(ui.parent_id, "ui")]
    assert artifacts == ["ui/experiment.png"]


def test_runs_page_dataset_column_shows_the_dvc_version(ui: UI, tmp_path: Path) -> None:
    page = f"{ui.base}/#/experiments/{ui.experiment_id}/runs"
    dom = chromium(page, tmp_path / "profile", "--dump-dom")
    # The Dataset column names the DVC path and the start of its md5 (MLflow's digest).
    assert DATASET in dom, "the stage's dataset input is not rendered on the runs page"
    assert DIGEST[:8] in dom, "the dataset's DVC md5 is not rendered on the runs page"


def test_run_page_shows_the_lineage_tags(ui: UI, tmp_path: Path) -> None:
    child = ui.client.search_runs(
        [ui.experiment_id], filter_string="tags.`tuneloop.stage` = 'train@support'"
    )[0]
    dom = chromium(
        f"{ui.base}/#/experiments/{ui.experiment_id}/runs/{child.info.run_id}",
        tmp_path / "profile",
        "--dump-dom",
    )
    for tag in ("train", "params.hash", "git.commit", child.data.tags["params.hash"]):
        assert tag in dom, f"{tag!r} not rendered on the run page"


def test_models_page_shows_the_challenger_alias(ui: UI, tmp_path: Path) -> None:
    name = ui.params.tracking.registered_model
    dom = chromium(f"{ui.base}/#/models/{name}", tmp_path / "profile", "--dump-dom")
    assert name in dom and "challenger" in dom, "the registered model's alias is not rendered"
