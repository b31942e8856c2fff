"""MLflow wiring: one parent run per pipeline run, one child run per stage.

A stage resumes the child run its flow task created (``MLFLOW_RUN_ID``) or,
under a plain ``dvc repro``, starts its own. Either way the run carries the
lineage tags: git commit and dirty flag, params hash, the md5 of every DVC dep
and out, and the Prefect flow-run id when there is one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tuneloop import lineage
from tuneloop.params import Params

log = logging.getLogger(__name__)

# Tag names, shared by every writer and reader of lineage.
TAG_STAGE = "tuneloop.stage"
TAG_COMMIT = "git.commit"
TAG_DIRTY = "git.dirty"
TAG_PARAMS_HASH = "params.hash"
TAG_FLOW_RUN = "prefect.flow_run_id"
TAG_CACHED = "dvc.cached"
TAG_PARENT = "mlflow.parentRunId"


# Read once: mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into this
# process's environment, so reading it later would return our own last choice,
# not the user's.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` as the user set it, else the project's own SQLite store."""
    return _USER_TRACKING_URI or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def setup(experiment: str) -> str:
    """Point MLflow at the project's store and return the experiment id (created if needed)."""
    mlflow.set_tracking_uri(tracking_uri())
    client = MlflowClient()
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        experiment_id = found.experiment_id
    else:
        # Artifacts beside the database, not in whatever folder a process happened to start in.
        location = None
        if tracking_uri().startswith("sqlite:"):
            location = (Path.cwd() / "mlartifacts").resolve().as_uri()
        experiment_id = client.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def lineage_tags(stage: str, params: Params) -> dict[str, str]:
    git = lineage.git_state()
    tags = {
        TAG_STAGE: stage,
        TAG_COMMIT: git.commit,
        TAG_DIRTY: str(git.dirty).lower(),
        TAG_PARAMS_HASH: lineage.params_hash(params, lineage.stage_param_groups(stage)),
    }
    if flow_run := os.environ.get("TUNELOOP_FLOW_RUN_ID"):
        tags[TAG_FLOW_RUN] = flow_run
    return tags


def dvc_tags(stage: str) -> dict[str, str]:
    """``dvc.dep.<path>`` / ``dvc.out.<path>`` md5 tags from dvc.lock."""
    md5s = lineage.dvc_lock_md5s(stage)
    return {
        f"dvc.{kind[:-1]}.{path}": md5
        for kind, paths in md5s.items()
        for path, md5 in paths.items()
    }


def flat_params(params: Params, stage: str) -> dict[str, str]:
    """The stage's param groups as ``group.key`` MLflow params."""

    def walk(prefix: str, node: Any) -> Iterator[tuple[str, str]]:
        if isinstance(node, Mapping):
            for key, value in node.items():
                yield from walk(f"{prefix}.{key}", value)
        else:
            yield prefix, str(node)[:500]

    subset = lineage.params_subset(params, lineage.stage_param_groups(stage))
    return dict(item for group, node in subset.items() for item in walk(group, node))


@contextlib.contextmanager
def stage_run(stage: str, params: Params) -> Iterator[Run]:
    """The MLflow run a stage logs into, with its lineage tags and params."""
    experiment_id = setup(params.tracking.experiment)
    # A flow task created this child run; resume it. Drop the variable once
    # used, or the transformers MLflow callback would try to start it again.
    run_id = os.environ.pop("MLFLOW_RUN_ID", None)
    # Inside an active run (a notebook, a flow in-process), the stage is its child.
    nested = mlflow.active_run() is not None
    with mlflow.start_run(
        run_id=run_id, run_name=stage, experiment_id=experiment_id, nested=nested
    ) as run:
        mlflow.set_tags(lineage_tags(stage, params) | dvc_tags(stage))
        mlflow.log_params(flat_params(params, stage))
        yield run


def log_metrics(metrics: Mapping[str, Any], prefix: str = "", run_id: str | None = None) -> None:
    """Log every number of a nested dict as ``a.b.c``, to ``run_id`` or else the active run."""
    flat: dict[str, float] = {}

    def walk(path: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(f"{path}.{key}" if path else str(key), value)
        elif isinstance(node, bool | int | float):
            flat[path] = float(node)

    walk(prefix, metrics)
    # MLflow allows only [A-Za-z0-9_\-. :/] in names; keep the rest readable.
    flat = {re.sub(r"[^\w\-. :/]", "_", key): value for key, value in flat.items()}
    if flat and run_id is not None:
        for key, value in flat.items():
            MlflowClient().log_metric(run_id, key, value)
    elif flat:
        mlflow.log_metrics(flat)
