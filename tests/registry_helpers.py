"""Registered model versions for the release tests, written without training.

Its own module (not ``helpers.py``) so that only the tests that need a registry import MLflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.tracking import MlflowClient


class EchoModel(mlflow.pyfunc.PythonModel):  # type: ignore[name-defined]
    """A version that serves nothing: for tests that read the registry, or whose artifacts are
    the served folder itself."""

    def predict(
        self, context: Any, model_input: list[str], params: dict[str, Any] | None = None
    ) -> list[str]:
        return model_input


@contextlib.contextmanager
def tracking_to(uri: str) -> Iterator[None]:
    """MLflow's fluent API on ``uri`` for the block. ``set_tracking_uri`` also sets
    $MLFLOW_TRACKING_URI, which a flow's process would inherit: both are put back."""
    previous = mlflow.get_tracking_uri()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)


def register_versions(
    folder: Path,
    model: str,
    artifacts: Sequence[Mapping[str, str]],
    python_model: mlflow.pyfunc.PythonModel | None = None,  # type: ignore[name-defined]
    name: str = "model",
) -> MlflowClient:
    """Versions 1..N of ``model`` in ``folder``'s SQLite store, each logged from its own run
    with the artifacts given for it; the client on that store."""
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("tuneloop", (folder / "mlartifacts").as_uri())
    with tracking_to(uri):
        for number, files in enumerate(artifacts, start=1):
            with mlflow.start_run(experiment_id=experiment, run_name=f"train-v{number}"):
                mlflow.pyfunc.log_model(
                    name=name,
                    python_model=python_model or EchoModel(),
                    artifacts=dict(files) or None,
                    pip_requirements=[],
                    registered_model_name=model,
                )
    return client


def register_champion_and_challenger(
    folder: Path,
    model: str,
    artifacts: Sequence[Mapping[str, str]] = ({}, {}),
    python_model: mlflow.pyfunc.PythonModel | None = None,  # type: ignore[name-defined]
    name: str = "model",
) -> MlflowClient:
    """Versions 1 (alias ``champion``) and 2 (alias ``challenger``)."""
    client = register_versions(folder, model, artifacts, python_model, name)
    client.set_registered_model_alias(model, "champion", "1")
    client.set_registered_model_alias(model, "challenger", "2")
    return client
